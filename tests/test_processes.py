"""No ``wuliang ps`` started by a test outlives the test session, whatever fails.

What passing guarantees:

* A test of the conformance suite over server processes whose body raises,
  and whose first server's close raises too, still has the second server's
  processes stopped by the ``make_ps`` fixture's finalizer; the first
  server's, which nothing in the test stops any more, are stopped at the
  session's end (``tests/processes.py``'s safety net), which says so: once
  that session is over, none of them runs.
* A ``wuliang ps --parent-pid`` whose parent is killed (SIGKILL: no
  finalizer, no atexit) stops by itself within a few seconds.

Every server here listens on loopback, and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import processes

TESTS = Path(__file__).resolve().parent
GONE_TIMEOUT = 30.0  # seconds for a process to be gone once nothing holds it


def alive(pid: int) -> bool:
    """Whether ``pid`` is a ``wuliang ps`` that has not exited (a zombie no
    init reaps counts as exited; a reused pid runs something else)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and b"wuliang\0ps" in cmdline


def wait_gone(pids: list[int], timeout: float = GONE_TIMEOUT) -> list[int]:
    """The pids still alive after up to ``timeout`` s (none, normally)."""
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_left(pids: list[int]) -> None:
    """SIGKILL for processes a failed test leaves running (not our children)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# A session of two tests: the first makes two servers of the conformance
# suite's process implementation through its make_ps fixture, breaks the
# first one's close and raises; the second records which processes still run
# once the first one's teardown is over.
INNER_TESTS = """
import json
import os
from pathlib import Path

import processes
import pytest
from test_ps_conformance import make_ps  # the suite's fixture, finalizer and all

RECORD = Path(os.environ["RECORD"])


@pytest.mark.parametrize("make_ps", ["remote-processes"], indirect=True)
def test_body_raises(make_ps):
    kept = make_ps(1)
    first = [p.pid for p in processes.running()]
    make_ps(2)
    second = [p.pid for p in processes.running() if p.pid not in first]

    def broken_close():
        raise RuntimeError("a close that fails before it stops anything")

    kept.close = broken_close
    RECORD.write_text(json.dumps({"first": first, "second": second}))
    raise RuntimeError("the test body fails")


def test_after_the_teardown():
    record = json.loads(RECORD.read_text())
    record["running"] = [p.pid for p in processes.running()]
    RECORD.write_text(json.dumps(record))
"""


def test_a_failing_test_leaves_no_server_running(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    record = tmp_path / "record.json"
    env = {
        **os.environ,
        "RECORD": str(record),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "processes", "-p", "no:cacheprovider"]
    inner = subprocess.run(
        [*command, "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = inner.stdout[-6000:] + inner.stderr[-3000:]
    assert record.exists(), said
    pids = json.loads(record.read_text())
    left = wait_gone(pids["first"] + pids["second"])
    kill_left(left)
    assert len(pids["first"]) == len(pids["second"]) == 2, pids
    assert "RuntimeError: the test body fails" in inner.stdout, said
    summary = inner.stdout.strip().splitlines()[-1] if inner.stdout.strip() else ""
    for outcome in ("1 failed", "1 passed", "1 error"):  # the teardown's error: the close
        assert outcome in summary, said
    # the finalizer went on past the failed close: only the first server's still ran
    assert sorted(pids["running"]) == sorted(pids["first"]), pids
    # and the safety net stopped those at the session's end, saying so
    assert "stopped 2 child processes a test left running" in inner.stdout, said
    assert left == [], f"wuliang ps processes still running after the session: {left}\n{said}"


# A parent that starts a wuliang ps with --parent-pid, prints the server's
# pid and waits to be killed.
PARENT = """
import subprocess, sys, time
import processes

server = processes.spawn(
    processes.ps_command("--port", "0", "--threads", "1"),
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
)
line = processes.read_line(server)
print(server.pid if "listening on grpc 127.0.0.1:" in line else f"no start: {line!r}", flush=True)
time.sleep(600)
"""


def test_a_server_stops_when_its_parent_is_killed() -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    parent = processes.spawn(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        line = processes.read_line(parent, processes.START_TIMEOUT * 2)
        assert line.strip().isdigit(), line
        server = int(line)
        assert alive(server)
        parent.kill()  # the parent only: no finalizer, no atexit runs
        parent.wait(timeout=processes.KILL_TIMEOUT)
        left = wait_gone([server])
        kill_left(left)
        assert left == [], "wuliang ps --parent-pid still running after its parent was killed"
    finally:
        processes.stop_each([parent])
