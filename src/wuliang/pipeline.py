"""The training pipeline: read → prepare → pull ahead of the step, push behind it.

Who runs what, and what each step waits for::

    reader threads   batch, keys prepared (ParquetReader's pool)
    puller thread    source.prepare(batch) ─► Step, source.prefetch(prepared)
                     (with read_ahead, one batch ahead: a disk tier reads its cold
                     rows while the step before it waits, pulls and trains)
                     wait: steps[i-2].applied (staleness 0 or 1; i-1 when the push of i-1
                           has already begun, or without linking)
                     link: steps[i-1] will write the rows step i shares into step i's rows
                     step.pulled = source.pull(step)       (a ParameterServer handle)
                     ─► ready queue, ``depth`` steps deep
    main thread      wait: step.pulled, steps[i-1].linked  ─► TF step ─► push(step, grads)
                     (sync steps: wait step.applied, run the hooks, step.released)
    pusher thread    source.push(step, grads, link): the rows step i + 1 shares first
                     ─► step.linked, then the rest ─► step.applied

With staleness 0 every step sees every earlier update (exact, deterministic):
the pull of step i runs early, once step i - 2 is pushed, overlapping step
i - 1 (row creation included). Before it, the puller links step i - 1's push
to step i's rows: where each key of step i - 1 sits in step i's pulled
rows, if there. That push then writes the rows it updates straight into step
i's input in a first half (those keys only), and the main thread waits only
for that half before step i: no second pull, and the rest of the push
overlaps step i. A push that has already begun when step i is pulled is not
linked; the pull then waits for it. A parameter server runs one caller's
calls in the order they were made (the embedded engine's shard workers run
a shard's tasks one at a time, a remote server in its client's sequence), so
whichever of step i's pull and step i - 1's linked half comes first, step i
sees the push's rows. With staleness 1 the early pull is all: rows can be
one update old.

A ``Step`` carries its own futures (``linked``, ``applied``, ``released``)
and its pull's handle (``pulled``), so waiting for a step is waiting on
that step's future, and an error in the pusher reaches every waiter through
them. The model side (what a pull, a link, a push mean for this model's
tables) is a ``StepSource``; the pipeline never imports TensorFlow (nor the
bridge, which does): the step inputs and gradients pass through unopened.
An exception in either thread is re-raised in the main thread with its
traceback (a pull error after the steps before it); ``close()`` applies the
pending pushes and joins both threads. Batches read ahead of a stopped loop
are dropped (as with tf.data).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as WaitTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from wuliang.ps_server import Handle
from wuliang.ps_server.threads import set_background
from wuliang.reader.batch import CsrBatch
from wuliang.reader.prepare import PreparedKeys

_END = object()
_POLL_S = 0.1  # how often a waiting thread looks at the stop flag


def _done() -> Future[Any]:
    done: Future[Any] = Future()
    done.set_result(None)
    return done


@dataclass(eq=False)
class Step:
    """One batch on its way through the pipeline (see the module docstring)."""

    seq: int  # position in this pipeline run
    number: int  # the global step it trains as
    batch: CsrBatch
    prepared: PreparedKeys
    inputs: Any  # the step function's inputs, opaque here
    rows: list[np.ndarray]  # packed rows per group of tables, filled by the pull
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    sync: bool = False  # hooks want the server in sync after this step
    linked_in: bool = False  # the previous step's push writes this step's shared rows
    pulled: Future[None] = field(default_factory=Future)  # `rows` filled
    linked: Future[None] = field(default_factory=Future)  # rows the next step shares pushed
    applied: Future[Any] = field(default_factory=Future)  # this step's push applied
    released: Future[None] = field(default_factory=Future)  # (sync) its hooks have run
    _link: Any = None  # where this step's push writes the next step's shared rows
    _push_begun: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def link_to(self, link: Any) -> bool:
        """Registers where this step's push writes the next step's shared
        rows, unless that push has already begun (False)."""
        with self._lock:
            if self._push_begun:
                return False
            self._link = link
            return True

    def begin_push(self) -> Any:
        """Marks the push begun; returns the link registered before, if any."""
        with self._lock:
            self._push_begun = True
            return self._link


class StepSource(Protocol):
    """The model side of the pipeline (a ``Session`` makes one per loop).

    ``prepare``, ``link`` and ``pull`` run on the puller thread, ``push`` on
    the pusher thread; none of them on the main thread."""

    def prepare(self, batch: CsrBatch) -> tuple[PreparedKeys, Any, list[np.ndarray]]:
        """(prepared keys, step inputs, the step's unfilled rows)."""
        ...

    def pull(self, prepared: PreparedKeys, rows: list[np.ndarray], step: int) -> Handle[None]:
        """Starts pulling the rows of global step ``step`` into ``rows``."""
        ...

    def prefetch(self, prepared: PreparedKeys) -> None:
        """Starts bringing the step's rows into the parameter server's
        memory (a disk tier), before the pull waits for earlier pushes."""
        ...

    def link(self, previous: PreparedKeys, prepared: PreparedKeys, rows: list[np.ndarray]) -> Any:
        """Where the previous step's push writes the rows this step shares."""
        ...

    def push(
        self,
        prepared: PreparedKeys,
        grads: Any,
        step: int,
        link: Any,
        linked: Callable[[], None],
    ) -> Any:
        """Applies a step's gradients (with a link: the shared rows first,
        then ``linked()``, then the rest); returns what was applied."""
        ...


class Pipeline:
    """Runs ahead of the main thread's steps (see the module docstring).

    Args:
        batches: the reader's iterator.
        source: the model side (``StepSource``).
        train: push each step's gradients (False: evaluation, pulls only).
        depth: steps pulled ahead.
        staleness: 0 or 1 (see the module docstring).
        trace: where stage timings go (``wuliang.context.Trace``).
        first_step: the global step of the first batch.
        step_floor: in a cluster, the job's step as far as known: a batch's
            step is the higher of it and the previous batch's step + 1
            (None: ``first_step`` + the batch's sequence number).
        sync_after: (global step, batch) -> bool, asked before a step is handed over:
            True marks it ``sync`` (the main thread then waits for
            ``applied`` before that step's hooks and sets ``released`` after
            them; no later step is pulled before, so checkpoints see the
            parameter server exactly as the step left it).
        background: scheduling of the two threads (``wuliang.ps_server.threads``).
        on_partition: called with a batch's ``partition`` when it differs from
            the previous batch's, before the batch's pull and once every
            earlier push is applied (a training session sets the servers'
            data clock there, so each row is stamped with its own partition's
            time).
    """

    def __init__(
        self,
        batches: Iterator[CsrBatch],
        source: StepSource,
        *,
        train: bool,
        depth: int,
        staleness: int,
        trace: Any,
        first_step: int = 0,
        sync_after: Callable[[int, CsrBatch], bool] | None = None,
        background: str = "normal",
        step_floor: Callable[[], int] | None = None,
        read_ahead: bool = False,
        on_partition: Callable[[Any], None] | None = None,
    ) -> None:
        self.batches = batches
        self.on_partition = on_partition
        self.read_ahead = read_ahead
        self.source = source
        self.train = train
        self.linking = train and staleness == 0
        self.staleness = staleness
        self.trace = trace
        self.first_step = first_step
        self.step_floor = step_floor
        self.sync_after = sync_after
        self.background = background
        self.stop = threading.Event()
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.to_push: queue.Queue = queue.Queue()
        self.pull_error: BaseException | None = None  # raised after the steps before it
        self.push_error: BaseException | None = None  # raised at the next push or close
        self.threads = [threading.Thread(target=self._pull_loop, name="wuliang-pull", daemon=True)]
        if train:
            self.threads.append(
                threading.Thread(target=self._push_loop, name="wuliang-push", daemon=True)
            )
        for t in self.threads:
            t.start()

    # -- main thread ---------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        previous: Step | None = None
        while True:
            step = self._get()
            if step is _END:
                self._raise(pull=True)
                return
            start = time.perf_counter()
            self._wait(step.pulled)
            if step.linked_in and previous is not None:  # rows final once its shared rows are
                self._wait(previous.linked)
            end = time.perf_counter()
            self.trace.record("wait_update", step.number, start, end)
            step.timings["wait_update"] = end - start
            previous = step
            yield step

    def push(self, step: Step, grads: Any) -> None:
        """Queues the step's gradients for the pusher."""
        self._raise(pull=False)
        self.to_push.put((step, grads))

    def wait_applied(self, step: Step) -> None:
        """Waits until the step's push is applied (raising its error)."""
        self._wait(step.applied)
        self._raise(pull=False)

    def close(self) -> None:
        """Applies the pending pushes, then stops and joins the threads."""
        self.stop.set()
        self.to_push.put(_END)
        while True:  # unblock the puller
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        for t in self.threads:
            t.join()
        close = getattr(self.batches, "close", None)  # e.g. the reader's threads
        if close is not None:
            close()
        self._raise(pull=False)

    def _get(self) -> Any:
        while True:
            try:
                return self.ready.get(timeout=_POLL_S)
            except queue.Empty:
                self._raise(pull=False)

    def _wait(self, future: Future[Any]) -> None:
        """The main thread's wait: raises the push error meanwhile (once)."""
        while True:
            try:
                future.result(_POLL_S)
                return
            except WaitTimeout:
                self._raise(pull=False)
            except BaseException as error:
                if error is self.push_error:
                    self.push_error = None
                raise

    def _raise(self, pull: bool) -> None:
        """Re-raises a push error, and the pull error once its steps are used."""
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
                self.ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _until(self, future: Future[Any]) -> bool:
        """The puller's wait: False once stopping (or the future failed:
        the pusher's error reaches the main thread)."""
        while not self.stop.is_set():
            try:
                future.result(_POLL_S)
                return True
            except WaitTimeout:
                continue
            except BaseException:
                return False
        return False

    def _pull_loop(self) -> None:
        set_background(self.background)
        steps: list[Step] = []  # the last two
        try:
            seq = 0
            number = self.first_step - 1
            ahead = self._read_step(seq, number)
            while ahead is not None and not self.stop.is_set():
                step = ahead
                number = step.number
                # With read_ahead, the next batch is read, prepared and its
                # prefetch started now, a step before its pull: the disk
                # reads its cold rows while this step waits, pulls and trains.
                ahead = self._read_step(seq + 1, number) if self.read_ahead else None
                waiting = time.perf_counter()
                previous = steps[-1] if steps else None
                if previous is not None and previous.sync and not self._until(previous.released):
                    return
                if self.train and not self._wait_pushes(steps, step):
                    return
                if not self._partition_begins(previous, step):
                    return
                step.timings["wait_push"] = time.perf_counter() - waiting
                self._pull(step)
                step.sync = self.sync_after is not None and self.sync_after(number, step.batch)
                if not self.train:
                    step.linked.set_result(None)
                    step.applied.set_result(None)
                steps = [*steps[-1:], step]
                if not self._put(step):
                    return
                seq += 1
                if ahead is None and not self.read_ahead:
                    ahead = self._read_step(seq, number)
            self._put(_END)
        except BaseException as e:
            self.pull_error = e
            self._put(_END)

    def _partition_begins(self, previous: Step | None, step: Step) -> bool:
        """``on_partition`` when step begins a partition, after the pushes
        before it; False when the pipeline stops meanwhile."""
        partition = getattr(step.batch, "partition", None)
        if self.on_partition is None or partition is None:
            return True
        before = None if previous is None else getattr(previous.batch, "partition", None)
        if before is not None and before.name == partition.name:
            return True
        if previous is not None and not self._until(previous.applied):
            return False
        self.on_partition(partition)
        return True

    def _read_step(self, seq: int, number: int) -> Step | None:
        """The next batch read and prepared as step ``seq`` (its global step
        after ``number``), its prefetch started. None at the end of the
        batches or once stopped."""
        if self.stop.is_set():
            return None
        start = time.perf_counter()
        batch = next(self.batches, None)
        read = time.perf_counter()
        if batch is None:
            return None
        number = (
            self.first_step + seq if self.step_floor is None else max(number + 1, self.step_floor())
        )
        self.trace.record("read", number, start, read)
        prepared, inputs, rows = self.source.prepare(batch)
        prepared_at = time.perf_counter()
        self.trace.record("prepare", number, read, prepared_at)
        step = Step(seq, number, batch, prepared, inputs, rows)
        step.timings.update(read=read - start, prepare=prepared_at - read)
        self.source.prefetch(prepared)  # the disk, while earlier steps train
        return step

    def _pull(self, step: Step) -> None:
        """Starts the step's pull; ``step.pulled`` completes once its rows
        are in (and its timing recorded)."""
        start = time.perf_counter()

        def done(handle: Handle[None]) -> None:
            end = time.perf_counter()
            self.trace.record("pull", step.number, start, end)
            step.timings["pull"] = end - start
            try:
                handle.wait()
            except BaseException as error:
                step.pulled.set_exception(error)
            else:
                step.pulled.set_result(None)

        self.source.pull(step.prepared, step.rows, step.number).add_done_callback(done)

    def _wait_pushes(self, steps: list[Step], step: Step) -> bool:
        """Before step's pull: the push of two steps back applied, and the
        previous one linked into step's rows (staleness 0) or applied (when
        its push has begun, or without linking); staleness 1 waits for two
        steps back only."""
        if len(steps) == 2 and not self._until(steps[0].applied):
            return False
        if not steps:
            return True
        previous = steps[-1]
        if self.staleness == 1:
            return True
        if self.linking:
            step.linked_in = previous.link_to(
                self.source.link(previous.prepared, step.prepared, step.rows)
            )
        return step.linked_in or self._until(previous.applied)

    # -- pusher --------------------------------------------------------------

    def _push_loop(self) -> None:
        set_background(self.background)
        step: Step | None = None
        try:
            while True:
                item = self.to_push.get()
                if item is _END:
                    return
                step, grads = item
                link = step.begin_push()
                start = time.perf_counter()

                def linked(step: Step = step, start: float = start) -> None:
                    self.trace.record("push_linked", step.number, start, time.perf_counter())
                    step.linked.set_result(None)

                with self.trace.span("push", step.number):
                    result = self.source.push(step.prepared, grads, step.number, link, linked)
                if not step.linked.done():
                    step.linked.set_result(None)
                step.applied.set_result(result)
        except BaseException as e:
            self.push_error = e
            if step is not None:
                for future in (step.linked, step.applied):
                    if not future.done():
                        future.set_exception(e)
            while True:  # what waits for later steps' pushes stops too
                try:
                    item = self.to_push.get_nowait()
                except queue.Empty:
                    break
                if item is not _END:
                    for future in (item[0].linked, item[0].applied):
                        future.set_exception(e)
