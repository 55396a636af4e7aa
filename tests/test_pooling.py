"""wuliang.embedding.pooling (numpy) against what the TF bridge hands the tower.

The reference is the training path itself: ``KeyPreparer`` (with or without
the sequence features' trims), ``bridge.batch_inputs`` (packing, the
single-valued gather, weights, max_len) and ``bridge.pool`` / ``sequence`` on
the gathered rows inside a ``tf.function``, as ``StepFunctions._forward``
runs them. numpy folds each row's sum in TensorFlow's order, so the results
are compared for equality, bit for bit; ``assert_same`` first checks the
1e-6 tolerance, to tell a rounding difference from a wrong result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import tensorflow as tf

from wuliang.embedding import EmbeddingTable, SparseFeature
from wuliang.embedding.bridge import Layout, batch_inputs, pool, sequence
from wuliang.embedding.pooling import Pooled, pool_features, pool_rows, pool_unique
from wuliang.reader import Csr, CsrBatch, KeyPreparer, PreparedKeys

RTOL = ATOL = 1e-6
COMBINERS = ("sum", "mean", "sqrtn", None)
# (dim of table t0, dim of table t1): equal dims share a packed group
DIMS = [(1, 64), (64, 64), (1, 1), (8, 3), (17, 32), (5, 5)]


@tf.function(reduce_retracing=True)
def graph_pool(
    values: tf.Tensor, segments: tf.Tensor, weights: tf.Tensor, combiner: str, size: tf.Tensor
) -> tf.Tensor:
    return pool(values, segments, weights, combiner, size)


@tf.function(reduce_retracing=True)
def graph_sequence(
    values: tf.Tensor,
    segments: tf.Tensor,
    positions: tf.Tensor,
    weights: tf.Tensor,
    max_len: int,
    size: tf.Tensor,
) -> tuple[tf.Tensor, tf.Tensor]:
    return sequence(values, segments, positions, weights, max_len, size)


def random_csr(
    rng: np.random.Generator, size: int, longest: int, weighted: bool, vocab: int = 50
) -> Csr:
    """Rows of 0..longest keys (about a quarter empty), weights in [0.1, 2)."""
    lengths = rng.integers(1, longest + 1, size) * (rng.random(size) > 0.25)
    offsets = np.zeros(size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, vocab, offsets[-1]).astype(np.uint64)
    weights = rng.uniform(0.1, 2.0, offsets[-1]).astype(np.float32) if weighted else None
    return Csr(values, offsets, weights)


def random_case(
    seed: int, dims: tuple[int, int]
) -> tuple[list[SparseFeature], CsrBatch, dict[str, np.ndarray]]:
    """Features of every combiner, weighted or not, over two tables; two
    single-valued ones (the bridge's [B, F] gather); a batch; table rows by key."""
    rng = np.random.default_rng(seed)
    tables = [EmbeddingTable(f"t{i}", d) for i, d in enumerate(dims)]
    size = int(rng.integers(1, 200))
    features, sparse = [], {}
    for combiner in COMBINERS:
        for weighted in (False, True):
            name = f"{combiner or 'seq'}_{'w' if weighted else 'u'}"
            max_len = int(rng.integers(1, 5)) if combiner is None else None
            table = tables[int(rng.integers(0, 2))]
            features.append(SparseFeature(name, table, combiner, max_len))
            sparse[name] = random_csr(rng, size, int(rng.integers(1, 12)), weighted)
    for combiner in ("sum", "sqrtn"):  # at most one value a row, no weights
        name = f"single_{combiner}"
        features.append(SparseFeature(name, tables[int(rng.integers(0, 2))], combiner))
        sparse[name] = random_csr(rng, size, 1, weighted=False)
    batch = CsrBatch(sparse, np.zeros((size, 0), np.float32), None, size)
    batch.validate()
    # Every key's row, to be pulled for the uniques; the scale varies per table.
    vectors = {
        t.name: (rng.normal(size=(50, t.dim)) * rng.uniform(0.01, 10)).astype(np.float32)
        for t in tables
    }
    return features, batch, vectors


def prepare(features: Sequence[SparseFeature], batch: CsrBatch, trim: bool) -> PreparedKeys:
    """The keys as Session prepares them (trim=True: the sequence features'
    max_lens) or untrimmed (batch_inputs then trims)."""
    max_lens = {f.name: f.max_len for f in features if f.is_sequence and f.max_len} if trim else {}
    tables = {f.name: f.table.name for f in features}
    return KeyPreparer(tables, num_shards=2, max_lens=max_lens)(batch)


def pulled(prepared: PreparedKeys, vectors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows pulled per table for its uniques (keys are row numbers here)."""
    return {t: vectors[t][keys.uniques.astype(np.int64)] for t, keys in prepared.tables.items()}


def bridge_embeddings(
    features: Sequence[SparseFeature],
    batch: CsrBatch,
    prepared: PreparedKeys,
    rows: dict[str, np.ndarray],
) -> dict[str, Pooled]:
    """What the training step hands the tower (StepFunctions._forward)."""
    layout = Layout.of(features)
    inputs = batch_inputs(batch, prepared, features, [], layout)
    packed = []
    for (dim, tables), n in zip(layout.groups, inputs.group_rows, strict=True):
        group = np.concatenate([rows[t] for t in tables] + [np.zeros((1, dim), np.float32)])
        assert len(group) == n + 1  # the pulled rows, then the zero row
        packed.append(tf.constant(group))
    out: dict[str, Pooled] = {}
    column = [0] * len(layout.groups)
    for f, single in zip(features, inputs.single, strict=True):
        g = layout.group_of(f.table.name)
        if single:
            out[f.name] = tf.gather(packed[g], inputs.row_index[g][:, column[g]]).numpy()
            column[g] += 1
            continue
        fi = inputs.features[f.name]
        values = tf.gather(packed[g], fi.inverse)
        size = tf.constant(batch.size, tf.int32)
        if f.is_sequence:
            assert f.max_len is not None
            padded, mask = graph_sequence(
                values, fi.segments, fi.positions, fi.weights, f.max_len, size
            )
            out[f.name] = (padded.numpy(), mask.numpy())
        else:
            out[f.name] = graph_pool(values, fi.segments, fi.weights, f.combiner, size).numpy()
    assert all(inputs.single[-2:]), "the single_* features take the [B, F] gather"
    return out


def assert_same(got: Pooled, want: Pooled, name: str) -> None:
    """Equal bit for bit (after checking the tolerance, for a clearer failure)."""
    got_parts = got if isinstance(got, tuple) else (got,)
    want_parts = want if isinstance(want, tuple) else (want,)
    assert len(got_parts) == len(want_parts), name
    for g, w in zip(got_parts, want_parts, strict=True):
        assert g.shape == w.shape and g.dtype == np.float32, (name, g.shape, w.shape, g.dtype)
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_array_equal(g, w, err_msg=f"{name}: not the same bits")


@pytest.mark.parametrize("trim", [True, False], ids=["prepared-trim", "untrimmed"])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("dims", DIMS, ids=[f"dims{a}-{b}" for a, b in DIMS])
def test_pooling_equals_the_bridge(dims: tuple[int, int], seed: int, trim: bool) -> None:
    features, batch, vectors = random_case(seed * 100 + dims[0] + dims[1], dims)
    prepared = prepare(features, batch, trim)
    rows = pulled(prepared, vectors)
    want = bridge_embeddings(features, batch, prepared, rows)
    every = pool_features(features, prepared, rows)
    assert list(every) == [f.name for f in features]
    for f in features:
        index = prepared.features[f.name]
        max_len = f.max_len if f.is_sequence else None
        table = rows[f.table.name]
        assert_same(every[f.name], want[f.name], f.name)
        if not f.is_sequence:
            pooled = every[f.name]
            assert isinstance(pooled, np.ndarray)
            assert not pooled[np.diff(index.offsets) == 0].any(), "an empty row pools to zeros"
        unique = pool_unique(
            table, index.inverse, index.offsets, f.combiner, index.weights, max_len
        )
        assert_same(unique, want[f.name], f.name)
        looked_up = table[index.inverse]  # every value's row, CSR order
        direct = pool_rows(looked_up, index.offsets, f.combiner, index.weights, max_len)
        assert_same(direct, want[f.name], f.name)
    if not trim:  # some sequence rows are longer than max_len: truncation is tested
        assert any(
            np.diff(batch.sparse[f.name].offsets).max() > (f.max_len or 0)
            for f in features
            if f.is_sequence
        )


# Row lengths exercising both halves of the fold: many rows stepped by
# position, and the last few long rows (np.add.at).
LENGTHS = {
    "few-long-rows": [300, 0, 1000, 7, 20],
    "many-short-then-few-long": [*[0, 1, 2, 3, 4] * 60, 400, 0, 350, 401],
    "many-rows": "random 0..30 x 2000",
    "one-row": [37],
}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dim", [1, 13, 64])
@pytest.mark.parametrize("layout", list(LENGTHS))
def test_long_and_many_rows_equal_the_bridge(layout: str, dim: int, weighted: bool) -> None:
    rng = np.random.default_rng(dim)
    lengths = LENGTHS[layout]
    lengths = rng.integers(0, 31, 2000) if isinstance(lengths, str) else np.array(lengths)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows = (rng.normal(size=(offsets[-1], dim)) * 10).astype(np.float32)  # sums cancel
    weights = rng.uniform(-1, 2, offsets[-1]).astype(np.float32) if weighted else None
    segments = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    tf_weights = np.ones(offsets[-1], np.float32) if weights is None else weights
    size = tf.constant(len(lengths), tf.int32)
    for combiner in ("sum", "mean", "sqrtn"):
        want = graph_pool(rows, segments, tf_weights, combiner, size).numpy()
        assert_same(pool_rows(rows, offsets, combiner, weights), want, combiner)


def test_a_worked_example() -> None:
    rows = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.float32)
    offsets = np.array([0, 2, 2, 3, 4])  # rows [0, 1], [], [2], [3]
    weights = np.array([1, 3, 0, 2], np.float32)
    np.testing.assert_array_equal(pool_rows(rows, offsets, "sum"), [[4, 6], [0, 0], [5, 6], [7, 8]])
    np.testing.assert_array_equal(
        pool_rows(rows, offsets, "sum", weights), [[10, 14], [0, 0], [0, 0], [14, 16]]
    )
    # mean: sum(w v) / sum(w); a zero sum of weights gives 0 (divide_no_nan)
    np.testing.assert_array_equal(
        pool_rows(rows, offsets, "mean", weights), [[2.5, 3.5], [0, 0], [0, 0], [7, 8]]
    )
    sqrtn = pool_rows(rows, offsets, "sqrtn", weights)
    np.testing.assert_allclose(sqrtn[0], np.array([10, 14]) / np.sqrt(10), rtol=1e-7)
    np.testing.assert_array_equal(sqrtn[1:], [[0, 0], [0, 0], [7, 8]])
    values, mask = pool_rows(rows, offsets, None, weights, max_len=1)
    np.testing.assert_array_equal(values, [[[1, 2]], [[0, 0]], [[0, 0]], [[14, 16]]])
    np.testing.assert_array_equal(mask, [[1], [0], [1], [1]])  # weight 0 still counts
    values, mask = pool_rows(rows, offsets, None, max_len=3)
    assert values.shape == (4, 3, 2) and mask.shape == (4, 3)
    np.testing.assert_array_equal(mask, [[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(values[0], [[1, 2], [3, 4], [0, 0]])


@pytest.mark.parametrize("combiner", COMBINERS)
def test_weights_cancelling_out_divide_no_nan_as_tf(combiner: str | None) -> None:
    rows = np.array([[1, -2], [3, 4], [5, 6]], np.float32)
    offsets = np.array([0, 2, 3, 3])
    weights = np.array([1, -1, 0], np.float32)  # row 0: sum 0; row 1: all zero
    max_len = 2 if combiner is None else None
    got = pool_rows(rows, offsets, combiner, weights, max_len)
    segments = tf.constant([0, 0, 1])
    if combiner is None:
        positions = tf.constant([0, 1, 0])
        want = sequence(rows, segments, positions, weights, 2, tf.constant(3))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w.numpy())
    else:
        np.testing.assert_array_equal(got, pool(rows, segments, weights, combiner, 3).numpy())


@pytest.mark.parametrize("combiner", COMBINERS)
def test_empty_batches_and_rows(combiner: str | None) -> None:
    max_len = 4 if combiner is None else None
    for size in (0, 3):  # no rows; rows without values
        offsets = np.zeros(size + 1, np.int64)
        got = pool_rows(np.zeros((0, 5), np.float32), offsets, combiner, max_len=max_len)
        if combiner is None:
            assert isinstance(got, tuple)
            assert got[0].shape == (size, 4, 5) and got[1].shape == (size, 4)
            assert not got[0].any() and not got[1].any()
        else:
            assert isinstance(got, np.ndarray)
            assert got.shape == (size, 5) and got.dtype == np.float32 and not got.any()
        unique = pool_unique(
            np.ones((2, 5), np.float32), np.zeros(0, np.int32), offsets, combiner, None, max_len
        )
        assert not (unique[0] if isinstance(unique, tuple) else unique).any()


def test_inputs_are_converted_not_modified() -> None:
    rows = np.arange(6, dtype=np.float64).reshape(3, 2)  # float64 in, float32 out
    rows.flags.writeable = False
    offsets = [0, 1, 3]  # a list of ints
    out = pool_rows(rows, offsets, "mean", weights=[1.0, 1.0, 3.0])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[0, 1], [(2 + 12) / 4, (3 + 15) / 4]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"combiner": "max"}, "combiner must be 'sum', 'mean', 'sqrtn' or None, got 'max'"),
        ({"combiner": None}, "needs an int max_len >= 1, got None"),
        ({"combiner": None, "max_len": 0}, "needs an int max_len >= 1, got 0"),
        ({"max_len": 3}, "max_len=3 is for sequences"),
        ({"offsets": np.array([1, 2, 3])}, "offsets must start at 0, got 1"),
        ({"offsets": np.array([0, 2, 1, 3])}, "offsets decrease after row 1"),
        ({"offsets": np.array([0, 2])}, "offsets end at 2 but rows has 3 values"),
        ({"offsets": np.array([0.0, 3.0])}, "offsets must be a 1-D integer array"),
        ({"offsets": np.zeros(0, np.int64)}, "offsets must be a 1-D integer array"),
        ({"weights": np.ones(2, np.float32)}, r"weights must be \[nnz\] = \[3\]"),
        ({"rows": np.ones(3, np.float32)}, r"rows must be a 2-D float array \[n, dim\]"),
        ({"rows": np.ones((3, 2), np.int64)}, "rows must be a 2-D float array"),
    ],
)
def test_pool_rows_errors_name_the_bad_input(kwargs: dict, message: str) -> None:
    args = {
        "rows": np.ones((3, 2), np.float32),
        "offsets": np.array([0, 1, 3]),
        "combiner": "sum",
        "weights": None,
        "max_len": None,
    }
    with pytest.raises(ValueError, match=message):
        pool_rows(**{**args, **kwargs})


def test_pool_unique_errors() -> None:
    unique = np.ones((4, 2), np.float32)
    offsets = np.array([0, 1, 3])
    with pytest.raises(ValueError, match="inverse index 4 is outside the 4 unique rows"):
        pool_unique(unique, np.array([0, 4, 1]), offsets, "sum")
    with pytest.raises(ValueError, match="inverse index -1 is outside"):
        pool_unique(unique, np.array([0, -1, 1]), offsets, "sum")
    with pytest.raises(ValueError, match="offsets end at 3 but inverse has 2 values"):
        pool_unique(unique, np.array([0, 1]), offsets, "sum")
    with pytest.raises(ValueError, match="inverse must be a 1-D integer array"):
        pool_unique(unique, np.array([0.0, 1.0, 2.0]), offsets, "sum")


def test_pool_features_errors() -> None:
    features, batch, vectors = random_case(7, (4, 6))
    prepared = prepare(features, batch, trim=True)
    rows = pulled(prepared, vectors)
    missing = SparseFeature("nope", features[0].table)
    with pytest.raises(KeyError, match="no feature 'nope'"):
        pool_features([missing], prepared, rows)
    other = SparseFeature(features[0].name, EmbeddingTable("other", features[0].table.dim))
    with pytest.raises(ValueError, match=r"was prepared for table 't[01]', not 'other'"):
        pool_features([other], prepared, rows)
    with pytest.raises(KeyError, match="no rows for table"):
        pool_features(features, prepared, {})
    table = features[0].table.name
    with pytest.raises(ValueError, match=rf"rows\['{table}'\] has shape"):
        pool_features(features, prepared, {**rows, table: rows[table][1:]})
    # Keys trimmed where training keeps more: the pooled rows would differ.
    seq = next(f for f in features if f.is_sequence)
    longer = SparseFeature(seq.name, seq.table, None, max_len=(seq.max_len or 0) + 1)
    with pytest.raises(ValueError, match="training keeps max_len="):
        pool_features([longer], prepared, rows)
    pooled = SparseFeature(seq.name, seq.table, "sum")
    with pytest.raises(ValueError, match="training keeps every value"):
        pool_features([pooled], prepared, rows)
