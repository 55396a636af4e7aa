"""The batch type of the data pipeline: sparse features as CSR, dense as a matrix.

A batch of B rows holds, per sparse feature, its values in compressed sparse
rows (CSR)::

    row:        0          1    2      3
    feature:   [7, 9, 7]   []   [3]    [4, 4]

    values  = [7, 9, 7, 3, 4, 4]        uint64 or int64, nnz long
    offsets = [0, 3, 3, 4, 6]           int64, B + 1 long: row i is
                                        values[offsets[i]:offsets[i + 1]]
    weights = [1., .5, 1., 1., 2., 2.]  optional float32, one per value

A single-valued feature is the same with one value per row (offsets
0, 1, ..., B; a missing value makes that row empty). Dense features are the
columns of one float32 ``[B, k]`` matrix (``dense_columns`` says which
columns belong to which feature) and labels are float32 ``[B]``, or a dict of
them for multi-task models.

Arrays may be read-only views of Arrow buffers (no copies on the read path):
treat them as immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

_KEY_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64))


@dataclass(frozen=True)
class Csr:
    """One sparse feature of a batch (see the module docstring)."""

    values: np.ndarray  # uint64 or int64 [nnz]
    offsets: np.ndarray  # int64 [B + 1]
    weights: np.ndarray | None = None  # float32 [nnz]

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def nnz(self) -> int:
        return len(self.values)

    def lengths(self) -> np.ndarray:
        """Values per row, int64 [B]."""
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def validate(self, name: str, num_rows: int | None = None) -> None:
        """Raises ValueError naming the feature (and row) if malformed."""
        who = f"feature {name!r}"
        _check_array(self.values, _KEY_DTYPES, 1, f"{who}: values")
        _check_array(self.offsets, (np.dtype(np.int64),), 1, f"{who}: offsets")
        if len(self.offsets) == 0:
            raise ValueError(f"{who}: offsets must have B + 1 entries, got 0")
        if num_rows is not None and self.num_rows != num_rows:
            raise ValueError(f"{who}: has {self.num_rows} rows, the batch has {num_rows}")
        if self.offsets[0] != 0:
            raise ValueError(f"{who}: offsets must start at 0 (row 0), got {self.offsets[0]}")
        steps = np.diff(self.offsets)
        bad = np.flatnonzero(steps < 0)
        if len(bad):
            raise ValueError(f"{who}: offsets not monotonic at row {bad[0]}")
        if self.offsets[-1] != len(self.values):
            over = np.flatnonzero(self.offsets > len(self.values))
            where = f" (row {max(over[0] - 1, 0)})" if len(over) else ""
            raise ValueError(
                f"{who}: offsets end at {self.offsets[-1]} but there are "
                f"{len(self.values)} values{where}"
            )
        if self.weights is not None:
            _check_array(self.weights, (np.dtype(np.float32),), 1, f"{who}: weights")
            if len(self.weights) != len(self.values):
                raise ValueError(
                    f"{who}: {len(self.weights)} weights for {len(self.values)} values"
                )


@dataclass
class CsrBatch:
    """B rows of sparse features (CSR), dense features and labels."""

    sparse: dict[str, Csr]
    dense: np.ndarray  # float32 [B, k]
    labels: np.ndarray | dict[str, np.ndarray] | None  # float32 [B] (per task)
    size: int
    dense_columns: dict[str, slice] = field(default_factory=dict)  # feature -> columns
    prepared: Any = None  # PreparedKeys, when the reader prepares keys
    position: Any = None  # ReaderPosition after this batch, when read by a ParquetReader
    validated: bool = False  # validate() passed (a validating reader's batches)
    partition: Any = None  # the Partition a StreamReader read it from

    def dense_feature(self, name: str) -> np.ndarray:
        """The columns of one dense feature, float32 [B, d]."""
        try:
            return self.dense[:, self.dense_columns[name]]
        except KeyError:
            known = ", ".join(self.dense_columns) or "none"
            raise KeyError(f"no dense feature {name!r} (dense features: {known})") from None

    def validate(self) -> None:
        """Raises ValueError naming the feature and row of the first problem."""
        for name, csr in self.sparse.items():
            csr.validate(name, self.size)
        _check_array(self.dense, (np.dtype(np.float32),), 2, "dense")
        if self.dense.shape[0] != self.size:
            raise ValueError(f"dense has {self.dense.shape[0]} rows, the batch has {self.size}")
        width = self.dense.shape[1]
        for name, cols in self.dense_columns.items():
            if not 0 <= cols.start <= cols.stop <= width:
                raise ValueError(f"dense feature {name!r}: columns {cols} outside [0, {width})")
        bad = np.flatnonzero(~np.isfinite(self.dense).all(axis=1)) if width else []
        if len(bad):
            row = int(bad[0])
            column = int(np.flatnonzero(~np.isfinite(self.dense[row]))[0])
            names = [n for n, c in self.dense_columns.items() if c.start <= column < c.stop]
            who = f"dense feature {names[0]!r}" if names else f"dense column {column}"
            raise ValueError(f"{who}: non-finite value {self.dense[row, column]} at row {row}")
        labels = self.labels
        if labels is None:
            self.validated = True
            return
        for name, values in labels.items() if isinstance(labels, dict) else [("label", labels)]:
            who = f"label {name!r}"
            _check_array(values, (np.dtype(np.float32),), 1, who)
            if len(values) != self.size:
                raise ValueError(f"{who}: {len(values)} values for {self.size} rows")
            bad = np.flatnonzero(~np.isfinite(values))
            if len(bad):
                raise ValueError(f"{who}: null or non-finite value at row {bad[0]}")
        self.validated = True


def _check_array(a: Any, dtypes: tuple[np.dtype, ...], ndim: int, who: str) -> None:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{who} must be a numpy array, got {type(a).__name__}")
    if a.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{who} must be {names}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{who} must be {ndim}-D, got shape {a.shape}")
