"""``ps_bench.py --disk``: the disk tier's parts against the disk's own limit.

In one run, on the disk under ``--disk-dir`` (default: a folder in the
current directory, removed after):

* the physical limit, as fio measures it: random reads with O_DIRECT of
  512 bytes and of 4 KiB at depth 1 and at ``--depth`` (threads each
  issuing ``pread``s at random aligned offsets of a file as large as the
  row files below, so that both span the same share of the disk);
* the row files (``details/row_file.h``): ``--records`` records of a dim-16
  Adagrad row (168 bytes) appended, then read at random in batches of
  ``--read-batch`` with ``--depth`` reads in flight (``RowFile::ReadMany``);
  ``cold_reads_vs_disk`` is their rate over the disk's (a record read
  fetches the 512-byte sectors that hold it, 512 or 1024 bytes: the disk's
  limit is its better rate of 512-byte and 4 KiB reads at the same depth).
  The disk and the row files take turns for ``--disk-rounds`` rounds and
  medians are compared;
* the cold index (``details/cold_index.h``): RAM per key at the table's
  cold rows (``ram_bytes_per_cold_row``).

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

from wuliang.ps_server import _engine

RECORD_BYTES = 8 + 32 + 4 * 16 + 4 * 16  # key | meta | weights | Adagrad state, dim 16


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
    direct = True

    def probe(read_bytes: int, depth: int) -> None:
        nonlocal direct
        rate, used = _engine.disk_random_reads(str(work), probe_bytes, read_bytes, depth, seconds)
        direct = direct and used
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
            rate, rows_direct, disk_per_row = _engine.row_file_reads(
                str(work / "rows"), RECORD_BYTES, records, reads, args.depth, args.read_batch
            )
            direct = direct and rows_direct
            row_rates.append(rate)
            print(f"row files: {rate:,.0f} records/s at depth {args.depth}", flush=True)
        cold_keys = records if quick else args.cold_keys
        ram_per_cold = _engine.cold_index_bytes_per_key(cold_keys)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # a record read fetches 512 or 1024 bytes: the disk's best rate at the depth bounds it
    limits = [max(a, b) for a, b in zip(disk[f"512B_depth{args.depth}"],
                                        disk[f"4096B_depth{args.depth}"], strict=True)]  # fmt: skip
    limit = statistics.median(limits)
    rows_rate = statistics.median(row_rates)
    result = {
        "disk_dir": str(base),
        "o_direct": direct,
        "rounds": rounds,
        "depth": args.depth,
        "disk_random_reads_per_s": disk,
        "disk_limit_reads_per_s": round(limit),
        "row_file_reads_per_s": [round(r) for r in row_rates],
        "record_bytes": RECORD_BYTES,
        "row_file_records": records,
        "cold_reads_per_s": round(rows_rate),
        "cold_reads_vs_disk": round(rows_rate / limit, 3) if limit else None,
        "disk_bytes_per_row": round(disk_per_row, 1),
        "cold_index_keys": cold_keys,
        "ram_bytes_per_cold_row": round(ram_per_cold, 2),
        "cores": os.cpu_count(),
        "seconds": round(time.perf_counter() - started, 1),
        "targets": {"cold_reads_vs_disk": 0.7, "ram_bytes_per_cold_row": 24},
        "targets_met": {
            "cold_reads_vs_disk": bool(limit) and rows_rate / limit >= 0.7,
            "ram_bytes_per_cold_row": ram_per_cold <= 24,
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
