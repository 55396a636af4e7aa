"""Criteo end to end: convert a Criteo TSV, train a DNN with wuliang, evaluate.

What this example shows:

1. ``wuliang.reader.convert.convert_criteo`` turning a Criteo Display
   Advertising TSV (label, 13 integer columns, 26 hex categorical columns,
   tab-separated, empty = missing) into Parquet part files in input order:
   ``C1`` … ``C26`` become hashed uint64 keys, ``I1`` … ``I13`` ``log1p``
   floats, and with ``--bucketize`` also ``I1_bucket`` … ``I13_bucket`` keys
   (log2 buckets of the integers).
2. A hold-out split by position: the last 10% of the rows test. Whole part
   files go to one side; the part holding the boundary is written as two files
   under ``WORK/split`` (its head trains, its tail tests).
3. One embedding table of the parameter server shared by all 26 (or 39)
   categorical features — the converter hashes each column with its own seed,
   so their keys do not collide — and the 13 integer columns as dense
   features, into a Keras MLP tower; ``Estimator.train`` on shuffled batches,
   ``Estimator.evaluate`` (exact AUC) on the held-out rows.

Without ``--input`` it first writes a synthetic Criteo-format TSV (``--rows``
rows) whose label depends on C1, C2, C3 and I1, so the model has something to
learn. The last line printed is one JSON object: auc, logloss, samples_per_s,
train_examples, test_examples::

    .venv/bin/python examples/criteo.py                      # synthetic data
    .venv/bin/python examples/criteo.py --input train.txt --bucketize
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORK_DIR = REPO / "runs" / "criteo"
DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
BUCKETS = [f"{name}_bucket" for name in DENSE]
LABEL = "label"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", type=Path, default=None, help="a Criteo TSV (default: write a synthetic one)"
    )
    p.add_argument("--rows", type=int, default=200_000, help="rows of the synthetic TSV")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help="synthetic TSV, converted Parquet and split go here (default: runs/criteo)",
    )
    p.add_argument("--bucketize", action="store_true", help="also I1..I13 log2 bucket keys")
    p.add_argument("--rows-per-file", type=int, default=1_000_000, help="rows per Parquet part")
    p.add_argument("--test-fraction", type=float, default=0.1, help="last rows held out")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 64], help="MLP layer sizes")
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate of the table")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


# -- data ----------------------------------------------------------------------


def write_synthetic(path: Path, rows: int, seed: int) -> None:
    """A Criteo-format TSV whose label is learnable.

    Categorical values are 8-digit hex strings drawn from a Zipf-like
    distribution over vocabularies of 10 to 100,000 values; integers are
    heavy-tailed counts (a few negative ones, as in Criteo); about 10% of the
    values are missing. The label is Bernoulli(sigmoid(logit)) with the logit
    a sum of per-value effects of C1, C2 and C3 and a term in log1p(I1).
    """
    rng = np.random.default_rng(seed)
    columns: dict[str, pa.Array] = {}
    logit = np.full(rows, -1.0)
    ints = {}
    for name in DENSE:
        values = np.floor(rng.lognormal(1.5, 1.5, rows)).astype(np.int64)
        values[rng.random(rows) < 0.02] = -1
        ints[name] = values
        columns[name] = pa.array(values, mask=rng.random(rows) < 0.1)
    logit += 0.6 * (np.log1p(np.maximum(ints["I1"], 0)) - 1.5)
    for k, name in enumerate(CATEGORICAL):
        vocab = int(10 ** (1 + 4 * k / (len(CATEGORICAL) - 1)))  # 10 ... 100,000
        ranks = np.arange(1, vocab + 1, dtype=np.float64)
        probs = ranks**-1.1 / np.sum(ranks**-1.1)
        ids = rng.choice(vocab, size=rows, p=probs)
        missing = rng.random(rows) < 0.1
        if name in ("C1", "C2", "C3"):
            effect = rng.normal(0.0, 1.0, vocab)
            logit += np.where(missing, 0.0, effect[ids])
        words = pa.array([f"{v:08x}" for v in rng.integers(0, 2**32, vocab)])
        columns[name] = words.take(pa.array(ids, mask=missing))
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    table = pa.table({LABEL: labels, **{n: columns[n] for n in DENSE + CATEGORICAL}})
    path.parent.mkdir(parents=True, exist_ok=True)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    pacsv.write_csv(table, path, options)


def split_tail(
    parts: Sequence[Path], out: Path, fraction: float
) -> tuple[list[Path], list[Path], int, int]:
    """(train files, test files, train rows, test rows): the last `fraction` of
    the rows (in file order) test. The part holding the boundary is written as
    out/boundary-train.parquet and out/boundary-test.parquet."""
    counts = np.array([pq.read_metadata(p).num_rows for p in parts], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    total = int(starts[-1])
    boundary = total - round(fraction * total)
    if not 0 < boundary < total:
        raise SystemExit(f"{total} rows: too few to hold out {fraction:.0%}")
    out.mkdir(parents=True, exist_ok=True)
    train: list[Path] = []
    test: list[Path] = []
    for path, lo, hi in zip(parts, starts[:-1], starts[1:], strict=True):
        if hi <= boundary:
            train.append(path)
        elif lo >= boundary:
            test.append(path)
        else:
            table = pq.read_table(path)
            head, tail = out / "boundary-train.parquet", out / "boundary-test.parquet"
            pq.write_table(table.slice(0, boundary - lo), head)
            pq.write_table(table.slice(boundary - lo), tail)
            train.append(head)
            test.append(tail)
    return train, test, boundary, total - boundary


# -- the model -----------------------------------------------------------------


def make_tower(sparse: Sequence[str], dense: Sequence[str], hidden: Sequence[int]) -> Any:
    """concat(embeddings of the sparse features, dense features) -> ReLU MLP -> logit."""
    import keras

    class Tower(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="tower")
            self.mlp = [keras.layers.Dense(h, activation="relu") for h in hidden]
            self.logit = keras.layers.Dense(1)

        def call(self, embeddings: dict[str, Any], dense_inputs: dict[str, Any]) -> Any:
            parts = [embeddings[n] for n in sparse] + [dense_inputs[n] for n in dense]
            x = keras.ops.concatenate(parts, axis=-1)
            for layer in self.mlp:
                x = layer(x)
            return self.logit(x)

    return Tower()


def train_and_evaluate(
    args: argparse.Namespace, train: list[Path], test: list[Path], train_rows: int
) -> dict[str, float]:
    import keras

    import wuliang as wl
    from wuliang.reader import ParquetReader

    keras.utils.set_random_seed(args.seed)
    sparse = CATEGORICAL + (BUCKETS if args.bucketize else [])
    table = wl.EmbeddingTable(
        "criteo",
        dim=args.dim,
        optimizer=wl.optimizers.Adagrad(args.lr),
        initializer=wl.initializers.Uniform(-0.05, 0.05),
        seed=args.seed,
    )
    features = [wl.SparseFeature(n, table) for n in sparse] + [wl.DenseFeature(n) for n in DENSE]
    estimator = wl.Estimator(
        make_tower(sparse, DENSE, args.hidden), features, label=LABEL, context=wl.Context()
    )
    columns = sparse + DENSE
    reader = ParquetReader(
        train,
        args.batch_size,
        columns,
        label=LABEL,
        shuffle_buffer=min(train_rows, 100_000),
        seed=args.seed,
        epochs=args.epochs,
    )
    steps = args.epochs * -(-train_rows // args.batch_size)
    hooks = [wl.hooks.Logging(every_steps=max(1, steps // 5))]
    start = time.perf_counter()
    trained = estimator.train(reader, hooks=hooks)
    train_s = time.perf_counter() - start
    metrics = estimator.evaluate(ParquetReader(test, 8192, columns, label=LABEL))
    rows = estimator.context.engine.stats()["criteo"]["rows"]
    estimator.context.close()
    return {**metrics, **trained, "train_s": train_s, "table_rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    from wuliang.reader.convert import convert_criteo

    args = parse_args(argv)
    started = time.perf_counter()
    work_dir: Path = args.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    source = args.input
    if source is None:
        source = work_dir / "synthetic.tsv"
        write_synthetic(source, args.rows, args.seed)
        print(f"wrote {args.rows:,} synthetic Criteo rows to {source}")
    start = time.perf_counter()
    parts = convert_criteo(
        source,
        work_dir / "parquet",
        rows_per_file=args.rows_per_file,
        bucketize=args.bucketize,
        progress=False,
    )
    took = time.perf_counter() - start
    print(f"converted {source} -> {work_dir / 'parquet'}: {len(parts)} part files in {took:.1f} s")
    train, test, train_rows, test_rows = split_tail(parts, work_dir / "split", args.test_fraction)
    print(f"hold-out split: {train_rows:,} train rows, {test_rows:,} test rows (the last ones)")
    keys = "26 categorical + 13 bucket" if args.bucketize else "26 categorical"
    print(
        f"wuliang: {keys} features in one table (dim {args.dim}, Adagrad lr {args.lr}), "
        f"13 dense, MLP {args.hidden}, batch {args.batch_size}, {args.epochs} epoch(s)"
    )
    result = train_and_evaluate(args, train, test, train_rows)
    print(
        f"wuliang: AUC {result['auc']:.4f}, logloss {result['logloss']:.4f}, "
        f"calibration {result['calibration']:.3f}, {result['samples_per_s']:,.0f} samples/s "
        f"({result['train_s']:.1f} s training, {result['table_rows']:,} table rows)"
    )
    print(f"total time {time.perf_counter() - started:.1f} s")
    summary = {
        "auc": result["auc"],
        "logloss": result["logloss"],
        "samples_per_s": result["samples_per_s"],
        "train_examples": train_rows,
        "test_examples": test_rows,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
