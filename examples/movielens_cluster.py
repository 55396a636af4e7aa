"""The MovieLens example's model trained by a job: one process, or every
trainer of a cluster (``wuliang launch``, or the pods of a TFJob).

    wuliang launch --ps 2 --workers 2 --model-dir runs/mlc/model -- \
        python examples/movielens_cluster.py --prepare runs/mlc/data \
        --model-dir runs/mlc/model --out runs/mlc/metrics.json

``--prepare DIR``: the chief converts the MovieLens ratings shipped in
``datasets/`` into DIR (split by time; the train part shuffled into 6 files,
so that 3 trainers read 2 each) unless DIR has them; the other trainers
wait for them. ``--train`` and ``--test`` name prepared files instead.

Every trainer reads its shard of the train files (``ParquetReader``'s default
in a cluster) and prints ``trainer T step S`` lines; the chief checkpoints
into ``--model-dir`` every ``--checkpoint-steps`` job steps, waits for every
trainer to finish its shard, evaluates on the whole test file and writes the
metrics as JSON to ``--out``. Without ``TF_CONFIG`` it is one process with
an embedded engine: the baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import keras

import wuliang as wl
from wuliang.reader import ParquetReader

REPO = Path(__file__).resolve().parents[1]


def movielens() -> Any:
    spec = importlib.util.spec_from_file_location("movielens", REPO / "examples" / "movielens.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Progress(wl.hooks.SessionRunHook):
    """Prints ``trainer T step S`` every ``every`` steps of this trainer."""

    def __init__(self, trainer: int, every: int) -> None:
        self.trainer, self.every, self.done = trainer, every, 0

    def after_run(self, run_context: Any, run_values: Any) -> None:
        self.done += 1
        if self.done % self.every == 0:
            print(f"trainer {self.trainer} step {run_context.step}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", help="a folder for the prepared data (see above)")
    p.add_argument("--train", help="train files (a folder, glob or file)")
    p.add_argument("--test", help="the test file")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--shuffle", type=int, default=20_000)
    p.add_argument("--checkpoint-steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--tower-sync-steps", type=int, default=1, help="Context(tower_sync_steps=): GEO mode"
    )
    p.add_argument("--step-pause", type=float, default=0.0, help="seconds after each step")
    p.add_argument(
        "--gpu-cache-rows", type=int, help="Context(gpu_cache_rows=): a hot cache per trainer"
    )
    p.add_argument(
        "--cache-sync-steps", type=int, default=8,
        help="Context(cache_sync_steps=): how often several trainers' caches merge",
    )  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    ml = movielens()
    keras.utils.set_random_seed(args.seed)
    tables = {t: wl.EmbeddingTable(t, dim=16, seed=42) for t, _ in ml.FEATURES.values()}
    features = [
        wl.SparseFeature(name, tables[table], combiner=combiner)
        for name, (table, combiner) in ml.FEATURES.items()
    ]
    context = wl.Context(
        tower_sync_steps=args.tower_sync_steps,
        gpu_cache_rows=args.gpu_cache_rows,
        cache_sync_steps=args.cache_sync_steps,
    )
    job = context.job
    trainer = 0 if job is None else job.trainer
    if args.prepare:
        args.train, args.test = prepared(Path(args.prepare), job is None or job.is_chief, ml)
    elif not (args.train and args.test):
        p.error("give --prepare DIR, or --train and --test")
    est = wl.Estimator(
        ml.make_tower([64, 32]),
        features,
        label=ml.LABEL,
        context=context,
        hooks=[wl.hooks.Checkpoint(args.model_dir, every_steps=args.checkpoint_steps)],
    )
    reader = ParquetReader(
        args.train, args.batch_size, shuffle_buffer=args.shuffle, seed=args.seed + trainer,
        epochs=args.epochs,
    )  # fmt: skip
    hooks: list[Any] = [Progress(trainer, 10)]
    if args.step_pause:
        hooks.append(Pause(args.step_pause))
    trained = est.train(reader, hooks=hooks)
    print(f"trainer {trainer} trained {trained['steps']} steps", flush=True)
    if job is not None:
        job.finish()
        if not job.is_chief:
            context.close()
            return 0
        job.wait_finished(timeout=600)
        est.save_checkpoint()
    test = ParquetReader(args.test, 4096, worker_index=0, num_workers=1)
    metrics = est.evaluate(test)
    out = {"auc": metrics["auc"], "logloss": metrics["logloss"], "step": est.global_step,
           "time": time.time()}  # fmt: skip
    Path(args.out).write_text(json.dumps(out))
    print(f"chief done: auc {metrics['auc']:.4f} at step {est.global_step}", flush=True)
    context.close()
    return 0


def prepare(ml: Any, out: Path, parts: int = 6) -> None:
    """MovieLens split by time into out/test.parquet and out/train/ (the
    train part shuffled into ``parts`` files); out/DONE written last."""
    import numpy as np
    import pyarrow.parquet as pq

    files = ml.convert(ml.DEFAULT_DATA, out)
    train, test, _, _ = ml.split_by_time(files, out / "split", ml.TRAIN_FRACTION)
    table = pq.read_table(train)
    table = table.take(np.random.default_rng(0).permutation(table.num_rows))
    (out / "train").mkdir(exist_ok=True)
    for i, rows in enumerate(np.array_split(np.arange(table.num_rows), parts)):
        part = out / "train" / f"part-{i:05d}.parquet"
        pq.write_table(table.slice(rows[0], len(rows)), part.with_suffix(".tmp"))
        part.with_suffix(".tmp").replace(part)
    test.replace(out / "test.parquet")
    (out / "DONE").write_text("ok\n")


def prepared(out: Path, chief: bool, ml: Any) -> tuple[str, str]:
    """(train, test) of the prepared folder: made by the chief, waited for
    (at most 10 minutes) by the others."""
    done = out / "DONE"
    if chief and not done.exists():
        prepare(ml, out)
    deadline = time.monotonic() + 600
    while not done.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{out} was not prepared in 10 minutes (the chief prepares it)")
        time.sleep(1)
    return str(out / "train"), str(out / "test.parquet")


class Pause(wl.hooks.SessionRunHook):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def after_run(self, run_context: Any, run_values: Any) -> None:
        time.sleep(self.seconds)


if __name__ == "__main__":
    sys.exit(main())
