"""CsrBatch / Csr: the validation of malformed batches and dense feature access."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest

from wuliang.reader import Csr, CsrBatch


def i64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def good_csr(weights: bool = False) -> Csr:
    """4 rows: [7, 9, 7], [], [3], [4, 4]."""
    values = np.array([7, 9, 7, 3, 4, 4], dtype=np.uint64)
    w = np.array([1.0, 0.5, 1.0, 1.0, 2.0, 2.0], dtype=np.float32) if weights else None
    return Csr(values, i64(0, 3, 3, 4, 6), w)


def good_batch() -> CsrBatch:
    dense = np.arange(12, dtype=np.float32).reshape(4, 3)
    return CsrBatch(
        sparse={
            "genres": good_csr(weights=True),
            "user": Csr(i64(-5, 11, 12, 13), i64(0, 1, 2, 3, 4)),
        },
        dense=dense,
        labels=np.array([0.0, 1.0, 1.0, 0.0], dtype=np.float32),
        size=4,
        dense_columns={"age": slice(0, 1), "emb": slice(1, 3)},
    )


def raises_naming(*parts: str) -> AbstractContextManager[Any]:
    """pytest.raises(ValueError) whose message contains every part, in order."""
    return pytest.raises(ValueError, match=".*".join(re.escape(p) for p in parts))


# -- valid batches ----------------------------------------------------------------


def test_valid_batch_passes() -> None:
    batch = good_batch()
    batch.validate()
    for name, csr in batch.sparse.items():
        csr.validate(name, 4)


def test_valid_edge_cases_pass() -> None:
    Csr(np.zeros(0, np.int64), i64(0)).validate("empty", 0)  # no rows
    Csr(np.zeros(0, np.uint64), i64(0, 0, 0)).validate("all_empty_rows", 2)
    Csr(np.zeros(0, np.uint64), i64(0, 0), np.zeros(0, np.float32)).validate("w", 1)
    CsrBatch({}, np.zeros((3, 0), np.float32), None, 3).validate()  # no features, no labels
    labels = {"click": np.ones(3, np.float32), "buy": np.zeros(3, np.float32)}
    CsrBatch({}, np.zeros((3, 0), np.float32), labels, 3).validate()


def test_csr_accessors() -> None:
    csr = good_csr()
    assert csr.num_rows == 4
    assert csr.nnz == 6
    np.testing.assert_array_equal(csr.lengths(), [3, 0, 1, 2])
    assert csr.row(0).tolist() == [7, 9, 7]
    assert csr.row(1).tolist() == []
    assert csr.row(3).tolist() == [4, 4]


# -- malformed offsets ---------------------------------------------------------


@pytest.mark.parametrize(
    ("offsets", "row"),
    [
        (i64(0, 3, 2, 4, 6), 1),  # row 1 has length -1
        (i64(0, 3, 3, 4, 2), 3),
        (i64(0, 1, 2, 3, 6, 5), 4),
    ],
)
def test_non_monotonic_offsets_name_feature_and_row(offsets: np.ndarray, row: int) -> None:
    csr = Csr(np.arange(6, dtype=np.uint64), offsets)
    with raises_naming("feature 'x'", f"row {row}"):
        csr.validate("x")
    batch = CsrBatch(
        {"x": csr}, np.zeros((len(offsets) - 1, 0), np.float32), None, len(offsets) - 1
    )
    with raises_naming("feature 'x'", f"row {row}"):
        batch.validate()


def test_offsets_past_the_values_name_feature_and_row() -> None:
    # Row 2 ends at 10 but there are only 6 values.
    csr = Csr(np.arange(6, dtype=np.int64), i64(0, 2, 4, 10, 10))
    with raises_naming("feature 'x'", "row 2"):
        csr.validate("x", 4)


def test_offsets_past_the_values_in_first_row() -> None:
    csr = Csr(np.arange(2, dtype=np.int64), i64(0, 5))
    with raises_naming("feature 'x'", "row 0"):
        csr.validate("x", 1)


def test_offsets_ending_before_the_values() -> None:
    # 6 values, but the offsets cover only 4 of them.
    csr = Csr(np.arange(6, dtype=np.int64), i64(0, 2, 4))
    with raises_naming("feature 'x'", "4", "6 values"):
        csr.validate("x", 2)


def test_offsets_not_starting_at_zero() -> None:
    csr = Csr(np.arange(6, dtype=np.int64), i64(1, 3, 6))
    with raises_naming("feature 'x'", "start at 0", "1"):
        csr.validate("x", 2)


def test_empty_offsets() -> None:
    with raises_naming("feature 'x'", "offsets"):
        Csr(np.zeros(0, np.int64), np.zeros(0, np.int64)).validate("x")


# -- malformed dtypes and shapes -------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint32])
def test_values_of_wrong_dtype(dtype: type) -> None:
    csr = Csr(np.arange(3).astype(dtype), i64(0, 1, 3))
    with raises_naming("feature 'x'", "values", str(np.dtype(dtype))):
        csr.validate("x", 2)


@pytest.mark.parametrize("dtype", [np.int32, np.uint64, np.float64])
def test_offsets_of_wrong_dtype(dtype: type) -> None:
    csr = Csr(np.arange(3, dtype=np.int64), np.array([0, 1, 3], dtype=dtype))
    with raises_naming("feature 'x'", "offsets", str(np.dtype(dtype))):
        csr.validate("x", 2)


def test_values_not_an_array() -> None:
    with raises_naming("feature 'x'", "numpy array", "list"):
        Csr([1, 2, 3], i64(0, 3)).validate("x")  # type: ignore[arg-type]


def test_values_2d() -> None:
    with raises_naming("feature 'x'", "1-D"):
        Csr(np.zeros((2, 2), np.int64), i64(0, 2, 4)).validate("x")


def test_weights_of_wrong_dtype() -> None:
    csr = Csr(np.arange(3, dtype=np.int64), i64(0, 1, 3), np.ones(3, np.float64))
    with raises_naming("feature 'x'", "weights", "float32", "float64"):
        csr.validate("x", 2)


@pytest.mark.parametrize("n", [0, 2, 4])
def test_weights_length_mismatch(n: int) -> None:
    csr = Csr(np.arange(3, dtype=np.int64), i64(0, 1, 3), np.ones(n, np.float32))
    with raises_naming("feature 'x'", f"{n} weights for 3 values"):
        csr.validate("x", 2)
    batch = CsrBatch({"x": csr}, np.zeros((2, 0), np.float32), None, 2)
    with raises_naming("feature 'x'", "weights"):
        batch.validate()


# -- batch-level checks --------------------------------------------------------------


@pytest.mark.parametrize("size", [3, 5])
def test_feature_rows_differ_from_batch_size(size: int) -> None:
    batch = good_batch()
    batch.size = size
    batch.dense = np.zeros((size, 3), np.float32)
    batch.labels = np.zeros(size, np.float32)
    with raises_naming("feature 'genres'", "4 rows", f"batch has {size}"):
        batch.validate()


def test_second_feature_rows_differ_from_batch_size() -> None:
    batch = good_batch()
    batch.sparse["user"] = Csr(i64(1, 2, 3), i64(0, 1, 2, 3))
    with raises_naming("feature 'user'", "3 rows", "batch has 4"):
        batch.validate()


def test_malformed_feature_named_in_batch_validate() -> None:
    batch = good_batch()
    batch.sparse["user"] = Csr(i64(1, 2, 3, 4), i64(0, 1, 3, 2, 4))
    with raises_naming("feature 'user'", "row 2"):
        batch.validate()


@pytest.mark.parametrize(
    ("dense", "message"),
    [
        (np.zeros((3, 3), np.float32), "dense has 3 rows"),
        (np.zeros((5, 3), np.float32), "dense has 5 rows"),
        (np.zeros(4, np.float32), "2-D"),
        (np.zeros((4, 3), np.float64), "float64"),
        (np.zeros((4, 2), np.float32), "'emb'"),  # columns 1:3 outside a width of 2
    ],
)
def test_dense_shape_mismatch(dense: np.ndarray, message: str) -> None:
    batch = good_batch()
    batch.dense = dense
    with raises_naming(message):
        batch.validate()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("row", [0, 2, 3])
def test_non_finite_label_names_the_row(bad: float, row: int) -> None:
    batch = good_batch()
    assert isinstance(batch.labels, np.ndarray)
    batch.labels = batch.labels.copy()
    batch.labels[row] = bad
    with raises_naming("label", f"row {row}"):
        batch.validate()


def test_nan_label_in_dict_names_label_and_first_row() -> None:
    batch = good_batch()
    batch.labels = {
        "click": np.zeros(4, np.float32),
        "buy": np.array([0, 1, np.nan, np.nan], np.float32),
    }
    with raises_naming("label 'buy'", "row 2"):
        batch.validate()


def test_label_of_wrong_length_or_dtype() -> None:
    batch = good_batch()
    batch.labels = np.zeros(3, np.float32)
    with raises_naming("label", "3 values for 4 rows"):
        batch.validate()
    batch.labels = np.zeros(4, np.float64)
    with raises_naming("label", "float64"):
        batch.validate()
    batch.labels = {"click": np.zeros(4, np.int64)}
    with raises_naming("label 'click'", "int64"):
        batch.validate()


# -- dense_feature ---------------------------------------------------------------------


def test_dense_feature_returns_its_columns() -> None:
    batch = good_batch()
    age = batch.dense_feature("age")
    emb = batch.dense_feature("emb")
    assert age.shape == (4, 1) and emb.shape == (4, 2)
    assert age.dtype == np.float32 and emb.dtype == np.float32
    np.testing.assert_array_equal(age[:, 0], [0, 3, 6, 9])
    np.testing.assert_array_equal(emb, [[1, 2], [4, 5], [7, 8], [10, 11]])


def test_dense_feature_unknown_name() -> None:
    batch = good_batch()
    with pytest.raises(KeyError) as info:
        batch.dense_feature("height")
    text = str(info.value)
    assert "'height'" in text
    assert "age" in text and "emb" in text  # lists the known ones


def test_dense_feature_unknown_name_when_none() -> None:
    batch = CsrBatch({}, np.zeros((2, 0), np.float32), None, 2)
    with pytest.raises(KeyError, match="none"):
        batch.dense_feature("x")
