"""Child processes of the tests (``wuliang ps`` servers) that never outlive
the test session.

``spawn(command, **popen)`` starts a process in a process group of its own
(``start_new_session``) and registers it until it is reaped.
``stop_each(processes)`` sends SIGTERM to every group first (they stop
together), waits for each (bounded), sends SIGKILL to the groups still
there and waits again (bounded); it goes on when stopping one fails, and
raises the first failure once every one was tried. ``stop_all()`` is the
session's safety net: it stops whatever is still registered (a test whose
fixture failed to stop its servers) and says what that was. It runs as
this module's ``pytest_sessionfinish`` hook (``tests/conftest.py``
registers the module as a plugin) and again at exit (``atexit``).

A session killed outright runs neither; ``ps_command(*args)`` therefore
starts ``wuliang ps`` with ``--parent-pid`` of this process: a server stops
by itself once its parent is gone. ``read_line`` reads a child's start
line with a deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

__all__ = ["ps_command", "read_line", "running", "spawn", "stop_all", "stop_each"]

START_TIMEOUT = 60.0  # seconds for a child's start line (a loaded CI machine)
STOP_TIMEOUT = 60.0  # seconds from SIGTERM to the exit before SIGKILL (a hung stop dumps at 15)
KILL_TIMEOUT = 20.0  # seconds from SIGKILL to the exit
NET_TIMEOUT = 10.0  # seconds the safety net gives its SIGTERM

_lock = threading.Lock()
_registered: dict[int, subprocess.Popen[Any]] = {}  # pid -> a process not yet reaped


def ps_command(*args: str) -> list[str]:
    """``python -m wuliang ps *args``, stopping by itself once this process is gone."""
    return [sys.executable, "-m", "wuliang", "ps", "--parent-pid", str(os.getpid()), *args]


def spawn(command: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(command, **popen)`` in a new session (so a process
    group of its own, whose id is its pid), registered until reaped."""
    process = subprocess.Popen(list(command), start_new_session=True, **popen)
    with _lock:
        _registered[process.pid] = process
    return process


def running() -> list[subprocess.Popen[Any]]:
    """The processes started by ``spawn`` that have not exited, oldest first
    (those that exited are reaped and forgotten)."""
    with _lock:
        for pid, process in list(_registered.items()):
            if process.poll() is not None:
                del _registered[pid]
        return list(_registered.values())


def read_line(process: subprocess.Popen[Any], timeout: float = START_TIMEOUT) -> str:
    """The first line ``process`` writes to its stdout pipe (with its newline;
    less if it exited or ``timeout`` s went by first). Reads the pipe's file
    descriptor directly, one byte at a time, so nothing after the line is
    taken from the pipe."""
    assert process.stdout is not None, "the process needs stdout=subprocess.PIPE"
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            byte = os.read(fd, 1)
            if not byte:  # end of file: it exited, or closed its stdout
                break
            line += byte
        elif process.poll() is not None:
            break
    return line.decode(errors="replace")


def _signal_group(process: subprocess.Popen[Any], sig: int) -> None:
    # Only while it is not reaped: until then its pid, and so its group's id,
    # cannot be another process's.
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(process.pid, sig)


def _reap(process: subprocess.Popen[Any], deadline: float) -> int:
    """Waits until ``deadline`` for the exit, then SIGKILLs the group and waits
    ``KILL_TIMEOUT`` more; the exit code. Closes its pipes, unregisters it."""
    try:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(KILL_TIMEOUT)
        return process.returncode
    finally:
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        if process.returncode is not None:
            with _lock:
                _registered.pop(process.pid, None)


def stop_each(
    processes: Sequence[subprocess.Popen[Any]], timeout: float = STOP_TIMEOUT
) -> list[int | None]:
    """Stops every process and its group: SIGTERM to all, up to ``timeout`` s
    for them to exit, then SIGKILL. Their exit codes in order (negative: the
    signal that ended it; None: it could not be reaped). A failure to stop
    one does not keep the others running: it is raised after all were tried."""
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    errors: list[BaseException] = []
    for process in processes:
        try:
            codes.append(_reap(process, deadline))
        except BaseException as error:  # even an interrupt: stop the rest first
            codes.append(None)
            errors.append(error)
    if errors:
        raise errors[0]
    return codes


def stop_all(timeout: float = NET_TIMEOUT) -> list[str]:
    """Stops every registered process (children a test left running); says
    which they were: pid, command and exit code."""
    left = running()
    if not left:
        return []
    try:
        codes: list[int | None] = stop_each(left, timeout)
    except BaseException:
        codes = [process.returncode for process in left]
    return [
        f"pid {process.pid} ({' '.join(map(str, process.args))}): exit code {code}"
        for process, code in zip(left, codes, strict=True)
    ]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The safety net at the end of a session (after every fixture's teardown)."""
    stopped = stop_all()
    if stopped:
        say = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"stopped {len(stopped)} child processes a test left running:", *stopped]
        for line in lines:
            if say is not None:
                say.write_line(line, yellow=True)
            else:
                print(line, file=sys.stderr)


@atexit.register
def _stop_all_at_exit() -> None:
    for line in stop_all():
        print(f"stopped a child process a test left running: {line}", file=sys.stderr)
