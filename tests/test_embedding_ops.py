"""wl.embedding.concat equals tf.concat (values and gradients) while taking
runs of one lookup's columns as a reshape; scatter_add_rows equals np.add.at;
index_in equals a dict lookup."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import wuliang as wl
from wuliang.embedding.kernels import index_in, scatter_add_rows

RNG = np.random.default_rng(5)
LOOKUP = RNG.normal(size=(3, 4, 2)).astype(np.float32)  # [B, F, dim]
OTHER = RNG.normal(size=(3, 5)).astype(np.float32)


def both(order: list[int | str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """concat and tf.concat of the lookup's columns in `order` ("x": OTHER),
    and the gradients of a weighted sum of each with respect to the lookup;
    plus how many slices the graph has (tf.concat and unstack have none)."""

    def columns(looked_up: tf.Tensor) -> list[tf.Tensor]:
        cols = tf.unstack(looked_up, axis=1)
        return [tf.constant(OTHER) if o == "x" else cols[o] for o in order]

    @tf.function
    def run(looked_up: tf.Tensor) -> tuple[tf.Tensor, ...]:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(looked_up)
            fused = wl.embedding.concat(columns(looked_up))
            plain = tf.concat(columns(looked_up), axis=1)
            width = sum(5 if o == "x" else 2 for o in order)
            weights = tf.range(width, dtype=tf.float32)
            fused_sum = tf.reduce_sum(fused * weights)
            plain_sum = tf.reduce_sum(plain * weights)
        g_fused = tape.gradient(fused_sum, looked_up)
        return fused, plain, g_fused, tape.gradient(plain_sum, looked_up)

    graph = run.get_concrete_function(tf.TensorSpec([None, 4, 2], tf.float32)).graph
    slices = sum(op.type == "StridedSlice" for op in graph.get_operations())
    fused, plain, g_fused, g_plain = (t.numpy() for t in run(tf.constant(LOOKUP)))
    return fused, plain, g_fused, g_plain, slices


@pytest.mark.parametrize(
    "order",
    [[0, 1, 2, 3], [0, 1, 2, 3, "x"], ["x", 1, 2], [2, 3, 0, 1], [3, 2, 1, 0], [0, 0, 1], [1]],
)
def test_concat_equals_tf_concat(order: list[int | str]) -> None:
    fused, plain, g_fused, g_plain, _ = both(order)
    np.testing.assert_array_equal(fused, plain)
    np.testing.assert_array_equal(g_fused, g_plain)
    assert g_plain.any()


def test_concat_of_a_whole_lookup_is_a_reshape() -> None:
    """All columns in order: no slicing of the lookup at all (a [1:3] run: one)."""
    assert both([0, 1, 2, 3])[4] == 0
    assert both(["x", 1, 2])[4] == 1


def test_concat_eager_and_errors() -> None:
    cols = tf.unstack(tf.constant(LOOKUP), axis=1)  # eager: plain tf.concat
    np.testing.assert_array_equal(wl.embedding.concat(cols).numpy(), LOOKUP.reshape(3, 8))
    with pytest.raises(ValueError, match="at least one"):
        wl.embedding.concat([])


def test_scatter_add_rows_equals_np_add_at() -> None:
    out = RNG.normal(size=(6, 3)).astype(np.float32)
    index = np.array([5, 0, 5, 2, 5, 0], np.int32)
    values = RNG.normal(size=(6, 3)).astype(np.float32)
    want = out.astype(np.float64)
    np.add.at(want, index, values)
    scatter_add_rows(out, index, values)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_scatter_add_rows_errors() -> None:
    out = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match="index 4 at position 1 is outside the 4 rows"):
        scatter_add_rows(out, np.array([0, 4], np.int32), np.ones((2, 2), np.float32))
    assert not out.any()  # checked before any write
    with pytest.raises(ValueError, match=r"values \[n, 2\]"):
        scatter_add_rows(out, np.array([0], np.int32), np.ones((1, 3), np.float32))
    with pytest.raises(TypeError, match="float32"):
        scatter_add_rows(out.astype(np.float64), np.array([0], np.int32), np.ones((1, 2)))


def test_index_in_equals_a_dict_lookup() -> None:
    b = RNG.permutation(1000)[:300].astype(np.uint64)
    a = RNG.integers(0, 1000, size=500).astype(np.int64)
    where = {int(k): j for j, k in enumerate(b)}
    want = np.array([where[int(k)] + 7 if int(k) in where else -1 for k in a], np.int32)
    got = index_in(a, b, 7)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(index_in(a, b[:0]), np.full(len(a), -1, np.int32))


def test_index_in_errors() -> None:
    keys = np.arange(4, dtype=np.int64)
    with pytest.raises(TypeError, match="1-D contiguous int64 or uint64"):
        index_in(keys.astype(np.int32), keys)
    with pytest.raises(TypeError, match="b must be"):
        index_in(keys, keys[::2])
    with pytest.raises(ValueError, match="must fit in int32"):
        index_in(keys, keys, 2**31 - 2)


def test_aligned_inputs_are_shared_with_tensorflow_others_copied() -> None:
    from wuliang.embedding.bridge import aligned_empty, as_tensor

    rows = aligned_empty((1000, 16), np.float32)
    assert rows.ctypes.data % 64 == 0 and rows.flags.c_contiguous
    rows[:] = 1.0
    shared = as_tensor(rows)
    assert isinstance(shared, tf.Tensor)
    rows[3, 5] = 7.0  # the tensor reads the same memory
    assert float(shared[3, 5]) == 7.0
    np.testing.assert_array_equal(tf.reduce_sum(shared, axis=1).numpy()[:3], [16.0] * 3)
    index = aligned_empty((4, 3), np.int32)
    index[:] = 2
    assert as_tensor(index).dtype == tf.int32
    assert aligned_empty((0, 16), np.float32).shape == (0, 16)

    unaligned = np.zeros(1001, np.float32)[1:]
    assert as_tensor(unaligned) is unaligned  # TensorFlow copies it itself
    frozen = aligned_empty((8,), np.float32)
    frozen.flags.writeable = False
    assert as_tensor(frozen) is frozen
    assert as_tensor(np.zeros((0, 4), np.float32)).shape == (0, 4)
