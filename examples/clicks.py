"""Click logs with string columns, end to end, as a Keras user writes it.

What this example shows (the README's training section is this script):

1. Click logs as they come: a CSV with a unix-time column, string ids
   (user, item, category), a ``|``-separated list of tags, a price and the
   click. A YAML schema says what each column is, and ``wuliang convert csv``
   writes Parquet: the strings become hashed uint64 keys (tagged, so that a
   served model hashes a client's raw strings the same way), the time stays an
   exact timestamp, and a bad number stops the conversion naming its row.
   (``--read-strings`` skips the conversion: ``ParquetReader`` reads Parquet
   string columns by hashing them the same way.)
2. A time split on the timestamp: the last day tests.
3. A Keras functional tower with named inputs (one per feature), preprocessing
   the price in the tower (``log1p``) and ending in ``Dense(1,
   activation="sigmoid")``, the usual Keras habit: its output is taken as
   probabilities.
4. ``Estimator(..., model_dir=...)``: ``train`` saves checkpoints there; a new
   estimator over the same ``model_dir`` (as a new process would make)
   evaluates the saved model; ``export`` writes the version a server serves.
   The readers are given no feature list: the estimator tells them what the
   model reads.

The last line printed is one JSON object: auc, logloss, rows, the restored
step and the export::

    .venv/bin/python examples/clicks.py                 # 40,000 generated rows
    .venv/bin/python examples/clicks.py --read-strings  # no conversion
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
DAY = 86_400
START = 1_700_000_000  # the logs' first second (2023-11-14)

SCHEMA = """\
columns:
  - {name: ts, kind: timestamp, unit: s}
  - {name: user, kind: sparse, type: string}
  - {name: item, kind: sparse, type: string}
  - {name: category, kind: sparse, type: string}
  - {name: tags, kind: sparse_list, type: string, separator: "|"}
  - {name: price, kind: dense}
  - {name: click, kind: label}
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=40_000, help="rows of generated click logs")
    p.add_argument("--days", type=int, default=7, help="days the logs span (the last tests)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "clicks")
    p.add_argument(
        "--read-strings",
        action="store_true",
        help="write the logs as Parquet string columns and read them directly, unconverted",
    )
    return p.parse_args(argv)


def write_logs(path: Path, rows: int, days: int, seed: int) -> pa.Table:
    """Generated click logs (a Zipf-ish catalogue; the click depends on the
    user's taste for the item's category, the item, and the price)."""
    rng = np.random.default_rng(seed)
    users = rng.zipf(1.3, rows) % 3_000
    items = rng.zipf(1.2, rows) % 5_000
    categories = items % 20
    taste = rng.normal(size=(3_000, 20))
    appeal = rng.normal(size=5_000)
    price = np.round(rng.lognormal(3.0, 1.2, rows), 2)
    logit = 1.2 * taste[users, categories] + appeal[items] - 0.6 * np.log1p(price) + 1.0
    click = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    tag_names = np.array(["new", "sale", "gift", "eco", "top"])
    tags = [tag_names[rng.random(5) < 0.3].tolist() for _ in range(rows)]
    table = pa.table(
        {
            "ts": np.sort(START + rng.integers(0, days * DAY, rows)),
            "user": [f"u{u}" for u in users],
            "item": [f"i{i}" for i in items],
            "category": [f"c{c}" for c in categories],
            "tags": tags,
            "price": price,
            "click": click,
        }
    )
    joined = pa.array(["|".join(t) for t in tags])  # the CSV's form: new|sale
    pacsv.write_csv(table.set_column(table.schema.get_field_index("tags"), "tags", joined), path)
    return table  # the Parquet form: list<string>


def split_by_time(data: pa.Table, cut: int, folder: Path) -> tuple[Path, Path]:
    """Rows before ``cut`` (unix seconds) train, the rest test; one file each."""
    folder.mkdir(parents=True, exist_ok=True)
    ts = data.column("ts")
    if pa.types.is_timestamp(ts.type):
        ts = pc.divide(pc.cast(pc.cast(ts, pa.timestamp("ms")), pa.int64()), 1000)
    early = pc.less(ts, cut)
    train, test = folder / "train.parquet", folder / "test.parquet"
    pq.write_table(data.filter(early), train)
    pq.write_table(data.filter(pc.invert(early)), test)
    return train, test


def main(argv: Sequence[str] | None = None) -> int:
    import keras

    import wuliang as wl
    from wuliang.reader import ParquetReader
    from wuliang.reader.convert import convert_csv

    args = parse_args(argv)
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    logs = write_logs(work / "clicks.csv", args.rows, args.days, args.seed)
    print(f"wrote {args.rows:,} click logs to {work / 'clicks.csv'}")

    # 1. Strings to keys: convert with a schema, or read the strings directly.
    if args.read_strings:
        data = logs
        print("reading the string columns directly (ParquetReader hashes them)")
    else:
        (work / "schema.yaml").write_text(SCHEMA)
        converted = convert_csv(
            work / "clicks.csv", work / "parquet", work / "schema.yaml", progress=False
        )
        print(
            f"$ wuliang convert csv clicks.csv parquet --schema schema.yaml\n{converted.summary()}"
        )
        data = pq.read_table(converted)

    # 2. The last day tests.
    cut = START + (args.days - 1) * DAY
    train, test = split_by_time(data, cut, work / "split")
    rows = {"train": pq.read_metadata(train).num_rows, "test": pq.read_metadata(test).num_rows}
    print(f"split by time: {rows['train']:,} train rows, {rows['test']:,} test rows")

    # 3. The model: three tables, a tower with named inputs.
    def model() -> tuple[keras.Model, list]:
        keras.utils.set_random_seed(args.seed)
        users = wl.EmbeddingTable("user", 16)
        items = wl.EmbeddingTable("item", 16)
        categories = wl.EmbeddingTable("category", 8)  # categories and tags share it
        features = [
            wl.SparseFeature("user", users),
            wl.SparseFeature("item", items),
            wl.SparseFeature("category", categories),
            wl.SparseFeature("tags", categories, combiner="mean"),
            wl.DenseFeature("price"),
        ]
        inputs = {
            "user": keras.Input(shape=(16,), name="user"),
            "item": keras.Input(shape=(16,), name="item"),
            "category": keras.Input(shape=(8,), name="category"),
            "tags": keras.Input(shape=(8,), name="tags"),
            "price": keras.Input(shape=(1,), name="price"),
        }
        price = keras.layers.Lambda(keras.ops.log1p)(inputs["price"])  # preprocessing
        joined = keras.layers.Concatenate()([*(inputs[n] for n in list(inputs)[:4]), price])
        hidden = keras.layers.Dense(64, activation="relu")(joined)
        hidden = keras.layers.Dense(32, activation="relu")(hidden)
        output = keras.layers.Dense(1, activation="sigmoid")(hidden)
        return keras.Model(inputs, output), features

    # 4. Train into a model directory; a new estimator evaluates the saved model.
    model_dir = work / "model"
    tower, features = model()
    est = wl.Estimator(tower, features, label="click", model_dir=model_dir)
    reader = ParquetReader(train, args.batch_size, epochs=args.epochs, shuffle_buffer=10_000)
    trained = est.train(reader)
    print(f"trained {trained['steps']} steps ({trained['samples_per_s']:,.0f} samples/s)")

    tower, features = model()  # as a new process would: nothing trained in memory
    saved = wl.Estimator(tower, features, label="click", model_dir=model_dir)
    metrics = saved.evaluate(ParquetReader(test, 1024))
    print(f"the saved model (step {saved.global_step}): AUC {metrics['auc']:.4f}")
    exported = saved.export(work / "exports")
    print(exported.status())
    print(
        json.dumps(
            {
                "auc": round(metrics["auc"], 4),
                "logloss": round(metrics["logloss"], 4),
                "train_rows": rows["train"],
                "test_rows": rows["test"],
                "restored_step": saved.global_step,
                "trained_steps": trained["steps"],
                "export_version": exported.version,
                "hashed": {f.name: f.hash_field for f in exported_model(exported.path).sparse},
            }
        )
    )
    return 0


def exported_model(path: Path) -> Any:
    """The model description an export records (how each feature's strings hash)."""
    from wuliang.ps_server.storage import Version

    return Version(path).model


if __name__ == "__main__":
    sys.exit(main())
