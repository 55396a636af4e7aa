"""Waiting for the signal that stops a server (SIGTERM, SIGINT), shared by
``wuliang ps`` and ``wuliang serve``.

A Python signal handler runs on the main thread, once that thread runs
bytecode again. The kernel hands a signal sent to the process to any of
its threads that does not block it, and a server has many (grpcio's, the
engine's shard threads): now and then one of them takes it (a thread that
is creating a thread at that moment does, and a busy machine makes that
more likely). A main thread blocked in ``threading.Event.wait()`` is then
never woken, and the server ignores the signal until it is killed. So the
main thread waits in short sleeps, after each of which the handlers of
signals taken by any thread have run, and the handler only records the
signal (no lock: one taking the lock of an ``Event`` the main thread holds
would deadlock).

``StopSignals(parent_pid=P)`` also stops once process P is no longer this
process's parent (it exited and this one was orphaned): an opt-in for test
harnesses and supervisors that must not leave servers behind when they die
(``wuliang ps --parent-pid``).
"""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

__all__ = ["StopSignals"]

POLL_SECONDS = 0.2  # the longest a stop waits for the main thread to notice


class StopSignals:
    """Records SIGINT and SIGTERM from its creation on (it installs their
    handlers: create it on the main thread, before the server starts, so a
    signal is never lost); ``wait()`` returns once one came.

    Args:
        parent_pid: when set, ``wait()`` also returns once this process is
            no longer the parent (``os.getppid()`` changed: it exited).
    """

    def __init__(self, parent_pid: int | None = None) -> None:
        if parent_pid is not None and parent_pid < 1:
            raise ValueError(f"parent_pid must be a process id >= 1, got {parent_pid!r}")
        self.parent_pid = parent_pid
        self.received: list[int] = []  # appended by the handler: atomic, no lock
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def reason(self) -> str | None:
        """Why the server should stop now ("SIGTERM", "parent process 12
        exited"), or None."""
        if self.received:
            return signal.Signals(self.received[0]).name
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            return f"parent process {self.parent_pid} exited"
        return None

    def wait(self) -> str:
        """Blocks until a stop signal came (or the parent exited); says which."""
        while (reason := self.reason()) is None:
            time.sleep(POLL_SECONDS)
        return reason
