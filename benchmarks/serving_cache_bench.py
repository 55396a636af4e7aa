"""Serving lookups in process, with and without the device cache
(``ModelStore(gpu_cache_rows=N)``, ``serving/device_cache.py``), and the
rows predictions read.

Setup (not timed): one full version of a table ``item`` of ``--rows`` rows
(default 2M) of dim 16, each row's shows drawn so that the key's rank by
shows is its Zipf rank (key 0 the hottest), written directly
(``VersionWriter``, no TensorFlow); two stores over it, one without the
cache and one with ``--cache-rows`` rows (default 10% of the table).

Timed: ``ModelStore.lookup`` of ``--keys`` keys (default 1000) drawn from
Zipf(1.1) over the table, one at a time on this thread, ``--lookups`` per
round, the two stores alternating for ``--rounds`` rounds (AB, BA, ...) so
that the machine's drift weighs on both alike. Reported: microseconds per
lookup (median of the rounds' means, and p50/p99 over all lookups) for
each and their ratio (``on_vs_off``: a lookup's answer leaves over the
network, so lookups read the engine whether the cache is on or not). Then
the same for the rows a prediction reads (``ModelStore.predict_rows``: with
the cache, hits from its snapshot, the rows left in its memory for a tower
there; ``predict_rows_on_vs_off``) and the cache's hit rate. With cupy (a
GPU) the cached rows are on the device; without, numpy arrays in host
memory (what ``--gpu-cache-rows`` costs on a machine without a GPU). The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import zipf_keys  # benchmarks/, the script's folder

from wuliang.ps_server import SGD, RowChunk, TableSpec
from wuliang.ps_server.storage import VersionWriter
from wuliang.serving.store import ModelStore

DIM = 16


def write_export(root: Path, rows: int) -> None:
    with VersionWriter(root, "1", "full") as writer:
        spec = TableSpec("item", DIM, optimizer=SGD())
        chunks = []
        for start in range(0, rows, 500_000):
            keys = np.arange(start, min(rows, start + 500_000), dtype=np.uint64)
            n = len(keys)
            weights = np.empty((n, DIM), np.float32)
            weights[:] = (keys[:, None] % 97).astype(np.float32) / 97.0
            shows = (1e9 / (keys.astype(np.float64) + 1.0) ** 1.1).astype(np.float32)
            ones = np.ones(n, np.uint64)
            state = np.zeros((n, 0), np.float32)
            counts, times = np.ones(n, np.uint32), np.zeros(n, np.uint32)
            chunks.append(RowChunk(keys, weights, state, counts, ones, times, ones, shows))
        writer.write_table(spec, chunks, state=False)
        writer.commit(number=1, parent=None, engine_version=1, step=1)
    (root / "LATEST").write_text("1\n")


def timed(read: Any, batches: list[np.ndarray], lookups: int, sync: Any) -> np.ndarray:
    out = np.empty(lookups)
    for i in range(lookups):
        keys = batches[i % len(batches)]
        t0 = time.perf_counter()
        read("item", keys)
        sync()
        out[i] = time.perf_counter() - t0
    return out


def compare(
    stores: dict[str, ModelStore], method: str, batches: list[np.ndarray], args: Any, sync: Any
) -> dict[str, Any]:
    """Microseconds per call of ``method`` of each store, alternating."""
    reads = {name: getattr(store, method) for name, store in stores.items()}
    for read in reads.values():  # warm up
        timed(read, batches, 200, sync)
    times: dict[str, list[np.ndarray]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            times[name].append(timed(reads[name], batches, args.lookups, sync))
    result: dict[str, Any] = {}
    for name, parts in times.items():
        every = np.concatenate(parts)
        result[f"{name}_us_per_lookup"] = round(
            float(np.median([p.mean() for p in parts])) * 1e6, 1
        )
        result[f"{name}_p50_us"] = round(float(np.percentile(every, 50)) * 1e6, 1)
        result[f"{name}_p99_us"] = round(float(np.percentile(every, 99)) * 1e6, 1)
        result[f"{name}_round_us"] = [round(float(p.mean()) * 1e6, 1) for p in parts]
    result["on_vs_off"] = round(result["on_us_per_lookup"] / result["off_us_per_lookup"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the table")
    parser.add_argument("--cache-rows", type=int, default=0, help="default: 10%% of --rows")
    parser.add_argument("--keys", type=int, default=1000, help="keys per lookup")
    parser.add_argument("--lookups", type=int, default=2000, help="lookups per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating the stores")
    parser.add_argument("--xp", default="auto", help="the cache's array module")
    parser.add_argument("--quick", action="store_true", help="200K rows, 4 rounds of 1000")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.lookups, args.rounds = 200_000, 1000, 4
    cache_rows = args.cache_rows or args.rows // 10
    work = Path(tempfile.mkdtemp(prefix="serving_cache_bench_"))
    try:
        write_export(work / "m", args.rows)
        stores = {
            "off": ModelStore(work / "m", "m", poll_secs=0, load_towers=False).start(),
            "on": ModelStore(
                work / "m",
                "m",
                poll_secs=0,
                load_towers=False,
                gpu_cache_rows=cache_rows,
                gpu_cache_xp=args.xp,
            ).start(),
        }
        rng = np.random.default_rng(0)
        batches = [zipf_keys(rng, args.rows, args.keys) for _ in range(64)]
        for b in batches[:4]:  # the same answers
            off, on = stores["off"].lookup("item", b), stores["on"].lookup("item", b)
            if not (np.array_equal(off.rows, on.rows) and np.array_equal(off.found, on.found)):
                raise RuntimeError("the cached store answers other rows")
        cache = stores["on"].device_cache
        assert cache is not None
        for b in batches[:4]:  # a prediction's rows through the cache: the same rows
            off, on = stores["off"].lookup("item", b), stores["on"].predict_rows("item", b)
            if not np.array_equal(off.rows, cache.kernels.to_host(on.rows)):
                raise RuntimeError("the cached store reads other rows for predictions")
        lookups = compare(stores, "lookup", batches, args, lambda: None)
        predict = compare(stores, "predict_rows", batches, args, cache.kernels.synchronize)
        stats = cache.stats()["item"]
        result: dict[str, Any] = {
            "rows": args.rows,
            "dim": DIM,
            "keys_per_lookup": args.keys,
            "cache_rows": cache_rows,
            "cache_device": cache.device,
            "hit_rate": round(stats["hits"] / max(1, stats["hits"] + stats["misses"]), 3),
            **lookups,
            "predict_rows": predict,
            "predict_rows_on_vs_off": predict["on_vs_off"],
        }
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
