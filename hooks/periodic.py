"""A hook that acts every N steps, every T seconds or after each partition
on a synced engine, and once at the end: the base of ``Checkpoint`` and
``IncrementalExport``."""

from __future__ import annotations

import threading
import time
from typing import Any

from wuliang.hooks.base import HookSession, SessionRunContext, SessionRunHook, SessionRunValues
from wuliang.reader.partitions import Partition
from wuliang.reader.stream import ends_partition

KEEP_RESULTS = 1000  # what a hook's result lists keep, newest last: flat memory for months


class Recent(list):
    """A list of a hook's results that keeps the newest ``KEEP_RESULTS``."""

    def append(self, item: Any) -> None:
        super().append(item)
        if len(self) > KEEP_RESULTS:
            del self[: len(self) - KEEP_RESULTS]


def results() -> Recent:
    return Recent()


class PeriodicSyncHook(SessionRunHook):
    """Calls ``trigger(session)`` after every ``every_steps``-th step, once
    ``every_secs`` have passed (checked ahead of each step), or, with
    ``every_partition``, after the last batch of each partition of a
    ``StreamReader``, with the engine in sync after that step (its push
    applied, nothing of later steps pulled), and in ``end`` when steps ran
    since the last trigger. ``partition`` is then the partition that step
    ended (else None).

    Syncing stalls the pipeline for about one step each time. Steps are
    global steps: in a cluster they advance by every trainer's steps, so a
    step "every N" is the first step at or past each multiple of N.

    ``chief_only`` hooks (checkpoints, evictions, exports) act only in the
    chief of a cluster (``Context.is_chief``); in the other trainers they
    do nothing.
    """

    chief_only = False

    def __init__(
        self, every_steps: int | None, every_secs: float | None, every_partition: bool = False
    ) -> None:
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be an int >= 1, got {every_steps!r}")
        if every_secs is not None and every_secs <= 0:
            raise ValueError(f"every_secs must be > 0, got {every_secs!r}")
        self.every_steps = every_steps
        self.every_secs = every_secs
        self.every_partition = bool(every_partition)
        self.partition: Partition | None = None  # the partition the step triggered ended
        self._lock = threading.Lock()
        self._due: set[int] = set()
        self._last_time = time.monotonic()
        self._last_step = -1  # global step at the last trigger (or start)
        self._asked: int | None = None  # the step sync_after was asked last
        self._active = True  # False: a chief_only hook in a trainer that is not the chief

    def trigger(self, session: HookSession) -> None:
        raise NotImplementedError

    def after_create_session(self, session: HookSession) -> None:
        self._last_step = session.global_step
        self._last_time = time.monotonic()
        self._active = not self.chief_only or getattr(session.context, "is_chief", True)

    def sync_after(self, step: int) -> bool:
        with self._lock:
            if not self._active:
                return False
            last = step - 1 if self._asked is None or self._asked >= step else self._asked
            self._asked = step
            due = (
                bool(self.every_steps)
                and (step + 1) // self.every_steps > (last + 1) // self.every_steps
            )
            now = time.monotonic()
            if self.every_secs is not None and now - self._last_time >= self.every_secs:
                due = True
                self._last_time = now
            if due:
                self._due.add(step)
            return due

    def sync_after_batch(self, step: int, batch: Any) -> bool:
        due = self.sync_after(step)
        if self.every_partition and ends_partition(batch) is not None:
            with self._lock:
                if not self._active:
                    return due
                self._due.add(step)
            return True
        return due

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        # an evaluation run changes nothing to save; a step not synced is
        # not the marked one (a cluster's steps jump: a mark may be <= it)
        if not run_context.train or not run_context.synced:
            return
        with self._lock:
            due = any(s <= run_context.step for s in self._due)
            # marks of this step and of steps read ahead but never trained
            self._due = {s for s in self._due if s > run_context.step}
        if due:
            self.partition = ends_partition(run_context.batch)
            try:
                self._fire(run_context.session)
            finally:
                self.partition = None

    def begin(self) -> None:
        with self._lock:
            self._due.clear()  # marks of a previous train() that stopped early
            self._asked = None

    def end(self, session: HookSession) -> None:
        if self._active and session.global_step != self._last_step:
            self._fire(session)

    def _fire(self, session: HookSession) -> None:
        self.trigger(session)
        self._last_step = session.global_step
