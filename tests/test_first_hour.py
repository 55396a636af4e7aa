"""What a new user meets first: any Keras model as the tower, errors that name
the real cause, and runs that say when they train nothing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import wuliang as wl
from wuliang.reader import Csr, CsrBatch, ParquetReader

B = 16


def write_data(path: Path, n: int = 96, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    user = rng.integers(1, 30, n)
    items = [rng.integers(1, 50, rng.integers(0, 4)).tolist() for _ in range(n)]
    x = rng.standard_normal((n, 2)).astype(np.float32)
    label = ((user % 3 == 0) ^ (x[:, 0] > 0)).astype(np.float32)
    table = pa.table(
        {
            "user": pa.array(user.astype(np.int64)),
            "items": pa.array(items, pa.list_(pa.int64())),
            "x": pa.array(list(x), pa.list_(pa.float32(), 2)),
            "age": pa.array(x[:, 1]),
            "label": pa.array(label),
        }
    )
    pq.write_table(table, path)
    return path


def features() -> list[Any]:
    user = wl.EmbeddingTable("user", 4)
    item = wl.EmbeddingTable("item", 3)
    # Declared order: user (4), x (2), items (3), age (1).
    return [
        wl.SparseFeature("user", user),
        wl.DenseFeature("x", 2),
        wl.SparseFeature("items", item, combiner="mean"),
        wl.DenseFeature("age"),
    ]


def reader(path: Path, **kwargs: Any) -> ParquetReader:
    return ParquetReader(path, B, ["user", "x", "items", "age"], label="label", **kwargs)


class Record(keras.layers.Layer):
    """Passes its input through; remembers the shapes and training flags seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, Any]] = []

    def call(self, inputs: Any, training: Any = None) -> Any:
        self.seen.append((tuple(inputs.shape), training))
        return inputs


# -- towers --------------------------------------------------------------------


def test_a_sequential_tower_gets_the_features_concatenated_in_declared_order(
    tmp_path: Path,
) -> None:
    path = write_data(tmp_path / "d.parquet")
    keras.utils.set_random_seed(0)
    record = Record()
    dense = keras.layers.Dense(1)
    tower = keras.Sequential([record, keras.layers.Dropout(0.5), dense])
    s = wl.Session(tower, features(), wl.Context(num_shards=2))
    batch = next(iter(reader(path)))
    out = s.run(batch, ["user", "items", "logits"], train=False)
    # The Dense layer saw [user | x | items | age]: its logits are that row times its kernel.
    kernel, bias = (np.asarray(w) for w in dense.get_weights())
    x = np.concatenate(
        [out["user"], batch.dense_feature("x"), out["items"], batch.dense_feature("age")], axis=1
    )
    assert kernel.shape == (10, 1)
    np.testing.assert_allclose(out["logits"], x @ kernel + bias, rtol=1e-5, atol=1e-6)
    assert record.seen and all(shape[1] == 10 for shape, _ in record.seen)
    result = s.train(reader(path, epochs=3))
    assert result["steps"] == 18 and s.global_step == 18
    # Dropout ran in training mode while training, in inference mode otherwise.
    flags = {bool(training) for _, training in record.seen if training is not None}
    assert flags == {True, False}, record.seen
    metrics = s.evaluate(reader(path))
    assert metrics["examples"] == 96 and 0.0 <= metrics["auc"] <= 1.0


def test_a_functional_tower_with_one_input(tmp_path: Path) -> None:
    path = write_data(tmp_path / "d.parquet")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    tower = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    s = wl.Session(
        tower, features(), wl.Context(num_shards=2), optimizer=keras.optimizers.Adam(0.05)
    )
    first = s.evaluate(reader(path))["loss"]
    s.train(reader(path, epochs=20))
    assert s.evaluate(reader(path))["loss"] < first - 0.05  # it learns


def test_towers_that_cannot_take_one_input_are_refused() -> None:
    a, b = keras.Input((4,)), keras.Input((6,))
    two = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    with pytest.raises(ValueError, match="functional Keras model with 2 inputs"):
        wl.Session(two, features(), wl.Context(num_shards=1))
    seq = wl.SparseFeature("hist", wl.EmbeddingTable("item", 3), combiner=None, max_len=4)
    with pytest.raises(ValueError, match="'hist' is a sequence feature"):
        wl.Session(keras.Sequential([keras.layers.Dense(1)]), [seq], wl.Context(num_shards=1))


def test_a_two_input_tower_gets_training_when_it_takes_it(tmp_path: Path) -> None:
    path = write_data(tmp_path / "d.parquet")
    seen: list[Any] = []
    dense = keras.layers.Dense(1)

    def tower(embeddings: dict, dense_inputs: dict, training: bool = False) -> tf.Tensor:
        seen.append(training)
        return dense(tf.concat([embeddings["user"], dense_inputs["age"]], axis=1))

    s = wl.Session(tower, features(), wl.Context(num_shards=1))
    s.train(reader(path), steps=2)
    s.evaluate(reader(path), steps=1)
    assert set(seen) == {True, False}


# -- errors that name the real cause -------------------------------------------


def test_a_sparse_feature_over_a_float_column_says_it_was_read_as_dense(tmp_path: Path) -> None:
    path = write_data(tmp_path / "d.parquet")
    feature = wl.SparseFeature("age", wl.EmbeddingTable("age", 4))
    s = wl.Session(keras.Sequential([keras.layers.Dense(1)]), [feature], wl.Context(num_shards=1))
    with pytest.raises(ValueError, match=r"SparseFeature 'age': the column is float.*as numbers"):
        s.train(ParquetReader(path, B, ["age"], label="label"))


@pytest.mark.parametrize("value", [10.5, "8", 0, -3, True])
def test_batch_size_must_be_a_positive_int(tmp_path: Path, value: Any) -> None:
    path = write_data(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=rf"batch_size must be an int >= 1, got {value!r}"):
        ParquetReader(path, value, ["user"])


def fed(offsets: list[int], values: int = 3) -> CsrBatch:
    keys = Csr(np.arange(1, values + 1, dtype=np.uint64), np.array(offsets, np.int64))
    user = Csr(np.arange(1, 4, dtype=np.uint64), np.arange(4, dtype=np.int64))
    dense = np.zeros((3, 3), np.float32)
    labels = np.zeros(3, np.float32)
    return CsrBatch(
        {"user": user, "items": keys}, dense, labels, 3, {"x": slice(0, 2), "age": slice(2, 3)}
    )


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([0, 1, 2, 9], r"feature 'items': offsets end at 9 but there are 3 values \(row 2\)"),
        ([0, 1, 2, 2**42], r"feature 'items': offsets end at 4398046511104 .* \(row 2\)"),
        ([0, -1, 2, 3], r"feature 'items': offsets not monotonic at row 0"),
        ([0, 2, 1, 3], r"feature 'items': offsets not monotonic at row 1"),
        ([-2, 0, 1, 3], r"feature 'items': offsets must start at 0 \(row 0\), got -2"),
        ([0, 1, 3], r"feature 'items': has 2 rows, the batch has 3"),
    ],
)
def test_a_fed_batch_is_validated(offsets: list[int], message: str) -> None:
    s = wl.Session(keras.Sequential([keras.layers.Dense(1)]), features(), wl.Context(num_shards=1))
    with pytest.raises(ValueError, match=message):
        s.run(fed(offsets))
    assert s.global_step == 0
    s.run(fed([0, 1, 1, 3]))  # a valid one trains
    assert s.global_step == 1


# -- runs that train nothing say so ----------------------------------------------


def test_resuming_at_the_readers_end_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_data(tmp_path / "d.parquet")
    model_dir = tmp_path / "model"

    def run() -> dict[str, Any]:
        keras.utils.set_random_seed(0)
        s = wl.Session(
            keras.Sequential([keras.layers.Dense(1)]), features(), wl.Context(num_shards=1)
        )
        return s.train(reader(path), hooks=[wl.hooks.Checkpoint(model_dir, every_steps=100)])

    assert run()["steps"] == 6
    with caplog.at_level(logging.WARNING, logger="wuliang"):
        assert run()["steps"] == 0
    assert "resumed at step 6; the reader is at its end" in caplog.text
    caplog.clear()
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(path).slice(0, 0), empty)
    s = wl.Session(keras.Sequential([keras.layers.Dense(1)]), features(), wl.Context(num_shards=1))
    with caplog.at_level(logging.WARNING, logger="wuliang"):
        assert s.train(reader(empty))["steps"] == 0
    assert "the reader yielded no batches: nothing trained" in caplog.text
