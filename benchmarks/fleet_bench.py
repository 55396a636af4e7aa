"""Serving a fleet from Redis, and one server overloaded: ``python
benchmarks/serving_bench.py --fleet [--quick]`` (this module is its
``--fleet`` part).

Setup (not timed): ``serving_setup.build_model`` 's model, its ``item``
table of ``rows`` rows (1M; ``--quick`` 200K) exported as version 1 (every
row's first weight 1), then the export benchmark's delta as version 2: 1%
of the item rows rewritten (same values: the rows still read 1) and 0.01%
erased. One ``redis-server`` and a 3-node Redis Cluster
(``--cluster-enabled yes``, ``redis-cli --cluster create``), all on this
machine, no persistence.

Figures, side by side in one run:

* ``delta_publish_vs_full``: ``wuliang publish`` of version 2 (a delta on
  top of version 1 in Redis) over ``publish`` of version 1 (a full copy),
  on the one Redis, both timed in each of ``ROUNDS`` rounds (Redis emptied
  before each), medians; the same on the cluster beside it;
* ``cluster_vs_single_redis``: lookups per second through ``RedisStore``
  (1000 item keys drawn Zipf(1.1), a hot cache of ``CACHE_ROWS`` rows per
  replica, ``clients`` client processes each with its own replica) from the
  cluster over the same from the one Redis, phases alternated ABBA;
* ``torn_during_publishes``: while clients look up from the cluster,
  ``DELTAS`` deltas are exported and published one after another, each
  rewriting the item rows below ``HOT`` with its version as their first
  weight: an answer whose rows do not all carry the version it names (or
  that misses a row that exists) is torn.

A lookup is answered or failed, counted by its kind: ``torn``, ``redis
<exception>`` for redis-py's errors, or another exception's type name.
Lookups per second count the answered ones only; ``failed_by_phase`` has
the failures by kind of each lookup phase with any (``single_redis_lookup``
and ``cluster_lookup``, over their rounds, and
``lookups_during_publishes``), ``failed_lookups_during_publishes`` the
last one's total, torn answers included.

Then the overload figures (``overload_bench.py``, its own model and
``wuliang serve``): TensorFlow Serving's clients in closed loops (none may
be refused), then open loops of predictions at twice the server's
capacity, with its default shedding, with none and on a bare server that
refuses everything: accepted and shed latencies, failures, goodput and the
server's RSS. ``failed_by_phase`` holds the phases of both.

Returns one JSON object (``serving_bench.py`` prints it last); targets:
``delta_publish_vs_full`` <= 0.05, ``cluster_vs_single_redis`` >= 0.8
(and no failed lookup in its rounds), ``torn_during_publishes`` == 0 (and
no failed lookup); ``closed_loop_refused`` == 0; under overload, with shedding on,
``overload_accepted_p99_ms`` <= 20, ``overload_failed`` == 0,
``shed_p99_vs_floor`` <= 1.2 and ``overload_rss_growth_mb`` <= 50.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import zipf_keys
from serving_setup import (
    KEYS_PER_LOOKUP,
    build_model,
    failure,
    free_port,
    signed_rows,
    start_redis,
)

ROUNDS = 2
CACHE_ROWS = 100_000
HOT = 5_000  # item rows each delta of the torn phase rewrites
DELTAS = 100
TARGETS = {
    "delta_publish_vs_full": 0.05,
    "cluster_vs_single_redis": 0.8,
    "torn_during_publishes": 0,
}


def start_cluster(folder: Path) -> tuple[list[subprocess.Popen], str]:
    """Three cluster-mode redis-servers on loopback, slots split evenly."""
    import redis

    ports: list[int] = []
    while len(ports) < 3:  # the cluster bus listens on port + 10000
        port = free_port()
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    procs = []
    for port in ports:
        work = folder / str(port)
        work.mkdir()
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled",
             "yes", "--cluster-config-file", str(work / "nodes.conf"), "--dir", str(work),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        ))  # fmt: skip
    for port in ports:
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
    nodes = [f"127.0.0.1:{p}" for p in ports]
    subprocess.run(
        ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    for port in ports:
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(400):
            if client.execute_command("CLUSTER INFO").get("cluster_state") == "ok":
                break
            time.sleep(0.05)
        client.close()
    return procs, "redis+cluster://" + ",".join(nodes)


def flush(url: str) -> None:
    from wuliang.serving.redis.nodes import Deployment

    deployment = Deployment(url, 60)
    for node in deployment.masters():
        deployment.client(node).flushall()
    deployment.close()


def lookup_client(
    url: str,
    rows: int,
    seconds: float,
    seed: int,
    erased: np.ndarray,
    ready: Any,
    stop: Any,
    queue: Any,
) -> None:
    """Lookups through a RedisStore for ``seconds`` after ``ready`` (or until
    ``stop``); puts (answered lookups, versions seen, failures by kind: the
    exception's, or ``torn``)."""
    from wuliang.serving.redis.replica import RedisStore

    rng = np.random.default_rng(seed)
    draws = [zipf_keys(rng, rows, KEYS_PER_LOOKUP) for _ in range(64)]
    exists = [~np.isin(k, erased) for k in draws]
    calls = done = 0
    failures: Counter[str] = Counter()
    versions: set[int] = set()
    with RedisStore(url, "bench", cache_rows=CACHE_ROWS, poll_s=0.5) as store:
        for k in draws[:8]:  # connections made, the cache started
            store.lookup("item", k)
        ready.wait()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end and not stop.is_set():
            i = calls % 64
            calls += 1
            try:
                got = store.lookup("item", draws[i])
            except Exception as error:
                failures[failure(error)] += 1
                continue
            versions.add(got.version)
            want = np.where(draws[i] < HOT, got.version, 1).astype(np.float32)
            want = np.where(got.version <= 2, 1.0, want)  # versions 1, 2 read 1 everywhere
            if (
                not np.array_equal(got.found, exists[i])
                or (got.rows[exists[i], 0] != want[exists[i]]).any()
            ):
                failures["torn"] += 1
            else:
                done += 1
    queue.put((done, sorted(versions), dict(failures)))


def run_lookups(
    url: str, rows: int, seconds: float, clients: int, erased: np.ndarray, during: Any = None
) -> dict[str, Any]:
    """``clients`` processes' lookups for ``seconds`` (or while ``during()``
    runs): answered lookups per second, failures by kind."""
    ctx = mp.get_context("spawn")
    queue, ready, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    length = seconds if during is None else 3600.0  # with during: until it returns
    procs = [
        ctx.Process(target=lookup_client, args=(url, rows, length, s, erased, ready, stop, queue))
        for s in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(3.0)  # the clients import and connect
    ready.set()
    start = time.perf_counter()
    extra = None
    if during is not None:
        extra = during()
        stop.set()
    parts = [queue.get(timeout=length + 600) for _ in procs]
    elapsed = max(seconds, time.perf_counter() - start)
    for p in procs:
        p.join()
    done = sum(p[0] for p in parts)
    failures = sum((Counter(p[2]) for p in parts), Counter())
    return {
        "qps": done / seconds if during is None else done / elapsed,
        "torn": failures["torn"],
        "failed": failures.total(),
        "failures": dict(failures),
        "versions": sorted({v for p in parts for v in p[1]}),
        "during": extra,
    }


def fleet(quick: bool = False, clients: int = 4) -> dict[str, Any]:
    """The Redis fleet's figures, then the overload figures
    (``overload_bench.overload``), in one dict: their targets side by side."""
    from overload_bench import overload  # benchmarks/, the script's folder

    result = redis_fleet(quick, clients)
    over = overload(quick=quick)
    targets, met = result.pop("targets"), result.pop("targets_met")
    targets.update(over.pop("targets"))
    met.update(over.pop("targets_met"))
    failed = {**result.pop("failed_by_phase"), **over.pop("failed_by_phase")}
    return {**result, **over, "failed_by_phase": failed, "targets": targets, "targets_met": met}


def redis_fleet(quick: bool = False, clients: int = 4) -> dict[str, Any]:
    """The figures of the Redis fleet (publishes, the cluster, torn answers)."""
    from wuliang.serving.redis.publish import publish

    rows = 200_000 if quick else 1_000_000
    seconds = 3.0 if quick else 5.0
    deltas = 20 if quick else DELTAS
    work = Path(tempfile.mkdtemp(prefix="fleet_bench_"))
    exports = work / "bench"
    children: list[subprocess.Popen] = []
    try:
        session = build_model(rows, exports)
        rng = np.random.default_rng(1)
        ps = session.context.ps
        changed = np.sort(rng.choice(rows, rows // 100, replace=False)).astype(np.uint64)
        ps.load("item", changed, signed_rows(changed, 1))
        erased = rng.choice(np.arange(HOT, rows), rows // 10_000, replace=False).astype(np.uint64)
        ps.erase("item", erased)
        second = session.export(exports)
        assert second.kind == "delta" and second.version == 2, second.status()
        single, port = start_redis()
        children.append(single)
        cluster_procs, cluster = start_cluster(work)
        children += cluster_procs
        one = f"redis://127.0.0.1:{port}/0"
        times: dict[str, dict[str, list[float]]] = {
            one: {"full": [], "delta": []},
            cluster: {"full": [], "delta": []},
        }
        delta_rows = 0
        for _ in range(ROUNDS):
            for url in (one, cluster):
                flush(url)
                first = publish(exports, url, "bench", version=1)
                then = publish(exports, url, "bench", version=2)
                assert (first.kind, then.kind) == ("full", "delta"), then.status()
                times[url]["full"].append(first.seconds)
                times[url]["delta"].append(then.seconds)
                delta_rows = sum(then.rows.values()) + sum(then.removed_rows.values())
        med = {u: {k: float(np.median(v)) for k, v in t.items()} for u, t in times.items()}
        lookups: dict[str, list[float]] = {one: [], cluster: []}
        failures: dict[str, Counter[str]] = {one: Counter(), cluster: Counter()}
        for order in ((one, cluster), (cluster, one)):  # ABBA
            for url in order:
                phase = run_lookups(url, rows, seconds, clients, erased)
                lookups[url].append(phase["qps"])
                failures[url].update(phase["failures"])
        single_qps = sum(lookups[one]) / len(lookups[one])
        cluster_qps = sum(lookups[cluster]) / len(lookups[cluster])

        published: list[float] = []

        def publishes() -> int:
            hot = np.arange(HOT, dtype=np.uint64)
            for version in range(3, 3 + deltas):
                ps.load("item", hot, signed_rows(hot, version))
                result = session.export(exports)
                assert result.version == version, result.status()
                done = publish(exports, cluster, "bench", version=version)
                assert done.kind == "delta", done.status()
                published.append(done.seconds)
            return deltas

        during = run_lookups(cluster, rows, 0.0, clients, erased, during=publishes)
        session.context.close()
        by_phase = {
            "single_redis_lookup": dict(failures[one]),
            "cluster_lookup": dict(failures[cluster]),
            "lookups_during_publishes": during["failures"],
        }
        result: dict[str, Any] = {
            "rows": rows,
            "delta_rows": delta_rows,
            "clients": clients,
            "cache_rows": CACHE_ROWS,
            "publish_full_s": round(med[one]["full"], 3),
            "publish_delta_s": round(med[one]["delta"], 4),
            "delta_publish_vs_full": round(med[one]["delta"] / med[one]["full"], 4),
            "cluster_publish_full_s": round(med[cluster]["full"], 3),
            "cluster_publish_delta_s": round(med[cluster]["delta"], 4),
            "cluster_delta_publish_vs_full": round(med[cluster]["delta"] / med[cluster]["full"], 4),
            "single_redis_lookup_qps": round(single_qps, 1),
            "cluster_lookup_qps": round(cluster_qps, 1),
            "single_redis_round_qps": [round(q, 1) for q in lookups[one]],
            "cluster_round_qps": [round(q, 1) for q in lookups[cluster]],
            "cluster_vs_single_redis": round(cluster_qps / single_qps, 3),
            "deltas_published_during_lookups": during["during"],
            "delta_publish_s_during_lookups": round(float(np.median(published)), 4),
            "lookups_during_publishes_qps": round(during["qps"], 1),
            "versions_seen_during_publishes": len(during["versions"]),
            "failed_lookups_during_publishes": during["failed"],
            "torn_during_publishes": during["torn"],
            "failed_by_phase": {k: v for k, v in by_phase.items() if v},
        }
        result["targets"] = dict(TARGETS)
        result["targets_met"] = {
            "delta_publish_vs_full": result["delta_publish_vs_full"]
            <= TARGETS["delta_publish_vs_full"],
            "cluster_vs_single_redis": result["cluster_vs_single_redis"]
            >= TARGETS["cluster_vs_single_redis"]
            and not failures[one]
            and not failures[cluster],
            "torn_during_publishes": result["torn_during_publishes"] == 0
            and result["failed_lookups_during_publishes"] == 0,
        }
        return result
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
        shutil.rmtree(work, ignore_errors=True)
