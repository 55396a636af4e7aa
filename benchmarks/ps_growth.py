"""Whether the RAM tier slows down as a table grows: ``ps_bench.py --growth``.

Two engines, one after the other, hold a small and a large table (16M and
64M rows of dim 16 with Adagrad; ``--quick``: 4M and 16M) and take the same
kind of stream: 100K-key batches, uniform and Zipf(1.1) over each table's
keys. ``large_vs_small_pull`` is the large table's uniform training-pull
rate against the small one's; ``growth_vs_machine`` is that ratio over the
machine's own (below): 1 when the engine slows down with size exactly as
the machine's memory does, more when less.

The machine's own figure, in the same run: one thread's random 64-byte
reads from memory the size of each table, mapped as the engine maps its
pool, each prefetched 32 reads ahead as the engine's pipeline does
(``machine_large_vs_small``; also without prefetching), so the ratio the
memory system itself gives its access pattern stands beside the engine's.
Deep prefetching makes the reads bound by how many TLB misses (page walks)
the core resolves at once, not by latency: past the huge-page TLB's reach
that is what drops. The share of each table's memory on huge pages is printed too:
the pool and the index ask for them (``MADV_HUGEPAGE``), and where the
kernel gives none, every probe is a TLB miss on 4 KiB pages.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
from ps_streams import DIM, make_streams, table_keys, time_calls

from wuliang.ps_server import Adagrad, Engine, TableSpec, _engine

PREFETCHED = 32  # reads ahead, as deep as the engine's pipeline (index slots, then rows)


def memory_of_process() -> tuple[int, int]:
    """(resident bytes, of which on transparent huge pages)."""
    rss = huge = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("AnonHugePages:"):
                huge = int(line.split()[1]) * 1024
    return rss, huge


def run_table(rows: int, shards: int, batch: int, batches: int, repeats: int) -> dict:
    spec = TableSpec("bench", DIM, optimizer=Adagrad(learning_rate=0.05))
    streams = make_streams(rows, batch, batches, seed=0)
    out = np.empty((batch, DIM), dtype=np.float32)
    rss0, huge0 = memory_of_process()
    with Engine(num_shards=shards) as engine:
        engine.create_table(spec)
        fill = np.empty((1 << 20, DIM), dtype=np.float32)
        t0 = time.perf_counter()
        for start in range(0, rows, len(fill)):
            keys = table_keys(np.arange(start, min(rows, start + len(fill))))
            engine.pull("bench", keys, out=fill[: len(keys)])
        fill_s = time.perf_counter() - t0
        del fill
        rss, huge = memory_of_process()
        result = {
            "fill_rows_per_s": rows / fill_s,
            "table_bytes": engine.stats("bench")["bytes"],
            "huge_page_share": (huge - huge0) / max(1, rss - rss0),
        }
        for name, stream in streams.items():
            result[f"{name}_pull"] = time_calls(
                lambda k: engine.pull("bench", k, out=out), stream, repeats
            )
    print(
        f"{rows:>12,} rows ({result['table_bytes'] / 2**30:5.1f} GiB, "
        f"{result['huge_page_share']:.0%} on huge pages): uniform pull "
        f"{result['uniform_pull'] / 1e6:5.1f}M, zipf pull {result['zipf_pull'] / 1e6:5.1f}M keys/s",
        flush=True,
    )
    return result


def machine_reads_per_s(table_bytes: int, ahead: int) -> float:
    """Random 64-byte reads/s of one thread from memory of table_bytes,
    mapped as the engine's pool (huge pages asked for), each read
    prefetched ``ahead`` reads before (0: none): best of 3."""
    return max(_engine.memory_random_reads(table_bytes, 8_000_000, ahead) for _ in range(3))


def main(args: argparse.Namespace) -> dict:
    small_rows, large_rows = (4_000_000, 16_000_000) if args.quick else (16_000_000, 64_000_000)
    batches, repeats = (10, 2) if args.quick else (20, 3)
    print(
        f"growth: {small_rows:,} against {large_rows:,} rows, dim {DIM}, Adagrad, "
        f"{args.shards} shards; {batches} batches of {args.batch:,} keys per stream",
        flush=True,
    )
    small = run_table(small_rows, args.shards, args.batch, batches, repeats)
    gc.collect()
    large = run_table(large_rows, args.shards, args.batch, batches, repeats)
    gc.collect()
    machine: dict[str, float] = {}
    for ahead in (0, PREFETCHED):
        for size in ("small", "large"):
            table_bytes = (small if size == "small" else large)["table_bytes"]
            machine[f"{size}_{ahead}"] = machine_reads_per_s(table_bytes, ahead)
        print(
            f"machine, reads prefetched {ahead} ahead: random 64-byte reads "
            f"{machine[f'small_{ahead}'] / 1e6:.1f}M/s from {small['table_bytes'] / 2**30:.1f} "
            f"GiB, {machine[f'large_{ahead}'] / 1e6:.1f}M/s from "
            f"{large['table_bytes'] / 2**30:.1f} GiB",
            flush=True,
        )
    machine_small, machine_large = machine[f"small_{PREFETCHED}"], machine[f"large_{PREFETCHED}"]
    return {
        "small_rows": small_rows,
        "large_rows": large_rows,
        "shards": args.shards,
        "small_pull_keys_per_s": round(small["uniform_pull"]),
        "large_pull_keys_per_s": round(large["uniform_pull"]),
        "small_zipf_pull_keys_per_s": round(small["zipf_pull"]),
        "large_zipf_pull_keys_per_s": round(large["zipf_pull"]),
        "small_huge_page_share": round(small["huge_page_share"], 3),
        "large_huge_page_share": round(large["huge_page_share"], 3),
        "machine_reads_small_per_s": round(machine_small),
        "machine_reads_large_per_s": round(machine_large),
        "machine_large_vs_small": round(machine_large / machine_small, 3),
        "machine_large_vs_small_unprefetched": round(machine["large_0"] / machine["small_0"], 3),
        "large_vs_small_zipf_pull": round(large["zipf_pull"] / small["zipf_pull"], 3),
        "large_vs_small_pull": round(large["uniform_pull"] / small["uniform_pull"], 3),
        # the engine's slowdown from the small table to the large one over the machine's
        "growth_vs_machine": round(
            (large["uniform_pull"] / small["uniform_pull"]) / (machine_large / machine_small), 3
        ),
    }
