"""Overload, and only overload, is shed: ``python benchmarks/overload_bench.py
[--quick]`` (also part of ``serving_bench.py --fleet``, through
``fleet_bench.fleet()``).

Setup (not timed): ``serving_setup.build_model`` 's model, its ``item`` table
of ``rows`` rows (1M; quick 200K) exported as version 1, served by ``wuliang
serve`` (``serving_setup.start_server``) in two settings, alternated ABBA
(quick: AB) in one run: ``shed``, the server's defaults, and ``unshed``,
``--max-queue 0`` (a server that never sheds; ``--baseline-args`` puts other
flags there, to compare two settings); and once, between the rounds,
``shed_floor.py`` 's bare server, which refuses every call and does nothing
else.

Requests: predictions of 100 rows as TensorFlow Serving's clients send
them, over its two APIs: gRPC ``tensorflow.serving.PredictionService/
Predict`` (``TensorProto`` s made by ``tf.make_tensor_proto``; ``tfs_grpc``)
and REST ``:predict`` (the row format, ``instances``; ``rest``).
Predictions, not lookups: a prediction costs the server milliseconds and a
refusal a tenth of that, so a server can refuse twice its capacity; a
lookup of 1000 keys over gRPC costs 400 µs and a refusal by bare grpcio
190 µs, so twice a lookup capacity is more refusals than the server's
Python can answer, shedding or not (``docs/performance.md``). The load
processes are ``serving_load.py`` 's (closed and open loops, answers
accepted, shed or failed by kind, on 2 cores beside the server).

Phases, on each server:

1. capacity (the first ``shed`` server): for each API, closed loops of 1,
   2, 4 and 8 callers (``SWEEP``), ``sweep_s`` each after a warm-up:
   ``capacity_qps``, the best accepted rate;
2. closed loops (``shed`` servers): for each API, ``CALLERS`` (8, 32, 64)
   callers, no retries, ``closed_s`` each after a warm-up; every answer
   but an accepted one is a refusal: ``closed_loop_refused``;
3. open-loop overload: for each API, after a warm-up (a closed loop of 2
   callers, ``sweep_s``), predictions sent at ``OVERLOAD`` (2) times its
   capacity for ``seconds`` (5; quick 3), the server's RSS sampled
   meanwhile (``rss_growth_mb``: its most over the RSS before). On the
   ``unshed`` server the queue then drains before the next phase;
4. the floor: the same open loops, at the same rates, on the bare server
   that refuses them all.

An overload's figures are those of its steady state: answers to requests
due ``ONSET_S`` (1 s) or more after it began. Its onset, the backlog that
builds while the server finds that arrivals outgrow what it answers (some
50 ms of arrivals at 2x for these predictions, then shed as stale), is a
one-off whose share of a percentile depends only on how long the window
is; it is reported apart (``onset``: the accepted and shed p99 of the
first second, and the whole window's).

Figures (the last JSON line): ``closed_loop_refused`` and ``closed_loop``
(per API and callers: rates, p50/p99, failures by kind); under overload
(``overload``: per setting and API, accepted and shed rates and p50/p99,
failures by kind, the offered rate the load processes kept, CPU per
answer of the server and clients, RSS, the onset), the headlines
``overload_accepted_p99_ms``, ``overload_shed_p99_ms``, ``overload_failed``
and ``overload_rss_growth_mb`` (the worse API, with the defaults),
``overload_goodput`` (accepted rate over capacity, the worse API), the
unshed server's ``overload_unshed_p99_ms`` and ``overload_unshed_failed``,
``shed_floor`` (the floor's shed rate and p50/p99 by API) and
``shed_p99_vs_floor``: the defaults' shed p99 over the floor's, the worse
API; ``overload_shed_counted``: each server's ``wuliang_shed_total`` by
transport beside the shed answers its clients saw; ``failed_by_phase``:
the failures of every phase of the ``shed`` servers that had any, by
kind. Rates and percentiles count answered calls only.

Targets: no closed-loop call refused; under overload accepted p99 <= 20
ms, no failure, shed p99 <= 1.2 x the floor's, RSS growth <= 50 MB.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from serving_load import LoadProcess, ms, run_load, summary

PREDICTS = 32  # distinct prebuilt predictions
ONSET_S = 1.0  # the first second of an overload: its onset
SWEEP = (1, 2, 4, 8)
CALLERS = (8, 32, 64)  # closed-loop callers of the predictions
OVERLOAD = 2.0  # the open loop's rate, times the capacity
LOAD_PROCS = 1  # load processes per transport
BASELINE = ("--max-queue", "0")  # the server that never sheds
PREDICT = {
    "rest": ("http", "/v1/models/bench:predict"),
    "tfs_grpc": ("grpc", "/tensorflow.serving.PredictionService/Predict"),
}
TRANSPORTS = ("http", "grpc")
APIS = tuple(PREDICT)
FLOOR_KEYS = ("rate", "offered_qps", "shed_qps", "shed_p50_ms", "shed_p99_ms", "failed")
TARGETS = {
    "closed_loop_refused": 0,
    "overload_accepted_p99_ms": 20.0,
    "overload_failed": 0,
    "shed_p99_vs_floor": 1.2,
    "overload_rss_growth_mb": 50.0,
}


def requests(rows: int) -> dict[str, tuple[str, list[str]]]:
    """The prebuilt predictions of each API (named, base64, for the load
    processes)."""
    from serving_setup import PREDICT_ROWS, predict_batch, tfs_request

    rng = np.random.default_rng(7)
    batches = [predict_batch(rng, rows) for _ in range(PREDICTS)]
    tfs = [tfs_request(b, "bench").SerializeToString() for b in batches]
    rest = []
    for b in batches:
        keys, offsets = b["genres"]
        instances = [
            {
                "user_id": int(b["user_id"][r]),
                "item_id": int(b["item_id"][r]),
                "genres": keys[offsets[r] : offsets[r + 1]].tolist(),
                "age": float(b["age"][r, 0]),
            }
            for r in range(PREDICT_ROWS)
        ]
        rest.append(json.dumps({"instances": instances}).encode())

    def named(name: str, bodies: list[bytes]) -> tuple[str, list[str]]:
        return name, [base64.b64encode(b).decode() for b in bodies]

    return {
        "rest": named("predict_rest", rest),
        "tfs_grpc": named("predict_tfs", tfs),
    }


def metric_sums(http_port: int, name: str, label: str) -> dict[str, float]:
    """A metric of the server's /metrics, summed by one of its labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            key = labels.partition(f'{label}="')[2].partition('"')[0]
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def drained(http_port: int, timeout: float = 60.0) -> None:
    """Waits until the server's queues are empty (an unshed server's backlog)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(metric_sums(http_port, "wuliang_queue_requests", "queue").values()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the server's queues did not drain in {timeout:g} s")


class Run:
    """What one run gathers over its servers."""

    def __init__(self, settings: Any) -> None:
        self.sweep: dict[str, list[float]] = {}
        self.capacity: dict[str, float] = {}
        self.closed: dict[str, dict[int, list[dict[str, Any]]]] = {
            api: {n: [] for n in CALLERS} for api in APIS
        }
        self.overload = {s: {api: [] for api in APIS} for s in settings}
        self.floor: dict[str, list[dict[str, Any]]] = {api: [] for api in APIS}
        self.shed_counted: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
        self.failed_by_phase: dict[str, dict[str, int]] = {}

    def failed(self, phase: str, run: dict[str, Any]) -> None:
        if run["failures"] or len(run["shed"]):
            counts = self.failed_by_phase.setdefault(phase, {})
            for kind, n in {**run["failures"], "RESOURCE_EXHAUSTED/503": len(run["shed"])}.items():
                if n:
                    counts[kind] = counts.get(kind, 0) + n


def server_round(
    run: Run,
    setting: str,
    server_args: tuple[str, ...],
    exports: Path,
    loads: dict[str, list[LoadProcess]],
    bodies: dict[str, tuple[str, list[str]]],
    seconds: float,
    sweep_s: float,
    closed_s: float,
) -> None:
    """One server of ``setting``: phases 1-3 of the module docstring."""
    from serving_setup import rss_mb, start_server, stop

    server, grpc_port, http_port = start_server(exports, extra_args=server_args)
    try:
        ports = {"http": http_port, "grpc": grpc_port}
        client_shed = dict.fromkeys(TRANSPORTS, 0)
        shed = setting == "shed"

        def load(api: str, length: float, **kind: Any) -> dict[str, Any]:
            transport, target = PREDICT[api]
            result = run_load(
                loads[transport], transport, ports[transport], target, bodies[api], length,
                server.pid, **kind,
            )  # fmt: skip
            client_shed[transport] += len(result["shed"])
            return result

        for api in APIS:
            if api not in run.capacity:
                load(api, sweep_s, conns=2)  # warm-up: a fresh server's first calls
                qps = []
                for conns in SWEEP:
                    result = load(api, sweep_s, conns=conns)
                    run.failed(f"capacity_{api}_{conns}", result)
                    qps.append(result["accepted_in_window"] / sweep_s)
                run.sweep[api] = qps
                run.capacity[api] = max(qps)
        if shed:
            for api in APIS:
                load(api, sweep_s, conns=CALLERS[0])  # warm-up
                for callers in CALLERS:
                    result = load(api, closed_s, conns=callers)
                    run.closed[api][callers].append(result)
                    run.failed(f"closed_{api}_{callers}", result)
        for api in APIS:
            load(api, sweep_s, conns=2)  # warm-up
            before = rss_mb(server.pid)
            result = load(api, seconds, rate=OVERLOAD * run.capacity[api])
            result["rss_before_mb"] = before
            run.overload[setting][api].append(result)
            if shed:
                run.failed(f"overload_{api}", result)
            drained(http_port)
        counted = {
            "server": metric_sums(http_port, "wuliang_shed_total", "transport"),
            "clients": client_shed,
        }
        run.shed_counted[setting].append(counted)
    finally:
        stop(server)


def floor_round(
    run: Run,
    loads: dict[str, list[LoadProcess]],
    bodies: dict[str, tuple[str, list[str]]],
    seconds: float,
) -> None:
    """Phase 4: the open-loop overloads on the bare server refusing every call."""
    from serving_setup import stop

    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "shed_floor.py"), "--serve"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        words = child.stdout.readline().split()
        ports = {"grpc": int(words[1]), "http": int(words[3])}
        for api in APIS:
            transport, target = PREDICT[api]
            port, procs = ports[transport], loads[transport]
            run_load(procs, transport, port, target, bodies[api], 1.0, child.pid, conns=2)
            result = run_load(
                procs, transport, port, target, bodies[api], seconds, child.pid,
                rate=OVERLOAD * run.capacity[api],
            )  # fmt: skip
            run.floor[api].append(result)
    finally:
        stop(child)


def overload(
    quick: bool = False,
    rows: int | None = None,
    seconds: float | None = None,
    procs: int = LOAD_PROCS,
    baseline_args: tuple[str, ...] = BASELINE,
) -> dict[str, Any]:
    """The figures of the module docstring (a dict with ``targets`` and
    ``targets_met``); ``procs``: load processes a transport;
    ``baseline_args``: the ``unshed`` server's flags."""
    from serving_setup import build_model

    rows = rows or (200_000 if quick else 1_000_000)
    seconds = seconds or (3.0 if quick else 5.0)
    sweep_s = 1.0 if quick else 1.5
    closed_s = 1.5 if quick else 3.0
    order = ("shed", "floor", "unshed") if quick else ("shed", "unshed", "floor", "unshed", "shed")
    settings = {"shed": (), "unshed": tuple(baseline_args)}
    run = Run(settings)
    work = Path(tempfile.mkdtemp(prefix="overload_bench_"))
    loads: dict[str, list[LoadProcess]] = {}
    try:
        t0 = time.perf_counter()
        session = build_model(rows, work / "bench")
        session.context.close()
        setup_s = time.perf_counter() - t0
        bodies = requests(rows)
        loads = {t: [LoadProcess() for _ in range(procs)] for t in TRANSPORTS}
        for setting in order:
            if setting == "floor":
                floor_round(run, loads, bodies, seconds)
            else:
                server_round(
                    run, setting, settings[setting], work / "bench", loads, bodies, seconds,
                    sweep_s, closed_s,
                )  # fmt: skip
    finally:
        for group in loads.values():
            for proc in group:
                proc.close()
        shutil.rmtree(work, ignore_errors=True)
    return figures(run, settings, rows, seconds, order, setup_s)


def steady(run: dict[str, Any], after: float = ONSET_S) -> dict[str, Any]:
    """An overload's answers to requests due ``after`` seconds or more
    after it began (its steady state), as ``run_load`` gives them."""
    keep_accepted = run["accepted_at"] >= after
    keep_shed = run["shed_at"] >= after
    return {
        **run,
        "accepted": run["accepted"][keep_accepted],
        "shed": run["shed"][keep_shed],
    }


def onset(run: dict[str, Any], after: float = ONSET_S) -> dict[str, Any]:
    """The p99s of an overload's first ``after`` seconds, and of its whole window."""
    first = {
        "accepted": run["accepted"][run["accepted_at"] < after],
        "shed": run["shed"][run["shed_at"] < after],
    }
    return {
        "first_s_accepted_p99_ms": ms(first["accepted"], 99),
        "first_s_shed_p99_ms": ms(first["shed"], 99),
        "window_accepted_p99_ms": ms(run["accepted"], 99),
        "window_shed_p99_ms": ms(run["shed"], 99),
    }


def figures(
    run: Run,
    settings: dict[str, tuple[str, ...]],
    rows: int,
    seconds: float,
    order: tuple[str, ...],
    setup_s: float,
) -> dict[str, Any]:
    """The run's figures and targets (the module docstring)."""
    over = {
        s: {api: summary([steady(r) for r in run.overload[s][api]]) for api in APIS}
        for s in settings
    }
    floor = {api: summary([steady(r) for r in run.floor[api]]) for api in APIS}
    for api in APIS:
        capacity = run.capacity[api]
        for setting in settings:
            runs = run.overload[setting][api]
            figure = over[setting][api]
            figure["rss_growth_mb"] = round(
                max(r["rss_max_mb"] - r["rss_before_mb"] for r in runs), 1
            )
            figure["goodput"] = round(figure["accepted_qps"] / capacity, 3)
            merged = {
                k: np.concatenate([r[k] for r in runs])
                for k in ("accepted", "shed", "accepted_at", "shed_at")
            }
            figure["onset"] = onset(merged)
    closed = {
        api: {str(n): summary(runs) for n, runs in by_callers.items()}
        for api, by_callers in run.closed.items()
    }
    shed = over["shed"].values()

    def worst(key: str, among: Any = shed) -> Any:
        values = [f[key] for f in among if f.get(key) is not None]
        return max(values) if values else None

    vs_floor = {
        api: round(over["shed"][api]["shed_p99_ms"] / floor[api]["shed_p99_ms"], 3)
        for api in APIS
        if over["shed"][api]["shed_p99_ms"] is not None and floor[api]["shed_p99_ms"]
    }
    result: dict[str, Any] = {
        "overload_rows": rows,
        "overload_seconds": seconds,
        "overload_onset_s": ONSET_S,
        "overload_rounds": "".join({"shed": "A", "unshed": "B", "floor": "F"}[s] for s in order),
        "overload_setup_s": round(setup_s, 1),
        "cores": os.cpu_count(),
        "capacity_qps": {api: round(q, 1) for api, q in run.capacity.items()},
        "capacity_sweep_qps": {api: [round(q, 1) for q in qs] for api, qs in run.sweep.items()},
        "closed_loop_refused": sum(
            sum(r["failures"].values()) + len(r["shed"])
            for by_callers in run.closed.values()
            for runs in by_callers.values()
            for r in runs
        ),
        "closed_loop": closed,
        "overload_accepted_p99_ms": worst("accepted_p99_ms"),
        "overload_shed_p99_ms": worst("shed_p99_ms"),
        "overload_failed": sum(f["failed"] for f in shed),
        "overload_rss_growth_mb": worst("rss_growth_mb"),
        "overload_goodput": min(f["goodput"] for f in shed),
        "overload_unshed_p99_ms": worst("accepted_p99_ms", over["unshed"].values()),
        "overload_unshed_failed": sum(f["failed"] for f in over["unshed"].values()),
        "shed_floor": {api: {k: floor[api][k] for k in FLOOR_KEYS} for api in APIS},
        "shed_p99_vs_floor_by_api": vs_floor,
        "shed_p99_vs_floor": max(vs_floor.values()) if vs_floor else None,
        "overload": over,
        "overload_shed_counted": run.shed_counted,
        "failed_by_phase": run.failed_by_phase,
    }
    met = {
        "closed_loop_refused": result["closed_loop_refused"] == 0,
        "overload_accepted_p99_ms": result["overload_accepted_p99_ms"] is not None
        and result["overload_accepted_p99_ms"] <= TARGETS["overload_accepted_p99_ms"],
        "overload_failed": result["overload_failed"] == 0,
        "shed_p99_vs_floor": result["shed_p99_vs_floor"] is not None
        and result["shed_p99_vs_floor"] <= TARGETS["shed_p99_vs_floor"],
        "overload_rss_growth_mb": result["overload_rss_growth_mb"]
        <= TARGETS["overload_rss_growth_mb"],
    }
    result["targets"] = TARGETS
    result["targets_met"] = met
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200K rows, 3 s overloads, AFB")
    parser.add_argument("--seconds", type=float, help="length of an overload phase")
    parser.add_argument("--procs", type=int, default=LOAD_PROCS, help="load processes a transport")
    parser.add_argument(
        "--baseline-args",
        default=" ".join(BASELINE),
        metavar="ARGS",
        help="the flags of the second server, reported as 'unshed' (default: %(default)s, "
        "never shedding; e.g. '--max-queue-ms 10' compares two settings side by side)",
    )
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # cleanup runs on SIGTERM too
    result = overload(
        quick=args.quick,
        seconds=args.seconds,
        procs=args.procs,
        baseline_args=tuple(args.baseline_args.split()),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
