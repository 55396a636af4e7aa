"""Stopping training on SIGTERM the way orchestrators expect: finish the
step, checkpoint, exit 0.

Kubernetes (and ``wuliang launch``) ends a pod with SIGTERM, then SIGKILL
after a grace period. While ``Session.train`` runs in the main thread, a
``StopOnSignal`` turns SIGTERM into a stop after the step being trained:
the loop ends as at the end of the data, the hooks' ``end`` runs (a
``Checkpoint`` hook saves, with the reader's position after that step), and
``train`` returns, so a script that ends there exits 0. A reader that waits
for data (``StreamReader``) is told to ``stop``, which ends its wait at
once. The session's ``stopped_by`` names the signal; a script that loops
over ``train`` calls checks it.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("wuliang")

SIGNALS = (signal.SIGTERM,)


class StopOnSignal:
    """Within ``with``: SIGTERM sets ``signal`` (its name) and stops
    ``reader`` (its ``stop()``, if it has one). Outside the main thread it
    does nothing (Python delivers signals to the main thread only)."""

    def __init__(self, reader: Any = None) -> None:
        self.reader = reader
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signal is None
        self.signal = signal.Signals(signum).name
        if first:
            log.warning("%s: finishing the step, then checkpointing and stopping", self.signal)
        stop = getattr(self.reader, "stop", None)
        if callable(stop):
            stop()
