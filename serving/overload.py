"""Shedding overload, and only overload (``wuliang serve --max-queue N
--max-queue-ms MS``).

A server that queues without bound answers everything late once requests
come faster than it can answer them, and keeps growing its queue (and its
memory) while clients time out and send more. A server that refuses every
request that would wait a little refuses normal load: N callers that each
wait for their answer before sending the next (a closed loop, how most
clients are written) keep up to N requests queued for as long as they
run, and a few dozen such callers are a normal load. Overload is arrivals
the server cannot finish (an open loop above capacity): its queue grows
for as long as it lasts. So each queue (an API's pool of each transport,
and the HTTP server's event loop) sheds as follows, per queue:

* **Normal**: every request is admitted while fewer than ``max_queue``
  (default ``DEFAULT_MAX_QUEUE``) wait ahead of it, however long they take:
  a closed loop of up to that many callers is never refused, however they
  start and send, and what they wait follows each API's own service time.
  A request that finds the queue full is shed, and the queue becomes
  overloaded. (Finding an overload sooner, by the queue's growth, was
  measured and dropped: a client starting 64 threads one after another
  grows the queue window after window as fast as twice the capacity of
  predictions does, and was refused.)
* **Overloaded**: a request is admitted only if it would start within
  ``max_queue_ms`` (default ``DEFAULT_MAX_QUEUE_MS``), or within one service
  time of the API where that is longer (at least one request queued per
  worker, so the workers never idle); the rest are shed at once. A request
  about to be served that has waited longer than that (the backlog of up to
  ``max_queue`` requests of the moment the overload was found, or of a
  probe) is shed then instead (``stale``), at once. This is controlled delay
  as Facebook's servers apply it ("Fail at Scale", ACM Queue 2015): a long
  queue allowed while the queue drains, a short one while it stands, so
  admitted requests keep their latency while the excess is refused, and a
  shed answer costs the server its parsing only. Adaptive LIFO is not used:
  with the excess refused at the door and stale requests shed, the admitted
  queue is within ``max_queue_ms``, and serving it newest first would only
  reorder a few requests.
* **Back to normal**: after a whole ``INTERVAL`` with no request shed (the
  arrivals fell below what the queue finishes), or after a probe: once
  overloaded for ``HOLD`` seconds, the queue admits everything (up to
  ``max_queue``) for ``PROBE_WINDOWS`` windows of ``WINDOW_S`` (for a pool
  at least ``WINDOW_DRAINS`` drains) and watches its length: a window grew
  when the queue set a new high in it, above every length since it was
  last empty. Closed-loop callers that were being refused all come back
  within their round trip, then stand still, however unevenly they send:
  normal again. Arrivals over capacity still set new highs in the last
  ``PROBE_GROWING`` windows: overloaded for twice the hold (up to
  ``MAX_HOLD``). A probe costs an overload a
  few milliseconds of queue (shed as stale after it); it spares
  closed-loop callers caught by a burst from being refused for good (each
  refused caller sends again at once, which no count of arrivals can tell
  from new ones).

The pieces:

* ``OverloadDetector``: one queue's state (normal, overloaded, probing):
  ``observe`` watches the queue's length, ``check`` says whether a request
  is admitted or why it is shed, ``stale`` whether one about to be served
  is shed instead.
* ``ApiQueue``: a pool's requests admitted and not yet answered
  (``in_flight``) over its ``workers``, and how fast they drain: a running
  mean (exponentially weighted, ``EWMA`` for the newest) of the time between
  two of them ending while every worker is busy. A request's expected wait
  is the ``lag`` before the server noticed it plus the requests ahead of it
  times that mean (``drain``). ``admit`` takes a request or raises
  ``Overloaded`` with a suggested retry delay, ``stale`` is asked before
  one is served, ``done`` ends one.
* gRPC: the lookup and prediction pools are ``SheddingPool`` s. grpcio hands
  each call to its pool's ``submit`` on the server's polling thread, which
  admits it or marks it shed there. The pool's threads take shed calls and
  admitted ones in turn, and one more thread takes only shed calls (never
  behind the queue that refused it); the handler finds the mark
  (``take_shed``) and answers RESOURCE_EXHAUSTED before parsing anything,
  with the trailing metadata ``grpc-retry-pushback-ms`` (gRPC's retry
  pushback).
* HTTP: a lookup up to 16 KB is answered on the event loop
  (``LoopQueue``). A busy loop reads requests in one pass and runs their
  handlers in the next, one after another: a handler has as many requests
  ahead of it as handlers ran before it in this pass (``PassClock``, the
  loop's selector, notes when each pass starts and counts them), and has
  waited the loop's lag (``LoopLag`` samples how late the loop runs a timer
  every ``LoopLag.INTERVAL``; the smaller of the last two samples) plus the
  time since the pass began. Predictions and big lookups then wait in the
  HTTP pools, an ``ApiQueue`` each (its lag: the loop's wait), ended on the
  pool's thread. The answer is 503 with ``Retry-After`` (whole seconds, at
  least 1, as HTTP has it) and ``{"error": ..., "retry_after_ms": N}``.
* Counted: ``wuliang_requests_total{code="RESOURCE_EXHAUSTED"}`` and
  ``wuliang_shed_total{transport, endpoint}``; ``wuliang_queue_requests
  {queue}`` (each queue's requests when scraped), ``wuliang_queue_overloaded
  {queue}`` (1 while overloaded) and ``wuliang_queue_overloads_total
  {queue}`` (times it became overloaded).
* Never shed: health checks, ``/metrics``, status and metadata: they are
  cheap, and they are what tells an orchestrator the server is alive. On
  gRPC they run on the server's own pool, apart from the shedding pools.

``max_queue=0`` admits any number of waiting requests (a queue then never
becomes overloaded, so nothing is shed); ``max_queue_ms=0`` keeps an
overloaded queue at ``max_queue`` (it sheds only beyond it).
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
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_QUEUE_MS",
    "ApiQueue",
    "LoopLag",
    "LoopQueue",
    "OverloadDetector",
    "Overloaded",
    "PassClock",
    "Shedding",
    "SheddingPool",
    "take_shed",
]

DEFAULT_MAX_QUEUE = 128  # requests that may wait in a queue: closed-loop callers never refused
DEFAULT_MAX_QUEUE_MS = 5.0  # the longest wait admitted while a queue is overloaded
EWMA = 0.1  # weight of the newest service time in the running mean
WINDOW_S = 0.01  # the shortest window over which a queue's growth is judged
WINDOW_DRAINS = 4  # and a pool's window lasts at least this many drains
INTERVAL = 0.1  # seconds without a shed that end an overload
HOLD = 2.0  # seconds overloaded before the first probe
MAX_HOLD = 16.0  # the longest hold, doubled from HOLD by each probe that finds overload
PROBE_WINDOWS = 3  # a probe's windows: callers coming back, then standing still or not
PROBE_GROWING = 2  # its last windows that set new highs, all: still overloaded


class Shedding:
    """The bounds of every queue of a serving process: ``max_queue``
    requests waiting before a queue is overloaded (None:
    ``DEFAULT_MAX_QUEUE``; 0: no bound, nothing shed) and ``max_queue_ms``,
    the longest wait admitted while it is (0: no bound)."""

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
        self.max_queue = DEFAULT_MAX_QUEUE if max_queue is None else max_queue
        self.max_queue_ms = float(max_queue_ms)

    def queue(self, name: str, workers: int) -> ApiQueue:
        return ApiQueue(name, workers, self.max_queue, self.max_queue_ms)

    def loop(self, name: str) -> LoopQueue:
        return LoopQueue(name, self.max_queue, self.max_queue_ms)


class OverloadDetector:
    """Whether one queue is overloaded, and so which requests it sheds (the
    module docstring's states). Its queue tells it how many requests wait
    whenever that changes (``observe``), of each request it takes
    (``check``) and of each it is about to serve (``stale``).

    A probe judges growth by windows of at least ``window_s`` (the queue's
    choice): a window grew when the queue set a new high in it, above every
    length since it was last empty. N closed-loop callers keep at most N
    requests queued, so once they are all in, their queue sets no new high
    however unevenly they send; arrivals over capacity set a new high in
    every window. Not thread-safe: its queue calls it under its own lock,
    or from its one thread.

    Args:
        max_queue: requests that may wait (0: no bound, nothing shed).
        max_wait: seconds, the longest wait admitted while overloaded (0:
            no bound: an overloaded queue sheds only beyond ``max_queue``).
    """

    def __init__(self, max_queue: int, max_wait: float) -> None:
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.overloaded = False
        self.overloads = 0  # times it became overloaded
        self.since = 0.0  # when the current overload began
        self._window_at: float | None = None  # when the current window began
        self._window_high = 0  # the most waiting in the current window
        self._record = 0  # the most waiting since the queue was last empty
        self._grew: deque[bool] = deque(maxlen=PROBE_GROWING)  # the last windows: new highs
        self._probe: int | None = None  # while probing: its windows so far
        self._hold = HOLD
        self._probe_at = 0.0  # when the next probe starts
        self._last_shed = 0.0
        self._calm_at = -MAX_HOLD  # when the last overload ended

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def observe(self, now: float, waiting: int, window_s: float) -> None:
        """The queue holds ``waiting`` requests waiting now; ``window_s``:
        the queue's window (what a probe watches)."""
        self._window_high = max(self._window_high, waiting)
        if self._window_at is None:
            self._window_at = now
        if now - self._window_at < window_s:
            return
        high, self._window_high, self._window_at = self._window_high, waiting, now
        if high == 0:
            self._record = 0  # empty for a whole window: highs count anew
        grew = high > self._record
        self._record = max(self._record, high)
        self._grew.append(grew)
        if self._probe is not None:
            self._probe += 1
            if self._probe >= PROBE_WINDOWS:
                self._probe = None
                if all(self._grew):  # still growing: over capacity
                    self._extend(now)
                    self._last_shed = now
                else:  # the callers came back and stood still: they wait for their answers
                    self._calm(now)

    def check(self, now: float, waiting: int, wait: float, limit: float) -> str | None:
        """None: admit a request that finds ``waiting`` requests ahead of it
        and would start in ``wait`` seconds; else why it is shed. ``limit``:
        the longest wait admitted while overloaded (``max_wait``, or more
        for an API slower than that)."""
        if self.max_queue and waiting >= self.max_queue:
            self._overload(now)
            return f"{waiting} requests wait already (max_queue {self.max_queue})"
        if not self.overloaded or self._probe is not None:
            return None
        if now - self._last_shed >= INTERVAL:
            self._calm(now)  # a whole interval without a shed: the arrivals fell
            return None
        if now >= self._probe_at:
            self._probe = 0
            self._record = waiting  # the callers shed meanwhile come back: highs count anew
            return None
        if self.max_wait and wait > limit:
            self._last_shed = now
            return (
                f"its queue has stood for {now - self.since:.1f} s and this request would wait "
                f"{wait * 1e3:.1f} ms (max_queue_ms {self.max_wait * 1e3:g})"
            )
        return None

    def stale(self, now: float, waited: float, limit: float) -> str | None:
        """None: serve a request that waited ``waited`` seconds in the
        queue; else, while overloaded, why it is shed instead: it waited
        longer than ``limit`` (a backlog of before the overload was found,
        or of a probe)."""
        if not self.overloaded or self._probe is not None or not self.max_wait:
            return None
        if waited <= limit:
            return None
        self._last_shed = now
        return (
            f"its queue has stood for {now - self.since:.1f} s and this request waited "
            f"{waited * 1e3:.1f} ms in it (max_queue_ms {self.max_wait * 1e3:g})"
        )

    def _overload(self, now: float) -> None:
        self._last_shed = now
        if self._probe is not None:  # a probe filled the queue: still overloaded
            self._probe = None
            self._extend(now)
        if not self.overloaded:
            if now - self._calm_at > MAX_HOLD:
                self._hold = HOLD  # calm long enough: the hold starts short again
            self.overloaded = True
            self.overloads += 1
            self.since = now
            self._probe_at = now + self._hold

    def _extend(self, now: float) -> None:
        self._hold = min(2 * self._hold, MAX_HOLD)
        self._probe_at = now + self._hold

    def _calm(self, now: float) -> None:
        self.overloaded = False
        self._calm_at = now


class ApiQueue:
    """One API's queue in front of its pool (see the module docstring).

    Args:
        name: how errors and metrics name it (``grpc Lookup`` …).
        workers: threads answering its requests.
        max_queue: requests that may wait for a worker (0: no bound).
        max_queue_ms: the longest wait admitted while overloaded (0: no bound).
    """

    def __init__(self, name: str, workers: int, max_queue: int, max_queue_ms: float) -> None:
        self.name = name
        self.workers = workers
        self.max_queue = max_queue
        self.max_wait = max_queue_ms / 1e3
        self.detector = OverloadDetector(max_queue, self.max_wait)
        self.in_flight = 0
        self.drain = 0.0  # seconds between two requests ending, the running mean
        self._ended = 0.0  # when the last one ended (time.perf_counter())
        self._lock = threading.Lock()

    @property
    def overloaded(self) -> bool:
        return self.detector.overloaded

    def _state(self, lag: float) -> tuple[int, float, float]:
        """(requests waiting, the wait of one arriving now, the longest wait
        admitted while overloaded: ``max_wait`` or one service time)."""
        n = self.in_flight
        drains = n - self.workers + 1  # requests to end before a new one starts
        wait = lag + (drains * self.drain if drains > 0 else 0.0)
        return max(n - self.workers, 0), wait, max(self.max_wait, self.drain * self.workers)

    def admit(self, lag: float = 0.0) -> float:
        """Takes one request, or raises ``Overloaded`` (see the module
        docstring); ``lag``: seconds it waited before the queue saw it.
        Returns when it arrived (``time.perf_counter()``), for ``stale``."""
        now = time.perf_counter()
        with self._lock:
            waiting, wait, limit = self._state(lag)
            why = self.detector.check(now, waiting, wait, limit)
            if why is None:
                self.in_flight += 1
                self._observe(now)
                return now - lag
            retry = max(wait - lag, limit)  # about when the queue drains to admit it
        retry_ms = max(1, round(retry * 1e3))
        raise Overloaded(f"overloaded: {self.name}: {why}; retry in {retry_ms} ms", retry_ms)

    def stale(self, arrived: float) -> Overloaded | None:
        """Whether a request that arrived at ``arrived`` and is about to be
        served is shed instead (the ``Overloaded`` to answer), because the
        queue is overloaded and it waited too long (``OverloadDetector.stale``);
        a request shed so is ended here, as ``done(None)`` would."""
        now = time.perf_counter()
        with self._lock:
            why = self.detector.stale(now, now - arrived, self._state(0.0)[2])
        if why is None:
            return None
        self.done(None)
        retry_ms = max(1, round(self.max_wait * 1e3))
        return Overloaded(f"overloaded: {self.name}: {why}; retry in {retry_ms} ms", retry_ms)

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
            self._observe(now)

    def _observe(self, now: float) -> None:
        waiting = max(self.in_flight - self.workers, 0)
        self.detector.observe(now, waiting, max(WINDOW_S, WINDOW_DRAINS * self.drain))


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
        self._admitted: deque[tuple[Future, Callable[..., Any], Any, Any, float]] = deque()
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
            arrived = self.queue.admit()
            shed = None
        except Overloaded as error:
            shed = error
        with self._work_ready:
            if self._closed:
                if shed is None:
                    self.queue.done(None)
                raise RuntimeError("cannot schedule new futures after shutdown")
            if shed is None:
                self._admitted.append((future, fn, args, kwargs, arrived))
            else:
                self._shed.append((future, fn, args, kwargs, shed))
                self._shed_ready.notify()
            self._work_ready.notify()
        return future

    def _take(
        self, shed_only: bool, shed_first: bool
    ) -> tuple[Future, Callable[..., Any], Any, Any, Overloaded | None, float] | None:
        ready = self._shed_ready if shed_only else self._work_ready
        with ready:
            while not self._shed and (shed_only or not self._admitted) and not self._closed:
                ready.wait()
            if self._shed and (shed_first or shed_only or not self._admitted):
                return (*self._shed.popleft(), 0.0)
            if self._admitted and not shed_only:
                future, fn, args, kwargs, arrived = self._admitted.popleft()
                return future, fn, args, kwargs, None, arrived
            return None  # closed, and nothing left

    def _work(self, shed_only: bool) -> None:
        shed_first = True  # a worker alternates while both kinds wait: sheds never starve work
        while (task := self._take(shed_only, shed_first)) is not None:
            future, fn, args, kwargs, shed, arrived = task
            shed_first = admitted = shed is None
            if admitted:  # an overloaded queue sheds (and ends) what waited too long
                shed = self.queue.stale(arrived)
                admitted = shed is None
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
                if admitted:
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
    that notes when each pass of the loop starts (when its ``select``
    returns) and counts the requests handled in it (``handled``, counted
    by ``LoopQueue.admit``). The loop runs the handlers of the requests it
    read in the previous pass one after another, so a handler running now
    has ``handled`` requests ahead of it and has waited at least
    ``in_pass()`` for them."""

    def __init__(self) -> None:
        super().__init__()
        self.started = time.perf_counter()
        self.handled = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(timeout)
        self.started = time.perf_counter()
        self.handled = 0
        return ready

    def in_pass(self) -> float:
        """Seconds since the loop's current pass started."""
        return time.perf_counter() - self.started


class LoopQueue:
    """An event loop as the queue of the requests it answers itself (the
    HTTP server's small lookups; see the module docstring): the requests
    ahead of a handler are those handled before it in the loop's pass, and
    its wait is the loop's lag plus the time since the pass began. Used
    from the loop's thread only.

    Args:
        name: how errors and metrics name it (``http loop``).
        max_queue: requests that may wait ahead of one (0: no bound).
        max_queue_ms: the longest wait admitted while overloaded (0: no bound).
    """

    def __init__(self, name: str, max_queue: int, max_queue_ms: float) -> None:
        self.name = name
        self.max_wait = max_queue_ms / 1e3
        self.detector = OverloadDetector(max_queue, self.max_wait)
        self.lag = LoopLag()
        self.clock = PassClock()

    @property
    def overloaded(self) -> bool:
        return self.detector.overloaded

    @property
    def in_flight(self) -> int:
        """The requests handled so far in the loop's current pass."""
        return self.clock.handled

    def wait(self) -> float:
        """How long a request handled now has waited for the loop: the part
        of the previous pass it waited (the loop's lag), and this pass so far."""
        return self.lag.seconds + self.clock.in_pass()

    def admit(self) -> float:
        """Takes one request handled now, or raises ``Overloaded``; returns
        its wait (``wait()``), for the pool it goes on to, if any."""
        now = time.perf_counter()
        waiting = self.clock.handled
        self.clock.handled = waiting + 1
        wait = self.wait()
        self.detector.observe(now, waiting, WINDOW_S)
        why = self.detector.check(now, waiting, wait, self.max_wait)
        if why is None:
            return wait
        retry_ms = max(1, round(max(wait, self.max_wait) * 1e3))
        raise Overloaded(f"overloaded: {self.name}: {why}; retry in {retry_ms} ms", retry_ms)
