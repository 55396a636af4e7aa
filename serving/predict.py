"""Predictions from raw feature values, exactly as training computed them.

A request gives, for a batch of ``rows`` rows, each sparse feature's keys
(CSR: ``values`` and ``offsets``, or one key per row, optional ``weights``)
and each dense feature's floats. ``predict``:

1. checks them against the model description of the served version (the
   manifest's ``model``: every feature present and no other, dims, dtypes,
   offsets; errors name the feature and row);
2. looks each table's keys up once (the unique keys of every feature that
   reads the table), all tables at one version: a lookup names the version
   it read, and while a new version switches in (table by table) the
   lookups are retried until they agree;
3. pools each feature's rows with the function training uses
   (``wuliang.embedding.pooling``: sum, mean, sqrtn, or a padded sequence
   and its mask);
4. runs that version's tower (its SavedModel's ``serve``) and returns its
   outputs (``predictions``, or ``predictions_<task>`` per task).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from wuliang.embedding.pooling import pool_rows
from wuliang.ps_server.storage import SparseInput
from wuliang.serving.errors import InvalidArgument, TooLarge, Unavailable
from wuliang.serving.store import ModelStore

SWITCH_RETRIES = 200  # lookups retried while a version switches in (1 ms apart)


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


def predict(
    store: ModelStore, features: Mapping[str, FeatureInput], rows: int, max_rows: int = 10_000
) -> PredictAnswer:
    """Scores a batch (see the module docstring)."""
    if not isinstance(rows, int) or rows < 1:
        raise InvalidArgument(f"rows must be an int >= 1, got {rows!r}")
    if rows > max_rows:
        raise TooLarge(f"{rows} rows in one request; at most {max_rows}")
    model = store.served().model
    sparse = model.sparse_by_name
    dense = model.dense_by_name
    if not sparse and not dense:
        raise Unavailable(f"model {store.name!r}: the served version has no model description")
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
    rows_by_table, version = _lookup(store, sparse, keys)
    inputs: dict[str, np.ndarray] = dict(dense_inputs)
    for name, f in sparse.items():
        table_rows, inverse = rows_by_table[name]
        offsets, weights = keys[name][1], keys[name][2]
        pooled = pool_rows(table_rows[inverse], offsets, f.combiner, weights, f.max_len)
        if isinstance(pooled, tuple):
            inputs[name], inputs[f"{name}_mask"] = pooled
        else:
            inputs[name] = pooled
    tower = store.served(version).tower
    if tower is None:
        raise Unavailable(f"model {store.name!r} serves lookups only (no tower loaded)")
    outputs = tower(inputs)
    return PredictAnswer(outputs, version)


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
    store: ModelStore,
    sparse: Mapping[str, SparseInput],
    keys: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]],
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """Per feature (its table's unique rows, inverse index), all read at one
    version; and that version."""
    by_table: dict[str, list[str]] = {}
    for name, f in sparse.items():
        by_table.setdefault(f.table, []).append(name)
    uniques = {}
    for table, names in by_table.items():
        joined = np.concatenate([keys[n][0] for n in names]) if names else np.zeros(0, np.uint64)
        unique, inverse = np.unique(joined, return_inverse=True)
        uniques[table] = (unique, inverse, [len(keys[n][0]) for n in names])
    for _ in range(SWITCH_RETRIES):
        results = {table: store.lookup(table, u[0]) for table, u in uniques.items()}
        labels = {r.version for r in results.values()}
        if len(labels) <= 1:
            version = labels.pop() if labels else store.version
            break
        time.sleep(0.001)  # a version is switching in, table by table
    else:
        raise Unavailable(f"model {store.name!r}: the tables did not settle on one version")
    out = {}
    for table, (_, inverse, sizes) in uniques.items():
        start = 0
        for name, size in zip(by_table[table], sizes, strict=True):
            out[name] = (results[table].rows, inverse[start : start + size])
            start += size
    return out, version
