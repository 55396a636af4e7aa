"""GPU hot cache benchmark: hit rates of its policies, its rows/s next to
the engine's, and an embedding step with and without it.

Hit rates. Key streams over a fixed universe of 10M keys, Zipf(1.05),
Zipf(1.1) and Zipf(1.2) by rank (ranks scrambled into hash-like keys),
batches of 4096 x 26 keys. Caches of 1%, 5% and 20% of the universe, each
with the decayed-counts policy (``"stats"``) and LRU, all fed the same
batches through the index the cache itself uses (``wuliang.ps_server.cache.
SlotIndex.observe``, its CPU twin: the same decisions as its kernels; one
call per batch with its unique keys and their counts). The first
``--warmup`` batches fill the caches; the hit rates are those of the
batches after: per key occurrence (what the trainer's lookups see) and per
batch-unique key (what the cache's gather sees). ``oracle`` is the share of
occurrences that the most frequent keys of each size take (a cache that
knew the distribution).

Rows/s, in the same run, on one table (dim 16, Adagrad) and batches of
65,536 unique keys (``--rows-batch``), all in a cache half full:

* engine pull / push: the embedded engine (``--shards`` threads), training
  pulls of existing rows and Adagrad pushes;
* cache lookup / update: ``CachedServer.pull_many`` / ``push_many`` as a
  trainer calls them (keys from the host, rows into and gradients from
  device arrays);
* device-resident (keys, rows and gradients on the device already, no copy
  to or from the host): the index lookup, the gather, the Adagrad update,
  and the three together (``device_hit_path_rows_per_s``);
* swap-in: pulls of keys not in the cache: rows the pull creates (known
  without a read) and rows that exist (read whole, every column, from the
  inner server by ``read_rows``; ``swap_in_read_table_rows`` says how big
  the table is);
* whole-row reads alone, on that table and those keys: the engine's
  ``read_rows`` next to the interface's default, an export scan filtered to
  the keys (``scan_rows``);
* write-back: the cache's updated rows loaded back into the engine.

An embedding step (``embedding_step``), on 1 and on 26 tables
(``--step-tables``): ``--step-keys`` unique keys per step (Zipf(1.2)), 5% of
each table's universe cached, the next step's pull running during the
step, (a) the host engine with the rows copied to the device and the
gradients back, against (b) the cache; ``step_cache_vs_host`` is (a)'s time
over (b)'s, ``step_vs_miss_bound`` (b)'s over the time (b) spent in the
engine (its misses), and ``miss_cost_vs_uncached`` that time over the
misses' share of (a)'s step, (1 - unique-key hit rate) x (a)'s time.

The array module is cupy where a GPU is present (``--xp`` to choose), numpy
otherwise. Does not import TensorFlow. The last line printed is one JSON
object.

    python benchmarks/gpu_cache_bench.py            # 1000 batches per stream
    python benchmarks/gpu_cache_bench.py --quick    # 200 batches, smaller table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from wuliang.ps_server import Adagrad, Engine, ParameterServer, PullPart, PushPart, TableSpec
from wuliang.ps_server.cache import CachedServer, SlotIndex, array_module
from wuliang.ps_server.cache.kernels import (
    NumpyKernels,
    engine_float_model,
    kernels_for,
)
from wuliang.ps_server.interface import scan_rows

UNIVERSE = 10_000_000
BATCH = 4096 * 26
STREAMS = {"zipf1.05": 1.05, "zipf1.1": 1.1, "zipf1.2": 1.2}
SIZES = {"1%": 0.01, "5%": 0.05, "20%": 0.20}
POLICIES = ("stats", "lru")
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
DIM = 16


def keys_of(ranks: np.ndarray) -> np.ndarray:
    """Key of rank r (0 = most frequent): an odd-multiplier scramble."""
    return (ranks.astype(np.uint64) + np.uint64(1)) * GOLDEN


def zipf_cdf(alpha: float, n: int) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def hit_rates(args: argparse.Namespace) -> dict:
    """Every stream through every (size, policy) cache; rates after warm-up."""
    out: dict = {"hit_rate": {}, "unique_hit_rate": {}, "oracle_hit_rate": {}, "policy_ms": {}}
    for stream, alpha in STREAMS.items():
        cdf = zipf_cdf(alpha, args.universe)
        rng = np.random.default_rng([args.seed, int(alpha * 1000)])
        caches = {}
        for size, share in SIZES.items():
            for policy in POLICIES:
                index = SlotIndex(NumpyKernels(), policy=policy, half_life=args.half_life)
                index.add("t", int(share * args.universe))
                caches[(size, policy)] = index
        hits = dict.fromkeys(caches, 0)
        unique_hits = dict.fromkeys(caches, 0)
        seconds = dict.fromkeys(caches, 0.0)
        occurrences = uniques = 0
        t0 = time.perf_counter()
        for batch in range(args.warmup + args.batches):
            ranks = np.searchsorted(cdf, rng.random(args.batch), side="right")
            keys, counts = np.unique(keys_of(ranks), return_counts=True)
            counts = counts.astype(np.float32)
            region = np.zeros(len(keys), np.int32)
            measured = batch >= args.warmup
            for config, cache in caches.items():
                start = time.perf_counter()
                plan = cache.observe(keys, region, counts)
                seconds[config] += time.perf_counter() - start
                if measured:
                    hits[config] += int(counts.sum() - counts[plan.miss].sum())
                    unique_hits[config] += len(keys) - len(plan.miss)
            if measured:
                occurrences += int(counts.sum())
                uniques += len(keys)
        batches = args.warmup + args.batches
        out["hit_rate"][stream] = {size: {} for size in SIZES}
        out["unique_hit_rate"][stream] = {size: {} for size in SIZES}
        out["policy_ms"][stream] = {size: {} for size in SIZES}
        for (size, policy), n in hits.items():
            out["hit_rate"][stream][size][policy] = round(n / occurrences, 4)
            out["unique_hit_rate"][stream][size][policy] = round(
                unique_hits[(size, policy)] / uniques, 4
            )
            out["policy_ms"][stream][size][policy] = round(
                1000 * seconds[(size, policy)] / batches, 2
            )
        out["oracle_hit_rate"][stream] = {
            size: round(float(cdf[int(share * args.universe) - 1]), 4)
            for size, share in SIZES.items()
        }
        rates = out["hit_rate"][stream]
        print(
            f"{stream}: {uniques / args.batches:,.0f} unique keys per batch; hit rate "
            + " | ".join(
                f"{size} stats {rates[size]['stats']:.4f} lru {rates[size]['lru']:.4f} "
                f"(oracle {out['oracle_hit_rate'][stream][size]:.4f})"
                for size in SIZES
            )
            + f"  [{time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
    return out


def best_rate(fn: Callable[[object], object], batches: list, repeats: int) -> float:
    """Best rows/s over ``repeats`` passes through the batches."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for keys in batches:
            fn(keys)
        best = max(best, sum(len(k) for k in batches) / (time.perf_counter() - start))
    return best


def fill(ps, table: str, keys: np.ndarray, step: int = 1) -> None:
    out = np.empty((1 << 18, DIM), np.float32)
    for start in range(0, len(keys), len(out)):
        part = keys[start : start + len(out)]
        ps.pull(table, part, out=out[: len(part)], step=step)


def throughput(args: argparse.Namespace, xp) -> dict:
    """Rows/s of the engine and of the cache on the same keys, same run."""
    spec = TableSpec("bench", DIM, optimizer=Adagrad(learning_rate=0.05))
    rng = np.random.default_rng(args.seed)
    grads = (rng.standard_normal((args.rows_batch, DIM)) * 0.01).astype(np.float32)
    out = np.empty((args.rows_batch, DIM), np.float32)
    result: dict = {}

    with CachedServer(Engine(args.shards), rows=args.cache_rows, xp=xp) as cached:
        cached.create_table(spec)
        start = time.perf_counter()
        fill(cached, "bench", keys_of(np.arange(args.cache_rows // 2)))  # every row new
        result["swap_in_new_rows_per_s"] = args.cache_rows // 2 / (time.perf_counter() - start)
        hot, _ = cached.index.cached("bench")  # half full: a set seldom overflows
        batches = [
            np.sort(rng.choice(hot, size=args.rows_batch, replace=False))
            for _ in range(args.rate_batches)
        ]

        with Engine(args.shards) as engine:
            engine.create_table(spec)
            fill(engine, "bench", keys_of(np.arange(args.table_rows)))
            result["engine_pull_rows_per_s"] = best_rate(
                lambda k: engine.pull("bench", k, out=out, step=2), batches, args.repeats
            )
            result["engine_push_rows_per_s"] = best_rate(
                lambda k: engine.push("bench", k, grads, unique=True, step=2),
                batches,
                args.repeats,
            )

        k = cached.kernels
        d_out = xp.empty((args.rows_batch, DIM), np.float32)
        d_grads = k.to_device(grads)

        # The cache's interface, as a trainer calls it: keys from the host,
        # rows into and gradients from device arrays.
        def lookup(keys: np.ndarray) -> None:
            cached.pull_many([PullPart("bench", keys, d_out)], step=3)
            k.synchronize()

        def update(keys: np.ndarray) -> None:
            cached.push_many([PushPart("bench", keys, d_grads)], unique=True, step=3)
            k.synchronize()

        result["cache_lookup_rows_per_s"] = best_rate(lookup, batches, args.repeats)
        result["cache_update_rows_per_s"] = best_rate(update, batches, args.repeats)
        stats = cached.cache_stats("bench")
        assert stats["rows"] == len(hot) and stats["misses"] == args.cache_rows // 2, stats

        # Device-resident: keys, rows and gradients on the device already.
        cache = cached._tables["bench"]
        index = cached.index
        base = cache.region.entry_base
        region = xp.zeros(args.rows_batch, np.int32)
        d_batches = [k.to_device(b) for b in batches]
        model, _ = engine_float_model()

        def index_lookup(keys) -> None:
            k.index_lookup(index, keys, region, None, True, index.epoch, 1.0)
            k.synchronize()

        slots = [k.index_lookup(index, b, region, None, False, 0, 1.0) - base for b in d_batches]

        def gather(s) -> None:
            k.gather_into(cache.rows.weights, s, d_out)
            k.synchronize()

        def adagrad(s) -> None:
            k.apply(spec, cache.math, model, cache.rows, s, d_grads, None, None, 3, 0)
            k.synchronize()

        def hit_path(keys) -> None:
            s = k.index_lookup(index, keys, region, None, True, index.epoch, 1.0) - base
            k.gather_into(cache.rows.weights, s, d_out)
            k.apply(spec, cache.math, model, cache.rows, s, d_grads, None, None, 3, 0)
            k.synchronize()

        result["device_lookup_rows_per_s"] = best_rate(index_lookup, d_batches, args.repeats)
        result["device_gather_rows_per_s"] = best_rate(gather, slots, args.repeats)
        result["device_update_rows_per_s"] = best_rate(adagrad, slots, args.repeats)
        result["device_hit_path_rows_per_s"] = best_rate(hit_path, d_batches, args.repeats)
        start = time.perf_counter()
        written = cached.flush("bench")
        result["write_back_rows_per_s"] = written / (time.perf_counter() - start)

    # Rows that exist but are not cached: read whole (read_rows), and the
    # reads alone: the engine's per-key read next to an export scan.
    read_rows = args.read_table_rows
    with CachedServer(Engine(args.shards), rows=args.rows_batch, xp=xp, policy="lru") as cached:
        cached.create_table(spec)
        inner = cached.inner
        fill(inner, "bench", keys_of(np.arange(read_rows)))
        waves = [keys_of(np.arange(i, read_rows, 4)[: args.rows_batch]) for i in range(2)]
        rows, found = inner.read_rows("bench", waves[0])
        assert found.all() and np.array_equal(rows.keys, waves[0])
        result["engine_read_rows_per_s"] = best_rate(
            lambda k: inner.read_rows("bench", k), waves, args.repeats
        )
        result["export_scan_read_rows_per_s"] = best_rate(
            lambda k: scan_rows(inner, "bench", k), waves, 1
        )
        start = time.perf_counter()
        for i, keys in enumerate(waves):
            cached.pull("bench", keys, out=out[: len(keys)], step=4 + i)
        seconds = time.perf_counter() - start
        result["swap_in_read_rows_per_s"] = sum(len(k) for k in waves) / seconds
        result["swap_in_read_table_rows"] = read_rows
    return {k: round(v) if isinstance(v, float) else v for k, v in result.items()}


# --- one embedding step, with and without the cache ---------------------------------


def step_keys(
    rng: np.random.Generator, cdf: np.ndarray, unique: int
) -> tuple[np.ndarray, np.ndarray]:
    """The first ``unique`` distinct keys of a Zipf stream, in the order
    first drawn, with their occurrences until the last of them was drawn."""
    draws = np.zeros(0, np.int64)
    while True:
        more = np.searchsorted(cdf, rng.random(max(unique, 4096) * 4), side="right")
        draws = np.concatenate([draws, more])
        ranks, first = np.unique(draws, return_index=True)
        if len(ranks) >= unique:
            break
    order = np.argsort(first, kind="stable")[:unique]  # kept keys, as first drawn
    cut = first[order[-1]] + 1  # every key drawn before this is kept
    position = np.full(len(ranks), -1, np.int64)
    position[order] = np.arange(unique)
    counts = np.bincount(position[np.searchsorted(ranks, draws[:cut])], minlength=unique)
    return keys_of(ranks[order]), counts.astype(np.float32)


def embedding_step(args: argparse.Namespace, xp, tables: int) -> dict:
    """Seconds per embedding step of ``args.step_keys`` unique keys over
    ``tables`` tables (Zipf(1.2), 5% of each table's universe cached), two
    ways in the same run, each pulling step i + 1 while step i runs:

    (a) the host engine: pull into host rows, rows to the device, the
        consumer (a stand-in for the tower: gradients from the rows, on the
        device), gradients to the host, push;
    (b) the device cache in front of the same engine: pull into device rows
        (misses fetched from the engine), the consumer, push of device
        gradients (misses to the engine).

    Both read the next step's rows before the step's push (staleness 1). The
    miss bound is the time (b) spent in the engine (its misses' pulls, reads,
    pushes and write-backs), measured in the same steps."""
    k = kernels_for(xp)
    per_table = args.step_keys // tables
    universe = args.step_universe // tables
    cdf = zipf_cdf(1.2, universe)
    steps = args.step_warmup + args.step_measured
    keys = [
        [step_keys(np.random.default_rng([args.seed, tables, s, t]), cdf, per_table)
         for t in range(tables)]
        for s in range(steps * args.step_rounds)  # each round goes on with the stream
    ]  # fmt: skip
    names = [f"t{t}" for t in range(tables)]
    specs = [TableSpec(n, DIM, optimizer=Adagrad(learning_rate=0.05)) for n in names]

    def consumer(rows):
        return rows * np.float32(1e-3) + np.float32(1e-4)

    def run(ps, device_rows: bool, first: int) -> tuple[float, float]:
        """Seconds per measured step and its time in the inner server; the
        steps are numbered from ``first``."""

        def parts(s: int):
            outs = [
                (xp.empty if device_rows else np.empty)((len(kc[0]), DIM), np.float32)
                for kc in keys[s]
            ]
            return [PullPart(n, kc[0], o, counts=kc[1])
                    for n, kc, o in zip(names, keys[s], outs, strict=True)], outs  # fmt: skip

        pending, outs = None, None
        start = inner = 0.0
        current, current_outs = parts(first)
        ps.pull_many(current, step=first)
        for s in range(steps):
            if s == args.step_warmup:
                k.synchronize()
                start = time.perf_counter()
                inner = getattr(ps, "inner_seconds", 0.0)
            if s + 1 < steps:
                nxt, outs = parts(first + s + 1)
                pending = ps.pull_many_async(nxt, step=first + s + 1)
            pushes = []
            for n, kc, rows in zip(names, keys[first + s], current_outs, strict=True):
                grads = consumer(rows if device_rows else k.to_device(rows))
                pushes.append(PushPart(n, kc[0], grads if device_rows else k.to_host(grads)))
            ps.push_many(pushes, unique=True, step=first + s)
            if pending is not None:
                pending.wait()
                current, current_outs, pending = nxt, outs, None
        k.synchronize()
        seconds = (time.perf_counter() - start) / args.step_measured
        return seconds, (getattr(ps, "inner_seconds", 0.0) - inner) / args.step_measured

    slots = {n: int(0.05 * universe) for n in names}
    hosts, caches, bounds, separate = [], [], [], []
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(Engine(args.shards))
        cached = stack.enter_context(CachedServer(Engine(args.shards), rows=slots, xp=xp))
        calls = None  # the same cache whose exchange is separate calls (--compare-calls)
        if args.compare_calls:
            calls = stack.enter_context(CachedServer(_CallByCall(args.shards), rows=slots, xp=xp))
        for spec in specs:
            for server in (engine, cached, calls):
                if server is not None:
                    server.create_table(spec)
        for r in range(args.step_rounds):  # alternated: this machine's drift hits all
            hosts.append(run(engine, False, r * steps)[0])
            seconds, inner = run(cached, True, r * steps)
            caches.append(seconds)
            bounds.append(inner)
            if calls is not None:
                separate.append(run(calls, True, r * steps)[1])
        stats = cached.cache_stats()
    host, cache = statistics.median(hosts), statistics.median(caches)
    miss_bound = statistics.median(bounds)
    hits = sum(s["hits"] for s in stats.values())
    looked = hits + sum(s["misses"] for s in stats.values())
    return {
        "tables": tables,
        "unique_keys": per_table * tables,
        "host_step_ms": round(1000 * host, 3),
        "cache_step_ms": round(1000 * cache, 3),
        "miss_bound_ms": round(1000 * miss_bound, 3),
        "unique_hit_rate": round(hits / max(looked, 1), 4),
        "step_cache_vs_host": round(host / cache, 3),
        "step_vs_miss_bound": round(cache / miss_bound, 3) if miss_bound else None,
        # what the misses cost the host, against what their share of the
        # uncached step costs: (1 - unique-key hit rate) x (a)'s step time
        "miss_cost_vs_uncached": round(miss_bound / ((1 - hits / max(looked, 1)) * host), 3),
        **(
            {"miss_bound_call_by_call_ms": round(1000 * statistics.median(separate), 3)}
            if separate
            else {}
        ),
    }


class _CallByCall(Engine):
    """An engine whose ``exchange_many`` is the interface's default: a load
    per table, a contains per table, one pull_many, a read_rows per table
    (what a cache's misses cost before the engine did them in one round)."""

    def exchange_many(self, parts: Any, *, step: int | None = None) -> Any:
        return ParameterServer.exchange_many(self, parts, step=step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 batches, smaller tables")
    parser.add_argument("--universe", type=int, default=UNIVERSE)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--batches", type=int, default=500, help="measured batches per stream")
    parser.add_argument("--warmup", type=int, default=500, help="batches before measuring")
    parser.add_argument("--half-life", type=float, default=1000.0, help="stats policy, batches")
    parser.add_argument("--table-rows", type=int, default=4_000_000, help="engine table rows")
    parser.add_argument("--cache-rows", type=int, default=1 << 20, help="rows/s: cache rows")
    parser.add_argument("--read-table-rows", type=int, default=1_000_000)
    parser.add_argument("--rows-batch", type=int, default=65_536, help="rows/s: keys a batch")
    parser.add_argument("--rate-batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--step-keys", type=int, default=65_536, help="unique keys per step")
    parser.add_argument("--step-universe", type=int, default=UNIVERSE, help="keys, all tables")
    parser.add_argument("--step-tables", default="1,26", help="embedding steps over these tables")
    parser.add_argument("--step-warmup", type=int, default=40, help="steps before measuring")
    parser.add_argument("--step-measured", type=int, default=20)
    parser.add_argument(
        "--step-rounds", type=int, default=3, help="host and cache runs, alternated (medians)"
    )
    parser.add_argument(
        "--compare-calls",
        action="store_true",
        help="also a cache whose misses go to the engine call by call (miss_bound_call_by_call_ms)",
    )
    parser.add_argument("--xp", default="auto", choices=("auto", "numpy", "cupy"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        given = {a.split("=")[0] for a in __import__("sys").argv[1:]}
        for name, value in (
            ("--batches", 100),
            ("--warmup", 100),
            ("--table-rows", 1_000_000),
            ("--cache-rows", 1 << 18),
            ("--read-table-rows", 250_000),
            ("--rate-batches", 4),
            ("--repeats", 2),
            ("--step-warmup", 20),
            ("--step-measured", 10),
        ):
            if name not in given:
                setattr(args, name[2:].replace("-", "_"), value)
    xp = array_module(args.xp)
    kernels = kernels_for(xp)
    model, exact = engine_float_model()
    print(
        f"array module {kernels.name} on {kernels.device}; universe {args.universe:,} keys, "
        f"batches of {args.batch:,}: {args.warmup} to warm up, {args.batches} measured; "
        f"engine rounding {model} ({'exact' if exact else 'NOT exact'})",
        flush=True,
    )
    started = time.perf_counter()
    rates = hit_rates(args)
    speed = throughput(args, xp)
    print(
        "rows/s: engine pull {engine_pull_rows_per_s:,} push {engine_push_rows_per_s:,} | "
        "cache lookup {cache_lookup_rows_per_s:,} update {cache_update_rows_per_s:,} | "
        "device-resident: lookup {device_lookup_rows_per_s:,} gather "
        "{device_gather_rows_per_s:,} adagrad {device_update_rows_per_s:,} hit path "
        "{device_hit_path_rows_per_s:,} | swap-in new {swap_in_new_rows_per_s:,} "
        "read {swap_in_read_rows_per_s:,} (table of {swap_in_read_table_rows:,}) | "
        "whole-row reads: engine read_rows {engine_read_rows_per_s:,} export scan "
        "{export_scan_read_rows_per_s:,} | "
        "write-back {write_back_rows_per_s:,}".format(**speed),
        flush=True,
    )
    steps = {}
    for tables in (int(t) for t in args.step_tables.split(",")):
        steps[str(tables)] = step = embedding_step(args, xp, tables)
        print(
            f"embedding step, {tables} table(s), {step['unique_keys']:,} unique keys: host "
            f"{step['host_step_ms']} ms, cache {step['cache_step_ms']} ms (its misses' host "
            f"time {step['miss_bound_ms']} ms; unique-key hit rate {step['unique_hit_rate']})",
            flush=True,
        )
    hit = rates["hit_rate"]
    ratios = [s["step_cache_vs_host"] for s in steps.values()]
    bounds = [s["step_vs_miss_bound"] for s in steps.values() if s["step_vs_miss_bound"]]
    miss_costs = [s["miss_cost_vs_uncached"] for s in steps.values()]
    result = {
        "array_module": kernels.name,
        "device": kernels.device,
        "exact_rounding": exact,
        "universe": args.universe,
        "batch": args.batch,
        "warmup_batches": args.warmup,
        "measured_batches": args.batches,
        "half_life": args.half_life,
        **rates,
        "step": steps,
        "step_cache_vs_host": min(ratios) if ratios else None,
        "step_vs_miss_bound": max(bounds) if bounds else None,
        "miss_cost_vs_uncached": max(miss_costs) if miss_costs else None,
        "targets": {
            "zipf1.2_5%_stats_at_least_0.95": hit["zipf1.2"]["5%"]["stats"] >= 0.95,
            "stats_at_least_lru_everywhere": all(
                hit[s][z]["stats"] >= hit[s][z]["lru"] for s in STREAMS for z in SIZES
            ),
            "device_hit_path_at_least_1e9": speed["device_hit_path_rows_per_s"] >= 1e9,
            "step_cache_vs_host_at_least_3": bool(ratios) and min(ratios) >= 3,
            "step_vs_miss_bound_at_most_1.25": bool(bounds) and max(bounds) <= 1.25,
            "miss_cost_vs_uncached_at_most_1.2": bool(miss_costs) and max(miss_costs) <= 1.2,
        },
        "rows_batch": args.rows_batch,
        "dim": DIM,
        "shards": args.shards,
        "table_rows": args.table_rows,
        "cache_rows": args.cache_rows,
        **speed,
        "device_hit_path_rows_per_s": speed["device_hit_path_rows_per_s"],
        "seconds": round(time.perf_counter() - started),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
