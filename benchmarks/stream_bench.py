"""Training that never stops: following partitions, fresh in serving, exactly
once across kills, memory flat.

Synthetic Criteo-shaped hourly partitions (``dt=YYYY-MM-DD/hour=HH``, each
``--rows`` rows of ``wuliang.reader.datagen``: C1…C26 keys, I1…I13, a label;
a fifth of each field's keys new in each hour, so tables grow unless
eviction bounds them; a ``row_key`` column names each row). The model: 26
tables of dim 16 (Adagrad), the 13 dense features, a 256-128 MLP. Four
measurements, all in one run:

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
* ``duplicated_rows`` / ``skipped_rows``: trainers follow the partitions as
  they land (one every ``--interval`` s), checkpointing every
  ``--checkpoint-steps`` steps, and are SIGKILLed ``--kills`` times at random
  moments and started again: a trainer process alone (embedded), and a
  ``wuliang launch`` job of 2 servers, a chief and a worker, any of them
  killed (``cluster_``). The model counts the rows it trained: ``row_key``
  is a sparse feature of its own 1-wide table whose rows the tower reads
  (times 0), so each row's ``count`` is the number of updates the final
  model holds of it: every row must have exactly 1.
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
ROW_KEY = "row_key"


# -- data --------------------------------------------------------------------------------


def row_keys(k: int, rows: int) -> np.ndarray:
    """The keys naming partition k's rows."""
    return (np.uint64(k) << np.uint64(32)) | np.arange(rows, dtype=np.uint64)


def partition_name(k: int) -> str:
    when = START + dt.timedelta(hours=k)
    return f"dt={when:%Y-%m-%d}/hour={when:%H}"


def write_partition(
    root: Path, k: int, rows: int, seed: int = 0, fresh: float = 0.2, files: int = 1
) -> Path:
    """Partition ``k`` (the k-th hour): its ``files`` files, then its marker."""
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
    columns[ROW_KEY] = pa.array(row_keys(k, rows), pa.uint64())
    folder = root / partition_name(k)
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table(columns)
    step = -(-rows // files)
    for i in range(files):
        part = table.slice(i * step, step)
        pq.write_table(part, folder / f"part-{i}.parquet", row_group_size=8192)
    (folder / "_SUCCESS").touch()
    return folder


class Producer(threading.Thread):
    """Lands partitions ``first``… one every ``interval`` seconds; ``landed``:
    each one's marker time."""

    def __init__(
        self, root: Path, first: int, count: int, rows: int, interval: float, files: int = 1
    ) -> None:
        super().__init__(name="producer", daemon=True)
        self.root, self.first, self.count, self.rows = root, first, count, rows
        self.interval, self.files = interval, files
        self.landed: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        for k in range(self.first, self.first + self.count):
            if self.stop.is_set():
                return
            write_partition(self.root, k, self.rows, files=self.files)
            self.landed[partition_name(k)] = time.time()
            self.stop.wait(self.interval)


# -- the model -----------------------------------------------------------------------------


def make_session(
    hooks: Sequence[Any] = (), ttl: int = 0, count_rows: bool = False, context: Any = None
) -> Any:
    """The model; ``count_rows``: with the ``row_key`` table that counts
    the rows trained."""
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
    features += [wl.DenseFeature(name) for name in DENSE]
    if count_rows:
        counter = wl.EmbeddingTable(ROW_KEY, 1, optimizer=wl.optimizers.SGD(1e-6))
        features.append(wl.SparseFeature(ROW_KEY, counter))
    mlp = keras.Sequential(
        [
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(1),
        ]
    )

    def tower(embeddings: dict, dense: dict) -> Any:
        inputs = [embeddings[n] for n in SINGLE] + [dense[n] for n in DENSE]
        logits = mlp(wl.embedding.concat(inputs))
        return logits + 0.0 * embeddings[ROW_KEY] if count_rows else logits

    return wl.Session(
        tower,
        features,
        context if context is not None else wl.Context(),
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
    cpu_us: dict[str, list[float]] = {"follow": [], "batch": []}
    for r in range(-1, 2 * rounds):  # -1: a warm-up (TensorFlow's tracing), not counted
        kind = ("follow", "batch")[(r + r // 2) % 2]  # follow, batch, batch, follow, ...
        if kind == "follow":
            session = make_session([wl.hooks.ProgressiveValidation()])
            reader = stream(root, timeout=0)
        else:
            session = make_session()
            reader = ParquetReader(files, BATCH, label="label", epochs=1)
        cpu = time.process_time()
        try:
            result = session.train(reader)
        finally:
            close(session)
        assert result["samples"] == partitions * rows, result
        if r >= 0:
            rates[kind].append(result["samples_per_s"])
            cpu_us[kind].append((time.process_time() - cpu) / result["samples"] * 1e6)
    follow, batch = statistics.median(rates["follow"]), statistics.median(rates["batch"])
    return {
        "follow_vs_batch": follow / batch,
        "follow_samples_per_s": follow,
        "batch_samples_per_s": batch,
        "rounds_samples_per_s": rates,
        # CPU time per sample, all threads (steadier than rates on a shared VM)
        "follow_vs_batch_cpu": statistics.median(cpu_us["batch"])
        / statistics.median(cpu_us["follow"]),
        "cpu_us_per_sample": {k: statistics.median(v) for k, v in cpu_us.items()},
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

context = wl.Context()  # a trainer of the job in TF_CONFIG, else embedded
job = context.job
checkpoint = wl.hooks.Checkpoint({model!r}, every_steps={every})
session = sb.make_session([checkpoint], count_rows=True, context=context)
print("started", flush=True)
session.train(sb.stream(sb.Path({root!r}), timeout={idle}, poll_s=0.2))
if job is not None:
    job.finish()
    if not job.is_chief:
        session.close()
        context.close()
        sys.exit(0)
    job.wait_finished(timeout=600)
session.close()  # the last checkpoint
chunks = list(context.ps.export(sb.ROW_KEY))
keys = np.concatenate([c.keys for c in chunks])
counts = np.concatenate([c.counts for c in chunks]).astype(np.uint64)
np.save({out!r}, np.stack([keys, counts]))
context.close()
print("done", flush=True)
"""


def count_rows(out: Path, partitions: int, rows: int) -> dict[str, int]:
    """Rows the final model trained more than once, and not at all."""
    keys, counts = np.load(out)
    expected = np.concatenate([row_keys(k, rows) for k in range(partitions)])
    counted = dict(zip(keys.tolist(), counts.tolist(), strict=True))
    duplicated = sum(c - 1 for c in counted.values() if c > 1)
    skipped = sum(1 for key in expected.tolist() if counted.get(key, 0) == 0)
    return {"duplicated_rows": int(duplicated), "skipped_rows": skipped, "rows": len(expected)}


def trainer_script(work: Path, name: str, every: int, interval: float) -> tuple[Path, Path]:
    """The trainer of a kill run, and the file its final counts go to."""
    root, model, out = work / name, work / f"{name}-model", work / f"{name}-counts.npy"
    fresh(root, model, out)
    here = str(Path(__file__).resolve().parent)
    fields = {"here": here, "model": str(model), "every": every, "out": str(out)}
    script = work / f"{name}_trainer.py"
    script.write_text(TRAINER.format(root=str(root), idle=max(10.0, 5 * interval), **fields))
    return script, out


def kills(work: Path, partitions: int, rows: int, interval: float, n: int, every: int) -> Any:
    """One trainer process following landing partitions, SIGKILLed ``n``
    times at random moments and started again."""
    script, out = trainer_script(work, "kill", every, interval)
    producer = Producer(work / "kill", 0, partitions, rows, interval)
    producer.start()
    rng = random.Random(7)
    killed = 0
    for run in range(n + 1):
        errors = work / f"kill-run-{run}.log"
        with errors.open("w") as err:
            command = [sys.executable, str(script)]
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        if not proc.stdout.readline().startswith("started"):
            proc.kill()
            raise RuntimeError(f"run {run} did not start: {errors.read_text()[-3000:]}")
        if run < n:
            time.sleep(rng.uniform(1.0, 2.5 * interval))
            if proc.poll() is not None:
                raise RuntimeError(f"run {run} failed: {errors.read_text()[-3000:]}")
            proc.kill()
            killed += 1
        code = proc.wait(timeout=600)
        proc.stdout.close()
        if run == n and code != 0:
            raise RuntimeError(f"the last run failed: {errors.read_text()[-3000:]}")
    producer.join()
    counted = count_rows(out, partitions, rows)
    return {
        "duplicated_rows": counted["duplicated_rows"],
        "skipped_rows": counted["skipped_rows"],
        "kills": killed,
        "kill_rows": counted["rows"],
    }


def cluster_kills(
    work: Path,
    partitions: int,
    rows: int,
    interval: float,
    n: int,
    every: int,
    recovery: str,
    workers: int = 1,
    roles: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A ``wuliang launch --recovery RECOVERY`` job (2 servers, a chief and
    ``workers`` workers) following landing partitions; ``n`` SIGKILLs at
    random moments, of random roles (or of ``roles``, in turn)."""
    script, out = trainer_script(work, "cluster", every, interval)
    model = work / "cluster-model"
    command = [sys.executable, "-m", "wuliang", "launch", "--ps", "2", "--workers", str(workers)]
    command += ["--model-dir", str(model), "--recovery", recovery]
    command += ["--", sys.executable, str(script)]
    log = work / "cluster-launch.log"
    pids: dict[str, int] = {}
    lines: list[str] = []
    with log.open("w") as err:
        launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)

    def follow() -> None:
        assert launch.stdout is not None
        for line in launch.stdout:
            lines.append(line.rstrip())
            found = re.match(r"\[launch\] started (\S+) \(pid (\d+)\)", line)
            if found:
                pids[found[1]] = int(found[2])

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    last = f"[worker-{workers - 1}]" if workers else "[chief-0]"
    while not any(line.split("] ")[-1] == "started" for line in lines if last in line):
        if time.monotonic() > deadline or launch.poll() is not None:
            launch.kill()
            raise RuntimeError("the job did not start:\n" + "\n".join(lines[-30:]))
        time.sleep(0.2)
    producer = Producer(work / "cluster", 0, partitions, rows, interval, files=2)
    producer.start()
    rng = random.Random(11)
    killed: list[str] = []
    for _ in range(n):
        time.sleep(rng.uniform(2.0, 3.0 * interval))
        role = rng.choice(sorted(pids)) if roles is None else roles[len(killed) % len(roles)]
        try:
            os.kill(pids[role], signal.SIGKILL)
            killed.append(role)
        except ProcessLookupError:
            pass
    producer.join()
    code = launch.wait(timeout=900)
    reader.join(timeout=10)
    assert launch.stdout is not None
    launch.stdout.close()
    (work / "cluster-job.log").write_text("\n".join(lines) + "\n")
    if code != 0:
        raise RuntimeError(f"the job ended with {code}:\n" + "\n".join(lines[-40:]))
    counted = count_rows(out, partitions, rows)
    name = f"cluster_{recovery}" + ("" if workers else "_one_trainer")
    return {
        f"{name}_duplicated_rows": counted["duplicated_rows"],
        f"{name}_skipped_rows": counted["skipped_rows"],
        f"{name}_kills": killed,
        "cluster_rows": counted["rows"],
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
    context = wl.Context(evict_every_steps=20)
    session = make_session([progressive, exports, checkpoint], ttl=12 * HOUR, context=context)
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
    p.add_argument("--only", nargs="+", choices=["follow", "fresh", "kills", "cluster", "memory"])
    p.add_argument("--work-dir", type=Path, default=None)
    args = p.parse_args(argv)
    quick = args.quick
    rows = args.rows or (8192 if quick else 16384)
    partitions = args.partitions or (16 if quick else 32)
    rounds = args.rounds or (3 if quick else 5)
    interval = args.interval or (3.0 if quick else 4.0)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="stream-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ["follow", "fresh", "kills", "cluster", "memory"])
    result: dict[str, Any] = {"quick": quick, "rows_per_partition": rows, "batch": BATCH}
    try:
        if "follow" in only:
            result |= follow_vs_batch(work, partitions, rows, rounds)
        if "fresh" in only:
            result |= freshness_after_landing(work, 8 if quick else 20, rows, interval)
        if "kills" in only:
            result |= kills(work, 10 if quick else 20, rows // 2, interval, args.kills,
                            args.checkpoint_steps)  # fmt: skip
        if "cluster" in only:
            for recovery, workers in (("full", 0), ("full", 1), ("partial", 1)):
                result |= cluster_kills(work, 10 if quick else 20, rows // 2, interval,
                                        args.kills, args.checkpoint_steps, recovery,
                                        workers)  # fmt: skip
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
