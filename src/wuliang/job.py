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
* **the cut.** A checkpoint of a job must hold every trainer's updates up
  to the position it records for it, and none after, or a restore from it
  trains rows twice (or skips them). So the chief holds the job while it
  writes one (``hold_trainers`` … ``release``): it puts a ``hold`` on the
  board; each other trainer's background thread sees it (in the answer to
  its next call; an idle trainer asks every ``_IDLE_POLL`` s), stops its
  trainer before the next push (``note_step`` waits), waits until the
  pushes already begun are applied (``push_done``), sends its position
  and answers ``held/<trainer>``; the trainer goes on once the hold is
  gone. A trainer that has finished its shard counts as held. The
  trainers stand still for the checkpoint's write; a trainer that does
  not answer within ``WULIANG_CUT_SECONDS`` (default 120 s) is named in a
  warning and the checkpoint is written without it (a restore from it may
  train that trainer's last rows twice). With a tower synced every k > 1
  steps (``Context(tower_sync_steps=)``), a trainer's tower change since
  its last sync is not in the cut.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from wuliang.ps_server import ParameterServer
from wuliang.ps_server.cluster import Cluster
from wuliang.ps_server.job import HELD, HOLD, POSITION, READY, JobState

__all__ = ["Job", "JobError"]

log = logging.getLogger("wuliang.job")
WAIT_SECONDS = 600.0
CUT_SECONDS = 120.0  # how long the chief waits for the trainers to stop for a cut
_IDLE_POLL = 0.2  # an idle trainer's board call (to see a hold), seconds
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
        self._in_flight = 0  # parts of begun pushes not yet done (see begin_push)
        self._held = False  # the chief holds the job: no push begins
        # what sends this trainer's changes held locally (a shared cache's
        # flush): before it answers a hold, and before it finishes
        self.flush: Callable[[], Any] | None = None
        self._hold_answered = b""  # the last hold this trainer stopped for
        self.cut_seconds = float(os.environ.get("WULIANG_CUT_SECONDS", CUT_SECONDS))

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
                self._start()  # from now on, a hold is answered
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
        if self.flush is not None:
            self.flush()
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

    # -- the cut of a checkpoint ------------------------------------------------------

    def push_done(self) -> None:
        """One part of a begun push is applied (or failed)."""
        with self._lock:
            self._in_flight -= 1
            self._lock.notify_all()

    def hold_trainers(self) -> bytes | None:
        """The chief, before writing a checkpoint: stops every other trainer
        at its next push, once its begun pushes are applied and its position
        is on the board (see the module docstring); returns the hold to
        ``release`` (None: the chief trains alone)."""
        if self.trainers == 1:
            return None
        hold = f"{self.trainer}-{time.time_ns()}".encode()
        self.call(put={HOLD: hold})
        others = [t for t in range(self.trainers) if t != self.trainer]
        names = [n for t in others for n in (f"{HELD}{t}", f"{FINISHED}{t}")]
        start, pause = time.monotonic(), 0.01
        while True:
            values = self.call(get=names).values
            waiting = [
                t for t in others
                if values.get(f"{HELD}{t}") != hold and f"{FINISHED}{t}" not in values
            ]  # fmt: skip
            if not waiting:
                return hold
            if time.monotonic() - start > self.cut_seconds:
                log.warning(
                    "trainer(s) %s did not stop for the checkpoint in %g s "
                    "(WULIANG_CUT_SECONDS): it is written without them, and a restore "
                    "from it may train their last rows again",
                    ", ".join(map(str, waiting)),
                    self.cut_seconds,
                )
                return hold
            time.sleep(pause)
            pause = min(pause * 2, _IDLE_POLL)

    def release(self, hold: bytes | None = None) -> None:
        """The chief: ends its hold (any hold left on the board when None,
        as a chief that restarts does)."""
        if hold is None or self.call(get=[HOLD]).values.get(HOLD) == hold:
            self.call(put={HOLD: b""})

    def _stop_for(self, hold: bytes) -> None:
        """The background thread of a trainer the chief holds: no push begins,
        the begun ones are applied, the position and steps go to the board
        with the answer; then waits until the hold is gone."""
        with self._lock:
            self._held = True
            if not self._lock.wait_for(lambda: self._in_flight <= 0, timeout=self.ps_timeout()):
                log.warning(
                    "trainer %d: its pushes were not applied in %g s; it stops "
                    "for the checkpoint without them",
                    self.trainer,
                    self.ps_timeout(),
                )
            steps, self._unsent = self._unsent, 0
            position, self._position = self._position, None
        try:
            if self.flush is not None:  # the cut has every change of the steps it counts
                self.flush()
            put = {f"{HELD}{self.trainer}": hold}
            if position is not None:
                put[f"{POSITION}{self.trainer}"] = position
            try:
                state = self.ps.job(add_steps=steps, floor=self.step, put=put)
            except BaseException:
                with self._lock:
                    self._unsent += steps
                    if self._position is None:
                        self._position = position
                raise
            self._hold_answered = hold
            with self._lock:
                self.step = max(self.step, state.step)
            start = time.monotonic()
            while self.ps.job(get=[HOLD]).values.get(HOLD) == hold:
                if time.monotonic() - start > self.wait_seconds:
                    log.warning("trainer %d: the chief's hold lasted over %g s; it goes on",
                                self.trainer, self.wait_seconds)  # fmt: skip
                    return
                time.sleep(_IDLE_POLL / 4)
        finally:
            with self._lock:
                self._held = False
                self._lock.notify_all()

    # -- counting steps in the background ------------------------------------------

    def note_step(self, position: Any = None, parts: int = 1) -> None:
        """Before a trained step's push: waits while the chief holds the job
        for a checkpoint, then counts the step and its push's ``parts`` (each
        ends with a ``push_done``) and keeps ``position``, the reader's after
        the step. The background thread sends the count and the newest
        position. Raises the error of a failed send."""
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._held and not self._lock.wait_for(
                lambda: not self._held, timeout=self.wait_seconds
            ):
                log.warning("trainer %d: the chief's hold lasted over %g s; it goes on",
                            self.trainer, self.wait_seconds)  # fmt: skip
                self._held = False
            self._unsent += 1
            self._in_flight += parts
            if position is not None:
                self._position = json.dumps(position.to_dict()).encode()
            self._start()
            self._lock.notify()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="wuliang-job", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        idle = None if self.is_chief else _IDLE_POLL  # a worker asks for a hold meanwhile
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._unsent or self._closed, timeout=idle)
                if self._closed and not self._unsent:
                    return
                steps, self._unsent = self._unsent, 0
                position, self._position = self._position, None
                self._sending = True
            put = {} if position is None else {f"{POSITION}{self.trainer}": position}
            get = [READY] if self._ready_value is not None else []
            if not self.is_chief:
                get.append(HOLD)
            try:
                state = self.ps.job(add_steps=steps, floor=self.step, put=put, get=get)
                if self._ready_value is not None and READY not in state.values:
                    self.ps.job(put={READY: self._ready_value})  # its server came back empty
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
            hold = state.values.get(HOLD)
            if hold is not None and hold != self._hold_answered:
                try:
                    self._stop_for(hold)
                except BaseException as error:
                    with self._lock:
                        self._error = error
                    time.sleep(_POLL[1])

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
