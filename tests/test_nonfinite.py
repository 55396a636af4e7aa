"""Nothing fails silently: NaN and infinite values in data, losses, gradients
and metrics raise by default (naming what and where), or are dropped and
counted when asked."""

from __future__ import annotations

import logging
from pathlib import Path

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import wuliang as wl
from wuliang.metrics import Metrics, auc, logloss
from wuliang.nonfinite import NonFiniteError
from wuliang.reader import Csr, CsrBatch, ParquetReader

N = 64


def write_data(path: Path, x: np.ndarray, label: np.ndarray | None = None) -> Path:
    n = len(x)
    label = (np.arange(n) % 2).astype(np.float32) if label is None else label
    table = pa.table(
        {
            "user": pa.array(np.arange(n, dtype=np.int64) % 7),
            "x": pa.array(x.astype(np.float32)),
            "v": pa.array(
                list(np.stack([x, -x], axis=1).astype(np.float32)), pa.list_(pa.float32(), 2)
            ),
            "label": pa.array(label),
        }
    )
    pq.write_table(table, path, row_group_size=16)
    return path


# -- the reader ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_reader_refuses_a_non_finite_dense_value(tmp_path: Path, bad: float) -> None:
    x = np.linspace(-1, 1, N)
    x[37] = bad
    path = write_data(tmp_path / "part-0.parquet", x)
    for column in ("x", "v"):
        reader = ParquetReader(path, 10, ["user", column], label="label")
        with pytest.raises(ValueError) as info:
            list(reader)
        message = str(info.value)
        assert "part-0.parquet" in message and "row 37" in message, message
        assert f"dense feature {column!r}" in message, message


def test_reader_drops_rows_with_non_finite_values_when_asked(tmp_path: Path) -> None:
    x = np.linspace(-1, 1, N).astype(np.float32)
    label = (np.arange(N) % 2).astype(np.float32)
    x[[3, 17, 18, 40]] = [np.nan, np.inf, np.nan, -np.inf]
    label[50] = np.nan
    path = write_data(tmp_path / "part-0.parquet", x, label)
    reader = ParquetReader(path, 10, ["user", "x"], label="label", non_finite="drop")
    batches = list(reader)
    kept = np.concatenate([b.dense[:, 0] for b in batches])
    expected = np.delete(np.arange(N), [3, 17, 18, 40, 50])
    np.testing.assert_array_equal(kept, x[expected])
    np.testing.assert_array_equal(np.concatenate([b.labels for b in batches]), label[expected])
    users = np.concatenate([b.sparse["user"].values for b in batches])
    np.testing.assert_array_equal(users, expected % 7)  # rows stay whole
    assert [b.size for b in batches] == [10, 10, 10, 10, 10, 9]
    assert reader.stats.dropped_rows == 5
    # Positions count the file's rows: resuming after the third batch yields the rest.
    start = batches[2].position
    rest = list(
        ParquetReader(path, 10, ["user", "x"], label="label", non_finite="drop", start=start)
    )
    np.testing.assert_array_equal(np.concatenate([b.dense[:, 0] for b in rest]), x[expected[30:]])
    with pytest.raises(ValueError, match="non_finite must be 'drop' or 'raise', got 'skip'"):
        ParquetReader(path, 10, ["x"], non_finite="skip")


def test_batch_validate_names_the_dense_feature_and_row() -> None:
    dense = np.zeros((4, 3), np.float32)
    dense[2, 1] = np.nan
    batch = CsrBatch({}, dense, None, 4, {"a": slice(0, 1), "b": slice(1, 3)})
    with pytest.raises(ValueError, match=r"dense feature 'b': non-finite value nan at row 2"):
        batch.validate()
    assert not batch.validated
    dense[2, 1] = 0.0
    batch.validate()
    assert batch.validated


# -- training ------------------------------------------------------------------


def session(non_finite: str | None = None, tower: object = None) -> wl.Session:
    keras.utils.set_random_seed(3)
    context = (
        wl.Context(num_shards=2)
        if non_finite is None
        else wl.Context(num_shards=2, non_finite=non_finite)
    )
    table = wl.EmbeddingTable("emb", 4, optimizer=wl.optimizers.SGD(0.1))
    features = [wl.SparseFeature("user", table), wl.DenseFeature("x")]
    mlp = keras.Sequential([keras.layers.Dense(1)])
    return wl.Session(tower or mlp, features, context, optimizer=keras.optimizers.SGD(0.1))


def batch(x: np.ndarray, labels: np.ndarray | None = None) -> CsrBatch:
    n = len(x)
    user = Csr(np.arange(1, n + 1, dtype=np.uint64), np.arange(n + 1, dtype=np.int64))
    y = (np.arange(n) % 2).astype(np.float32) if labels is None else labels
    return CsrBatch({"user": user}, x.reshape(n, 1).astype(np.float32), y, n, {"x": slice(0, 1)})


def weights(s: wl.Session) -> list[np.ndarray]:
    return [np.array(v) for v in s.functions.tower.weights]


def table_rows(s: wl.Session) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for chunk in s.context.engine.export("emb"):
        out.update({int(k): w.copy() for k, w in zip(chunk.keys, chunk.weights, strict=True)})
    return out


class SqrtTower:
    """sqrt(|x * s|): where x is 0 the gradient of s is NaN, the loss finite."""

    def __init__(self) -> None:
        self.w = tf.Variable(np.ones((4, 1), np.float32), name="w")
        self.s = tf.Variable(1.0, name="s")

    def __call__(self, emb: dict, dense: dict) -> tf.Tensor:
        return emb["user"] @ self.w + tf.sqrt(tf.abs(dense["x"] * self.s))


class LogTower:
    """log(x): NaN where x < 0."""

    def __init__(self) -> None:
        self.w = tf.Variable(np.ones((4, 1), np.float32), name="w")

    def __call__(self, emb: dict, dense: dict) -> tf.Tensor:
        return emb["user"] @ self.w + tf.math.log(dense["x"])


class NanRowTower:
    """The gradient of the user embedding is NaN where x is 0; loss finite."""

    def __init__(self) -> None:
        self.w = tf.Variable(np.ones((4, 1), np.float32), name="w")

    def __call__(self, emb: dict, dense: dict) -> tf.Tensor:
        scale = tf.where(dense["x"] == 0.0, np.float32(np.nan), np.float32(1.0))
        v = tf.stop_gradient(scale) * emb["user"]
        picked = tf.where(dense["x"] == 0.0, tf.zeros_like(v), v)  # forward finite, backward nan
        return picked @ tf.stop_gradient(self.w)


def test_a_nan_loss_stops_training_by_default() -> None:
    s = session(tower=LogTower())
    s.run(batch(np.ones(8)))
    before = s.functions.tower.w.numpy(), table_rows(s)
    with pytest.raises(NonFiniteError, match=r"loss is nan at step 2"):
        s.run(batch(np.where(np.arange(8) == 3, -1.0, 1.0)))
    # Nothing of the failing step was applied.
    np.testing.assert_array_equal(s.functions.tower.w.numpy(), before[0])
    after = table_rows(s)
    assert all(np.array_equal(after[k], v) for k, v in before[1].items())


def test_a_non_finite_tower_gradient_names_the_variable_and_step() -> None:
    s = session(tower=SqrtTower())
    x = np.linspace(0.5, 1.5, 8)
    s.run(batch(x))
    x[5] = 0.0
    before = s.functions.tower.s.numpy(), s.functions.tower.w.numpy()
    with pytest.raises(NonFiniteError) as info:
        s.run(batch(x))
    message = str(info.value)
    assert "tower variable 's'" in message and "at step 2" in message, message
    assert "'w'" not in message, message
    # No variable took the step's update (the finite ones are left alone too
    # with SGD: a non-finite loss or gradient stops before anything else).
    np.testing.assert_array_equal(s.functions.tower.s.numpy(), before[0])


def test_a_non_finite_row_gradient_names_the_table_key_and_step() -> None:
    s = session(tower=NanRowTower())
    x = np.ones(8)
    s.run(batch(x))
    before = table_rows(s)
    x[6] = 0.0
    with pytest.raises(NonFiniteError, match=r"table 'emb': the gradient of key 7 is not finite"):
        s.run(batch(x))
    assert table_rows(s).keys() == before.keys()
    for key, row in table_rows(s).items():  # no row of the failing step was pushed
        np.testing.assert_array_equal(row, before[key])


def test_drop_mode_skips_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    s = session("drop", tower=NanRowTower())
    x = np.ones(8)
    x[6] = 0.0
    with caplog.at_level(logging.WARNING, logger="wuliang"):
        s.run(batch(x))
        s.run(batch(x))
    assert s.non_finite == {"emb": 2}
    assert s.context.engine.stats("emb")["dropped_nan"] == 2
    assert "not finite" in caplog.text and "'emb'" in caplog.text
    with wl.Context(num_shards=1) as fresh:  # the same table, untrained
        fresh.create_table(s.context.tables["emb"])
        initial = fresh.engine.pull("emb", np.array([7], np.uint64), train=False)[0]
    np.testing.assert_array_equal(table_rows(s)[7], initial)  # key 7's updates were dropped
    assert not np.array_equal(table_rows(s)[1], initial)

    t = session("drop", tower=SqrtTower())
    x = np.linspace(0.5, 1.5, 8)
    x[2] = 0.0
    scale = t.functions.tower.s.numpy().copy()
    t.run(batch(x))
    assert t.non_finite == {"tower": 1}
    assert t.functions.tower.s.numpy() == scale  # its gradient was dropped (SGD: no update)
    with pytest.raises(ValueError, match="non_finite must be 'raise' or 'drop', got 'ignore'"):
        wl.Context(non_finite="ignore")


def test_training_through_the_pipeline_stops_at_a_nan(tmp_path: Path) -> None:
    x = np.ones(N)
    x[45] = 0.0
    path = write_data(tmp_path / "part-0.parquet", x)
    s = session(tower=NanRowTower())
    with pytest.raises(NonFiniteError, match=r"key 3 is not finite .* at step 6"):
        s.train(ParquetReader(path, 8, ["user", "x"], label="label"))


# -- metrics -------------------------------------------------------------------


def test_metrics_refuse_non_finite_predictions() -> None:
    labels = np.array([0, 1, 0, 1], np.float32)
    scores = np.array([0.1, 0.9, np.nan, 0.8], np.float32)
    with pytest.raises(ValueError, match=r"score 2 is nan"):
        auc(labels, scores)
    with pytest.raises(ValueError, match=r"score 2 is nan"):
        logloss(labels, scores)
    metrics = Metrics()
    metrics.update(labels, scores)
    with pytest.raises(ValueError, match=r"score 2 is nan"):
        metrics.result()
    with pytest.raises(ValueError, match=r"label 1 is inf"):
        auc(np.array([0, np.inf]), np.array([0.2, 0.3]))
    assert auc(labels, np.array([0.1, 0.9, 0.2, 0.8])) == 1.0
