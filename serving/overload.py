"""Shedding overload early: each API's bounded queue (``wuliang serve
--max-queue N --max-queue-ms MS``).

A server that queues without bound answers everything late once requests
come faster than it answers them, and keeps growing its queue (and its
memory) while clients time out and send more. Here each API (lookups,
predictions) of each transport admits a request only if it will start soon,
and answers the rest at once, so that clients back off or go to another
replica while the admitted requests keep their latency:

* ``ApiQueue``: one API's requests admitted and not yet answered
  (``in_flight``) over its ``workers``, and a running mean of their service
  time (an exponentially weighted one, ``EWMA`` for the newest). ``admit``
  takes a request when fewer than ``workers + max_queue`` are in flight and
  its expected wait (the ``lag`` before the server noticed it, plus the
  requests ahead of it shared among the workers times the mean service time)
  is at most ``max_queue_ms``; otherwise it raises ``Overloaded`` with a
  suggested retry delay (the time the queue needs to drain). ``done`` ends
  an admitted request.
* gRPC: the lookup and prediction pools are ``SheddingPool`` s. grpcio hands
  each call to its pool's ``submit`` on the server's polling thread, which
  admits it or sheds it there: a shed call runs on a one-thread pool of its
  own (never behind the queue it was refused by), where the handler finds
  it marked (``take_shed``) and answers RESOURCE_EXHAUSTED before parsing
  anything, with the trailing metadata ``grpc-retry-pushback-ms`` (gRPC's
  retry pushback).
* HTTP: a small lookup is answered on the event loop, so its wait is the
  loop's: ``LoopLag`` samples how late the loop runs a timer every
  ``LoopLag.INTERVAL``, and a lookup or prediction is shed while the last two
  samples both exceed ``max_queue_ms`` (one late tick, a collection or a
  scheduler hiccup, sheds nothing). Predictions and big lookups run in the
  HTTP pool, which has an ``ApiQueue`` too (its lag: the loop's). The
  answer is 503 with ``Retry-After`` (whole seconds, at least 1, as HTTP
  has it) and ``{"error": ..., "retry_after_ms": N}``.
* Counted: ``wuliang_requests_total{code="RESOURCE_EXHAUSTED"}`` and
  ``wuliang_shed_total{transport, endpoint}``; ``wuliang_queue_requests
  {queue}`` is each queue's in-flight count when scraped.
* Never shed: health checks, ``/metrics``, status and metadata: they are
  cheap, and they are what tells an orchestrator the server is alive. On
  gRPC they run on the server's own pool, apart from the shedding pools.

Defaults (``DEFAULT_QUEUE_PER_WORKER``, ``DEFAULT_MAX_QUEUE_MS``): up to 4
requests waiting per worker, and no request admitted to wait more than
``DEFAULT_MAX_QUEUE_MS``. ``max_queue=0`` and ``max_queue_ms=0`` switch each
bound off; both off, nothing is shed.
"""

from __future__ import annotations

import asyncio
import threading
import time
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
    "Shedding",
    "SheddingPool",
    "take_shed",
]

DEFAULT_QUEUE_PER_WORKER = 4  # requests that may wait per worker of a pool
DEFAULT_MAX_QUEUE_MS = 10.0  # the longest a request is admitted to wait
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
        self.service = 0.0  # seconds, the running mean
        self._lock = threading.Lock()

    def admit(self, lag: float = 0.0) -> None:
        """Takes one request, or raises ``Overloaded`` (see the module docstring)."""
        with self._lock:
            n = self.in_flight
            ahead = n - self.workers + 1  # waiting before this one, and this one
            wait = lag + (ahead * self.service / self.workers if ahead > 0 else 0.0)
            if self.max_queue and ahead > self.max_queue:
                why = f"{ahead - 1} requests wait already (max_queue {self.max_queue})"
            elif self.max_wait and wait > self.max_wait:
                why = f"it would wait {wait * 1e3:.1f} ms (max_queue_ms {self.max_wait * 1e3:g})"
            else:
                self.in_flight = n + 1
                return
            drain = max(n - self.workers + 1, 1) * self.service / self.workers
        retry_ms = max(1, round(max(drain, self.max_wait) * 1e3))
        raise Overloaded(f"overloaded: {self.name}: {why}; retry in {retry_ms} ms", retry_ms)

    def done(self, seconds: float | None) -> None:
        """Ends an admitted request that took ``seconds`` to serve (None:
        it never ran)."""
        with self._lock:
            self.in_flight -= 1
            if seconds is not None:
                self.service += EWMA * (seconds - self.service)


# -- gRPC -----------------------------------------------------------------------------

_marks = threading.local()


def take_shed() -> Overloaded | None:
    """The ``Overloaded`` a ``SheddingPool`` marked the call running on this
    thread with (once), or None: the handler raises it before any work."""
    error = getattr(_marks, "shed", None)
    if error is not None:
        _marks.shed = None
    return error


def _run_shed(error: Overloaded, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    _marks.shed = error
    try:
        return fn(*args, **kwargs)
    finally:
        _marks.shed = None


class SheddingPool(ThreadPoolExecutor):
    """A pool for grpcio's ``experimental_thread_pool`` that admits each call
    to its ``ApiQueue`` or runs it, marked shed, on ``shed_pool``."""

    def __init__(self, queue: ApiQueue, shed_pool: ThreadPoolExecutor, name: str) -> None:
        super().__init__(queue.workers, thread_name_prefix=name)
        self.queue = queue
        self.shed_pool = shed_pool

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        try:
            self.queue.admit()
        except Overloaded as error:
            return self.shed_pool.submit(_run_shed, error, fn, args, kwargs)
        try:
            return super().submit(self._run, fn, args, kwargs)
        except BaseException:  # shut down: grpcio sees the error, the count stays right
            self.queue.done(None)
            raise

    def _run(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.queue.done(time.perf_counter() - start)


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
        """The lag a new request meets: the smaller of the last two samples."""
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
