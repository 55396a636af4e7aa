"""Training that never stops: MovieLens landing week by week, followed, scored, served.

What this example shows, on one machine, as production runs it on several:

1. A **producer** (a thread here; an ETL job in production) writes MovieLens
   as weekly Hive partitions, ``WORK/landing/dt=YYYY-MM-DD/part-0.parquet``
   (the week's ratings, in time order), each completed by its ``_SUCCESS``
   marker, one every ``--interval`` seconds: years of clicks replayed
   faster than real time.
2. A **trainer** follows them (``PartitionSource`` + ``StreamReader``): each
   complete partition is trained once, oldest first, waiting for the next.
   ``ProgressiveValidation`` scores every partition with the model trained
   through the ones before it, before training on it (AUC, log loss,
   calibration to ``WORK/progressive.jsonl``); ``IncrementalExport(
   every_partition=True)`` writes a delta of the rows each partition changed
   to ``WORK/exports``; ``Checkpoint`` saves into ``WORK/model`` (the reader's
   position with it, so a restart resumes exactly: run the script again with
   ``--resume`` after stopping it). SIGTERM finishes the step, checkpoints,
   and the script exits 0.
3. A **server** (``wuliang serve`` on free loopback ports) follows
   ``WORK/exports`` and applies each delta while serving. The script asks it
   which version it serves, and prints for each partition how fresh the
   served model was: seconds from the partition's marker to the first answer
   from a version that includes it.

The last line printed is one JSON object: partitions, examples,
progressive_auc (the mean over partitions), progressive_auc_last,
freshness_p50_s / freshness_max_s, versions_exported and served_version::

    .venv/bin/python examples/streaming.py --weeks 12 --interval 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from movielens import DEFAULT_DATA, FEATURES, LABEL, Server, convert, make_tower

REPO = Path(__file__).resolve().parents[1]
WEEK_S = 7 * 86_400
MONDAY = 4 * 86_400  # the unix epoch was a Thursday


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MovieLens CSV directory")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "streaming")
    p.add_argument("--weeks", type=int, default=40, help="weekly partitions to land")
    p.add_argument("--min-week-ratings", type=int, default=100, help="smaller weeks are merged")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between two partitions")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--gate-auc-drop",
        type=float,
        default=None,
        help="hold a week's export when its progressive AUC is this far below the trailing mean",
    )
    p.add_argument("--resume", action="store_true", help="keep WORK/model and WORK/landing")
    p.add_argument("--no-serve", action="store_true", help="train and export only")
    return p.parse_args(argv)


# -- the producer ------------------------------------------------------------------


def weekly(days: Sequence[Path], weeks: int, min_rows: int) -> list[tuple[str, pa.Table]]:
    """The first ``weeks`` weekly partitions: (``dt=`` the Monday of the
    week, its ratings in time order); a week of fewer than ``min_rows``
    ratings is merged into the next (under the later week's name)."""
    ratings = pa.concat_tables(pq.read_table(path) for path in days)
    week = (ratings.column("timestamp").to_numpy() - MONDAY) // WEEK_S
    bounds = np.flatnonzero(np.diff(week)) + 1  # the first row of each week after the first
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(week)]])
    out: list[tuple[str, pa.Table]] = []
    first = 0
    for begin, end in zip(starts, ends, strict=True):
        if end - first < min_rows and end < len(week):
            continue  # a small week joins the next
        monday = dt.datetime.fromtimestamp(int(week[begin]) * WEEK_S + MONDAY, dt.timezone.utc)
        out.append((f"dt={monday:%Y-%m-%d}", ratings.slice(first, end - first)))
        first = end
        if len(out) == weeks:
            break
    return out


class Producer(threading.Thread):
    """Lands one partition every ``interval`` seconds: its data file, then
    its marker (the time a partition landed is its marker's)."""

    def __init__(self, root: Path, partitions: list[tuple[str, pa.Table]], interval: float):
        super().__init__(name="producer", daemon=True)
        self.root, self.partitions, self.interval = root, partitions, interval
        self.landed: dict[str, float] = {}  # partition -> time.time() of its marker

    def run(self) -> None:
        for name, table in self.partitions:
            folder = self.root / name
            if (folder / "_SUCCESS").exists():  # landed in an earlier run (--resume)
                continue
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, folder / "part-0.parquet")
            (folder / "_SUCCESS").touch()
            self.landed[name] = time.time()
            time.sleep(self.interval)


# -- the server ----------------------------------------------------------------------


class Serving(threading.Thread):
    """Starts ``wuliang serve`` once the first version is exported, then asks
    it every 50 ms which version it serves: when each was first served."""

    def __init__(self, export_dir: Path, work: Path) -> None:
        super().__init__(name="serving", daemon=True)
        self.export_dir, self.work = export_dir, work
        self.server: Server | None = None
        self.first_served: dict[int, float] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not (self.export_dir / "LATEST").exists():
                if self.stop.wait(0.05):
                    return
            self.server = Server(self.export_dir, "movielens", cwd=self.work)
            while not self.stop.wait(0.05):
                self.first_served.setdefault(self.server.version(), time.time())
        except BaseException as e:  # reported by the main thread
            self.error = e

    def served_by(self, version: int, timeout: float = 30.0) -> float | None:
        """When a version >= ``version`` was first served, waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.error is None:
            times = [t for v, t in list(self.first_served.items()) if v >= version]
            if times:
                return min(times)
            time.sleep(0.05)
        return None

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=60)
        if self.server is not None:
            self.server.stop()


# -- the trainer ---------------------------------------------------------------------


def make_session(args: argparse.Namespace, hooks: list[Any]) -> Any:
    import keras

    import wuliang as wl

    keras.utils.set_random_seed(args.seed)
    tables = {
        table: wl.EmbeddingTable(table, dim=args.dim, seed=args.seed)
        for table, _ in FEATURES.values()
    }
    features = [
        wl.SparseFeature(name, tables[table], combiner=combiner)
        for name, (table, combiner) in FEATURES.items()
    ]
    return wl.Session(make_tower([64, 32]), features, hooks=hooks)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    import wuliang as wl
    from wuliang.reader import PartitionSource, StreamReader

    args = parse_args(argv)
    work: Path = args.work_dir
    landing, model_dir, export_dir = work / "landing", work / "model", work / "exports"
    jsonl = work / "progressive.jsonl"
    if not args.resume:  # the example's own scratch: start clean
        for folder in (landing, model_dir, export_dir):
            shutil.rmtree(folder, ignore_errors=True)
        jsonl.unlink(missing_ok=True)
    partitions = weekly(convert(args.data, work), args.weeks, args.min_week_ratings)
    rows = sum(t.num_rows for _, t in partitions)
    print(f"producer: {len(partitions)} weekly partitions of {rows} ratings into {landing}")
    producer = Producer(landing, partitions, args.interval)

    progressive = wl.hooks.ProgressiveValidation(jsonl=jsonl, gate_auc_drop=args.gate_auc_drop)
    exports = wl.hooks.IncrementalExport(export_dir, every_partition=True, gate=progressive)
    checkpoint = wl.hooks.Checkpoint(model_dir, every_secs=60, keep=3)
    session = make_session(args, [progressive, exports, checkpoint])
    # A trainer waits for ever (timeout=None); this one ends once no partition
    # has landed for a while.
    source = PartitionSource(landing, poll_s=0.1)
    idle = max(5.0, 3 * args.interval)
    reader = StreamReader(source, args.batch_size, list(FEATURES), LABEL, timeout=idle)
    serving = None if args.no_serve else Serving(export_dir, work)
    producer.start()
    if serving is not None:
        serving.start()
    try:
        trained = session.train(reader)
        session.close()  # the last checkpoint
        if session.stopped_by:
            print(f"{session.stopped_by}: stopped after step {session.global_step}, checkpointed")
        fresh: dict[str, float] = {}
        print("partition       examples  progressive AUC  log loss  version  fresh (s)")
        for record in progressive.records:
            name = record["partition"]
            version = exports.after_partition.get(name)
            served = None
            if serving is not None and version is not None and name in producer.landed:
                served = serving.served_by(version)
            if served is not None:
                fresh[name] = served - producer.landed[name]
            print(
                f"{name:15} {record['examples']:8d}  {record['auc']:15.4f}  "
                f"{record['logloss']:8.4f}  {version!s:>7}  "
                f"{fresh.get(name, float('nan')):9.2f}"
            )
    finally:
        session.context.close()
        if serving is not None:
            serving.close()
    if serving is not None and serving.error is not None:
        raise SystemExit(f"serving failed: {serving.error}")
    aucs = [r["auc"] for r in progressive.records if not np.isnan(r["auc"])]
    freshness = list(fresh.values())
    result = {
        "partitions": len(progressive.records),
        "examples": trained["samples"],
        "progressive_auc": float(np.mean(aucs)) if aucs else None,
        "progressive_auc_last": aucs[-1] if aucs else None,
        "freshness_p50_s": float(np.median(freshness)) if freshness else None,
        "freshness_max_s": max(freshness) if freshness else None,
        "versions_exported": len(exports.results),
        "served_version": max(serving.first_served) if serving and serving.first_served else None,
        "stopped_by": session.stopped_by,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
