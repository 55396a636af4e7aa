"""How the engine's calls scale with shard threads: ``ps_bench.py --scaling``.

For S = 2, 4, 8, 16 shards, one engine each holds the same table (dim 16,
Adagrad) and takes the same uniform stream of 100K-key batches: training
pulls and pushes, in keys/s. Beside the rates, where the CPU goes:

* ``caller_ns_per_key``: CPU of the calling thread (binding, planning,
  dispatch): the serial part of a call;
* ``shard_ns_per_key``: CPU of every other thread (the shard workers): the
  parallel part. If it grows with S, shards repeat work (each scanning the
  whole batch for its keys did: that is what the split round removed);
* ``grouped_pull``: the same batches grouped by shard beforehand
  (``shard_offsets``), the engine with no split at all.

``pull_16_vs_2`` and ``push_16_vs_2`` are measured rates; they mean
scaling only on a machine with 16 cores or more. On fewer cores the
benchmark also prints ``model_pull_16_vs_2`` / ``model_push_16_vs_2``:
Amdahl's law over the measured CPU, ``(c + w2 / 2) / (c + w16 / 16)`` with c
the caller's and wS the shards' CPU per key at S shards (memory bandwidth and
wake-up latency ignored, so an upper bound of what 16 cores give).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from ps_streams import DIM, make_streams, table_keys

from wuliang.ps_server import Adagrad, Engine, TableSpec, shard_of

SHARDS = (2, 4, 8, 16)


def fill(engine: Engine, rows: int) -> None:
    out = np.empty((1 << 20, DIM), dtype=np.float32)
    for start in range(0, rows, len(out)):
        keys = table_keys(np.arange(start, min(rows, start + len(out))))
        engine.pull("bench", keys, out=out[: len(keys)])


def grouped(batches: list[np.ndarray], shards: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each batch's keys sorted by shard, with the shard offsets."""
    out = []
    for keys in batches:
        owner = shard_of(keys, shards)
        order = np.argsort(owner, kind="stable")
        offsets = np.zeros(shards + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(np.bincount(owner, minlength=shards))
        out.append((keys[order], offsets))
    return out


def timed(fn, batches: list, repeats: int) -> tuple[float, float, float]:
    """Best keys/s over the passes, and the caller's and the other threads'
    CPU ns per key over all of them."""
    keys = sum(len(b[0]) if isinstance(b, tuple) else len(b) for b in batches)
    best, caller, total = 0.0, 0.0, 0.0
    for _ in range(repeats):
        c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        for b in batches:
            fn(b)
        elapsed = time.perf_counter() - t0
        caller += time.thread_time() - c0
        total += time.process_time() - p0
        best = max(best, keys / elapsed)
    n = keys * repeats
    return best, caller / n * 1e9, (total - caller) / n * 1e9


def run_shards(shards: int, rows: int, batches: list[np.ndarray], repeats: int) -> dict:
    spec = TableSpec("bench", DIM, optimizer=Adagrad(learning_rate=0.05))
    out = np.empty((len(batches[0]), DIM), dtype=np.float32)
    grads = np.random.default_rng(1).standard_normal(out.shape, dtype=np.float32) * 0.01
    with Engine(num_shards=shards) as engine:
        engine.create_table(spec)
        fill(engine, rows)
        pull = timed(lambda k: engine.pull("bench", k, out=out), batches, repeats)
        push = timed(lambda k: engine.push("bench", k, grads), batches, repeats)
        pre = grouped(batches, shards)
        grouped_pull = timed(
            lambda b: engine.pull("bench", b[0], out=out, shard_offsets=b[1]), pre, repeats
        )
    result = {
        "pull": pull[0],
        "push": push[0],
        "grouped_pull": grouped_pull[0],
        "pull_caller_ns_per_key": pull[1],
        "pull_shard_ns_per_key": pull[2],
        "push_caller_ns_per_key": push[1],
        "push_shard_ns_per_key": push[2],
    }
    print(
        f"shards {shards:2d}: pull {pull[0] / 1e6:5.1f}M (grouped {grouped_pull[0] / 1e6:5.1f}M) "
        f"push {push[0] / 1e6:5.1f}M keys/s | CPU ns/key pull caller {pull[1]:5.1f} "
        f"shards {pull[2]:6.1f}, push caller {push[1]:5.1f} shards {push[2]:6.1f}",
        flush=True,
    )
    return result


def amdahl(small: dict, large: dict, op: str, s_small: int, s_large: int) -> float:
    def per_key(r: dict, s: int) -> float:
        return r[f"{op}_caller_ns_per_key"] + r[f"{op}_shard_ns_per_key"] / s

    return per_key(small, s_small) / per_key(large, s_large)


def main(args: argparse.Namespace) -> dict:
    rows = 2_000_000 if args.quick else 8_000_000
    batches = 10 if args.quick else 20
    repeats = 2 if args.quick else 3
    stream = make_streams(rows, args.batch, batches, seed=0)["uniform"]
    cores = os.cpu_count() or 1
    print(
        f"table: {rows:,} rows, dim {DIM}, Adagrad; {batches} uniform batches of "
        f"{args.batch:,} keys; {cores} cores",
        flush=True,
    )
    runs = {s: run_shards(s, rows, stream, repeats) for s in SHARDS}
    small, large = runs[SHARDS[0]], runs[SHARDS[-1]]
    result: dict = {"cores": cores, "rows": rows, "batch": args.batch}
    for s, r in runs.items():
        result[f"pull_keys_per_s_{s}"] = round(r["pull"])
        result[f"push_keys_per_s_{s}"] = round(r["push"])
        result[f"grouped_pull_keys_per_s_{s}"] = round(r["grouped_pull"])
        for key in ("pull_caller", "pull_shard", "push_caller", "push_shard"):
            result[f"{key}_ns_per_key_{s}"] = round(r[f"{key}_ns_per_key"], 1)
    result["pull_16_vs_2"] = round(large["pull"] / small["pull"], 2)
    result["push_16_vs_2"] = round(large["push"] / small["push"], 2)
    if cores < SHARDS[-1]:
        result["model_pull_16_vs_2"] = round(amdahl(small, large, "pull", 2, 16), 2)
        result["model_push_16_vs_2"] = round(amdahl(small, large, "push", 2, 16), 2)
    return result
