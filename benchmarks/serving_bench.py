"""Online serving: lookups, predictions, and lookups while deltas land.

Setup (not timed): a model shaped like the MovieLens example (``user_id``,
``item_id``, ``genres`` (a list, mean) and ``age``; a Keras MLP 64-32-1)
whose ``item`` table has ``--rows`` rows (default 2M) of dim 16, exported as
a full version into a temporary folder and served by ``wuliang serve``
(gRPC and HTTP, a subprocess polling every 0.2 s; ``--gpu-cache-rows N``:
with its device cache, ``serving/device_cache.py``). Every row's first
weight is the export version that last wrote it (1 in the base version).

Phases, each ``--seconds`` long, ``--clients`` client processes (default 4)
on loopback, each sending one request at a time:

1. ``lookup``: gRPC ``Lookup`` of 1000 ``item`` keys drawn from Zipf(1.1)
   over the table (``wuliang.serving.Client``);
2. ``redis``: side by side, the same 1000-key draws as ``MGET`` from Redis
   (``redis-server`` on loopback, the base version published with
   ``wuliang publish``), with redis-py and its hiredis parser, decoded into
   rows as a client would;
   (and ``floor``: grpcio's own floor, for the analysis: a bare grpcio sync
   server with the same pool of 2 answering a constant of a lookup answer's
   size (65,011 bytes) to requests of a lookup's size, no wuliang code; the
   clients do not decode it.) Phases 1, 2 and the floor alternate for
   ``--rounds`` rounds (ABC, CBA, ...), so that the machine's drift over
   the run weighs on all alike; ``lookup_vs_redis`` and ``lookup_vs_floor``
   are ratios of requests over all rounds;
3. ``http_lookup``: the same lookups over HTTP/JSON (``:lookup``, keep-alive);
4. ``predict``: gRPC ``Predict`` of 100 rows;
5. ``lookup_during_delta``: as 1, while this process writes a delta every
   second (the first 50,000 item rows rewritten with the new version as
   their first weight) and the server applies each. A response whose rows
   do not all carry the version it names is a torn read;
6. ``tfs_predict``: the same 100-row predictions through TensorFlow
   Serving's API (``tensorflow-serving-api`` 's ``PredictionServiceStub``,
   ``TensorProto`` inputs as its clients build them: ``tf.make_tensor_proto``
   of int64 ids, the genres padded with -1, float32 ages), alternated with
   4 (own ``Predict``) for ``--rounds`` rounds: ``tfs_predict_vs_own`` is
   the ratio of their rates, ``tfs_predict_p99_vs_own`` of their p99s;
7. ``two_models``: a second ``wuliang serve --model-config`` serving two
   copies of the export as two models; half the clients predict (TensorFlow
   Serving's API) from one, half from the other: ``two_models_p99_ms``, and
   ``two_models_p99_vs_one``, its ratio to 6's p99 (as many clients: the same
   total load on one model).

``--tfs`` runs phases 4, 6 and 7 only. ``--fleet`` runs none of these but
``fleet_bench.py`` 's figures: publishes of deltas to Redis, a Redis Cluster
against one Redis, torn answers while deltas are published, and
(``overload_bench.py``) TensorFlow Serving's clients in closed loops of 8,
32 and 64 callers (none refused), then predictions at twice the capacity
of ``wuliang serve``, with its default shedding, with none and on a bare
server refusing everything: the accepted and the shed answers' p99,
failures, goodput and the server's RSS growth (targets: no closed-loop
refusal, accepted p99 <= 20 ms, no failure, shed p99 <= 1.2 x the bare
server's, RSS growth <= 50 MB).

Every call is answered (OK, or HTTP 200, with an answer of the right shape)
or failed, counted by its kind: the gRPC status name (``RESOURCE_EXHAUSTED``,
``DEADLINE_EXCEEDED``, ...), ``http 503``, ``redis <exception>``, ``bad
answer`` (the wrong shape or size), ``torn``, or another exception's type
name. wuliang's own client does not retry (``retries=0``): a call the server
shed counts as ``RESOURCE_EXHAUSTED``. Rates (``qps``: answered calls per
second), percentiles and their ratios are over the answered calls only;
``failed_by_phase`` has each phase's failures by kind (the phases with
any), ``failed_requests`` their total, torn reads included (also counted
as ``torn_reads``).

Each phase also reports the CPU one answered request cost the server and
the clients (``cpu_us_per_request``): on this 2-core machine clients and
server share the cores, so both bound the throughput.

The last line is one JSON object (see ``result`` below); targets:
``lookup_vs_redis`` >= 2, lookup p99 <= 10 ms (also during deltas),
predict p99 <= 20 ms at batch 100, ``tfs_predict_vs_own`` >= 0.9,
``tfs_predict_p99_vs_own`` <= 1.2, ``two_models_p99_vs_one`` <= 2, no
failed request, no torn read.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import zipf_keys  # benchmarks/, the script's folder
from serving_setup import (
    DIM,
    HOT,
    KEYS_PER_LOOKUP,
    PREDICT_ROWS,
    build_model,
    cpu_seconds,
    failure,
    free_port,
    predict_batch,
    start_redis,
    start_server,
    tfs_request,
    write_delta,
)

FLOOR_METHOD = "/wuliang.bench.Floor/Echo"
FLOOR_ANSWER_BYTES = 65_011  # a LookupResponse of 1000 keys, dim 16, version < 128
TARGETS = {
    "lookup_vs_redis": 2.0,
    "lookup_p99_ms": 10.0,
    "lookup_p99_during_delta_ms": 10.0,
    "predict_p99_ms": 20.0,
    "tfs_predict_vs_own": 0.9,
    "tfs_predict_p99_vs_own": 1.2,
    "two_models_p99_vs_one": 2.0,
}


# -- clients ------------------------------------------------------------------------


def torn(rows: np.ndarray, found: np.ndarray, keys: np.ndarray, version: int) -> bool:
    """Rows that do not all carry the version the answer names."""
    want = np.where(keys < HOT, version, 1).astype(np.float32)
    return bool((~found).any() or (rows[:, 0] != want).any())


def client_process(kind: str, port: int, rows: int, seconds: float, seed: int, queue: Any) -> None:
    """One client: requests of ``kind`` for ``seconds``; puts the latencies of
    the answered calls and the failed calls' count by kind."""
    rng = np.random.default_rng(seed)
    draws = [zipf_keys(rng, rows, KEYS_PER_LOOKUP) for _ in range(64)]
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    versions: set[int] = set()
    if kind == "redis":
        import redis

        from wuliang.serving.redis.keys import Keys, Layout, cell_dtype, row_keys

        db = redis.Redis(port=port)
        meta = json.loads(db.get(Keys("bench").meta(int(db.get(Keys("bench").current)))))
        prefix = Layout.of(meta).cell_prefix(0, "item")  # one Redis: one shard
        names = [row_keys(prefix, k) for k in draws]
    elif kind == "floor":
        import grpc

        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", [("grpc.max_receive_message_length", 64 << 20)]
        )
        echo = channel.unary_unary(FLOOR_METHOD)
        requests = [k.tobytes() for k in draws]  # a lookup's size
    elif kind.startswith("tfs_predict"):  # tfs_predict, or tfs_predict:MODEL
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        model = kind.partition(":")[2] or "bench"
        tfs_requests = [tfs_request(predict_batch(rng, rows), model) for _ in range(16)]
    elif kind == "http_lookup":
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        bodies = [json.dumps({"keys": k.tolist()}) for k in draws]
    else:  # no retry: a call the server shed fails with RESOURCE_EXHAUSTED
        from wuliang.serving.client import Client

        client = Client(f"127.0.0.1:{port}", model="bench", timeout=10, retries=0)
        batches = [predict_batch(rng, rows) for _ in range(16)]
    end = time.perf_counter() + seconds
    cpu = time.process_time()
    i = 0
    while time.perf_counter() < end:
        start = time.perf_counter()
        failed: str | None = None  # None: answered
        try:
            if kind == "redis":  # decoded into rows, as a client would
                values = db.mget(names[i % 64])
                if any(v is None for v in values):
                    failed = "bad answer"
                else:
                    np.frombuffer(b"".join(values), cell_dtype(DIM))["row"]
            elif kind == "floor":
                if len(echo(requests[i % 64], timeout=10)) != FLOOR_ANSWER_BYTES:
                    failed = "bad answer"
            elif kind == "http_lookup":
                conn.request(
                    "POST", "/v1/models/bench/tables/item:lookup", bodies[i % 64],
                    {"Content-Type": "application/json"},
                )  # fmt: skip
                answer = conn.getresponse()
                payload = answer.read()
                if answer.status != 200:
                    failed = f"http {answer.status}"
                elif b"model_version" not in payload:
                    failed = "bad answer"
            elif kind.startswith("tfs_predict"):
                response = stub.Predict(tfs_requests[i % 16], 10)
                versions.add(response.model_spec.version.value)
                if len(response.outputs["predictions"].tensor_content) != 4 * PREDICT_ROWS:
                    failed = "bad answer"
            elif kind == "predict":
                outputs, version = client.predict(batches[i % 16], PREDICT_ROWS)
                versions.add(version)
                if outputs["predictions"].shape != (PREDICT_ROWS,):
                    failed = "bad answer"
            else:
                keys = draws[i % 64]
                answer = client.lookup("item", keys)
                versions.add(answer.version)
                if answer.rows.shape != (len(keys), DIM):
                    failed = "bad answer"
                elif torn(answer.rows, answer.found, keys, answer.version):
                    failed = "torn"
        except Exception as error:
            failed = failure(error)
            if kind == "http_lookup":
                conn.close()  # the next call on a fresh connection
        if failed is None:
            latencies.append(time.perf_counter() - start)
        else:
            failures[failed] += 1
        i += 1
    queue.put(
        {
            "latencies": latencies,
            "failures": dict(failures),
            "versions": sorted(versions),
            "cpu_s": time.process_time() - cpu,
        }
    )


def figures(
    latencies: np.ndarray, seconds: float, server_cpu_s: float, client_cpu_s: float
) -> dict[str, float]:
    """Rate, percentiles and CPU per request of the answered calls."""
    return {
        "qps": len(latencies) / seconds,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3),
        "p99_ms": float(np.percentile(latencies, 99) * 1e3),
        "server_cpu_us": server_cpu_s / len(latencies) * 1e6,
        "client_cpu_us": client_cpu_s / len(latencies) * 1e6,
    }


def run_phase(kind: str, port: int, args: argparse.Namespace, server_pid: int) -> dict[str, Any]:
    """One phase: the answered calls' latencies and figures, the failed calls
    by kind, and the CPU each answered call cost the server and the clients
    (microseconds, from /proc and process_time)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    kinds = kind.split(",")  # several: the clients take turns among them
    procs = [
        ctx.Process(
            target=client_process,
            args=(kinds[s % len(kinds)], port, args.rows, args.seconds, s, queue),
        )
        for s in range(args.clients)
    ]
    server_cpu0 = cpu_seconds(server_pid)
    for p in procs:
        p.start()
    parts = [queue.get(timeout=args.seconds + 300) for _ in procs]
    server_cpu = cpu_seconds(server_pid) - server_cpu0
    for p in procs:
        p.join()
    latencies = np.concatenate([np.array(p["latencies"]) for p in parts])
    failures = sum((Counter(p["failures"]) for p in parts), Counter())
    if not len(latencies):
        raise RuntimeError(f"no {kind} call was answered; failures: {dict(failures)}")
    client_cpu = sum(p["cpu_s"] for p in parts)
    return {
        "latencies": latencies,
        "seconds": args.seconds,
        "server_cpu_s": server_cpu,
        "client_cpu_s": client_cpu,
        **figures(latencies, args.seconds, server_cpu, client_cpu),
        "failed": failures.total(),
        "failures": dict(failures),
        "torn": failures["torn"],
        "versions": sorted({v for p in parts for v in p["versions"]}),
    }


def merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's figures over its rounds."""
    latencies = np.concatenate([r["latencies"] for r in rounds])
    failures = sum((Counter(r["failures"]) for r in rounds), Counter())
    return {
        "latencies": latencies,
        **figures(
            latencies,
            sum(r["seconds"] for r in rounds),
            sum(r["server_cpu_s"] for r in rounds),
            sum(r["client_cpu_s"] for r in rounds),
        ),
        "round_qps": [round(r["qps"], 1) for r in rounds],
        "failed": failures.total(),
        "failures": dict(failures),
        "torn": failures["torn"],
        "versions": sorted({v for r in rounds for v in r["versions"]}),
    }


def floor_server(port: int, ready: Any) -> None:
    """grpcio's floor: the same sync server, pool and message sizes as a
    lookup, answering a constant from a handler that does nothing."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    answer = b"\0" * FLOOR_ANSWER_BYTES
    server = grpc.server(ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: answer)
    service, method = FLOOR_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def start_floor() -> tuple[Any, int]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    port = free_port()
    child = ctx.Process(target=floor_server, args=(port, ready), daemon=True)
    child.start()
    if not ready.wait(60):
        child.kill()
        raise RuntimeError("the grpcio floor server did not start")
    return child, port


def lookup_phases(
    args: argparse.Namespace,
    session: Any,
    exports: Path,
    server: subprocess.Popen,
    grpc_port: int,
    http_port: int,
) -> dict[str, Any]:
    """Phases 1-3 and 5 (see the module docstring)."""
    redis_server = None
    try:
        redis_port = None
        if not args.skip_redis:
            from wuliang.serving.redis.publish import publish

            redis_server, redis_port = start_redis()
            publish(exports, f"redis://127.0.0.1:{redis_port}/0", model="bench", version=1)
        # Lookups, the Redis baseline and the floor alternate (ABC, CBA...) so
        # that the machine's drift over the run weighs on all alike.
        floor, floor_port = start_floor()
        rounds: dict[str, list[dict[str, Any]]] = {"lookup": [], "redis": [], "floor": []}
        targets = {"lookup": (grpc_port, server.pid), "floor": (floor_port, floor.pid)}
        if redis_server is not None and redis_port is not None:
            targets["redis"] = (redis_port, redis_server.pid)
        for r in range(args.rounds):
            order = ["lookup", "redis", "floor"]
            for kind in order if r % 2 == 0 else order[::-1]:
                if kind in targets:
                    port, pid = targets[kind]
                    rounds[kind].append(run_phase(kind, port, args, pid))
        floor.kill()
        phases = {kind: merge(parts) for kind, parts in rounds.items() if parts}
        if phases["floor"]["failed"]:  # not a wuliang request, but the figure would be wrong
            raise RuntimeError(f"calls to the floor server failed: {phases['floor']['failures']}")
        phases["http_lookup"] = run_phase("http_lookup", http_port, args, server.pid)
        stop = threading.Event()
        written: list[int] = []

        def deltas() -> None:
            version = 2
            while not stop.wait(1.0):
                write_delta(session, exports, version)
                written.append(version)
                version += 1

        writer = threading.Thread(target=deltas)
        writer.start()
        try:
            phases["lookup_during_delta"] = run_phase("lookup", grpc_port, args, server.pid)
        finally:
            stop.set()
            writer.join()
        phases["lookup_during_delta"]["deltas_written"] = len(written)
    finally:
        if redis_server is not None:
            redis_server.send_signal(signal.SIGTERM)
            redis_server.wait(timeout=30)
    return phases


def lookup_figures(phases: dict[str, Any]) -> dict[str, Any]:
    """The figures of phases 1-3 and 5."""
    lookup, during = phases["lookup"], phases["lookup_during_delta"]
    redis_qps = phases["redis"]["qps"] if "redis" in phases else None
    return dict(
        lookup_qps=round(lookup["qps"], 1),
        lookup_p50_ms=round(lookup["p50_ms"], 3),
        lookup_p99_ms=round(lookup["p99_ms"], 3),
        lookup_keys_per_s=round(lookup["qps"] * KEYS_PER_LOOKUP),
        http_lookup_qps=round(phases["http_lookup"]["qps"], 1),
        http_lookup_p99_ms=round(phases["http_lookup"]["p99_ms"], 3),
        redis_mget_qps=None if redis_qps is None else round(redis_qps, 1),
        redis_mget_p99_ms=None if "redis" not in phases else round(phases["redis"]["p99_ms"], 3),
        lookup_vs_redis=None if not redis_qps else round(lookup["qps"] / redis_qps, 2),
        lookup_round_qps=lookup["round_qps"],
        grpc_floor_qps=round(phases["floor"]["qps"], 1),
        lookup_vs_floor=round(lookup["qps"] / phases["floor"]["qps"], 2),
        redis_round_qps=phases["redis"]["round_qps"] if "redis" in phases else None,
        lookup_qps_during_delta=round(during["qps"], 1),
        lookup_p99_during_delta_ms=round(during["p99_ms"], 3),
        deltas_written=during["deltas_written"],
        versions_seen_during_delta=during["versions"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the item table")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="lookup, Redis and floor phases, alternated (ABC, CBA, ...)",
    )
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--quick", action="store_true", help="200K rows, 3 s phases")
    parser.add_argument("--skip-redis", action="store_true", help="no Redis baseline")
    parser.add_argument(
        "--tfs", action="store_true", help="only the predictions (own, TF Serving's, two models)"
    )
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="only the fleet figures (fleet_bench.py): delta vs full publish, a 3-node Redis "
        "Cluster vs one Redis, torn answers during delta publishes; and lookups at 4x the "
        "capacity of predictions, shed or not, and closed loops of TF Serving's clients "
        "(overload_bench.py)",
    )
    parser.add_argument(
        "--gpu-cache-rows",
        type=int,
        default=0,
        help="the server's --gpu-cache-rows (the rows have no shows: the smallest keys, "
        "which are the hottest of the Zipf draws, are cached)",
    )
    args = parser.parse_args()
    if args.fleet:
        from fleet_bench import fleet  # benchmarks/, the script's folder

        print(json.dumps(fleet(quick=args.quick, clients=args.clients)))
        return
    if args.quick:
        args.rows, args.seconds, args.rounds = 200_000, 3.0, 1
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    work = Path(tempfile.mkdtemp(prefix="serving_bench_"))
    exports = work / "bench"
    server = redis_server = None
    try:
        t0 = time.perf_counter()
        session = build_model(args.rows, exports)
        shutil.copytree(exports, work / "bench2")  # the second model of two_models
        setup_s = time.perf_counter() - t0
        server, grpc_port, http_port = start_server(exports, args.gpu_cache_rows)
        result: dict[str, Any] = {"rows": args.rows, "dim": DIM, "clients": args.clients}
        result["gpu_cache_rows"] = args.gpu_cache_rows
        result["cores"] = os.cpu_count()
        result["setup_s"] = round(setup_s, 1)
        phases: dict[str, Any] = {}
        if not args.tfs:
            phases.update(lookup_phases(args, session, exports, server, grpc_port, http_port))
            result.update(lookup_figures(phases))
        # own and TF Serving's predictions alternate (AB, BA, ...), after a
        # second of each untimed (a tower's first calls are slower)
        warm = argparse.Namespace(**{**vars(args), "seconds": 1.0})
        for kind in ("predict", "tfs_predict"):
            run_phase(kind, grpc_port, warm, server.pid)
        rounds: dict[str, list[dict[str, Any]]] = {"predict": [], "tfs_predict": []}
        for r in range(args.rounds):
            order = ["predict", "tfs_predict"]
            for kind in order if r % 2 == 0 else order[::-1]:
                rounds[kind].append(run_phase(kind, grpc_port, args, server.pid))
        own, tfs = merge(rounds["predict"]), merge(rounds["tfs_predict"])
        phases["predict"], phases["tfs_predict"] = own, tfs
        # two models, one server: each at half the load
        config = work / "models.config"
        second = work / "bench2"
        config.write_text(
            "model_config_list {\n"
            f'  config {{ name: "a" base_path: "{exports}" }}\n'
            f'  config {{ name: "b" base_path: "{second}" }}\n'
            "}\n"
        )
        two, two_grpc, _ = start_server(exports, args.gpu_cache_rows, config)
        try:
            both = "tfs_predict:a,tfs_predict:b"
            run_phase(both, two_grpc, warm, two.pid)
            phases["two_models"] = run_phase(both, two_grpc, args, two.pid)
        finally:
            two.send_signal(signal.SIGTERM)
            two.wait(timeout=30)
        result.update(
            predict_qps=round(own["qps"], 1),
            predict_p50_ms=round(own["p50_ms"], 3),
            predict_p99_ms=round(own["p99_ms"], 3),
            tfs_predict_qps=round(tfs["qps"], 1),
            tfs_predict_p50_ms=round(tfs["p50_ms"], 3),
            tfs_predict_p99_ms=round(tfs["p99_ms"], 3),
            predict_round_qps=own["round_qps"],
            tfs_predict_round_qps=tfs["round_qps"],
            tfs_predict_vs_own=round(tfs["qps"] / own["qps"], 3),
            tfs_predict_p99_vs_own=round(tfs["p99_ms"] / own["p99_ms"], 3),
            two_models_qps=round(phases["two_models"]["qps"], 1),
            two_models_p50_ms=round(phases["two_models"]["p50_ms"], 3),
            two_models_p99_ms=round(phases["two_models"]["p99_ms"], 3),
            two_models_p99_vs_one=round(phases["two_models"]["p99_ms"] / tfs["p99_ms"], 3),
            failed_requests=sum(p["failed"] for k, p in phases.items() if k != "floor"),
            failed_by_phase={k: p["failures"] for k, p in phases.items() if p["failures"]},
            torn_reads=sum(p["torn"] for p in phases.values()),
        )
        result["cpu_us_per_request"] = {
            name: {"server": round(p["server_cpu_us"]), "clients": round(p["client_cpu_us"])}
            for name, p in phases.items()
        }
        result["targets"] = TARGETS
        met = {
            "predict_p99_ms": result["predict_p99_ms"] <= TARGETS["predict_p99_ms"],
            "tfs_predict_vs_own": result["tfs_predict_vs_own"] >= TARGETS["tfs_predict_vs_own"],
            "tfs_predict_p99_vs_own": result["tfs_predict_p99_vs_own"]
            <= TARGETS["tfs_predict_p99_vs_own"],
            "two_models_p99_vs_one": result["two_models_p99_vs_one"]
            <= TARGETS["two_models_p99_vs_one"],
            "no_failures": result["failed_requests"] == 0 and result["torn_reads"] == 0,
        }
        if not args.tfs:
            met.update(
                lookup_vs_redis=(result["lookup_vs_redis"] or 0) >= TARGETS["lookup_vs_redis"],
                lookup_p99_ms=result["lookup_p99_ms"] <= TARGETS["lookup_p99_ms"],
                lookup_p99_during_delta_ms=result["lookup_p99_during_delta_ms"]
                <= TARGETS["lookup_p99_during_delta_ms"],
            )
        result["targets_met"] = met
        session.context.close()
    finally:
        for child in (server, redis_server):
            if child is not None:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
