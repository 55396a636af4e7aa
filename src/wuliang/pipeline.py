"""The training pipeline: read → prepare → pull ahead of the step, push behind it.

::

    reader threads ─► batch (keys prepared in the reader's pool)
    puller thread  ─► step inputs (index arrays) ─► wait for pushes (staleness) ─► link ─► pull rows
                          └── ready queue, `prefetch` batches deep ──► main thread: the TF step
    pusher thread  ◄── row gradients of step i (queued by the main thread) ─► engine.push
                          └── (staleness 0) updated rows of keys step i + 1 shares ─► its rows

With staleness 0 every step sees every earlier update (exact, deterministic):
the pull of step i runs early, once step i - 2 is pushed, overlapping step
i - 1 (row creation included). Before it, the puller "links" step i - 1's
push to step i's rows: where each key of step i - 1 sits in step i's pulled
rows, if there. That push then writes the rows it updates straight into step
i's input (engine ``push(updated=, updated_rows=)``) in a first half of the
push (those keys only), and the main thread waits only for that half before
step i: no second pull, and the rest of the push overlaps step i. A push
that has already started when step i is pulled is not linked; the pull then
waits for it. The engine's shard workers run a shard's pull and push tasks
one at a time, so whichever comes first, the push's rows are what step i
sees. With staleness 1 the early pull is all: rows can be one update old. An
exception in either thread is re-raised in the main thread with its
traceback; ``close()`` waits for the pending pushes and joins both threads.

The pipeline is generic: it never imports TensorFlow (nor the bridge, which
does); the step inputs pass through it unopened.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from wuliang.reader.batch import CsrBatch
from wuliang.reader.prepare import PreparedKeys
from wuliang.threads import set_background

_END = object()


@dataclass
class Pulled:
    """A batch ready for its step: inputs built, rows pulled."""

    seq: int
    batch: CsrBatch
    prepared: PreparedKeys
    inputs: Any  # the step function's inputs, opaque here
    rows: list[np.ndarray]  # packed rows per group of tables
    timings: dict[str, float]
    sync: bool = False  # after this step: wait for its push; release() before the next pull
    linked: bool = False  # the previous step's push writes into rows: wait for it first


class Pipeline:
    """Runs ahead of the main thread's steps.

    Args:
        batches: the reader's iterator.
        prepare: batch -> (PreparedKeys, step inputs), for batches the reader
            did not prepare; the inputs are opaque here (the Session's
            ``wuliang.embedding.bridge.StepInputs``).
        rows_for: PreparedKeys -> the batch's (unfilled) packed rows.
        pull: (PreparedKeys, rows, step) -> None: pulls into rows the
            batch of that global step.
        push: (PreparedKeys, row gradients, step, link or None, linked_done)
            -> None, calling linked_done() once the linked rows are written;
            None for evaluation.
        link: (previous PreparedKeys, PreparedKeys, rows) -> what the previous
            batch's push needs to write its updated rows into ``rows``
            (staleness 0); None: the pull waits for that push instead.
        depth: batches pulled ahead.
        staleness: 0 or 1 (see the module docstring).
        trace: where stage timings go.
        first_step: the global step of the first batch (for the trace).
        sync_after: global step -> bool, asked before a batch is handed over:
            True marks it ``sync``: the main thread then calls ``wait_pushed``
            and ``release`` around that step's hooks, and no later batch is
            pulled until ``release`` (checkpoints see the engine exactly as
            the step left it).
        background: scheduling of the two threads (``wuliang.threads``).

    Batches read ahead of a stopped loop are dropped (as with tf.data).
    """

    def __init__(
        self,
        batches: Iterator[CsrBatch],
        prepare: Callable[[CsrBatch], tuple[PreparedKeys, Any]],
        rows_for: Callable[[PreparedKeys], list[np.ndarray]],
        pull: Callable[[PreparedKeys, list[np.ndarray], int], None],
        push: Callable[[PreparedKeys, Any, int, Any, Callable[[], None]], None] | None,
        link: Callable[[PreparedKeys, PreparedKeys, list[np.ndarray]], Any] | None,
        depth: int,
        staleness: int,
        trace: Any,
        first_step: int = 0,
        sync_after: Callable[[int], bool] | None = None,
        background: str = "normal",
    ) -> None:
        self.batches = batches
        self.background = background
        self.sync_after = sync_after
        self.released = -1  # highest sync seq released by the main thread
        self._sync_seq: int | None = None
        self.first_step = first_step
        self.prepare = prepare
        self.rows_for = rows_for
        self.pull = pull
        self.push_fn = push
        self.link = link if push is not None and staleness == 0 else None
        self.links: dict[int, Any] = {}  # seq -> its push's link (under pushed_cv)
        self.push_started = -1  # highest seq whose push has begun
        self.staleness = staleness
        self.trace = trace
        self.stop = threading.Event()
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.to_push: queue.Queue = queue.Queue()
        self.pushed = -1  # highest seq whose push is applied
        self.linked_pushed = -1  # highest seq whose linked rows are written
        self.pushed_cv = threading.Condition()
        self.pull_error: BaseException | None = None  # raised after the batches before it
        self.push_error: BaseException | None = None  # raised at the next push or close
        self.threads = [threading.Thread(target=self._pull_loop, name="wuliang-pull", daemon=True)]
        if push is not None:
            self.threads.append(
                threading.Thread(target=self._push_loop, name="wuliang-push", daemon=True)
            )
        for t in self.threads:
            t.start()

    # -- main thread ---------------------------------------------------------

    def __iter__(self) -> Iterator[Pulled]:
        while True:
            item = self._get()
            if item is _END:
                self._raise(pull=True)
                return
            if self.link is not None:  # rows are final once the previous push is applied
                start = time.perf_counter()
                if item.linked:
                    self._wait_for_push(item.seq - 1, linked=True)
                    self._raise(pull=False)
                end = time.perf_counter()
                self.trace.record("wait_update", self.first_step + item.seq, start, end)
                item.timings["wait_update"] = end - start
            yield item

    def push(self, prepared: PreparedKeys, grads: Any, seq: int) -> None:
        self._raise(pull=False)
        self.to_push.put((prepared, grads, seq))

    def wait_pushed(self, seq: int) -> None:
        """Waits until the push of batch ``seq`` is applied (raising its error)."""
        self._wait_for_push(seq)
        self._raise(pull=False)

    def release(self, seq: int) -> None:
        """Lets the puller go on past the sync batch ``seq``."""
        with self.pushed_cv:
            self.released = max(self.released, seq)
            self.pushed_cv.notify_all()

    def close(self) -> None:
        """Applies the pending pushes, then stops and joins the threads."""
        self.stop.set()
        self.to_push.put(_END)
        while True:  # unblock the puller
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        with self.pushed_cv:
            self.pushed_cv.notify_all()
        for t in self.threads:
            t.join()
        close = getattr(self.batches, "close", None)  # e.g. the reader's threads
        if close is not None:
            close()
        self._raise(pull=False)

    def _get(self) -> Any:
        while True:
            try:
                return self.ready.get(timeout=0.1)
            except queue.Empty:
                self._raise(pull=False)

    def _raise(self, pull: bool) -> None:
        """Re-raises a push error, and the pull error once its batches are used."""
        if self.push_error is not None:
            error, self.push_error = self.push_error, None
            raise error
        if pull and self.pull_error is not None:
            error, self.pull_error = self.pull_error, None
            raise error

    # -- puller --------------------------------------------------------------

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _wait_for_push(self, target: int, linked: bool = False) -> bool:
        """Waits until the push of step `target` is applied (``linked``: only
        its linked rows written)."""
        with self.pushed_cv:
            while (
                (self.linked_pushed if linked else self.pushed) < target
                and not self.stop.is_set()
                and self.push_error is None
            ):
                self.pushed_cv.wait(timeout=0.1)
        return not self.stop.is_set() and self.push_error is None

    def _wait_released(self, seq: int) -> bool:
        with self.pushed_cv:
            while self.released < seq and not self.stop.is_set() and self.push_error is None:
                self.pushed_cv.wait(timeout=0.1)
        return not self.stop.is_set() and self.push_error is None

    def _pull_loop(self) -> None:
        set_background(self.background)
        try:
            seq = 0
            previous: PreparedKeys | None = None
            while not self.stop.is_set():
                start = time.perf_counter()
                batch = next(self.batches, None)
                read = time.perf_counter()
                if batch is None:
                    break
                self.trace.record("read", self.first_step + seq, start, read)
                prepared, inputs = self.prepare(batch)
                prepared_at = time.perf_counter()
                self.trace.record("prepare", self.first_step + seq, read, prepared_at)
                step = self.first_step + seq
                if self._sync_seq is not None:  # the previous step is a sync step
                    if not self._wait_released(self._sync_seq):
                        return
                    self._sync_seq = None
                early = self.staleness == 1 or self.link is not None
                if self.push_fn is not None and not self._wait_for_push(
                    seq - 2 if early else seq - 1
                ):
                    return
                rows = self.rows_for(prepared)
                linked = False
                if self.link is not None and previous is not None:
                    link = self.link(previous, prepared, rows)
                    with self.pushed_cv:
                        if self.push_started < seq - 1:
                            self.links[seq - 1] = link
                            linked = True
                    if not linked and not self._wait_for_push(seq - 1):
                        return
                waited = time.perf_counter()
                self.pull(prepared, rows, step)
                pulled = time.perf_counter()
                self.trace.record("pull", step, waited, pulled)
                timings = {
                    "read": read - start,
                    "prepare": prepared_at - read,
                    "wait_push": waited - prepared_at,
                    "pull": pulled - waited,
                }
                previous = prepared
                sync = self.sync_after is not None and self.sync_after(step)
                if sync:
                    self._sync_seq = seq
                item = Pulled(seq, batch, prepared, inputs, rows, timings, sync, linked)
                if not self._put(item):
                    return
                seq += 1
            self._put(_END)
        except BaseException as e:
            self.pull_error = e
            self._put(_END)

    # -- pusher --------------------------------------------------------------

    def _linked_done(self, seq: int, start: float) -> None:
        self.trace.record("push_linked", self.first_step + seq, start, time.perf_counter())
        with self.pushed_cv:
            self.linked_pushed = seq
            self.pushed_cv.notify_all()

    def _push_loop(self) -> None:
        assert self.push_fn is not None
        set_background(self.background)
        try:
            while True:
                item = self.to_push.get()
                if item is _END:
                    return
                prepared, grads, seq = item
                with self.pushed_cv:
                    self.push_started = seq
                    link = self.links.pop(seq, None)
                start = time.perf_counter()
                with self.trace.span("push", self.first_step + seq):
                    self.push_fn(
                        prepared,
                        grads,
                        self.first_step + seq,
                        link,
                        lambda s=seq, t=start: self._linked_done(s, t),
                    )
                with self.pushed_cv:
                    self.pushed = seq
                    self.linked_pushed = seq
                    self.pushed_cv.notify_all()
        except BaseException as e:
            self.push_error = e
            with self.pushed_cv:
                self.pushed_cv.notify_all()
