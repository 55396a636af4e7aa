"""Parameter-server engine benchmark: wuliang's engine vs a naive engine.

Both engines hold the same table (N rows, dim 16, Adagrad, fp32) and are
driven from one Python thread with batches of 100K keys drawn from a uniform
and a Zipf(1.1) stream over the table's keys:

* wuliang: the sharded engine (``--shards``, default 2 threads);
* naive:   ``std::unordered_map`` behind one mutex, same row layout,
           initializer and optimizer code, compiled with the same flags
           (``benchmarks/csrc``: the module ``wuliang_bench``, installed only
           by a build with ``WULIANG_BENCH=ON``, as ``make bench`` does:
           ``pip install . -Ccmake.define.WULIANG_BENCH=ON``; without it
           only the wuliang engine runs).

pull = training pull (counts the sighting), push = Adagrad update with
duplicate keys summed. Engines run one after the other so that each has the
whole machine. The last line printed is one JSON object.

    python benchmarks/ps_bench.py            # 16M rows
    python benchmarks/ps_bench.py --quick    # 2M rows
    python benchmarks/ps_bench.py --rows 50000000 --skip-naive
    python benchmarks/ps_bench.py --remote   # remote servers (ps_remote.py)
    python benchmarks/ps_bench.py --disk     # the disk tier's parts (ps_disk.py)
    python benchmarks/ps_bench.py --growth   # 64M rows against 16M (ps_growth.py)
    python benchmarks/ps_bench.py --scaling  # 2 to 16 shard threads (ps_scaling.py)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
from ps_streams import DIM, make_streams, table_keys, time_calls

from wuliang.ps_server import Adagrad, Engine, TableSpec

META_BYTES = 24  # count, last-update step and time, version


def naive_module() -> ModuleType | None:
    """The naive engine's module, or None (with a note) when it is not built."""
    if importlib.util.find_spec("wuliang_bench") is None:
        print(
            "naive: the wuliang_bench module is not installed; only the wuliang engine runs. "
            "Build it with: make bench  (or: pip install . -Ccmake.define.WULIANG_BENCH=ON)",
            flush=True,
        )
        return None
    return importlib.import_module("wuliang_bench")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_row_reads_per_s(rng: np.random.Generator) -> float:
    """Random 64-byte row reads/s of one thread (numpy gather from 1 GiB):
    how fast this machine's memory is right now, for reading the others."""
    table = np.ones((1 << 24, 16), dtype=np.float32)
    index = rng.integers(0, len(table), size=4_000_000)
    t0 = time.perf_counter()
    table.take(index, axis=0)
    return len(index) / (time.perf_counter() - t0)


def run_engine(
    name: str,
    pull: Callable[[np.ndarray, np.ndarray], object],
    push: Callable[[np.ndarray, np.ndarray], object],
    rows: int,
    streams: dict[str, list[np.ndarray]],
    repeats: int,
) -> dict[str, float]:
    batch = len(streams["uniform"][0])
    out = np.empty((batch, DIM), dtype=np.float32)
    grads = np.random.default_rng(1).standard_normal((batch, DIM), dtype=np.float32) * 0.01
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    fill = 1 << 20
    fill_out = np.empty((fill, DIM), dtype=np.float32)
    for start in range(0, rows, fill):
        keys = table_keys(np.arange(start, min(rows, start + fill)))
        pull(keys, fill_out[: len(keys)])
    fill_s = time.perf_counter() - t0
    result = {"fill_rows_per_s": rows / fill_s, "rss_bytes": rss_bytes() - rss0}
    for stream, batches in streams.items():
        cpu: list[float] = []
        result[f"{stream}_pull"] = time_calls(lambda k: pull(k, out), batches, repeats, cpu)
        result[f"{stream}_push"] = time_calls(lambda k: push(k, grads), batches, repeats, cpu)
        result[f"{stream}_pull_cpu"], result[f"{stream}_push_cpu"] = cpu
    print(
        f"{name:8s} fill {result['fill_rows_per_s'] / 1e6:5.2f}M rows/s | "
        + " | ".join(
            f"{s} pull {result[f'{s}_pull'] / 1e6:5.1f}M push {result[f'{s}_push'] / 1e6:5.1f}M"
            for s in streams
        )
        + " keys/s",
        flush=True,
    )
    return result


def run_wuliang(
    spec: TableSpec, args: argparse.Namespace, streams: dict[str, list[np.ndarray]]
) -> tuple[dict[str, float], dict]:
    with Engine(num_shards=args.shards) as engine:
        engine.create_table(spec)
        result = run_engine(
            f"wuliang/{args.shards}",
            lambda k, out: engine.pull("bench", k, out=out),
            lambda k, g: engine.push("bench", k, g),
            args.rows,
            streams,
            args.repeats,
        )
        return result, engine.stats("bench")


def main() -> None:
    import ps_disk

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16_000_000)
    parser.add_argument("--quick", action="store_true", help="2M rows, fewer batches")
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--skip-naive", action="store_true", help="only the wuliang engine")
    parser.add_argument(
        "--remote",
        action="store_true",
        help="remote servers (1 and 2 wuliang ps processes) vs the embedded engine vs "
        "grpcio's floor, in batches of 55K unique keys of 2M rows (benchmarks/ps_remote.py)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--remote: alternated rounds")
    parser.add_argument(
        "--server-threads", type=int, default=2, help="--remote: each wuliang ps's --threads"
    )
    parser.add_argument(
        "--disk",
        action="store_true",
        help="the disk tier: the disk's random-read rate, row-file reads and the cold "
        "index's RAM per key (benchmarks/ps_disk.py)",
    )
    parser.add_argument(
        "--growth",
        action="store_true",
        help="a 64M-row table's pulls against a 16M-row one's, beside the machine's own "
        "random reads at both sizes (benchmarks/ps_growth.py)",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="pulls and pushes at 2, 4, 8 and 16 shard threads, with the CPU of the caller "
        "and of the shards per key (benchmarks/ps_scaling.py)",
    )
    ps_disk.add_arguments(parser)
    args = parser.parse_args()
    if args.growth or args.scaling:
        module = importlib.import_module("ps_growth" if args.growth else "ps_scaling")
        print(json.dumps(module.main(args)))
        return
    if args.disk:
        ps_disk.main(args)
        return
    if args.remote:
        import ps_remote

        given = {a.split("=")[0] for a in sys.argv[1:]}
        if "--rows" not in given:
            args.rows = 1_000_000 if args.quick else 2_000_000
        if "--batch" not in given:
            args.batch = 55_000
        if "--batches" not in given:
            args.batches = 10 if args.quick else 20
        ps_remote.main(args)
        return
    if args.quick:
        args.rows, args.batches, args.repeats = 2_000_000, 10, 2

    spec = TableSpec("bench", DIM, optimizer=Adagrad(learning_rate=0.05))
    streams = make_streams(args.rows, args.batch, args.batches, seed=0)
    print(
        f"table: {args.rows:,} rows, dim {DIM}, Adagrad; {args.batches} batches of "
        f"{args.batch:,} keys per stream",
        flush=True,
    )

    ours, stats = run_wuliang(spec, args, streams)
    gc.collect()

    naive: dict[str, float] = {}
    naive_bytes = 0
    bench = None if args.skip_naive else naive_module()
    if bench is not None:
        baseline = bench.NaiveEngine(spec.to_native())
        naive = run_engine(
            "naive",
            lambda k, out: baseline.pull(k, True, out),
            lambda k, g: baseline.push(k, g),
            args.rows,
            streams,
            args.repeats,
        )
        naive_bytes = baseline.bytes()
        del baseline

    raw = 8 + 4 * DIM + 4 * spec.state_dim + META_BYTES
    result = {
        "machine_row_reads_per_s": round(machine_row_reads_per_s(np.random.default_rng(2))),
        "rows": stats["rows"],
        "dim": DIM,
        "shards": args.shards,
        "batch": args.batch,
        "pull_keys_per_s": round(ours["uniform_pull"]),
        "push_keys_per_s": round(ours["uniform_push"]),
        "zipf_pull_keys_per_s": round(ours["zipf_pull"]),
        "zipf_push_keys_per_s": round(ours["zipf_push"]),
        # CPU time of the process (caller and shard threads) per key, best pass
        "pull_cpu_ns_per_key": round(ours["uniform_pull_cpu"], 1),
        "push_cpu_ns_per_key": round(ours["uniform_push_cpu"], 1),
        "zipf_pull_cpu_ns_per_key": round(ours["zipf_pull_cpu"], 1),
        "zipf_push_cpu_ns_per_key": round(ours["zipf_push_cpu"], 1),
        "fill_rows_per_s": round(ours["fill_rows_per_s"]),
        "bytes_per_row": round(stats["bytes"] / stats["rows"], 1),
        "raw_bytes_per_row": raw,
        "bytes_ratio": round(stats["bytes"] / stats["rows"] / raw, 3),
        "table_bytes": stats["bytes"],
        "rss_bytes": ours["rss_bytes"],
    }
    if naive:
        result.update(
            naive_pull_keys_per_s=round(naive["uniform_pull"]),
            naive_push_keys_per_s=round(naive["uniform_push"]),
            naive_zipf_pull_keys_per_s=round(naive["zipf_pull"]),
            naive_zipf_push_keys_per_s=round(naive["zipf_push"]),
            pull_speedup=round(ours["uniform_pull"] / naive["uniform_pull"], 2),
            push_speedup=round(ours["uniform_push"] / naive["uniform_push"], 2),
            zipf_pull_speedup=round(ours["zipf_pull"] / naive["zipf_pull"], 2),
            zipf_push_speedup=round(ours["zipf_push"] / naive["zipf_push"], 2),
            naive_bytes_per_row=round(naive_bytes / args.rows, 1),
            naive_rss_bytes=naive["rss_bytes"],
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
