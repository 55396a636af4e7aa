"""The TF bridge against a pure-TensorFlow reference with the same weights.

One training step of a small model (two tables; a single-valued feature and a
weighted multi-valued feature sharing one table; a second table whose keys
also occur in the first; empty rows; a dense feature; a sequence feature)
runs on the engine (``wuliang.optimizers.SGD``) and a Keras ``SGD`` for the
tower. The same step is computed with the tables as ``tf.Variable`` s
(``tf.nn.safe_embedding_lookup_sparse`` / ``tf.gather``) under a
``GradientTape``; loss, updated rows and updated tower weights must agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import wuliang as wl
from wuliang.ps_server import Normal
from wuliang.reader import Csr, CsrBatch

ROW_LR = 0.2  # engine SGD on the rows
TOWER_LR = 0.1  # Keras SGD on the tower
T1 = wl.EmbeddingTable("t1", dim=4, optimizer=wl.optimizers.SGD(ROW_LR), initializer=Normal(0.5))
T2 = wl.EmbeddingTable(  # the same dim as t1: the bridge packs them into one input
    "t2", dim=4, optimizer=wl.optimizers.SGD(ROW_LR), initializer=Normal(0.5), seed=7
)
T3 = wl.EmbeddingTable(
    "t3", dim=3, optimizer=wl.optimizers.SGD(ROW_LR), initializer=Normal(0.5), seed=9
)
LABELS = np.array([1, 0, 1, 0, 1], np.float32)
DENSE_X = np.array([[0.5, -1.0], [1.5, 0.2], [-0.3, 0.8], [0.0, 0.0], [2.0, -0.5]], np.float32)

# Per feature: (table, rows of keys, rows of weights or None). Key 1 is in
# "user" and "hist" (same table t1), in "item" and "tags" (table t2, packed
# with t1: other rows) and in "brand" (t3); keys 4 and 13 repeat within a row;
# every feature has empty rows; "user", "item" have at most one value per row
# (the bridge's single-value gather), "brand" too but weighted (pooled).
POOLED: dict[str, tuple[wl.EmbeddingTable, list[list[int]], list[list[float]] | None]] = {
    "user": (T1, [[1], [2], [1], [], [2]], None),
    "hist": (
        T1,
        [[1, 4, 4], [], [5], [2, 6, 1, 7], []],
        [[0.5, 1.0, 2.0], [], [1.5], [0.3, 1.2, 0.7, 2.5], []],
    ),
    "item": (T2, [[1], [11], [1], [12], []], None),
    "tags": (T2, [[11, 13], [13], [], [1, 13, 13], [14]], None),
    "brand": (T3, [[12], [1], [], [14], [1]], [[2.0], [0.5], [], [1.5], [3.0]]),
}
SEQ_MAX_LEN = 3
SEQUENCE: dict[str, tuple[wl.EmbeddingTable, list[list[int]], list[list[float]] | None]] = {
    "user": (T1, [[1], [2], [1], [], [2]], None),
    # row 2 is longer than max_len (key 9 is cut off), key 1 repeats in row 4
    "seq": (T1, [[1, 4, 5], [], [6, 7, 8, 9], [4], [1, 1]], None),
    "item": (T2, [[1], [11], [1], [12], []], None),
}
POSITION_WEIGHTS = [1.0, 0.5, 0.25]


def csr(rows: Sequence[Sequence[int]], weights: Sequence[Sequence[float]] | None) -> Csr:
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    values = np.array([k for r in rows for k in r], np.uint64)
    w = None if weights is None else np.array([x for r in weights for x in r], np.float32)
    return Csr(values, offsets, w)


def make_batch(spec: dict[str, tuple[Any, list[list[int]], Any]]) -> CsrBatch:
    sparse = {name: csr(rows, weights) for name, (_, rows, weights) in spec.items()}
    return CsrBatch(sparse, DENSE_X.copy(), LABELS.copy(), len(LABELS), {"x": slice(0, 2)})


def table_keys(spec: dict[str, tuple[wl.EmbeddingTable, list[list[int]], Any]]) -> dict[str, Any]:
    """Sorted unique keys per table over every feature that uses it."""
    keys: dict[str, set[int]] = {}
    for table, rows, _ in spec.values():
        keys.setdefault(table.name, set()).update(k for r in rows for k in r)
    return {t: np.array(sorted(ks), np.uint64) for t, ks in keys.items()}


def numpy_pool(
    rows: list[list[int]],
    weights: list[list[float]] | None,
    table: dict[int, np.ndarray],
    combiner: str,
    dim: int,
) -> np.ndarray:
    """The reference pooling, one row at a time in float64."""
    out = np.zeros((len(rows), dim))
    for i, keys in enumerate(rows):
        w = np.ones(len(keys)) if weights is None else np.asarray(weights[i], np.float64)
        if not keys:
            continue
        total = sum(wj * table[k].astype(np.float64) for k, wj in zip(keys, w, strict=True))
        norm = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        out[i] = total / norm
    return out


@dataclass
class Tower:
    """concat(features, dense) -> Dense(6, tanh) -> Dense(1); sequence features
    are pooled with fixed position weights under their mask."""

    names: list[str]
    sequence: str | None = None
    fused: bool = False  # wl.embedding.concat instead of tf.concat

    def __post_init__(self) -> None:
        self.hidden = keras.layers.Dense(
            6, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1)
        )
        self.out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2))

    def __call__(self, embeddings: dict[str, Any], dense: dict[str, tf.Tensor]) -> tf.Tensor:
        parts = []
        for name in self.names:
            if name == self.sequence:
                values, mask = embeddings[name]
                weighted = mask * tf.constant(POSITION_WEIGHTS)[None, :]
                total = tf.reduce_sum(values * weighted[:, :, None], axis=1)
                count = tf.maximum(tf.reduce_sum(mask, axis=1, keepdims=True), 1.0)
                parts.append(total / count)
            else:
                parts.append(embeddings[name])
        parts.append(dense["x"])
        x = wl.embedding.concat(parts) if self.fused else tf.concat(parts, axis=1)
        return self.out(self.hidden(x))

    def variables(self) -> list[tf.Variable]:
        return [*self.hidden.trainable_variables, *self.out.trainable_variables]


def copy_tower(tower: Tower, width: int) -> Tower:
    """A second tower with the same weights (and fresh variables)."""
    twin = Tower(tower.names, tower.sequence)  # tf.concat
    twin.hidden.build((None, width))
    twin.out.build((None, 6))
    twin.hidden.set_weights(tower.hidden.get_weights())
    twin.out.set_weights(tower.out.get_weights())
    return twin


def exported_rows(session: wl.Session, table: str) -> dict[int, np.ndarray]:
    rows = {}
    for chunk in session.context.engine.export(table):
        for key, row in zip(chunk.keys.tolist(), chunk.weights, strict=True):
            rows[key] = row.copy()
    return rows


def sparse_ids(
    rows: list[list[int]], weights: list[list[float]] | None, index: dict[int, int]
) -> tuple[tf.SparseTensor, tf.SparseTensor | None]:
    """The feature as SparseTensors of variable row ids (and weights)."""
    coords = [[i, j] for i, r in enumerate(rows) for j in range(len(r))]
    width = max(1, *(len(r) for r in rows))
    ids = tf.SparseTensor(
        tf.constant(coords, tf.int64, shape=[len(coords), 2]),
        tf.constant([index[k] for r in rows for k in r], tf.int64),
        [len(rows), width],
    )
    if weights is None:
        return ids, None
    w = tf.SparseTensor(ids.indices, tf.constant([x for r in weights for x in r]), ids.dense_shape)
    return ids, w


def reference_step(
    spec: dict[str, tuple[wl.EmbeddingTable, list[list[int]], list[list[float]] | None]],
    combiner: str,
    initial: dict[str, np.ndarray],
    keys: dict[str, np.ndarray],
    tower: Tower,
) -> tuple[float, dict[str, dict[int, np.ndarray]], list[np.ndarray]]:
    """Pure TF: loss, rows after an SGD step, tower weights after an SGD step."""
    variables = {t: tf.Variable(initial[t]) for t in initial}
    index = {t: {int(k): i for i, k in enumerate(keys[t])} for t in keys}
    with tf.GradientTape() as tape:
        embeddings: dict[str, Any] = {}
        for name, (table, rows, weights) in spec.items():
            var, idx = variables[table.name], index[table.name]
            if name == tower.sequence:
                padded = np.zeros((len(rows), SEQ_MAX_LEN), np.int64)
                mask = np.zeros((len(rows), SEQ_MAX_LEN), np.float32)
                for i, r in enumerate(rows):
                    for j, k in enumerate(r[:SEQ_MAX_LEN]):
                        padded[i, j], mask[i, j] = idx[k], 1.0
                values = tf.gather(var, padded) * mask[:, :, None]
                embeddings[name] = (values, tf.constant(mask))
            else:
                ids, w = sparse_ids(rows, weights, idx)
                embeddings[name] = tf.nn.safe_embedding_lookup_sparse(
                    var, ids, w, combiner=combiner
                )
        logits = tower(embeddings, {"x": tf.constant(DENSE_X)})
        loss = tf.reduce_mean(
            tf.nn.sigmoid_cross_entropy_with_logits(labels=LABELS, logits=logits[:, 0])
        )
    tower_vars = tower.variables()
    grads = tape.gradient(loss, [*variables.values(), *tower_vars])
    rows_after = {}
    for (t, var), g in zip(variables.items(), grads, strict=False):
        updated = var.numpy() - ROW_LR * tf.convert_to_tensor(g).numpy()
        rows_after[t] = {int(k): updated[i] for i, k in enumerate(keys[t])}
    tower_after = [
        v.numpy() - TOWER_LR * g.numpy()
        for v, g in zip(tower_vars, grads[len(variables) :], strict=True)
    ]
    return float(loss), rows_after, tower_after


def check_step(
    spec: dict[str, tuple[wl.EmbeddingTable, list[list[int]], list[list[float]] | None]],
    combiner: str | None,
    sequence: str | None,
    fused: bool = False,
    order: list[str] | None = None,
) -> None:
    """One step of the spec's features, concatenated by the tower in `order`
    (default: declared), compared with pure TF (which uses tf.concat)."""
    keras.utils.set_random_seed(11)
    features: list[wl.SparseFeature | wl.DenseFeature] = [
        wl.SparseFeature(name, table, combiner=None, max_len=SEQ_MAX_LEN)
        if name == sequence
        else wl.SparseFeature(name, table, combiner=combiner or "sum")
        for name, (table, _, _) in spec.items()
    ]
    features.append(wl.DenseFeature("x", dim=2))
    tower = Tower(order or list(spec), sequence, fused)
    width = sum(t.dim for t, _, _ in spec.values()) + 2
    tower.hidden.build((None, width))
    tower.out.build((None, 6))
    twin = copy_tower(tower, width)
    session = wl.Session(
        tower,
        features,
        wl.Context(num_shards=2),
        optimizer=keras.optimizers.SGD(TOWER_LR),
    )
    engine = session.context.engine
    keys = table_keys(spec)
    initial = {t: engine.pull(t, k, train=False) for t, k in keys.items()}
    assert all(engine.stats(t)["rows"] == 0 for t in keys)  # a lookup creates nothing

    batch = make_batch(spec)
    fetched = session.run(batch, ["loss", "logits", *spec], train=True)

    loss, rows_after, tower_after = reference_step(spec, combiner or "sum", initial, keys, twin)
    np.testing.assert_allclose(fetched["loss"], loss, rtol=1e-6)

    # the fetched embeddings: manual pooling (or padding) of the rows used
    for name, (table, rows, weights) in spec.items():
        by_key = dict(zip(keys[table.name].tolist(), initial[table.name], strict=True))
        if name == sequence:
            values, mask = fetched[name]
            want = np.zeros((len(rows), SEQ_MAX_LEN, table.dim), np.float32)
            want_mask = np.zeros((len(rows), SEQ_MAX_LEN), np.float32)
            for i, r in enumerate(rows):
                for j, k in enumerate(r[:SEQ_MAX_LEN]):
                    want[i, j], want_mask[i, j] = by_key[k], 1.0
            np.testing.assert_array_equal(mask, want_mask)
            np.testing.assert_allclose(values, want, rtol=1e-6)
        else:
            want = numpy_pool(rows, weights, by_key, combiner or "sum", table.dim)
            np.testing.assert_allclose(fetched[name], want, rtol=1e-5, atol=1e-6)

    # rows: exactly the batch's keys exist (not those past max_len: neither
    # pulled nor pushed), each moved by its whole gradient
    for table, want_rows in rows_after.items():
        got = exported_rows(session, table)
        cut_off = {9} if sequence and table == "t1" else set()
        want_rows = {k: row for k, row in want_rows.items() if k not in cut_off}
        assert sorted(got) == sorted(want_rows)
        start = dict(zip(keys[table].tolist(), initial[table], strict=True))
        moved = {k for k, row in want_rows.items() if np.abs(row - start[k]).max() > 1e-4}
        assert moved == set(want_rows)  # the comparison is not vacuous
        for key, row in want_rows.items():
            np.testing.assert_allclose(
                got[key], row, rtol=1e-5, atol=1e-7, err_msg=f"{table}/{key}"
            )

    # the tower
    for got, want in zip(tower.variables(), tower_after, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
    assert session.global_step == 1


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_one_step_matches_pure_tf(combiner: str) -> None:
    check_step(POOLED, combiner, sequence=None)


def test_fused_concat_tower_matches_pure_tf() -> None:
    """A tower concatenating with wl.embedding.concat: "user" and "item" are the
    two single-valued features of the dim-4 lookup, adjacent: taken as one
    reshape of it; same loss, rows and tower as tf.concat in pure TF."""
    check_step(POOLED, "mean", None, fused=True, order=["user", "item", "hist", "tags", "brand"])


def test_sequence_feature_matches_pure_tf() -> None:
    """values and mask reach the tower; the tower's masked pooling trains the rows
    (the value past max_len gets no gradient)."""
    check_step(SEQUENCE, "sum", sequence="seq")


def test_a_table_with_no_keys_in_the_batch() -> None:
    """A table whose features are all empty in a batch is pulled with no keys and
    pushed nothing; the step still trains the rest."""
    keras.utils.set_random_seed(3)
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(4))

    def tower(embeddings: dict[str, tf.Tensor], dense_in: dict[str, tf.Tensor]) -> tf.Tensor:
        return dense(tf.concat([embeddings["user"], embeddings["brand"], dense_in["x"]], axis=1))

    session = wl.Session(
        tower,
        [wl.SparseFeature("user", T1), wl.SparseFeature("brand", T3), wl.DenseFeature("x", 2)],
        wl.Context(num_shards=2),
        optimizer=keras.optimizers.SGD(TOWER_LR),
    )
    empty = {"user": (T1, [[1], [2], [], [3], [1]], None), "brand": (T3, [[]] * 5, None)}
    # A table with no keys in the batch (alone in its dimension) reads as zero rows.
    out = session.run(make_batch(empty), ["loss", "brand"])
    assert np.isfinite(out["loss"])
    np.testing.assert_array_equal(out["brand"], np.zeros((5, 3), np.float32))
    assert session.context.engine.stats("t3")["rows"] == 0
    assert sorted(exported_rows(session, "t1")) == [1, 2, 3]


@pytest.mark.parametrize("unused", ["item", "brand"])
def test_feature_the_tower_does_not_use(unused: str) -> None:
    """A declared sparse feature the tower ignores (or only exposes as an output)
    has no gradient path: its rows should simply not change. ("item"'s table t2
    is packed with t1, which the loss uses; "brand"'s t3 is alone.)"""
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(4))

    def tower(embeddings: dict[str, tf.Tensor], dense_in: dict[str, tf.Tensor]) -> Any:
        logits = dense(tf.concat([embeddings["user"], dense_in["x"]], axis=1))
        return logits, {"unused_vec": embeddings[unused]}

    table = POOLED[unused][0]
    session = wl.Session(
        tower,
        [wl.SparseFeature("user", T1), wl.SparseFeature(unused, table), wl.DenseFeature("x", 2)],
        wl.Context(num_shards=2),
    )
    spec = {"user": POOLED["user"], unused: POOLED[unused]}
    keys = table_keys(spec)[table.name]
    before = session.context.engine.pull(table.name, keys, train=False)
    # A feature that does not reach the loss gets zero row gradients.
    out = session.run(make_batch(spec), ["loss", "unused_vec"])
    assert np.isfinite(out["loss"])
    after = session.context.engine.pull(table.name, keys, train=False)
    np.testing.assert_array_equal(after, before)


def test_embedding_table_statistics_options() -> None:
    """``stats_half_life`` goes into the table's spec; ``stats_label`` is a
    column name or None."""
    table = wl.EmbeddingTable("items", 4, stats_label="click", stats_half_life=100)
    assert table.spec().stats_half_life == 100 and table.stats_label == "click"
    assert wl.EmbeddingTable("items", 4).spec().stats_half_life == 0
    with pytest.raises(ValueError, match="stats_label"):
        wl.EmbeddingTable("items", 4, stats_label="")
    with pytest.raises(ValueError, match="stats_half_life"):
        wl.EmbeddingTable("items", 4, stats_half_life=-1)
