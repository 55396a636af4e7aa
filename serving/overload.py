"""Shedding overload early: each API's bounded queue (``wuliang serve
--max-queue N --max-queue-ms MS``).

A server that queues without bound answers everything late once requests
come faster than it answers them, and keeps growing its queue (and its
memory) while clients time out and send more. Here each API (lookups,
predictions) of each transport admits a request only if it will start soon,
and answers the rest at once, so that clients back off or go to another
replica while the admitted requests keep their latency:

* ``ApiQueue``: one API's requests admitted and not yet answered
  (``in_flight``) over its ``workers``, and how fast they drain: a running
  mean (exponentially weighted, ``EWMA`` for the newest) of the time between
  two of them ending while every worker is busy. ``admit`` takes a request
  when fewer than ``workers + max_queue`` are in flight and its expected
  wait (the ``lag`` before the server noticed it, plus the requests ahead of
  it times that mean, ``drain``) is at most ``max_queue_ms``; otherwise it
  raises ``Overloaded`` with a suggested retry delay (the time the queue
  needs to drain). ``done`` ends an admitted request.
* gRPC: the lookup and prediction pools are ``SheddingPool`` s. grpcio hands
  each call to its pool's ``submit`` on the server's polling thread, which
  admits it or marks it shed there. The pool's threads take shed calls and
  admitted ones in turn, and one more thread takes only shed calls (never
  behind the queue that refused them); the handler finds the mark
  (``take_shed``) and answers RESOURCE_EXHAUSTED before parsing anything,
  with the trailing metadata ``grpc-retry-pushback-ms`` (gRPC's retry
  pushback).
* HTTP: a lookup up to 16 KB is answered on the event loop, so its wait
  is the loop's. A busy loop reads a request in one pass and runs its
  handler in the next, handlers one after another: a handler has waited
  about one pass, the loop's lag (``LoopLag`` samples how late the loop
  runs a timer every ``LoopLag.INTERVAL``; the smaller of the last two
  samples), plus the time since the current pass began (``PassClock``, the
  loop's selector, notes when each pass starts). A lookup or prediction
  is shed while that sum exceeds ``max_queue_ms``, so a pass admits about
  ``max_queue_ms`` of work and sheds the rest. Predictions and big lookups
  run in the HTTP pools, which have an ``ApiQueue`` each (its lag: that
  sum), ended on the pool's thread. The
  answer is 503 with ``Retry-After`` (whole seconds, at least 1, as HTTP
  has it) and ``{"error": ..., "retry_after_ms": N}``.
* Counted: ``wuliang_requests_total{code="RESOURCE_EXHAUSTED"}`` and
  ``wuliang_shed_total{transport, endpoint}``; ``wuliang_queue_requests
  {queue}`` is each queue's in-flight count when scraped.
* Never shed: health checks, ``/metrics``, status and metadata: they are
  cheap, and they are what tells an orchestrator the server is alive. On
  gRPC they run on the server's own pool, apart from the shedding pools.

Defaults (``DEFAULT_QUEUE_PER_WORKER``, ``DEFAULT_MAX_QUEUE_MS``): up to 32
requests waiting per worker, and no request admitted to wait more than
``DEFAULT_MAX_QUEUE_MS``. ``max_queue=0`` and ``max_queue_ms=0`` switch each
bound off; both off, nothing is shed.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from wuliang.serving.errors import Overloaded

__all__ = [
    "DEFAULT_MAX_QUEUE_MS",
    "DEFAULT_QUEUE_PER_WORKER",
    "ApiQueue",
    "LoopLag",
    "Overloaded",
    "PassClock",
    "Shedding",
    "SheddingPool",
    "take_shed",
]

DEFAULT_QUEUE_PER_WORKER = 32  # requests that may wait per worker of a pool
DEFAULT_MAX_QUEUE_MS = 5.0  # the longest a request is admitted to wait
EWMA = 0.1  # weight of the newest service time in the running mean


class Shedding:
    """The bounds of every queue of a serving process: ``max_queue``
    requests waiting (None: ``DEFAULT_QUEUE_PER_WORKER`` per worker of the
    pool; 0: no bound) and ``max_queue_ms`` of expected wait (0: no bound)."""

    def __init__(
        self, max_queue: int | None = None, max_queue_ms: float = DEFAULT_MAX_QUEUE_MS
    ) -> None:
        if max_queue is not None and (
            isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0
        ):
            raise ValueError(f"max_queue must be an int >= 0 (0: no bound), got {max_queue!r}")
        if not isinstance(max_queue_ms, int | float) or not 0 <= max_queue_ms < float("inf"):
            raise ValueError(
                f"max_queue_ms must be a finite number >= 0 (0: no bound), got {max_queue_ms!r}"
            )
        self.max_queue = max_queue
        self.max_queue_ms = float(max_queue_ms)

    def queue(self, name: str, workers: int) -> ApiQueue:
        waiting = DEFAULT_QUEUE_PER_WORKER * workers if self.max_queue is None else self.max_queue
        return ApiQueue(name, workers, waiting, self.max_queue_ms)


class ApiQueue:
    """One API's bounded queue (see the module docstring).

    Args:
        name: how errors and metrics name it (``grpc Lookup`` …).
        workers: threads answering its requests.
        max_queue: requests that may wait for a worker (0: no bound).
        max_queue_ms: the longest expected wait admitted (0: no bound).
    """

    def __init__(self, name: str, workers: int, max_queue: int, max_queue_ms: float) -> None:
        self.name = name
        self.workers = workers
        self.max_queue = max_queue
        self.max_wait = max_queue_ms / 1e3
        self.in_flight = 0
        self.drain = 0.0  # seconds between two requests ending, the running mean
        self._ended = 0.0  # when the last one ended (time.perf_counter())
        self._lock = threading.Lock()

    def admit(self, lag: float = 0.0) -> None:
        """Takes one request, or raises ``Overloaded`` (see the module docstring)."""
        with self._lock:
            n = self.in_flight
            ahead = n - self.workers + 1  # waiting before this one, and this one
            wait = lag + (ahead * self.drain if ahead > 0 else 0.0)
            if self.max_queue and ahead > self.max_queue:
                why = f"{ahead - 1} requests wait already (max_queue {self.max_queue})"
            elif self.max_wait and wait > self.max_wait:
                why = f"it would wait {wait * 1e3:.1f} ms (max_queue_ms {self.max_wait * 1e3:g})"
            else:
                self.in_flight = n + 1
                return
            drain = max(ahead, 1) * self.drain
        retry_ms = max(1, round(max(drain, self.max_wait) * 1e3))
        raise Overloaded(f"overloaded: {self.name}: {why}; retry in {retry_ms} ms", retry_ms)

    def done(self, seconds: float | None) -> None:
        """Ends an admitted request that took ``seconds`` to serve (None:
        it never ran). The queue drains a request every ``drain`` seconds:
        while every worker is busy, the time since the last request ended
        (what the workers' service times come to, whatever they spent
        waiting for the GIL or for grpcio); otherwise a service time shared
        among the workers."""
        now = time.perf_counter()
        with self._lock:
            busy = self.in_flight >= self.workers
            self.in_flight -= 1
            if seconds is not None:
                sample = now - self._ended if busy else seconds / self.workers
                self.drain += EWMA * (min(sample, seconds) - self.drain)
            self._ended = now


# -- gRPC -----------------------------------------------------------------------------

_marks = threading.local()


def take_shed() -> Overloaded | None:
    """The ``Overloaded`` a ``SheddingPool`` marked the call running on this
    thread with (once), or None: the handler raises it before any work."""
    error = getattr(_marks, "shed", None)
    if error is not None:
        _marks.shed = None
    return error


class SheddingPool(ThreadPoolExecutor):
    """A pool for grpcio's ``experimental_thread_pool`` that admits each call
    to its ``ApiQueue`` or marks it shed.

    A shed call is answered by the first thread free to: while both kinds
    wait, the pool's threads take a shed call and an admitted one in turn
    (shed calls must not starve the work, as they would under clients
    that send again at once), and one more thread takes shed calls only,
    for when every worker is held by a long request. So it never
    waits behind the queue that refused it. (Its answer costs about as much
    as a small lookup, grpcio's per-call work, so more threads of its own
    would only contend for the GIL.) It is a ``ThreadPoolExecutor`` for
    grpcio's sake (grpcio checks the type); ``submit`` and ``shutdown`` are
    its own.
    """

    def __init__(self, queue: ApiQueue, name: str) -> None:
        super().__init__(1, thread_name_prefix=name)  # its own threads are never started
        self.queue = queue
        self._admitted: deque[tuple[Future, Callable[..., Any], Any, Any]] = deque()
        self._shed: deque[tuple[Future, Callable[..., Any], Any, Any, Overloaded]] = deque()
        lock = threading.Lock()
        self._work_ready = threading.Condition(lock)  # the workers wait on it
        self._shed_ready = threading.Condition(lock)  # the thread for shed calls waits on it
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(False,), name=f"{name}_{i}", daemon=True)
            for i in range(queue.workers)
        ]
        self._threads.append(
            threading.Thread(target=self._work, args=(True,), name=f"{name}_shed", daemon=True)
        )
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            self.queue.admit()
            shed = None
        except Overloaded as error:
            shed = error
        with self._work_ready:
            if self._closed:
                if shed is None:
                    self.queue.done(None)
                raise RuntimeError("cannot schedule new futures after shutdown")
            if shed is None:
                self._admitted.append((future, fn, args, kwargs))
            else:
                self._shed.append((future, fn, args, kwargs, shed))
                self._shed_ready.notify()
            self._work_ready.notify()
        return future

    def _take(
        self, shed_only: bool, shed_first: bool
    ) -> tuple[Future, Callable[..., Any], Any, Any, Any] | None:
        ready = self._shed_ready if shed_only else self._work_ready
        with ready:
            while not self._shed and (shed_only or not self._admitted) and not self._closed:
                ready.wait()
            if self._shed and (shed_first or shed_only or not self._admitted):
                return self._shed.popleft()
            if self._admitted and not shed_only:
                return (*self._admitted.popleft(), None)
            return None  # closed, and nothing left

    def _work(self, shed_only: bool) -> None:
        shed_first = True  # a worker alternates while both kinds wait: sheds never starve work
        while (task := self._take(shed_only, shed_first)) is not None:
            shed_first = task[4] is None
            future, fn, args, kwargs, shed = task
            start = time.perf_counter()
            try:
                if future.set_running_or_notify_cancel():
                    _marks.shed = shed
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as error:
                        future.set_exception(error)
                    finally:
                        _marks.shed = None
            finally:
                if shed is None:
                    self.queue.done(time.perf_counter() - start)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Ends the threads once the calls submitted are done (``wait``: waits for that)."""
        with self._work_ready:
            self._closed = True
            self._work_ready.notify_all()
            self._shed_ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
        super().shutdown(wait=False)


# -- HTTP -----------------------------------------------------------------------------


class LoopLag:
    """How late an event loop runs a timer, sampled every ``INTERVAL``
    seconds on that loop: the wait of a request it has not read yet."""

    INTERVAL = 0.002

    def __init__(self) -> None:
        self.last = 0.0  # seconds, the newest sample
        self.previous = 0.0
        self._handle: asyncio.TimerHandle | None = None

    @property
    def seconds(self) -> float:
        """The loop's lag: the smaller of the last two samples (one late
        tick, a collection or a scheduler hiccup, is not a late loop)."""
        return min(self.last, self.previous)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        due = loop.time() + self.INTERVAL
        self._handle = loop.call_at(due, self._tick, loop, due)

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        self.previous, self.last = self.last, max(0.0, now - due)
        due = now + self.INTERVAL
        self._handle = loop.call_at(due, self._tick, loop, due)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


class PassClock(selectors.DefaultSelector):
    """The selector of an event loop (``asyncio.SelectorEventLoop(clock)``)
    that notes when each pass of the loop starts: when its ``select``
    returns. The loop then runs the handlers of the requests it read in the
    previous pass one after another, so a handler running now has waited
    at least ``in_pass()`` for those ahead of it in this pass."""

    def __init__(self) -> None:
        super().__init__()
        self.started = time.perf_counter()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(timeout)
        self.started = time.perf_counter()
        return ready

    def in_pass(self) -> float:
        """Seconds since the loop's current pass started."""
        return time.perf_counter() - self.started
