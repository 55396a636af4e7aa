"""Pooling without TensorFlow: what the bridge hands the tower, in numpy.

An online server looks a request's keys up in an engine and must pool the
rows exactly as training did (``wuliang.embedding.bridge``: ``batch_inputs``,
then ``pool`` or ``sequence``), with no TensorFlow in the request path. Per
sparse feature of a batch of B rows the values are in CSR layout (``offsets``
int64 ``[B + 1]``: row i is values ``offsets[i]:offsets[i + 1]``), with
optional float32 weights, one per value (none: every weight is 1)::

    "sum"    sum_j w_j v_j                      -> float32 [B, dim]
    "mean"   sum_j w_j v_j / sum_j w_j
    "sqrtn"  sum_j w_j v_j / sqrt(sum_j w_j^2)
    None     w_j v_j of the first max_len values of each row, zero-padded,
             -> (float32 [B, max_len, dim], mask float32 [B, max_len])

A zero denominator gives 0 (as ``tf.math.divide_no_nan``), so an empty row
pools to zeros. The mask is 1 where a value is, whatever its weight.

Three entry points, from the rawest to what the reader's key preparation
gives (``wuliang.reader.prepare``: per table the unique keys, pulled once,
and per feature the inverse index of each value into them):

* ``pool_rows(rows, offsets, ...)``: the looked-up rows of the values, in
  CSR order;
* ``pool_unique(unique_rows, inverse, offsets, ...)``: the rows are
  ``unique_rows[inverse]`` (a sequence gathers only the values it keeps);
* ``pool_features(features, prepared, rows)``: every sparse feature of a
  prepared batch, ``rows[table]`` pulled for ``prepared.tables[table].uniques``.

Design: vectorised, no Python loop per row (one step per position in the
longest rows). The order of float32 additions
decides the last bits of a sum, so a row's weighted sum is folded exactly as
TensorFlow's ``unsorted_segment_sum`` does on CPU: from 0, one value at a time
in CSR order. ``_RowOrder`` does that across rows at once: rows sorted
longest first, step p adds the p-th value of every row that has one (numpy's
``add.reduceat`` and ``add.reduce`` sum in another order, pairwise: up to a
few float32 ulps apart, more where values cancel). Products, square roots and
quotients are single correctly rounded float32 operations, as in TF, so the
pooled rows equal the bridge's bit for bit (the tests check equality). A
sequence is one boolean-mask assignment, whose row-major order is the CSR
order of the kept values. The module imports numpy only, so a serving process
may import it without TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    from wuliang.embedding.features import SparseFeature
    from wuliang.reader.prepare import PreparedKeys

__all__ = ["POOLING_COMBINERS", "Pooled", "pool_features", "pool_rows", "pool_unique"]

POOLING_COMBINERS = ("sum", "mean", "sqrtn")  # and None: a sequence
_FEW_ROWS = 16  # rows left when _RowOrder finishes with np.add.at

# [B, dim] for a pooling combiner; (values [B, max_len, dim], mask [B, max_len]) for a sequence
Pooled: TypeAlias = np.ndarray | tuple[np.ndarray, np.ndarray]


def pool_rows(
    rows: np.ndarray,
    offsets: np.ndarray,
    combiner: str | None,
    weights: np.ndarray | None = None,
    max_len: int | None = None,
) -> Pooled:
    """Pools the looked-up rows of one feature's values per batch row.

    Args:
        rows: float32 ``[nnz, dim]``: the row of each value, in CSR order.
        offsets: int64 ``[B + 1]``: row i's values are
            ``rows[offsets[i]:offsets[i + 1]]`` (starts at 0, ends at nnz).
        combiner: ``"sum"``, ``"mean"``, ``"sqrtn"``, or None for a sequence.
        weights: float32 ``[nnz]``, one per value; None: all 1.
        max_len: a sequence's length (combiner None only): each row keeps
            its first ``max_len`` values.

    Returns:
        float32 ``[B, dim]``, or for a sequence (values ``[B, max_len, dim]``,
        mask ``[B, max_len]``), both float32 (see the module docstring).

    Raises:
        ValueError: a bad combiner or max_len, or arrays of the wrong shape
            or not a CSR layout (the message names which).
    """
    who = "pool_rows"
    _check_combiner(combiner, max_len, who)
    rows = _as_rows(rows, "rows", who)
    offsets = _as_offsets(offsets, len(rows), "rows", who)
    weights = _as_weights(weights, len(rows), who)
    return _pool(rows, offsets, combiner, weights, max_len)


def pool_unique(
    unique_rows: np.ndarray,
    inverse: np.ndarray,
    offsets: np.ndarray,
    combiner: str | None,
    weights: np.ndarray | None = None,
    max_len: int | None = None,
) -> Pooled:
    """``pool_rows(unique_rows[inverse], offsets, ...)``, gathering only the
    values a sequence keeps.

    Args:
        unique_rows: float32 ``[U, dim]``: the rows pulled for the unique keys.
        inverse: int ``[nnz]``: each value's row in ``unique_rows``, in CSR order
            (a ``FeatureIndex.inverse``).
        offsets, combiner, weights, max_len: as ``pool_rows``.

    Raises:
        ValueError: as ``pool_rows``, or an inverse index outside
            ``[0, len(unique_rows))``.
    """
    return _pool_unique(unique_rows, inverse, offsets, combiner, weights, max_len, "pool_unique")


def pool_features(
    features: Sequence[SparseFeature],
    prepared: PreparedKeys,
    rows: Mapping[str, np.ndarray],
) -> dict[str, Pooled]:
    """Every sparse feature of a prepared batch, pooled as training pools it.

    Args:
        features: the model's sparse features (their combiner and max_len).
        prepared: the batch's keys (``KeyPreparer``; with a sequence
            feature's ``max_lens`` or without trimming).
        rows: table name -> float32 ``[U, dim]``, the rows pulled for
            ``prepared.tables[table].uniques`` in that order.

    Returns:
        feature name -> what the tower gets (``pool_rows``' result), in the
        order of ``features``.

    Raises:
        KeyError: a feature missing from prepared, or a table from rows.
        ValueError: rows of the wrong shape, a feature prepared for another
            table, or keys trimmed where training would not trim them.
    """
    out: dict[str, Pooled] = {}
    for f in features:
        who = f"feature {f.name!r}"
        index = prepared.features.get(f.name)
        if index is None:
            known = ", ".join(prepared.features) or "none"
            raise KeyError(f"the prepared keys have no {who} (features: {known})")
        table = f.table.name
        if index.table != table:
            raise ValueError(f"{who} was prepared for table {index.table!r}, not {table!r}")
        if table not in rows:
            known = ", ".join(rows) or "none"
            raise KeyError(f"no rows for table {table!r} of {who} (tables: {known})")
        table_rows = _as_rows(rows[table], f"rows[{table!r}]", who)
        expected = (len(prepared.tables[table].uniques), f.table.dim)
        if table_rows.shape != expected:
            raise ValueError(
                f"{who}: rows[{table!r}] has shape {table_rows.shape}, expected {expected} "
                "(one row per unique key of the table, of the table's dim)"
            )
        trimmed = prepared.max_lens.get(f.name)
        if trimmed is not None and not (f.is_sequence and trimmed >= (f.max_len or 0)):
            keeps = f"max_len={f.max_len} values" if f.is_sequence else "every value"
            raise ValueError(
                f"{who}: its keys were prepared keeping {trimmed} values a row; "
                f"training keeps {keeps}"
            )
        max_len = f.max_len if f.is_sequence else None
        out[f.name] = _pool_unique(
            table_rows, index.inverse, index.offsets, f.combiner, index.weights, max_len, who
        )
    return out


# -- implementation ------------------------------------------------------------


def _pool_unique(
    unique_rows: Any,
    inverse: Any,
    offsets: Any,
    combiner: str | None,
    weights: Any,
    max_len: int | None,
    who: str,
) -> Pooled:
    _check_combiner(combiner, max_len, who)
    unique_rows = _as_rows(unique_rows, "unique_rows", who)
    inverse = np.asarray(inverse)
    if inverse.ndim != 1 or not np.issubdtype(inverse.dtype, np.integer):
        raise ValueError(
            f"{who}: inverse must be a 1-D integer array, got {inverse.dtype} {inverse.shape}"
        )
    offsets = _as_offsets(offsets, len(inverse), "inverse", who)
    weights = _as_weights(weights, len(inverse), who)
    if len(inverse) and (inverse.min() < 0 or inverse.max() >= len(unique_rows)):
        bad = inverse[(inverse < 0) | (inverse >= len(unique_rows))][0]
        raise ValueError(
            f"{who}: inverse index {bad} is outside the {len(unique_rows)} unique rows"
        )
    if combiner is None:  # gather only the values the sequence keeps
        assert max_len is not None
        keep, offsets = _first_values(offsets, max_len)
        if keep is not None:
            inverse = inverse[keep]
            weights = None if weights is None else weights[keep]
    return _pool(np.take(unique_rows, inverse, axis=0), offsets, combiner, weights, max_len)


def _pool(
    rows: np.ndarray,
    offsets: np.ndarray,
    combiner: str | None,
    weights: np.ndarray | None,
    max_len: int | None,
) -> Pooled:
    """Checked inputs: rows float32 [nnz, dim], offsets int64 [B + 1]."""
    if combiner is None:
        assert max_len is not None
        return _sequence(rows, offsets, weights, max_len)
    lengths = np.diff(offsets)
    order = _RowOrder(offsets)
    weighted = rows if weights is None else rows * weights[:, None]
    summed = order.sums(weighted)
    if combiner == "sum":
        return summed
    if weights is None:  # the sum of the weights (or their squares) is the count
        norm = lengths.astype(np.float32)
    else:
        norm = order.sums(weights if combiner == "mean" else weights * weights)
    if combiner == "sqrtn":
        norm = np.sqrt(norm)
    out = np.zeros_like(summed)
    np.divide(summed, norm[:, None], out=out, where=norm[:, None] != 0)  # divide_no_nan
    return out


class _RowOrder:
    """Sums each row's values in CSR order, from 0: the order of TensorFlow's
    ``unsorted_segment_sum`` on CPU (one ``+=`` per value in index order), so
    the float32 results are the same bits.

    Vectorised over rows, not values: rows sorted longest first, step p adds
    the p-th value of every row that has one (a prefix of the sorted rows).
    Once at most ``_FEW_ROWS`` rows are left, their remaining values go to
    one ``np.add.at`` (unbuffered, in index order: the same fold), so a few
    very long rows cost no Python step per value.
    """

    def __init__(self, offsets: np.ndarray) -> None:
        lengths = np.diff(offsets)
        self.size = len(lengths)
        self.rows = np.argsort(-lengths, kind="stable")  # longest first
        self.lengths = lengths[self.rows]
        self.starts = offsets[:-1][self.rows]
        longest = int(self.lengths[0]) if self.size else 0
        # active[p]: how many rows have more than p values (a prefix of self.rows)
        active = np.searchsorted(-self.lengths, -np.arange(longest), side="left")
        self.steps = int(np.count_nonzero(active > _FEW_ROWS))
        self.active = active[: self.steps]
        # The rest: the values at positions >= steps of the rows still active.
        rest = int(active[self.steps]) if self.steps < longest else 0
        left = self.lengths[:rest] - self.steps
        self.rest_rows = np.repeat(np.arange(rest), left)
        first = np.repeat(self.starts[:rest] + self.steps - np.cumsum(left) + left, left)
        self.rest_values = first + np.arange(len(first))

    def sums(self, x: np.ndarray) -> np.ndarray:
        """float32 [B, ...]: per row, the sum of its values' entries of x."""
        acc = np.zeros((self.size, *x.shape[1:]), np.float32)  # in sorted order
        for p, n in enumerate(self.active):
            acc[:n] += x[self.starts[:n] + p]
        if len(self.rest_rows):
            np.add.at(acc, self.rest_rows, x[self.rest_values])
        out = np.empty_like(acc)
        out[self.rows] = acc
        return out


def _sequence(
    rows: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    keep, offsets = _first_values(offsets, max_len)
    if keep is not None:
        rows = rows[keep]
        weights = None if weights is None else weights[keep]
    lengths = np.diff(offsets)  # now at most max_len
    present = np.arange(max_len) < lengths[:, None]  # [B, max_len]
    values = np.zeros((len(lengths), max_len, rows.shape[1]), np.float32)
    # Row-major order of `present` is the CSR order of the kept values.
    values[present] = rows if weights is None else rows * weights[:, None]
    return values, present.astype(np.float32)


def _first_values(offsets: np.ndarray, max_len: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(which values to keep, or None for all; the offsets of what is kept)
    when each row keeps its first max_len values."""
    lengths = np.diff(offsets)
    if len(lengths) == 0 or lengths.max() <= max_len:
        return None, offsets
    positions = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    kept = np.zeros_like(offsets)
    np.cumsum(np.minimum(lengths, max_len), out=kept[1:])
    return positions < max_len, kept


# -- checks --------------------------------------------------------------------


def _check_combiner(combiner: Any, max_len: Any, who: str) -> None:
    if combiner is None:
        if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1:
            raise ValueError(
                f"{who}: a sequence (combiner=None) needs an int max_len >= 1, got {max_len!r}"
            )
    elif combiner not in POOLING_COMBINERS:
        raise ValueError(
            f"{who}: combiner must be 'sum', 'mean', 'sqrtn' or None, got {combiner!r}"
        )
    elif max_len is not None:
        raise ValueError(
            f"{who}: max_len={max_len!r} is for sequences (combiner=None); combiner "
            f"{combiner!r} pools every value of a row, as training does"
        )


def _as_rows(rows: Any, name: str, who: str) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.floating):
        raise ValueError(
            f"{who}: {name} must be a 2-D float array [n, dim], got {rows.dtype} {rows.shape}"
        )
    return rows.astype(np.float32, copy=False)


def _as_offsets(offsets: Any, nnz: int, values: str, who: str) -> np.ndarray:
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or len(offsets) == 0 or not np.issubdtype(offsets.dtype, np.integer):
        raise ValueError(
            f"{who}: offsets must be a 1-D integer array of B + 1 entries, "
            f"got {offsets.dtype} {offsets.shape}"
        )
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0:
        raise ValueError(f"{who}: offsets must start at 0, got {offsets[0]}")
    bad = np.flatnonzero(np.diff(offsets) < 0)
    if len(bad):
        raise ValueError(f"{who}: offsets decrease after row {bad[0]}")
    if offsets[-1] != nnz:
        raise ValueError(f"{who}: offsets end at {offsets[-1]} but {values} has {nnz} values")
    return offsets


def _as_weights(weights: Any, nnz: int, who: str) -> np.ndarray | None:
    if weights is None:
        return None
    weights = np.asarray(weights)
    if weights.shape != (nnz,):
        raise ValueError(
            f"{who}: weights must be [nnz] = [{nnz}], one per value, got {weights.shape}"
        )
    return weights.astype(np.float32, copy=False)
