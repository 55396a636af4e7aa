"""Overload is shed early: a lookup or prediction that would wait too long
is answered at once (gRPC RESOURCE_EXHAUSTED with a retry pushback, HTTP 503
with Retry-After), counted in /metrics; health, status and metrics are never
shed; the client retries shed calls with backoff; the queues' counts come
back to zero."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from small_model import trained_export

from wuliang.serving import overload
from wuliang.serving.client import Client, ServingClientError
from wuliang.serving.errors import Overloaded
from wuliang.serving.grpc import proto
from wuliang.serving.grpc.common import PUSHBACK_KEY
from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.http.server import HttpServer
from wuliang.serving.overload import (
    DEFAULT_MAX_QUEUE,
    HOLD,
    INTERVAL,
    ApiQueue,
    LoopLag,
    OverloadDetector,
    Shedding,
)
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore

KEYS = np.arange(0, 40, 3, dtype=np.uint64)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    trained = trained_export(tmp_path_factory.mktemp("overload"))
    served = Service([ModelStore(trained["exports"], "m", poll_secs=0).start()])
    yield served
    served.close()
    trained["session"].context.close()


def shed_count(service: Service, transport: str, endpoint: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "wuliang_shed_total", {"transport": transport, "endpoint": endpoint}
    )
    return value or 0.0


# -- the queue --------------------------------------------------------------------------


def test_a_closed_loop_up_to_max_queue_is_admitted_however_long_it_waits() -> None:
    """N callers waiting for their answers keep N requests queued: a normal
    load, admitted whatever it waits, until max_queue requests wait."""
    queue = ApiQueue("grpc Predict", workers=2, max_queue=5, max_queue_ms=5)
    queue.drain = 0.5  # a request ends every 500 ms: the 5th waiting waits 3 s
    for _ in range(2 + 5):  # 2 working, 5 waiting
        queue.admit()
    assert not queue.overloaded
    with pytest.raises(
        Overloaded, match=r"grpc Predict: 5 requests wait already \(max_queue 5\)"
    ) as shed:
        queue.admit()
    assert shed.value.retry_ms == 3000  # the queue drains in 3 s
    assert queue.overloaded and queue.detector.overloads == 1
    assert queue.in_flight == 7


def test_an_overloaded_queue_admits_only_short_waits() -> None:
    queue = ApiQueue("http Predict", workers=2, max_queue=5, max_queue_ms=9)
    queue.admit()
    queue.done(0.004)  # one worker of two busy: 2 ms between ends; the mean moves a tenth
    assert queue.drain == pytest.approx(0.0002)
    for _ in range(2 + 5):
        queue.admit()
    with pytest.raises(Overloaded, match="max_queue 5"):
        queue.admit()  # a standing queue: overloaded
    for _ in range(3):
        queue.done(0.004)
    queue.drain = 0.002
    # 4 in flight: 2 working, 2 waiting; the next starts after 3 ends (6 ms), then 8 ms
    queue.admit()
    queue.admit()
    with pytest.raises(Overloaded, match=r"would wait 10\.0 ms \(max_queue_ms 9\)") as shed:
        queue.admit()
    assert "its queue has stood for" in str(shed.value)
    assert shed.value.retry_ms == 10
    idle = ApiQueue("q", 2, 4, 10)
    idle.admit(lag=0.011)  # normal: a late one is admitted
    idle.detector.check(time.perf_counter(), 4, 0.0, 0.0)  # found 4 waiting: overloaded
    with pytest.raises(Overloaded, match=r"would wait 11\.0 ms"):
        idle.admit(lag=0.011)  # the server noticed it 11 ms late


def test_an_overloaded_queue_admits_one_service_time_of_a_slow_api() -> None:
    """max_queue_ms is a floor: a prediction of 20 ms may wait one more."""
    queue = ApiQueue("grpc Predict", workers=2, max_queue=4, max_queue_ms=5)
    queue.detector.check(time.perf_counter(), 4, 0.0, 0.0)
    queue.drain = 0.01  # 2 workers: each request takes a worker 20 ms
    queue.admit()
    queue.admit()  # both working
    queue.admit()  # starts in 10 ms
    queue.admit()  # 20 ms: one service time
    with pytest.raises(Overloaded, match=r"would wait 30\.0 ms"):
        queue.admit()


def test_without_bounds_nothing_is_shed() -> None:
    queue = Shedding(max_queue=0, max_queue_ms=0).queue("grpc Lookup", 1)
    queue.drain = 1.0
    for _ in range(1000):
        queue.admit(lag=5.0)
    assert queue.in_flight == 1000 and not queue.overloaded
    assert Shedding().queue("q", 3).max_queue == DEFAULT_MAX_QUEUE == 128


T = 1000.0  # a clock for the detector
W = 0.01  # its windows


def overloaded_detector(max_queue: int = 10) -> OverloadDetector:
    detector = OverloadDetector(max_queue, 0.005)
    assert detector.check(T, 0, 1.0, 0.005) is None  # a long wait: normal load
    assert detector.check(T, max_queue, 0.0, 0.005) is not None
    assert detector.overloaded and detector.since == T
    return detector


def feed(detector: OverloadDetector, start: float, levels: list[int]) -> float:
    """The queue's waiting requests, one level a millisecond from
    ``start``; returns the time after the last."""
    now = start
    for waiting in levels:
        detector.observe(now, waiting, W)
        now += 0.001
    return now


@pytest.mark.parametrize(
    "levels",
    [
        [64] * 200,  # a step: 64 callers at once, then each sends when answered
        [40 + (i * 7) % 25 for i in range(200)],  # callers sending unevenly, never over 64
        [min(100, i // 2) for i in range(400)],  # 100 callers joining over 200 ms
        list(range(128)),  # growing by one a millisecond, up to max_queue
    ],
    ids=["step", "uneven", "ramp", "growth"],
)
def test_only_a_full_queue_makes_it_overloaded(levels: list[int]) -> None:
    """A closed loop of up to max_queue callers is never refused, however
    its callers start and send: before the queue holds max_queue requests,
    nothing tells a ramp of callers from arrivals over capacity."""
    detector = OverloadDetector(128, 0.005)
    now = feed(detector, T, levels)
    assert not detector.overloaded
    for waiting in levels:
        assert detector.check(now, waiting, 1.0, 0.005) is None  # however long they wait
    assert detector.check(now, 128, 1.0, 0.005) is not None
    assert detector.overloaded


def test_an_overload_ends_after_an_interval_without_a_shed() -> None:
    detector = overloaded_detector()
    assert detector.check(T + 0.01, 3, 0.004, 0.005) is None  # short: admitted
    assert detector.check(T + 0.02, 3, 0.006, 0.005) is not None  # long: shed
    assert detector.check(T + 0.07, 3, 0.006, 0.005) is not None
    assert detector.overloaded
    later = T + 0.07 + INTERVAL + 0.001
    assert detector.check(later, 3, 0.5, 0.005) is None  # no shed for an interval
    assert not detector.overloaded


def test_a_stale_request_is_shed_only_while_overloaded() -> None:
    detector = OverloadDetector(10, 0.005)
    assert detector.stale(T, 0.5, 0.005) is None  # normal: served however long it waited
    detector.check(T, 10, 0.0, 0.005)
    assert detector.stale(T, 0.004, 0.005) is None
    assert "waited 6.0 ms in it (max_queue_ms 5)" in (detector.stale(T, 0.006, 0.005) or "")


def shed_until(detector: OverloadDetector, start: float, until: float) -> None:
    """Long waits every 10 ms from ``start`` to before ``until``: each shed."""
    now = start
    while now < until - 0.005:
        assert detector.check(now, 5, 0.05, 0.005) is not None
        now += 0.01


def test_a_probe_that_finds_callers_standing_still_ends_the_overload() -> None:
    """Closed-loop callers refused since a burst all come back at the probe
    and then wait their turn: the queue stands still, so it is normal again."""
    detector = overloaded_detector()
    shed_until(detector, T, T + HOLD)
    start = T + HOLD
    assert detector.check(start, 2, 0.05, 0.005) is None  # the probe begins: admitted
    assert detector.probing
    now = feed(detector, start, [6, 8, 9] + [9] * 7)  # they come back within a window
    assert detector.check(now, 9, 0.05, 0.005) is None
    feed(detector, now, [9, 8, 9, 7, 9] * 6)  # and stand still
    assert not detector.probing and not detector.overloaded


def test_a_probe_that_finds_the_queue_growing_keeps_the_overload_and_doubles_the_hold() -> None:
    detector = overloaded_detector(max_queue=1000)
    shed_until(detector, T, T + HOLD)
    start = T + HOLD
    assert detector.check(start, 2, 0.05, 0.005) is None
    end = feed(detector, start, list(range(2, 40)))  # arrivals over capacity: new highs
    assert not detector.probing and detector.overloaded
    assert detector.check(end, 40, 0.05, 0.005) is not None  # sheds again
    shed_until(detector, end, end + 2 * HOLD)  # no probe before twice the hold
    assert detector.check(end + 2 * HOLD, 5, 0.05, 0.005) is None  # probing
    assert detector.probing and detector.overloads == 1


def test_a_probe_that_fills_the_queue_keeps_the_overload() -> None:
    detector = overloaded_detector(max_queue=10)
    shed_until(detector, T, T + HOLD)
    start = T + HOLD
    assert detector.check(start, 2, 0.05, 0.005) is None  # the probe admits
    assert detector.check(start + 0.001, 10, 0.05, 0.005) is not None  # full
    assert detector.check(start + 0.002, 3, 0.05, 0.005) is not None  # overloaded
    assert detector.overloads == 1


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"max_queue": -1}, "max_queue"), ({"max_queue_ms": float("nan")}, "max_queue_ms")],
)
def test_bad_bounds_are_named(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Shedding(**kwargs)


def test_the_loop_lag_is_how_late_its_timer_runs() -> None:
    lag = LoopLag()

    async def block() -> tuple[float, float]:
        lag.start(asyncio.get_running_loop())
        await asyncio.sleep(0.02)
        quiet = lag.last
        time.sleep(0.03)  # the loop is held: its tick comes late
        await asyncio.sleep(0.0005)  # the late tick runs first
        late = lag.last
        lag.stop()
        return quiet, late

    quiet, late = asyncio.run(block())
    assert quiet < 0.015 and late >= 0.02
    loop = asyncio.new_event_loop()
    try:
        lag._tick(loop, loop.time() - 0.03)
        assert lag.seconds < 0.03  # one late tick is not a late loop
        lag._tick(loop, loop.time() - 0.03)
        assert lag.seconds >= 0.03
        lag.stop()
    finally:
        loop.close()


# -- gRPC -------------------------------------------------------------------------------


def busy(pool: ThreadPoolExecutor, release: threading.Event, n: int) -> list[Any]:
    """``n`` requests that hold their worker until ``release`` (they pass
    the pool's admission like any call)."""
    return [pool.submit(release.wait, 30) for _ in range(n)]


def test_grpc_sheds_at_once_and_never_sheds_health_or_status(service: Service) -> None:
    server = GrpcServer(
        service, lookup_threads=1, predict_threads=1, shedding=Shedding(1, max_queue_ms=0)
    )
    release = threading.Event()
    try:
        held = busy(server.lookup_pool, release, 2)  # the worker and the one place queued
        before = shed_count(service, "grpc", "Lookup")
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        lookup = channel.unary_unary(
            proto.method_path("Lookup"),
            request_serializer=proto.LookupRequest.SerializeToString,
            response_deserializer=proto.LookupResponse.FromString,
        )
        request = proto.LookupRequest(model="m", table="users", keys=KEYS.tobytes())
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as shed:
            lookup(request, timeout=10)
        assert time.perf_counter() - start < 2  # at once, not after the held ones
        error = shed.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded: grpc Lookup: 1 requests wait already (max_queue 1)" in error.details()
        pushback = dict(error.trailing_metadata())[PUSHBACK_KEY]
        assert int(pushback) >= 1
        with Client(f"127.0.0.1:{server.port}", retries=0) as client:
            assert client.healthy()  # never shed
            assert client.status()[0]["name"] == "m"
            with pytest.raises(ServingClientError, match="RESOURCE_EXHAUSTED"):
                client.lookup("users", KEYS)
        assert shed_count(service, "grpc", "Lookup") - before == 2
        text = service.metrics.text().decode()
        assert 'wuliang_queue_requests{queue="grpc Lookup"} 2.0' in text
        release.set()
        for future in held:
            future.result(timeout=30)
        rows = lookup(request, timeout=10)
        assert rows.version == 1
        channel.close()
    finally:
        release.set()
        server.stop()
    assert server.lookup_queue.in_flight == 0


def test_grpc_predictions_of_both_apis_are_shed_by_their_pool(service: Service) -> None:
    """Predictions wait in their own pool: a full one sheds wuliang's and
    TensorFlow Serving's Predict, and lookups still answer."""
    from wuliang.serving.tfs import proto as tfs_proto

    server = GrpcServer(service, predict_threads=1, shedding=Shedding(1, max_queue_ms=0))
    release = threading.Event()
    try:
        held = busy(server.predict_pool, release, 2)
        before = {e: shed_count(service, "grpc", e) for e in ("Predict", "tfs.Predict")}
        with Client(f"127.0.0.1:{server.port}", retries=0) as client:
            with pytest.raises(ServingClientError, match="RESOURCE_EXHAUSTED: overloaded"):
                client.predict({"user": np.array([1], np.uint64)}, rows=1)
            channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
            tfs_predict = channel.unary_unary(
                f"/{tfs_proto.PREDICTION_SERVICE}/Predict",
                request_serializer=tfs_proto.PredictRequest.SerializeToString,
                response_deserializer=tfs_proto.PredictResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as shed:
                tfs_predict(tfs_proto.PredictRequest(), timeout=10)
            assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            channel.close()
            assert client.lookup("users", KEYS).version == 1
        assert shed_count(service, "grpc", "Predict") - before["Predict"] == 1
        assert shed_count(service, "grpc", "tfs.Predict") - before["tfs.Predict"] == 1
        release.set()
        for future in held:
            future.result(timeout=30)
    finally:
        release.set()
        server.stop()


def test_an_overloaded_grpc_queue_sheds_a_call_that_would_wait_too_long(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(overload, "INTERVAL", 60.0)  # no calm while the test sets up
    server = GrpcServer(service, lookup_threads=1, shedding=Shedding(100, max_queue_ms=10))
    release = threading.Event()
    try:
        held = busy(server.lookup_pool, release, 2)  # one working, one waiting
        server.lookup_queue.drain = 0.5  # a lookup ends every 500 ms, say
        with Client(f"127.0.0.1:{server.port}", retries=0) as client:
            assert client.status()[0]["name"] == "m"  # connected
            # a standing queue: 100 requests found waiting
            server.lookup_queue.detector.check(time.perf_counter(), 100, 0.0, 0.0)
            # two to end before it starts: longer than one service time (500 ms)
            with pytest.raises(ServingClientError, match=r"would wait 1000\.0 ms"):
                client.lookup("users", KEYS)
        release.set()
        for future in held:
            future.result(timeout=30)
    finally:
        release.set()
        server.stop()


def test_the_client_retries_shed_calls_with_backoff(service: Service) -> None:
    server = GrpcServer(service, lookup_threads=1, shedding=Shedding(1, max_queue_ms=0))
    release = threading.Event()
    try:
        held = busy(server.lookup_pool, release, 2)
        threading.Timer(0.3, release.set).start()
        before = shed_count(service, "grpc", "Lookup")
        start = time.perf_counter()
        with Client(f"127.0.0.1:{server.port}", retries=8, timeout=20) as client:
            result = client.lookup("users", KEYS)
        assert result.version == 1 and time.perf_counter() - start >= 0.3
        shed = shed_count(service, "grpc", "Lookup") - before
        assert 1 <= shed <= 8  # backed off: not a retry per millisecond
        for future in held:
            future.result(timeout=30)
        # a deadline shorter than the pause: the shed answer, not a retry past it
        again = threading.Event()
        held = busy(server.lookup_pool, again, 2)
        try:
            with Client(f"127.0.0.1:{server.port}", retries=5, timeout=0.5) as client:
                client.lookup("users", KEYS, timeout=0.001 + 0.01)
        except ServingClientError as error:
            assert error.code in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
        else:
            raise AssertionError("a held pool answered")
        again.set()
        for future in held:
            future.result(timeout=30)
    finally:
        release.set()
        server.stop()


def test_under_real_overload_every_answer_is_served_or_shed(service: Service) -> None:
    """64 calls at once on one lookup thread with room for 2 waiting: some
    are shed, none fails otherwise, and the queue empties."""
    server = GrpcServer(service, lookup_threads=1, shedding=Shedding(2, max_queue_ms=0))
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        lookup = channel.unary_unary(
            proto.method_path("Lookup"),
            request_serializer=proto.LookupRequest.SerializeToString,
            response_deserializer=proto.LookupResponse.FromString,
        )
        keys = np.arange(20_000, dtype=np.uint64).tobytes()
        request = proto.LookupRequest(model="m", table="users", keys=keys)
        codes: dict[str, int] = {}
        for _ in range(3):
            calls = [lookup.future(request, timeout=30) for _ in range(64)]
            for call in calls:
                code = call.code().name
                codes[code] = codes.get(code, 0) + 1
        channel.close()
        assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert codes["OK"] >= 3
    finally:
        server.stop()
    assert server.lookup_queue.in_flight == 0


# -- HTTP -------------------------------------------------------------------------------


def http_call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, None if body is None else json.dumps(body))
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    if response.getheader("Content-Type", "").startswith("application/json"):
        return response.status, json.loads(data), response
    return response.status, data, response


def test_http_sheds_a_full_pool_with_503_and_retry_after(service: Service) -> None:
    server = HttpServer(service, workers=1, shedding=Shedding(1, max_queue_ms=0))
    assert server._api.pools["lookup"][1].workers == 2
    pool = server._api.pools["predict"][1]
    try:
        pool.admit()
        pool.admit()  # one working, one waiting: full
        before = shed_count(service, "http", "Predict")
        predict = {"instances": [{"user": 1, "items": [2, 3], "x": 0.5}]}
        status, answer, response = http_call(server.port, "POST", "/v1/models/m:predict", predict)
        assert status == 503, answer
        assert response.getheader("Retry-After") == "1"
        assert answer["retry_after_ms"] >= 1
        assert "overloaded: http Predict: 1 requests wait already" in answer["error"]
        assert http_call(server.port, "GET", "/healthz")[0] == 200
        assert http_call(server.port, "GET", "/v1/models/m")[0] == 200
        status, text, _ = http_call(server.port, "GET", "/metrics")
        assert status == 200 and b"wuliang_shed_total{" in text
        assert shed_count(service, "http", "Predict") - before == 1
        small = {"keys": [1, 2]}
        path = "/v1/models/m/tables/users:lookup"
        assert http_call(server.port, "POST", path, small)[0] == 200  # inline: no pool
        big = {"keys": list(range(4000))}  # over inline_bytes: the lookup pool, not full
        assert http_call(server.port, "POST", path, big)[0] == 200
        lookups = server._api.pools["lookup"][1]
        for _ in range(lookups.workers + 1):
            lookups.admit()
        status, answer, _ = http_call(server.port, "POST", path, big)
        assert status == 503 and "http Lookup" in answer["error"], answer
        for _ in range(lookups.workers + 1):
            lookups.done(None)
        pool.done(None)
        pool.done(None)
        status, answer, _ = http_call(server.port, "POST", "/v1/models/m:predict", predict)
        assert status == 200, answer
    finally:
        server.stop()
    assert pool.in_flight == 0


def on_loop(server: HttpServer, work: Any) -> Any:
    """``work()`` run on the server's event loop (its queue's thread)."""

    async def run() -> Any:
        return work()

    return asyncio.run_coroutine_threadsafe(run(), server._loop).result(timeout=30)


def test_a_late_loop_sheds_only_while_overloaded(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One caller behind a slow request waits for the loop: not overload.
    Once the loop's queue has stood (overloaded), a request that would
    wait longer than max_queue_ms is shed."""
    monkeypatch.setattr(overload, "INTERVAL", 60.0)
    server = HttpServer(service, shedding=Shedding(max_queue_ms=10))
    loop_queue = server._api.loop_queue
    lag = loop_queue.lag
    try:
        server._loop.call_soon_threadsafe(lag.stop)  # samples set by hand below
        time.sleep(0.05)
        lag.last = lag.previous = 0.025
        before = shed_count(service, "http", "Lookup")
        path = "/v1/models/m/tables/users:lookup"
        assert http_call(server.port, "POST", path, {"keys": [1]})[0] == 200  # normal
        on_loop(server, lambda: loop_queue.detector.check(time.perf_counter(), 128, 0, 0))
        assert loop_queue.overloaded
        status, answer, response = http_call(server.port, "POST", path, {"keys": [1]})
        assert status == 503 and response.getheader("Retry-After") == "1"
        # its lag (a pass of the loop) and how far into the current pass it is
        waited = re.search(
            r"overloaded: http loop: its queue has stood for [\d.]+ s and this request would "
            r"wait ([\d.]+) ms \(max_queue_ms 10\)",
            answer["error"],
        )
        assert waited and 25.0 <= float(waited[1]) < 35.0, answer
        assert 25 <= answer["retry_after_ms"] < 35
        assert http_call(server.port, "GET", "/healthz")[0] == 200
        text = http_call(server.port, "GET", "/metrics")[1].decode()
        assert "wuliang_http_loop_lag_seconds 0.025" in text
        assert 'wuliang_queue_overloaded{queue="http loop"} 1.0' in text
        assert 'wuliang_queue_overloads_total{queue="http loop"} 1.0' in text
        lag.last = 0.001  # one late tick is not a late loop
        assert http_call(server.port, "POST", path, {"keys": [1]})[0] == 200
        assert shed_count(service, "http", "Lookup") - before == 1
    finally:
        server.stop()


# -- the serving process's heap -----------------------------------------------------


def test_the_heap_is_frozen_and_retired_garbage_is_collected_at_the_next_freeze() -> None:
    """``wuliang serve`` freezes its heap after each version, so collections
    skip the models' objects; a cycle that became garbage after a freeze
    (a retired version's) is collected by the next one."""
    import gc
    import weakref

    from wuliang.serving.run import freeze_heap

    class Node:
        pass

    try:
        first = Node()
        first.me = first  # a cycle: only the collector frees it
        gone = weakref.ref(first)
        freeze_heap()
        assert gc.get_freeze_count() > 0
        del first
        gc.collect()
        assert gone() is not None  # frozen: the collector does not look at it
        freeze_heap()
        assert gone() is None
    finally:
        gc.unfreeze()
