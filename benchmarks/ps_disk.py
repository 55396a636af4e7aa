"""``ps_bench.py --disk``: the disk tier's parts against the disk's own limit.

In one run, on the disk under ``--disk-dir`` (default: a folder in the
current directory, removed after):

* the physical limit, as fio measures it: random reads with O_DIRECT of
  512 bytes and of 4 KiB at random aligned offsets of a file as large as the
  row files below (so that both span the same share of the disk), at depth
  1 and as many in flight as the tier keeps: through io_uring at its depth
  (64) where the kernel allows it, else ``--depth`` threads of ``pread``s;
* the row files (``details/row_file.h``): ``--records`` records of a dim-16
  Adagrad row (168 bytes) appended, then read at random in batches of
  ``--read-batch`` (``RowFile::ReadMany``), through the tier's reader
  (io_uring) and through the pool of ``--depth`` threads, with the CPU each
  read costs (``cpu_us_per_read``);
  ``cold_reads_vs_disk`` is their rate over the disk's (a record read
  fetches the 512-byte sectors that hold it, 512 or 1024 bytes: the disk's
  limit is its better rate of 512-byte and 4 KiB reads at the same depth).
  The disk and the row files take turns for ``--disk-rounds`` rounds and
  medians are compared;
* the cold index (``details/cold_index.h``): RAM per key at the table's
  cold rows (``ram_bytes_per_cold_row``);
* the engine with its disk tier: a table of ``--table-rows`` rows (dim 16,
  Adagrad; 200M, about 32 GB, with ``--memory-gb 4``; ``--quick``: 2M rows
  over a budget of an eighth of them) filled with ``load``, then trained on
  Zipf(1.05) and Zipf(1.2) key streams (``--stream-batches`` batches of
  ``--stream-batch`` keys: a training pull, then an Adagrad push); next to
  it the same streams on an engine without the tier, whose table starts
  empty and takes the rows the streams create (it fits in RAM). Per
  stream: pull and push keys/s of both, cold rows read per second, and the
  tiered engine's RAM per cold row (its cold index over its cold rows) and
  disk bytes per row.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from ps_streams import table_keys, zipf_indices

from wuliang.ps_server import Adagrad, Engine, TableSpec, _engine

RECORD_BYTES = 8 + 32 + 4 * 16 + 4 * 16  # key | meta | weights | Adagrad state, dim 16
ROW_BYTES = 64 + 96  # a dim-16 Adagrad row in the engine's pool: weights | meta and state


def zipf_batches(rng: np.random.Generator, alpha: float, rows: int, batch: int, n: int) -> list:
    ranks = zipf_indices(rng, batch * n, rows, alpha)
    return [table_keys(ranks[i * batch : (i + 1) * batch]) for i in range(n)]


def fill(engine: Engine, rows: int, chunk: int = 1 << 20) -> float:
    """Loads rows 0..rows-1 (the hottest ranks first); returns rows/s."""
    rng = np.random.default_rng(5)
    weights = rng.standard_normal((chunk, 16)).astype(np.float32) * np.float32(0.01)
    state = np.full((chunk, 16), 0.1, np.float32)
    start = time.perf_counter()
    for first in range(0, rows, chunk):
        n = min(chunk, rows - first)
        engine.load("t", table_keys(np.arange(first, first + n)), weights[:n], state[:n])
    return rows / (time.perf_counter() - start)


def train_stream(engine: Engine, batches: list, step0: int) -> dict[str, float]:
    """Seconds of the pulls and of the pushes over the batches."""
    pull = push = 0.0
    grads = np.full((len(batches[0]), 16), 0.01, np.float32)
    reads = engine.stats("t")["cold_reads"]
    for i, keys in enumerate(batches):
        t0 = time.perf_counter()
        engine.pull("t", keys, step=step0 + i)
        t1 = time.perf_counter()
        engine.push("t", keys, grads[: len(keys)], step=step0 + i)
        push += time.perf_counter() - t1
        pull += t1 - t0
    keys = sum(len(b) for b in batches)
    return {
        "pull_keys_per_s": keys / pull,
        "push_keys_per_s": keys / push,
        "cold_reads": engine.stats("t")["cold_reads"] - reads,
        "seconds": pull + push,
    }


def engine_figures(args: argparse.Namespace, work: Path) -> dict:
    """The tiered table against the same streams on an engine without the tier."""
    quick = args.quick
    rows = 2_000_000 if quick else args.table_rows
    memory = rows // 8 * ROW_BYTES if quick else int(args.memory_gb * (1 << 30))
    batch, n = args.stream_batch, (10 if quick else args.stream_batches)
    spec = TableSpec("t", 16, optimizer=Adagrad(learning_rate=0.05))
    rng = np.random.default_rng(9)
    streams = {f"zipf{a}": zipf_batches(rng, a, rows, batch, n) for a in (1.05, 1.2)}
    out: dict = {"table_rows": rows, "memory_bytes": memory, "stream_batch": batch,
                 "stream_batches": n}  # fmt: skip
    with Engine(args.shards, disk_dir=work / "tier", memory_bytes=memory) as tiered:
        tiered.create_table(spec)
        out["fill_rows_per_s"] = round(fill(tiered, rows))
        stats = tiered.stats("t")
        print(f"filled {rows:,} rows: {stats['cold_rows']:,} on disk, "
              f"{out['fill_rows_per_s']:,} rows/s", flush=True)  # fmt: skip
        step = 1
        for name, batches in streams.items():
            got = train_stream(tiered, batches, step)
            step += len(batches)
            out[name] = {"tiered": {k: round(v) for k, v in got.items() if k != "seconds"}}
            out[name]["cold_reads_per_s"] = round(got["cold_reads"] / got["seconds"])
        stats = tiered.stats("t")
        out["cold_rows"] = stats["cold_rows"]
        out["ram_bytes_per_cold_row"] = round(
            stats["cold_index_bytes"] / max(stats["cold_rows"], 1), 2
        )
        out["table_bytes_on_disk"] = stats["disk_bytes"]
        out["disk_bytes_per_row"] = round(stats["disk_bytes"] / max(stats["cold_rows"], 1), 1)
        out["demoted"], out["demoted_written"] = stats["demoted"], stats["demoted_written"]
        out["files_compacted"] = stats["files_compacted"]
        out["disk_error"] = stats["disk_error"]
    with Engine(args.shards) as plain:
        plain.create_table(spec)
        step = 1
        for name, batches in streams.items():
            got = train_stream(plain, batches, step)
            step += len(batches)
            out[name]["in_ram"] = {k: round(v) for k, v in got.items() if k.endswith("per_s")}
            t, r = out[name]["tiered"], out[name]["in_ram"]
            out[name]["pull_vs_in_ram"] = round(t["pull_keys_per_s"] / r["pull_keys_per_s"], 3)
            out[name]["push_vs_in_ram"] = round(t["push_keys_per_s"] / r["push_keys_per_s"], 3)
            print(f"{name}: pull {t['pull_keys_per_s']:,} keys/s tiered, "
                  f"{r['pull_keys_per_s']:,} in RAM; push {t['push_keys_per_s']:,} / "
                  f"{r['push_keys_per_s']:,}; {out[name]['cold_reads_per_s']:,} cold reads/s",
                  flush=True)  # fmt: skip
    return out


def main(args: argparse.Namespace) -> None:
    base = Path(args.disk_dir) if args.disk_dir else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="wuliang-disk-bench-", dir=base))
    quick = args.quick
    seconds = 2.0 if quick else 5.0
    records = 1_000_000 if quick else args.records
    # the probe file as large as the row files: the same span of the disk
    probe_bytes = max(records * 4096 // (4096 // RECORD_BYTES), 256 << 20)
    reads = 100_000 if quick else 400_000
    started = time.perf_counter()
    rounds = 1 if quick else args.disk_rounds
    disk: dict[str, list[int]] = {}
    row_rates: list[float] = []
    pool_rates: list[float] = []  # the pool of preads, where io_uring is the tier's reader
    cpu_per_read: dict[str, list[float]] = {}
    ring = _engine.io_uring_available()
    readers = ("io_uring", "threads") if ring else ("threads",)
    direct = True

    def probe(read_bytes: int, depth: int) -> None:
        nonlocal direct
        rate, used = _engine.disk_random_reads(str(work), probe_bytes, read_bytes, depth, seconds)
        direct = direct and used
        if ring and depth > 1:
            depth = _engine.IO_URING_DEPTH  # what the probe kept in flight
        disk.setdefault(f"{read_bytes}B_depth{depth}", []).append(round(rate))
        print(f"disk: {read_bytes}-byte random reads at depth {depth}: {rate:,.0f}/s", flush=True)

    try:
        for read_bytes in (512, 4096):
            probe(read_bytes, 1)
        # This kind of disk drifts by a factor of 2 within minutes: the
        # limit and the row files take turns, and medians are compared.
        for _ in range(rounds):
            for read_bytes in (512, 4096):
                probe(read_bytes, args.depth)
            # the tier's reader (io_uring where allowed), then the pool of preads
            for reader in ("io_uring", "threads") if ring else ("threads",):
                previous = _engine.set_io_uring(reader == "io_uring")
                cpu = time.process_time()
                try:
                    rate, rows_direct, disk_per_row = _engine.row_file_reads(
                        str(work / "rows"), RECORD_BYTES, records, reads, args.depth,
                        args.read_batch,
                    )  # fmt: skip
                finally:
                    _engine.set_io_uring(previous)
                cpu_us = (time.process_time() - cpu) / reads * 1e6
                direct = direct and rows_direct
                (row_rates if reader == readers[0] else pool_rates).append(rate)
                cpu_per_read.setdefault(reader, []).append(round(cpu_us, 2))
                print(f"row files ({reader}): {rate:,.0f} records/s, {cpu_us:.1f} us of CPU "
                      "a read", flush=True)  # fmt: skip
        cold_keys = records if quick else args.cold_keys
        ram_per_cold = _engine.cold_index_bytes_per_key(cold_keys)
        engine = engine_figures(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # a record read fetches 512 or 1024 bytes: the disk's best rate at the depth bounds it
    depth = _engine.IO_URING_DEPTH if ring else args.depth
    limits = [max(a, b) for a, b in zip(disk[f"512B_depth{depth}"],
                                        disk[f"4096B_depth{depth}"], strict=True)]  # fmt: skip
    limit = statistics.median(limits)
    rows_rate = statistics.median(row_rates)
    result = {
        "disk_dir": str(base),
        "o_direct": direct,
        "rounds": rounds,
        "depth": depth,
        "disk_random_reads_per_s": disk,
        "disk_limit_reads_per_s": round(limit),
        "reader": readers[0],
        "row_file_reads_per_s": [round(r) for r in row_rates],
        "row_file_reads_threads_per_s": [round(r) for r in pool_rates],
        "cpu_us_per_read": cpu_per_read,
        "record_bytes": RECORD_BYTES,
        "row_file_records": records,
        "cold_reads_per_s": round(rows_rate),
        "cold_reads_vs_disk": round(rows_rate / limit, 3) if limit else None,
        "disk_bytes_per_row": round(disk_per_row, 1),
        "cold_index_keys": cold_keys,
        "cold_index_bytes_per_key": round(ram_per_cold, 2),
        "engine": engine,
        "ram_bytes_per_cold_row": engine["ram_bytes_per_cold_row"],
        "table_bytes_on_disk": engine["table_bytes_on_disk"],
        "cores": os.cpu_count(),
        "seconds": round(time.perf_counter() - started, 1),
        "targets": {
            "cold_reads_vs_disk": 0.7,
            "ram_bytes_per_cold_row": 24,
            "table_bytes_on_disk": 32e9,
        },
        "targets_met": {
            "cold_reads_vs_disk": bool(limit) and rows_rate / limit >= 0.7,
            "ram_bytes_per_cold_row": engine["ram_bytes_per_cold_row"] <= 24,
            "table_bytes_on_disk": engine["table_bytes_on_disk"] >= 32e9,
        },
    }
    print(json.dumps(result))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disk-dir", help="--disk: where to measure (default: the current dir)")
    parser.add_argument("--depth", type=int, default=32, help="--disk: reads in flight")
    parser.add_argument("--records", type=int, default=10_000_000, help="--disk: row records")
    parser.add_argument("--disk-rounds", type=int, default=3, help="--disk: alternated rounds")
    parser.add_argument("--read-batch", type=int, default=4096, help="--disk: reads per batch")
    parser.add_argument("--cold-keys", type=int, default=50_000_000, help="--disk: cold index keys")
    parser.add_argument("--table-rows", type=int, default=200_000_000, help="--disk: rows")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="--disk: the RAM budget")
    parser.add_argument("--stream-batch", type=int, default=100_000, help="--disk: keys a batch")
    parser.add_argument("--stream-batches", type=int, default=30, help="--disk: batches a stream")
