"""A trainer's part in a cluster job: the shared step, the chief's ready
mark, every trainer's reader position.

The trainers of a ``TF_CONFIG`` cluster (``wuliang.ps_server.cluster``)
share the parameter servers' job board (``wuliang.ps_server.job``):

* **the step.** Each trained step is counted on the board; a trainer's
  ``global_step`` is the job's (its own steps plus every other trainer's,
  as far as the last answer tells), so row stamps (TTL eviction),
  checkpoint and export names are the cluster's. Counting does not stall a
  step: one background thread sends what accumulated since its last call
  (``note_step``), one call at a time.
* **ready.** The chief alone restores (the newest checkpoint of its
  ``model_dir``) or initializes the tables and the tower, then marks the
  job ready; workers wait for that mark before their first step
  (``wait_ready``, bounded: ``WULIANG_JOB_WAIT_SECONDS``, default 600 s).
  A trainer that restarts while the job is ready (the servers hold it)
  restores nothing: the servers' rows are newer than any checkpoint.
* **finished.** A trainer that has trained its whole shard says so
  (``finish``); the chief waits for all (``wait_finished``) before its last
  checkpoint and evaluation.
* **positions.** Each trainer publishes its reader position after every
  trained batch (with the step count); the chief's checkpoints record all
  of them, a restore puts them back on the board, and a trainer that
  restarts resumes from its own, wherever the board got it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from wuliang.ps_server import ParameterServer
from wuliang.ps_server.cluster import Cluster
from wuliang.ps_server.job import POSITION, READY, JobState

__all__ = ["Job", "JobError"]

log = logging.getLogger("wuliang.job")
WAIT_SECONDS = 600.0
FINISHED = "finished/"  # + trainer index: that trainer trained its whole shard
_POLL = (0.05, 2.0)  # first and longest pause while waiting for the chief


class JobError(RuntimeError):
    """The job cannot go on (the chief never marked it ready)."""


class Job:
    """One trainer's view of the job board (see the module docstring)."""

    def __init__(
        self, ps: ParameterServer, cluster: Cluster, wait_seconds: float | None = None
    ) -> None:
        self.ps = ps
        self.cluster = cluster
        self.trainer = cluster.trainer_index
        self.trainers = cluster.num_trainers
        self.is_chief = cluster.is_chief
        if wait_seconds is None:
            wait_seconds = float(os.environ.get("WULIANG_JOB_WAIT_SECONDS", WAIT_SECONDS))
        self.wait_seconds = wait_seconds
        self.step = 0  # the highest job step this trainer has seen
        self._lock = threading.Condition()
        self._unsent = 0  # steps trained and not yet counted on the board
        self._position: bytes | None = None  # the newest position, not yet sent
        self._ready_value: bytes | None = None  # the chief's mark, kept on the board
        self._error: BaseException | None = None
        self._sending = False  # the background thread's call is in flight
        self._closed = False
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        role = "chief" if self.is_chief else "worker"
        return f"Job({role}, trainer {self.trainer} of {self.trainers}, step {self.step})"

    # -- the board, synchronously ------------------------------------------------

    def call(self, **kwargs: Any) -> JobState:
        """One call to the board (``ParameterServer.job``), raising it to
        the highest step seen; remembers the step it answers."""
        state = self.ps.job(floor=self.step, **kwargs)
        with self._lock:
            self.step = max(self.step, state.step)
        return state

    def ready(self) -> dict[str, Any] | None:
        """The chief's ready mark (what the job started from), or None."""
        value = self.call(get=[READY]).values.get(READY)
        return None if value is None else json.loads(value)

    def mark_ready(self, **info: Any) -> None:
        """The chief: the tables and the tower are in place."""
        self._ready_value = json.dumps(info).encode()
        self.call(put={READY: self._ready_value})

    def wait_ready(self) -> dict[str, Any]:
        """A worker: waits until the chief marked the job ready; JobError
        after ``wait_seconds``."""
        logged = False
        for waited in _polls():
            mark = self.ready()
            if mark is not None:
                return mark
            if waited > self.wait_seconds:
                chief = (self.cluster.chief or self.cluster.worker)[0]
                raise JobError(
                    f"the chief ({chief}) has not made the job ready (restored or "
                    f"initialized its tables) after {waited:.0f} s "
                    "(WULIANG_JOB_WAIT_SECONDS)"
                )
            if not logged and waited > 5:
                log.info("trainer %d waits for the chief to make the job ready", self.trainer)
                logged = True
        raise AssertionError("unreachable")  # _polls never ends

    def positions(self) -> dict[str, dict[str, Any]]:
        """Every trainer's reader position on the board, by trainer index."""
        values = self.call(prefix=POSITION).values
        return {name.removeprefix(POSITION): json.loads(v) for name, v in values.items()}

    def position(self) -> dict[str, Any] | None:
        """This trainer's reader position on the board (None: none yet)."""
        return self.positions().get(str(self.trainer))

    def put_positions(self, positions: dict[str, Any]) -> None:
        """Puts trainers' positions (a restored checkpoint's) on the board."""
        put = {f"{POSITION}{t}": json.dumps(p).encode() for t, p in positions.items()}
        self.call(put=put)

    def sync(self) -> int:
        """Sends what is unsent now (after the background call in flight,
        if any) and returns the job's step."""
        with self._lock:
            self._lock.wait_for(lambda: not self._sending, timeout=self.ps_timeout())
            steps, self._unsent = self._unsent, 0
            position, self._position = self._position, None
        put = {} if position is None else {f"{POSITION}{self.trainer}": position}
        return self.call(add_steps=steps, put=put).step

    def finish(self) -> None:
        """Marks this trainer's shard done (after sending what is unsent)."""
        self.sync()
        self.call(put={f"{FINISHED}{self.trainer}": b"1"})

    def wait_finished(self, timeout: float = WAIT_SECONDS) -> None:
        """The chief, before its last checkpoint: waits until every trainer
        has finished (``finish``); JobError naming those that have not
        after ``timeout`` s."""
        for waited in _polls():
            done = self.call(prefix=FINISHED).values
            missing = [t for t in range(self.trainers) if f"{FINISHED}{t}" not in done]
            if not missing:
                return
            if waited > timeout:
                raise JobError(
                    f"trainer(s) {', '.join(map(str, missing))} did not finish in {timeout:g} s"
                )

    # -- counting steps in the background ------------------------------------------

    def note_step(self, position: Any = None) -> None:
        """Counts one trained step (and the reader position after it); sent
        by the background thread. Raises the error of a failed send."""
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._unsent += 1
            if position is not None:
                self._position = json.dumps(position.to_dict()).encode()
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="wuliang-job", daemon=True)
                self._thread.start()
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._unsent or self._closed)
                if self._closed and not self._unsent:
                    return
                steps, self._unsent = self._unsent, 0
                position, self._position = self._position, None
                self._sending = True
            put = {} if position is None else {f"{POSITION}{self.trainer}": position}
            get = [READY] if self._ready_value is not None else []
            try:
                state = self.ps.job(add_steps=steps, floor=self.step, put=put, get=get)
                if get and READY not in state.values:  # the board's server came back empty
                    self.ps.job(put={READY: self._ready_value})
            except BaseException as error:  # raised in the trainer at its next step
                with self._lock:
                    self._sending = False
                    self._lock.notify_all()
                    self._error = error
                    self._unsent += steps
                    if self._position is None:
                        self._position = position
                time.sleep(_POLL[1])  # the client retried already; pause, then again
                continue
            with self._lock:
                self.step = max(self.step, state.step)
                self._sending = False
                self._lock.notify_all()

    def close(self) -> None:
        """Sends what is unsent (bounded by the client's deadlines) and stops."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self.ps_timeout())

    def ps_timeout(self) -> float:
        return float(getattr(self.ps, "timeout", 60.0)) + 5.0


def _polls() -> Iterator[float]:
    """Seconds waited so far, before each poll; pauses between polls double
    from the first to the longest of ``_POLL``."""
    start, pause = time.monotonic(), _POLL[0]
    while True:
        yield time.monotonic() - start
        time.sleep(pause)
        pause = min(pause * 2, _POLL[1])
