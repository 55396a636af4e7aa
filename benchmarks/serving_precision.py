"""What compressed serving vectors cost: memory per row and AUC on MovieLens.

Trains the MovieLens example (``examples/movielens.py``: library defaults,
time split, 2 epochs), exports it, and serves the export three times, with
the vectors stored as fp32, fp16 and int8 (``wuliang serve --precision``).
Each served model scores the test split through ``wuliang.serving.predict``
(raw feature values, pooled as in training, the export's tower), keys
never trained reading as their initial vectors as in training
(``--missing initial``; the served default, zeros, is scored too). Reported
per precision: the test AUC, its change against fp32, the largest change of
a prediction. MovieLens' tables are too small to show memory per row (a
table's first pool chunks dominate), so memory is measured on a table of
``--rows`` random rows (dim 16 and 64) loaded at each precision: bytes per
row of the engine (rows, index and metadata: ``stats()["bytes"] / rows``).
fp32 equals the trainer's own predictions (checked, 1e-5). The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import movielens_example  # benchmarks/, the script's folder

PRECISIONS = ("fp32", "fp16", "int8")
BATCH = 1000


def features_of(batch: Any, names: list[str]) -> dict[str, Any]:
    """A reader batch as raw request features (keys and offsets per feature)."""
    from wuliang.serving.predict import FeatureInput

    return {
        name: FeatureInput(batch.sparse[name].values.view(np.uint64), batch.sparse[name].offsets)
        for name in names
    }


def score(store: Any, test: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(predictions, labels) of the test split, served by ``store``."""
    from wuliang.reader import ParquetReader
    from wuliang.serving.predict import predict

    predictions, labels = [], []
    for batch in ParquetReader(test, BATCH, names, label="label"):
        answer = predict(store, store.served(), features_of(batch, names), batch.size)
        predictions.append(answer.outputs["predictions"].ravel())
        labels.append(batch.labels)
    return np.concatenate(predictions), np.concatenate(labels)


def bytes_per_row(rows: int, dim: int, precision: str) -> float:
    from wuliang.ps_server import SGD, Engine, TableSpec, Zeros

    spec = TableSpec("t", dim, optimizer=SGD(), initializer=Zeros(), precision=precision)
    rng = np.random.default_rng(0)
    with Engine(2) as engine:
        engine.create_table(spec)
        for start in range(0, rows, 250_000):
            keys = np.arange(start, min(rows, start + 250_000), dtype=np.uint64)
            engine.load("t", keys, rng.standard_normal((len(keys), dim), dtype=np.float32))
        stats = engine.stats("t")
        return round(stats["bytes"] / stats["rows"], 1)


def run(epochs: int, max_ratings: int | None, work: Path) -> dict[str, Any]:
    from wuliang.metrics import auc
    from wuliang.reader import ParquetReader
    from wuliang.serving.store import ModelStore

    ml = movielens_example()
    argv = ["--work-dir", str(work), "--epochs", str(epochs), "--no-export"]
    if max_ratings is not None:
        argv += ["--max-ratings", str(max_ratings)]
    args = ml.parse_args(argv)
    files = ml.convert(args.data, args.work_dir)
    train, test, train_rows, _ = ml.split_by_time(
        files, args.work_dir / "split", ml.TRAIN_FRACTION, args.max_ratings
    )
    _, estimator = ml.train_wuliang(args, train, test, train_rows)
    session = estimator.session
    exports = work / "exports"
    session.export(exports, kind="full")
    names = list(ml.FEATURES)
    trainer = np.concatenate(
        list(session.predict(ParquetReader(test, BATCH, names, label="label")))
    )
    result: dict[str, Any] = {"test_examples": len(trainer)}
    base = None
    with ModelStore(exports, "movielens", poll_secs=0) as store:  # missing keys: zeros
        predictions, labels = score(store, test, names)
        result["fp32_missing_zeros_auc"] = auc(labels, predictions)
    for precision in PRECISIONS:
        with ModelStore(
            exports, "movielens", precision=precision, missing="initial", poll_secs=0
        ) as store:
            predictions, labels = score(store, test, names)
        if precision == "fp32":
            np.testing.assert_allclose(predictions, trainer, rtol=1e-5, atol=1e-6)
            base = predictions
        result[precision] = {
            "auc": auc(labels, predictions),
            "max_prediction_change": float(np.abs(predictions - base).max()),
        }
        result[precision]["auc_change"] = result[precision]["auc"] - result["fp32"]["auc"]
    estimator.context.close()
    return result


def memory(rows: int) -> dict[str, Any]:
    return {
        f"bytes_per_row_dim{dim}": {p: bytes_per_row(rows, dim, p) for p in PRECISIONS}
        for dim in (16, 64)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-ratings", type=int, default=None, help="a prefix, for quick runs")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the memory table")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.epochs, args.max_ratings, Path(tmp))
    result.update(memory(args.rows), memory_rows=args.rows)
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
