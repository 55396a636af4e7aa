"""What a table's storage costs against what it learns: fp16 training
tables against fp32 ones (``EmbeddingTable(precision="fp16")``).

* **Quality.** The MovieLens example's model (``examples/movielens.py``: five
  tables of dim 16, Adagrad(0.05) on the tables; the ratings split by time,
  the later 20% held out) trained with every table fp32 and with every table
  fp16, alternated, ``--seeds`` seeds each: the held-out AUC of each and
  ``auc_minus_fp32``, the mean difference (fp16 − fp32).
* **Bytes.** A table of ``--rows`` keys (dim 16, Adagrad) in each precision:
  the engine's bytes per key in RAM (rows with their optimizer state and
  metadata, and the index: ``fp16_storage_bytes_vs_fp32``), and the weights
  and optimizer state alone (``fp16_weights_and_state_vs_fp32``).
* **Speed.** The training samples/s of the same runs
  (``fp16_samples_per_s_vs_fp32``, medians).

``--quick``: one seed, one epoch. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_data import movielens_example  # benchmarks/, the script's folder

DIM = 16


def train_once(ml: Any, split: tuple[Path, Path, int], precision: str, seed: int,
               epochs: int) -> dict[str, float]:  # fmt: skip
    """The example's model with every table in ``precision``: its held-out
    AUC and training samples/s."""
    import keras

    import wuliang as wl
    from wuliang.optimizers import Adagrad
    from wuliang.reader import ParquetReader

    train, test, rows = split
    keras.utils.set_random_seed(seed)
    options = {"dim": DIM, "seed": seed, "optimizer": Adagrad(0.05), "precision": precision}
    tables = {table: wl.EmbeddingTable(table, **options) for table, _ in ml.FEATURES.values()}
    features = [
        wl.SparseFeature(name, tables[table], combiner=combiner)
        for name, (table, combiner) in ml.FEATURES.items()
    ]
    estimator = wl.Estimator(ml.make_tower([64, 32]), features, label=ml.LABEL,
                             context=wl.Context(num_shards=2))  # fmt: skip
    columns = list(ml.FEATURES)
    reader = ParquetReader(train, 256, columns, label=ml.LABEL, shuffle_buffer=rows, seed=seed,
                           epochs=epochs)  # fmt: skip
    start = time.perf_counter()
    trained = estimator.train(reader)
    seconds = time.perf_counter() - start
    metrics = estimator.evaluate(ParquetReader(test, 4096, columns, label=ml.LABEL))
    estimator.context.close()
    return {"auc": metrics["auc"], "samples_per_s": trained["steps"] * 256 / seconds}


def bytes_per_key(precision: str, rows: int) -> tuple[float, float]:
    """(bytes per key in RAM with the index, bytes of weights and state a
    key) of a dim-16 Adagrad table of ``rows`` keys."""
    from wuliang.optimizers import Adagrad
    from wuliang.ps_server import Engine, TableSpec

    with Engine(2) as engine:
        engine.create_table(TableSpec("t", DIM, optimizer=Adagrad(0.05), precision=precision))
        keys = np.arange(rows, dtype=np.uint64)
        for lo in range(0, rows, 1 << 20):
            part = keys[lo : lo + (1 << 20)]
            engine.load("t", part, np.zeros((len(part), DIM), np.float32))
        stats = engine.stats("t")
        assert stats["rows"] == rows
    weight_bytes = {"fp32": 4, "fp16": 2}[precision] * DIM
    state_bytes = 4 * DIM  # Adagrad: an accumulator per weight, float32
    return (stats["row_bytes"] + stats["index_bytes"]) / rows, weight_bytes + state_bytes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, one epoch")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=4_000_000, help="keys of the bytes table")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.rows = 1, 1, 1_000_000
    ml = movielens_example()
    auc: dict[str, list[float]] = {"fp32": [], "fp16": []}
    rate: dict[str, list[float]] = {"fp32": [], "fp16": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = ml.convert(ml.DEFAULT_DATA, Path(tmp))
        train, test, rows, _ = ml.split_by_time(files, Path(tmp, "split"), ml.TRAIN_FRACTION)
        for seed in range(42, 42 + args.seeds):
            for precision in ("fp32", "fp16"):  # alternated: the machine's drift hits both
                r = train_once(ml, (train, test, rows), precision, seed, args.epochs)
                print(f"seed {seed} {precision}: AUC {r['auc']:.4f}, "
                      f"{r['samples_per_s']:,.0f} samples/s", flush=True)  # fmt: skip
                auc[precision].append(round(r["auc"], 4))
                rate[precision].append(r["samples_per_s"])
    ram = {p: bytes_per_key(p, args.rows) for p in ("fp32", "fp16")}
    for precision, (per_key, own) in ram.items():
        print(
            f"{precision}: {per_key:.1f} bytes a key in RAM, {own} of weights and state", flush=True
        )
    mean = {k: sum(v) / len(v) for k, v in auc.items()}
    result = {
        "seeds": args.seeds,
        "epochs": args.epochs,
        "auc_fp32": auc["fp32"],
        "auc_fp16": auc["fp16"],
        "auc_minus_fp32": round(mean["fp16"] - mean["fp32"], 4),
        "bytes_per_key_fp32": round(ram["fp32"][0], 1),
        "bytes_per_key_fp16": round(ram["fp16"][0], 1),
        "fp16_storage_bytes_vs_fp32": round(ram["fp16"][0] / ram["fp32"][0], 3),
        "fp16_weights_and_state_vs_fp32": round(ram["fp16"][1] / ram["fp32"][1], 3),
        "fp16_samples_per_s_vs_fp32": round(
            statistics.median(rate["fp16"]) / statistics.median(rate["fp32"]), 3
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
