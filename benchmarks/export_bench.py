"""Export benchmark: full and delta exports of a big table, and restoring it.

One table of N rows (default 10M; dim 16, Adagrad state) in the embedded
engine of a real Session (tiny tower, so the SavedModel is written too):

* ``full_export``: ``wuliang.export.export(SessionSource, kind="full")``:
  every row (vector and metadata, no optimizer state) to Arrow files,
  sha256 of each, fsync, the SavedModel, atomic rename;
* ``delta_export``: after pushing 1% of the rows (and erasing 0.01%), the
  next version: a delta found through the engine's change log;
* ``checkpoint_delta_export``: the same delta made by ``wuliang export``
  from checkpoints (reads and verifies the whole checkpoint: follows the
  table size);
* ``restore``: applying the full export to a fresh engine (what serving
  does: verify every file, load the rows);
* ``checkpoint_save`` / ``checkpoint_restore``: the same rows with their
  optimizer state, as a training checkpoint;
* baseline ``tf_checkpoint``: the TF-native way to persist such a table:
  ``tf.train.Checkpoint`` of a [N, 16] variable and its Adagrad accumulator
  plus the keys (no delta possible: every save is full).

The last line printed is one JSON object.

    python benchmarks/export_bench.py            # 10M rows
    python benchmarks/export_bench.py --quick    # 1M rows
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DIM = 16
CHUNK = 1 << 20


def timed(fn: Any) -> tuple[Any, float]:
    gc.collect()
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def make_session(rows: int, seed: int) -> Any:
    import keras

    import wuliang as wl

    table = wl.EmbeddingTable("emb", DIM, optimizer=wl.optimizers.Adagrad(0.05))
    dense = keras.layers.Dense(1)
    session = wl.Session(
        lambda e, d: dense(e["item"]), [wl.SparseFeature("item", table)], wl.Context(num_shards=2)
    )
    engine = session.context.engine
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**63, size=rows + rows // 100, dtype=np.uint64))[:rows]
    rng.shuffle(keys)
    for start in range(0, rows, CHUNK):
        part = keys[start : start + CHUNK]
        weights = rng.standard_normal((len(part), DIM), dtype=np.float32)
        state = np.full((len(part), DIM), 0.1, np.float32)
        engine.load("emb", part, weights, state)
    return session, keys


def tf_checkpoint(rows: int, folder: Path) -> float:
    """Saves [rows, 16] weights + accumulator + keys with tf.train.Checkpoint."""
    import tensorflow as tf

    weights = tf.Variable(tf.random.normal([rows, DIM]))
    accumulator = tf.Variable(tf.fill([rows, DIM], 0.1))
    keys = tf.Variable(tf.range(rows, dtype=tf.int64))
    checkpoint = tf.train.Checkpoint(weights=weights, accumulator=accumulator, keys=keys)
    _, seconds = timed(lambda: checkpoint.write(str(folder / "tf" / "ckpt")))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--quick", action="store_true", help="1M rows")
    parser.add_argument("--dir", help="where to write (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = 1_000_000 if args.quick else args.rows

    from wuliang.checkpoint import latest_checkpoint
    from wuliang.export import CheckpointSource, SessionSource, apply_chain, export
    from wuliang.ps_server import Engine

    folder = Path(args.dir or tempfile.mkdtemp(prefix="export-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    exports, model_dir = folder / "exports", folder / "model"
    for old in (exports, model_dir, folder / "tf", folder / "ckpt-exports"):
        shutil.rmtree(old, ignore_errors=True)
    try:
        (session, keys), load_s = timed(lambda: make_session(rows, args.seed))
        print(f"loaded {rows:,} rows in {load_s:.1f} s", flush=True)
        engine = session.context.engine

        full, full_s = timed(lambda: export(SessionSource(session), exports, "full"))
        print(full.status(), flush=True)
        _, ckpt_save_s = timed(lambda: session.save_checkpoint(model_dir, keep=None))

        rng = np.random.default_rng(args.seed + 1)
        touched = rng.choice(keys, rows // 100, replace=False)
        engine.push("emb", touched, rng.standard_normal((len(touched), DIM), dtype=np.float32))
        engine.erase("emb", rng.choice(keys, rows // 10_000, replace=False))
        session.context.global_step += 1

        delta, delta_s = timed(lambda: export(SessionSource(session), exports))
        print(delta.status(), flush=True)
        assert delta.kind == "delta", delta.status()
        session.save_checkpoint(model_dir, keep=None)
        ckpt_exports = folder / "ckpt-exports"
        first = sorted(model_dir.glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1]))[0]
        export(CheckpointSource(first), ckpt_exports, "full")
        newest = latest_checkpoint(model_dir)
        ckpt_delta, ckpt_delta_s = timed(lambda: export(CheckpointSource(newest), ckpt_exports))
        print(ckpt_delta.status(), flush=True)

        session.close()
        session.context.close()  # frees the table

        def restore() -> Engine:
            target = Engine(num_shards=2)
            apply_chain(target, exports, 1)
            return target

        target, restore_s = timed(restore)
        restored_rows = target.stats("emb")["rows"]
        target.close()
        assert restored_rows == rows, restored_rows

        def restore_checkpoint() -> Any:
            again, _ = make_session(0, args.seed)
            again.restore_checkpoint(first)
            return again

        again, ckpt_restore_s = timed(restore_checkpoint)
        again.context.close()

        tf_s = tf_checkpoint(rows, folder)
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)

    result = {
        "rows": rows,
        "dim": DIM,
        "full_export_s": round(full_s, 3),
        "delta_rows": sum(delta.rows.values()),
        "delta_removed": sum(delta.removed.values()),
        "delta_export_s": round(delta_s, 3),
        "delta_to_full_ratio": round(delta_s / full_s, 4),
        "checkpoint_delta_export_s": round(ckpt_delta_s, 3),
        "restore_s": round(restore_s, 3),
        "full_export_rows_per_s": round(rows / full_s),
        "restore_rows_per_s": round(rows / restore_s),
        "rows_per_s": round(rows / max(full_s, restore_s)),
        "checkpoint_save_s": round(ckpt_save_s, 3),
        "checkpoint_restore_s": round(ckpt_restore_s, 3),
        "tf_checkpoint_s": round(tf_s, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
