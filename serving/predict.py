"""Predictions from raw feature values at one served version, exactly as
training computed them.

A request gives, for a batch of ``rows`` rows, each sparse feature's keys
(CSR: ``values`` and ``offsets``, or one key per row, optional ``weights``)
and each dense feature's floats. ``predict(store, served, features, rows)``,
with ``served`` the snapshot of the version to answer from:

1. checks that the version has a tower (FAILED_PRECONDITION otherwise: a
   replica serving lookups only) and a model description;
2. checks the features against the version's model description (every
   feature present and no other, dims, dtypes, offsets; errors name the
   feature and row);
3. looks each table's keys up once (the unique keys of every feature that
   reads the table), every table at the snapshot's version
   (``store.lookup(..., at=served)``: ``VersionMoved`` when the store has
   moved on, and the caller starts again from a new snapshot);
4. pools each feature's rows with the function training uses
   (``wuliang.embedding.pooling``: sum, mean, sqrtn, or a padded sequence
   and its mask);
5. runs the snapshot's tower (its SavedModel's ``serve``) and returns its
   outputs (``predictions``, or ``predictions_<task>`` per task).

``Service.predict`` resolves the snapshot, decodes the request with its
model description and retries on ``VersionMoved``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from wuliang.embedding.pooling import pool_rows
from wuliang.ps_server.storage import ModelDescription, SparseInput
from wuliang.serving.errors import FailedPrecondition, InvalidArgument
from wuliang.serving.model import ServedModel, ServedVersion

__all__ = ["Decoder", "FeatureInput", "PredictAnswer", "check_model", "predict"]


@dataclass
class FeatureInput:
    """One feature's values for the batch (see the module docstring)."""

    values: np.ndarray  # sparse: uint64/int64 keys [nnz]; dense: float32 [rows, dim]
    offsets: np.ndarray | None = None  # sparse: int64 [rows + 1]; None: one key per row
    weights: np.ndarray | None = None  # sparse: float32 [nnz]


@dataclass
class PredictAnswer:
    outputs: dict[str, np.ndarray]  # float32 [rows] or [rows, k] by output name
    version: int


# A transport's request decoder: the features and the row count of a request,
# read with the model description of the version that answers it.
Decoder = Callable[[ModelDescription], tuple[Mapping[str, FeatureInput], int]]


def check_model(store: ServedModel, served: ServedVersion) -> None:
    """FAILED_PRECONDITION unless the version can predict (a tower and a
    model description)."""
    if served.tower is None:
        raise FailedPrecondition(
            f"model {store.name!r} version {served.number} serves lookups only, not "
            f"predictions: {served.no_tower}"
        )
    if not served.model.sparse and not served.model.dense:
        raise FailedPrecondition(
            f"model {store.name!r} version {served.number} has no model description "
            "(its manifest lists no features), so its features cannot be read"
        )


def predict(
    store: ServedModel, served: ServedVersion, features: Mapping[str, FeatureInput], rows: int
) -> PredictAnswer:
    """Scores a batch at the ``served`` version (see the module docstring)."""
    check_model(store, served)
    if not isinstance(rows, int) or rows < 1:
        raise InvalidArgument(f"rows must be an int >= 1, got {rows!r}")
    sparse = served.model.sparse_by_name
    dense = served.model.dense_by_name
    unknown = sorted(set(features) - set(sparse) - set(dense))
    if unknown:
        raise InvalidArgument(
            f"model {store.name!r} has no feature {unknown[0]!r} "
            f"(features: {', '.join([*sparse, *dense])})"
        )
    missing = [name for name in [*sparse, *dense] if name not in features]
    if missing:
        raise InvalidArgument(f"feature {missing[0]!r} is missing from the request")
    keys = {name: _sparse(name, features[name], rows) for name in sparse}
    dense_inputs = {name: _dense(name, features[name], rows, f.dim) for name, f in dense.items()}
    rows_by_table = _lookup(store, served, sparse, keys)
    inputs: dict[str, np.ndarray] = dict(dense_inputs)
    for name, f in sparse.items():
        table_rows, inverse = rows_by_table[name]
        offsets, weights = keys[name][1], keys[name][2]
        pooled = pool_rows(table_rows[inverse], offsets, f.combiner, weights, f.max_len)
        if isinstance(pooled, tuple):
            inputs[name], inputs[f"{name}_mask"] = pooled
        else:
            inputs[name] = pooled
    assert served.tower is not None  # check_model
    return PredictAnswer(served.tower(inputs), served.number)


def _sparse(
    name: str, feature: FeatureInput, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    values = np.asarray(feature.values)
    if values.dtype not in (np.uint64, np.int64) or values.ndim != 1:
        raise InvalidArgument(
            f"sparse feature {name!r}: keys must be a 1-D uint64 or int64 array, got "
            f"{values.dtype} {list(values.shape)}"
        )
    values = values.view(np.uint64)
    if feature.offsets is None or len(feature.offsets) == 0:
        if len(values) != rows:
            raise InvalidArgument(
                f"sparse feature {name!r}: {len(values)} keys for {rows} rows and no offsets"
            )
        offsets = np.arange(rows + 1, dtype=np.int64)
    else:
        offsets = np.asarray(feature.offsets)
        if offsets.dtype != np.int64 or offsets.shape != (rows + 1,):
            raise InvalidArgument(
                f"sparse feature {name!r}: offsets must be int64 [rows + 1 = {rows + 1}], got "
                f"{offsets.dtype} {list(offsets.shape)}"
            )
        if offsets[0] != 0:
            raise InvalidArgument(f"sparse feature {name!r}: offsets must start at 0 (row 0)")
        bad = np.flatnonzero(np.diff(offsets) < 0)
        if len(bad):
            raise InvalidArgument(f"sparse feature {name!r}: offsets decrease at row {bad[0]}")
        if offsets[-1] != len(values):
            raise InvalidArgument(
                f"sparse feature {name!r}: offsets end at {offsets[-1]}, there are "
                f"{len(values)} keys"
            )
    weights = None
    if feature.weights is not None and len(feature.weights):
        weights = np.asarray(feature.weights)
        if weights.dtype != np.float32 or weights.shape != values.shape:
            raise InvalidArgument(
                f"sparse feature {name!r}: weights must be float32 [{len(values)}], got "
                f"{weights.dtype} {list(weights.shape)}"
            )
        if not np.isfinite(weights).all():
            raise InvalidArgument(f"sparse feature {name!r}: a weight is not finite")
    return values, offsets, weights


def _dense(name: str, feature: FeatureInput, rows: int, dim: int) -> np.ndarray:
    values = np.asarray(feature.values)
    if values.dtype != np.float32 or values.size != rows * dim:
        raise InvalidArgument(
            f"dense feature {name!r}: expected float32 [{rows}, {dim}], got "
            f"{values.dtype} {list(values.shape)}"
        )
    values = values.reshape(rows, dim)
    bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
    if len(bad):
        raise InvalidArgument(f"dense feature {name!r}: a value of row {bad[0]} is not finite")
    return values


def _lookup(
    store: ServedModel,
    served: ServedVersion,
    sparse: Mapping[str, SparseInput],
    keys: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per feature (its table's unique rows, inverse index), every table read
    at the snapshot's version."""
    by_table: dict[str, list[str]] = {}
    for name, f in sparse.items():
        by_table.setdefault(f.table, []).append(name)
    out = {}
    for table, names in by_table.items():
        joined = np.concatenate([keys[n][0] for n in names])
        unique, inverse = np.unique(joined, return_inverse=True)
        result = store.lookup(table, unique, at=served)  # VersionMoved: the caller retries
        start = 0
        for name in names:
            size = len(keys[name][0])
            out[name] = (result.rows, inverse[start : start + size])
            start += size
    return out
