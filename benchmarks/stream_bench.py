"""Training that never stops: following partitions, fresh in serving, exactly
once across kills, memory flat.

Synthetic Criteo-shaped hourly partitions (``dt=YYYY-MM-DD/hour=HH``, each
``--rows`` rows of ``wuliang.reader.datagen``: C1…C26 keys, I1…I13, a label;
a fifth of each field's keys new in each hour, so tables grow unless
eviction bounds them; a ``row_id`` column, read as a dense feature the tower
ignores, names each row). The model: 26 tables of dim 16 (Adagrad), the 13
dense features, a 256-128 MLP. Four measurements, all in one run:

* ``follow_vs_batch``: samples/s of ``Session.train`` following the
  partitions (``StreamReader`` over a ``PartitionSource``, every partition
  already landed, with ``ProgressiveValidation``) against the same files read
  as one fixed dataset (``ParquetReader`` over them in the same order), same
  model and batches; the two alternate (ABAB…, ``--rounds`` each), a fresh
  session each run, and the ratio is of the medians.
* ``freshness_overhead_p99_s``: a producer lands a partition every
  ``--interval`` s; the trainer follows (``PartitionSource`` at its default
  polling), exports a delta after each partition
  (``IncrementalExport(every_partition=True)``); ``wuliang serve`` (its
  defaults) follows the export folder; a client asks it for a lookup every
  20 ms. Per partition: the first answer computed with a version that
  includes it, minus the partition's marker time, minus the partition's own
  training time (``ProgressiveValidation``'s ``started``/``finished``).
* ``duplicated_rows`` / ``skipped_rows``: a trainer process follows the
  partitions as they land (one every ``--interval`` s), checkpointing every
  ``--checkpoint-steps`` steps, and is SIGKILLed ``--kills`` times at random
  moments and started again; each run logs the row ids of every step it
  trains. A run's steps at or after the step the next run restored are not
  in the model (it went back to the checkpoint), so the rows the final model
  trained are the other runs' logged steps: each row must appear once.
* ``rss_growth_200_vs_20``: one trainer follows ``--rss-partitions``
  partitions (progressive validation, a delta export after each partition,
  a full one every 8, pruned to 16 versions, a checkpoint every 30 s keeping
  2, and ``TTL(seconds=12 h)`` on data time, so the tables are at their
  bound by the 20th hour): its RSS after the last partition over its RSS
  after the 20th, with the tables' rows at both.

The last line is one JSON object with those keys and the figures behind them::

    .venv/bin/python benchmarks/stream_bench.py --quick
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wuliang.reader.datagen import DENSE, SINGLE, DatagenConfig, generate_table
from wuliang.reader.hashing import hash_ints

HOUR = 3600
START = dt.datetime(2026, 1, 1)
DIM = 16
BATCH = 512
ROW_ID = "row_id"


# -- data --------------------------------------------------------------------------------


def partition_name(k: int) -> str:
    when = START + dt.timedelta(hours=k)
    return f"dt={when:%Y-%m-%d}/hour={when:%H}"


def write_partition(root: Path, k: int, rows: int, seed: int = 0, fresh: float = 0.2) -> Path:
    """Partition ``k`` (the k-th hour): its file, then its marker."""
    rng = np.random.default_rng([seed, k])
    cfg = DatagenConfig(rows, seed=seed, mean_length=0.0)
    table = generate_table(cfg, rows, rng).select([*SINGLE, *DENSE, "label"])
    columns = {name: table.column(name) for name in table.column_names}
    new = rng.random(rows) < fresh  # keys first seen in this hour
    for name in SINGLE:
        keys = table.column(name).to_numpy().copy()
        ids = np.arange(rows, dtype=np.int64) + (k << 32)
        keys[new] = hash_ints(ids[new], f"fresh-{name}")
        columns[name] = pa.array(keys, pa.uint64())
    columns[ROW_ID] = pa.array(np.arange(rows, dtype=np.float32))
    folder = root / partition_name(k)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), folder / "part-0.parquet", row_group_size=8192)
    (folder / "_SUCCESS").touch()
    return folder


class Producer(threading.Thread):
    """Lands partitions ``first``… one every ``interval`` seconds; ``landed``:
    each one's marker time."""

    def __init__(self, root: Path, first: int, count: int, rows: int, interval: float) -> None:
        super().__init__(name="producer", daemon=True)
        self.root, self.first, self.count, self.rows = root, first, count, rows
        self.interval = interval
        self.landed: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        for k in range(self.first, self.first + self.count):
            if self.stop.is_set():
                return
            write_partition(self.root, k, self.rows)
            self.landed[partition_name(k)] = time.time()
            self.stop.wait(self.interval)


# -- the model -----------------------------------------------------------------------------


def make_session(hooks: Sequence[Any] = (), ttl: int = 0, **context: Any) -> Any:
    import keras

    import wuliang as wl

    keras.utils.set_random_seed(1)
    eviction = {"eviction": wl.eviction.TTL(seconds=ttl)} if ttl else {}
    features: list[Any] = [
        wl.SparseFeature(
            name, wl.EmbeddingTable(name, DIM, optimizer=wl.optimizers.Adagrad(0.05), **eviction)
        )
        for name in SINGLE
    ]
    features += [wl.DenseFeature(name) for name in [*DENSE, ROW_ID]]
    mlp = keras.Sequential(
        [
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(1),
        ]
    )

    def tower(embeddings: dict, dense: dict) -> Any:  # row_id is not an input
        inputs = [embeddings[n] for n in SINGLE] + [dense[n] for n in DENSE]
        return mlp(wl.embedding.concat(inputs))

    return wl.Session(
        tower,
        features,
        wl.Context(**context),
        hooks=list(hooks),
        optimizer=keras.optimizers.Adagrad(0.01),
    )


def stream(root: Path, timeout: float | None, **source: Any) -> Any:
    from wuliang.reader import PartitionSource, StreamReader

    return StreamReader(PartitionSource(root, **source), BATCH, label="label", timeout=timeout)


def fresh(*paths: Path) -> None:
    """Removes what an earlier run left (``--work-dir``)."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def close(session: Any) -> None:
    session.close()
    session.context.close()


# -- follow vs batch ---------------------------------------------------------------------


def follow_vs_batch(work: Path, partitions: int, rows: int, rounds: int) -> dict[str, Any]:
    import wuliang as wl
    from wuliang.reader import ParquetReader

    root = work / "follow"
    fresh(root)
    for k in range(partitions):
        write_partition(root, k, rows)
    files = [str(root / partition_name(k) / "part-0.parquet") for k in range(partitions)]
    rates: dict[str, list[float]] = {"follow": [], "batch": []}
    for r in range(-1, 2 * rounds):  # -1: a warm-up (TensorFlow's tracing), not counted
        kind = ("follow", "batch")[(r + r // 2) % 2]  # follow, batch, batch, follow, ...
        if kind == "follow":
            session = make_session([wl.hooks.ProgressiveValidation()])
            reader = stream(root, timeout=0)
        else:
            session = make_session()
            reader = ParquetReader(files, BATCH, label="label", epochs=1)
        try:
            result = session.train(reader)
        finally:
            close(session)
        assert result["samples"] == partitions * rows, result
        if r >= 0:
            rates[kind].append(result["samples_per_s"])
    follow, batch = statistics.median(rates["follow"]), statistics.median(rates["batch"])
    return {
        "follow_vs_batch": follow / batch,
        "follow_samples_per_s": follow,
        "batch_samples_per_s": batch,
        "rounds_samples_per_s": rates,
    }


# -- freshness -----------------------------------------------------------------------------


class Served(threading.Thread):
    """Asks ``wuliang serve`` for a lookup every 20 ms: the first time each
    model version answered."""

    def __init__(self, url: str) -> None:
        super().__init__(name="served", daemon=True)
        self.url = url
        self.first: dict[int, float] = {}
        self.failed: Counter[str] = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        body = json.dumps({"keys": [1, 2, 3]}).encode()
        while not self.stop.wait(0.02):
            try:
                with urllib.request.urlopen(self.url, body, timeout=5) as answer:
                    version = int(json.loads(answer.read())["model_version"])
                self.first.setdefault(version, time.time())
            except OSError as error:  # no version yet, or refused
                self.failed[type(error).__name__] += 1

    def answered(self, version: int) -> float | None:
        times = [t for v, t in list(self.first.items()) if v >= version]
        return min(times) if times else None


def start_server(export_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "wuliang", "serve", "--exports", str(export_dir)]
    command += ["--model", "m", "--port", "0", "--http-port", "0"]
    with log.open("w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    match = re.search(r"http ([\d.]+):(\d+)", banner)
    if match is None:
        proc.kill()
        raise RuntimeError(f"wuliang serve did not start: {log.read_text()[-2000:]}")
    return proc, f"http://{match[1]}:{match[2]}/v1/models/m/tables/{SINGLE[0]}:lookup"


def freshness_after_landing(
    work: Path, partitions: int, rows: int, interval: float
) -> dict[str, Any]:
    import wuliang as wl

    root, export_dir = work / "fresh", work / "fresh-exports"
    fresh(root, export_dir)
    write_partition(root, 0, rows)  # the server starts from a first version
    progressive = wl.hooks.ProgressiveValidation()
    exports = wl.hooks.IncrementalExport(export_dir, every_partition=True, keep_versions=16)
    session = make_session([progressive, exports])
    reader = stream(root, timeout=max(30.0, 4 * interval))  # at the default polling
    producer = Producer(root, 1, partitions, rows, interval)
    served = server = None
    trainer = threading.Thread(target=session.train, args=(reader,), daemon=True)
    try:
        trainer.start()
        deadline = time.monotonic() + 120
        while not (export_dir / "LATEST").exists():
            if time.monotonic() > deadline or not trainer.is_alive():
                raise RuntimeError("no first export")
            time.sleep(0.05)
        server, url = start_server(export_dir, work / "serve.log")
        served = Served(url)
        served.start()
        while not served.first:
            time.sleep(0.05)
        producer.start()
        producer.join()
        trainer.join(timeout=600)
        time.sleep(3)  # the last version reaches the server
    finally:
        producer.stop.set()
        reader.stop()
        trainer.join(timeout=60)
        close(session)
        if served is not None:
            served.stop.set()
            served.join(timeout=10)
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
            assert server.stdout is not None
            server.stdout.close()
    overheads, totals, missing = [], [], []
    records = {r["partition"]: r for r in progressive.records}
    for name, landed in producer.landed.items():
        version = exports.after_partition.get(name)
        answered = None if version is None or served is None else served.answered(version)
        record = records.get(name)
        if answered is None or record is None:
            missing.append(name)
            continue
        totals.append(answered - landed)
        overheads.append(answered - landed - (record["finished"] - record["started"]))
    if not overheads:
        raise RuntimeError(f"no partition was served: {missing}")
    return {
        "freshness_overhead_p99_s": float(np.percentile(overheads, 99)),
        "freshness_overhead_p50_s": float(np.median(overheads)),
        "freshness_p99_s": float(np.percentile(totals, 99)),
        "freshness_partitions": len(overheads),
        "freshness_not_served": missing,
        "lookups_failed_by_kind": dict(served.failed) if served is not None else {},
        "train_s_per_partition": statistics.median(
            r["finished"] - r["started"] for r in progressive.records
        ),
    }


# -- exactly once across kills --------------------------------------------------------------

TRAINER = """
import sys
sys.path.insert(0, {here!r})
import numpy as np
import stream_bench as sb
import wuliang as wl

class RowLog(wl.hooks.SessionRunHook):
    # the rows of every step, written before a checkpoint can include it
    def __init__(self, path, run):
        self.out = open(path, "a")
        self.run = run

    def after_create_session(self, session):
        print("restored", session.global_step, flush=True)

    def after_run(self, run_context, run_values):
        batch = run_context.batch
        ids = batch.dense_feature(sb.ROW_ID).astype(np.int64).ravel().tolist()
        line = f"{{self.run}} {{run_context.step}} {{batch.partition.name}} "
        self.out.write(line + " ".join(map(str, ids)) + "\\n")
        self.out.flush()

run = int(sys.argv[1])
checkpoint = wl.hooks.Checkpoint({model!r}, every_steps={every})
session = sb.make_session([RowLog({log!r}, run), checkpoint])
session.train(sb.stream(sb.Path({root!r}), timeout={idle}, poll_s=0.2))
session.close()
print("done", session.global_step, flush=True)
"""


def kills(work: Path, partitions: int, rows: int, interval: float, n: int, every: int) -> Any:
    """Trains following landing partitions, SIGKILLed ``n`` times at random
    moments; the rows in the final model counted from the runs' logs."""
    root, model, log = work / "kill", work / "kill-model", work / "rows.log"
    fresh(root, model, log)
    script = work / "kill_trainer.py"
    here = str(Path(__file__).resolve().parent)
    idle = max(20.0, 5 * interval)
    fields = {"here": here, "model": str(model), "every": every, "log": str(log)}
    script.write_text(TRAINER.format(root=str(root), idle=idle, **fields))
    producer = Producer(root, 0, partitions, rows, interval)
    producer.start()
    rng = random.Random(7)
    starts: list[int] = []  # the step each run restored
    killed = 0
    final_step = None
    for run in range(n + 1):
        errors = work / f"kill-run-{run}.log"
        with errors.open("w") as err:
            command = [sys.executable, str(script), str(run)]
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("restored"):
            proc.kill()
            raise RuntimeError(f"run {run} did not start: {errors.read_text()[-3000:]}")
        starts.append(int(line.split()[1]))
        if run < n:
            time.sleep(rng.uniform(1.0, 2.5 * interval))
            if proc.poll() is not None:
                raise RuntimeError(f"run {run} failed: {errors.read_text()[-3000:]}")
            proc.kill()
            killed += 1
        else:
            for rest in proc.stdout:
                if rest.startswith("done"):
                    final_step = int(rest.split()[1])
        code = proc.wait(timeout=600)
        proc.stdout.close()
        if run == n and code != 0:
            raise RuntimeError(f"the last run failed: {errors.read_text()[-3000:]}")
    producer.join()
    trained: Counter[tuple[str, int]] = Counter()
    for text in log.read_text().splitlines():
        run_text, step_text, name, *ids = text.split()
        run, step = int(run_text), int(step_text)
        if run + 1 < len(starts) and step >= starts[run + 1]:
            continue  # undone: the next run went back to a checkpoint before it
        for i in ids:
            trained[(name, int(i))] += 1
    expected = {(partition_name(k), i) for k in range(partitions) for i in range(rows)}
    duplicated = sum(c - 1 for c in trained.values() if c > 1)
    skipped = len(expected - set(trained))
    return {
        "duplicated_rows": duplicated,
        "skipped_rows": skipped,
        "kills": killed,
        "kill_runs_restored_at": starts,
        "kill_final_step": final_step,
        "kill_rows": len(expected),
    }


# -- memory over many partitions ----------------------------------------------------------


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def memory(work: Path, partitions: int, rows: int) -> dict[str, Any]:
    import wuliang as wl

    root = work / "memory"
    fresh(root, *(work / f"memory-{what}" for what in ("exports", "model")), work / "memory.jsonl")
    for k in range(partitions):
        write_partition(root, k, rows)
    at: dict[int, tuple[float, int, int]] = {}  # partitions -> RSS MB, rows, log entries

    class Sample(wl.hooks.ProgressiveValidation):
        def _finish(self, partition: Any, step: int) -> None:
            super()._finish(partition, step)
            done = len(at) + 1
            stats = session.context.ps.stats().values()
            logs = sum(s["change_log"] + s["removed_log"] for s in stats)
            at[done] = (rss_mb(), sum(s["rows"] for s in stats), logs)

    progressive = Sample(jsonl=work / "memory.jsonl", keep=50)
    exports = wl.hooks.IncrementalExport(
        work / "memory-exports", every_partition=True, keep_versions=16, full_every=8
    )
    checkpoint = wl.hooks.Checkpoint(work / "memory-model", every_secs=30, keep=2)
    session = make_session([progressive, exports, checkpoint], ttl=12 * HOUR, evict_every_steps=20)
    try:
        session.train(stream(root, timeout=0))
    finally:
        close(session)
    early = min(20, partitions)
    return {
        "rss_growth_200_vs_20": at[partitions][0] / at[early][0],
        "rss_mb_at": {str(early): at[early][0], str(partitions): at[partitions][0]},
        "table_rows_at": {str(early): at[early][1], str(partitions): at[partitions][1]},
        "log_entries_at": {str(early): at[early][2], str(partitions): at[partitions][2]},
        "rss_partitions": partitions,
    }


# -- main -----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes: a few minutes")
    p.add_argument("--rows", type=int, default=None, help="rows per partition")
    p.add_argument("--partitions", type=int, default=None, help="for follow_vs_batch")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--interval", type=float, default=None, help="s between landings")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--checkpoint-steps", type=int, default=10)
    p.add_argument("--rss-partitions", type=int, default=200)
    p.add_argument("--only", nargs="+", choices=["follow", "fresh", "kills", "memory"])
    p.add_argument("--work-dir", type=Path, default=None)
    args = p.parse_args(argv)
    quick = args.quick
    rows = args.rows or (8192 if quick else 16384)
    partitions = args.partitions or (16 if quick else 32)
    rounds = args.rounds or 3
    interval = args.interval or (3.0 if quick else 4.0)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="stream-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ["follow", "fresh", "kills", "memory"])
    result: dict[str, Any] = {"quick": quick, "rows_per_partition": rows, "batch": BATCH}
    try:
        if "follow" in only:
            result |= follow_vs_batch(work, partitions, rows, rounds)
        if "fresh" in only:
            result |= freshness_after_landing(work, 8 if quick else 20, rows, interval)
        if "kills" in only:
            result |= kills(work, 10 if quick else 20, rows // 2, interval, args.kills,
                            args.checkpoint_steps)  # fmt: skip
        if "memory" in only:
            result |= memory(work, args.rss_partitions, 1024 if quick else 2048)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
