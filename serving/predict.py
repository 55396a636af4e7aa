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
   (``store.predict_rows(..., at=served)``, or ``lookup`` for a store
   without it: ``VersionMoved`` when the store has moved on, and the caller
   starts again from a new snapshot);
4. pools each feature's rows with the function training uses
   (``wuliang.embedding.pooling``: sum, mean, sqrtn, or a padded sequence
   and its mask). Rows from a device cache are pooled where they are: handed
   to TensorFlow through DLPack (no copy; a GPU's memory with cupy, host
   memory with numpy) and pooled by the training step's own TensorFlow
   functions (``embedding.bridge.pool`` / ``sequence``), the tower then
   taking the tensors where they are;
5. runs the snapshot's tower (its SavedModel's ``serve``) and returns its
   outputs (``predictions``, or ``predictions_<task>`` per task).

``Service.predict`` resolves the snapshot, decodes the request with its
model description and retries on ``VersionMoved``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wuliang.embedding.pooling import pool_rows
from wuliang.ps_server import LookupResult
from wuliang.ps_server.storage import ModelDescription, SparseInput
from wuliang.serving.errors import FailedPrecondition, InvalidArgument
from wuliang.serving.model import ServedModel, ServedVersion

# Threads answering predictions, per transport (``wuliang serve
# --predict-threads``). TensorFlow spreads one prediction over the cores
# itself: on 2 cores one thread answered 100-row predictions at 474/s where
# two answered 323-403/s, and kept their latency under overload (p99 13-15
# ms against 19-26; benchmarks/overload_bench.py). With more cores a second
# thread overlaps one prediction's Python with another's TensorFlow.
PREDICT_THREADS = 1 if (os.cpu_count() or 1) <= 2 else 2

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
    assert served.tower is not None  # check_model
    if getattr(store, "device_cache", None) is not None:
        pooled = _pool_in_tensorflow(sparse, keys, rows_by_table, rows)
        return PredictAnswer(served.tower({**dense_inputs, **pooled}), served.number)
    inputs: dict[str, np.ndarray] = dict(dense_inputs)
    for name, f in sparse.items():
        table_rows, inverse = rows_by_table[name]
        offsets, weights = keys[name][1], keys[name][2]
        pooled = pool_rows(table_rows[inverse], offsets, f.combiner, weights, f.max_len)
        if isinstance(pooled, tuple):
            inputs[name], inputs[f"{name}_mask"] = pooled
        else:
            inputs[name] = pooled
    return PredictAnswer(served.tower(inputs), served.number)


def _pool_in_tensorflow(
    sparse: Mapping[str, SparseInput],
    keys: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]],
    rows_by_table: Mapping[str, tuple[Any, np.ndarray]],
    batch: int,
) -> dict[str, Any]:
    """Each feature pooled by TensorFlow from rows where they are (DLPack):
    the training step's ``pool`` and ``sequence``, per value in CSR order."""
    import tensorflow as tf

    from wuliang.embedding.bridge import pool, sequence
    from wuliang.embedding.rows import as_tensor

    tensors: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for name, f in sparse.items():
        table_rows, inverse = rows_by_table[name]
        rows = tensors.get(id(table_rows))
        if rows is None:
            rows = tensors[id(table_rows)] = _to_tensorflow(table_rows, as_tensor, tf)
        _, offsets, weights = keys[name]
        lengths = np.diff(offsets)
        segments = np.repeat(np.arange(batch, dtype=np.int32), lengths)
        w = np.ones(len(inverse), np.float32) if weights is None else weights
        if f.combiner is None:  # a sequence: its first max_len values
            positions = (np.arange(len(inverse)) - np.repeat(offsets[:-1], lengths)).astype(
                np.int32
            )
            keep = positions < f.max_len
            values = tf.gather(rows, inverse[keep])
            out[name], out[f"{name}_mask"] = sequence(
                values, segments[keep], positions[keep], w[keep], f.max_len, batch
            )
        else:
            out[name] = pool(tf.gather(rows, inverse), segments, w, f.combiner, batch)
    return out


def _to_tensorflow(rows: Any, as_tensor: Callable[[Any], Any], tf: Any) -> Any:
    """Rows as a tensor without a copy: a device array through DLPack (its
    stream synchronized first), a host array through ``as_tensor``."""
    if isinstance(rows, np.ndarray):
        return tf.convert_to_tensor(as_tensor(np.ascontiguousarray(rows)))
    import cupy  # type: ignore[import-not-found]

    cupy.cuda.get_current_stream().synchronize()
    return tf.experimental.dlpack.from_dlpack(rows.__dlpack__())


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
) -> dict[str, tuple[Any, np.ndarray]]:
    """Per feature (its table's unique rows, inverse index), every table read
    at the snapshot's version."""
    by_table: dict[str, list[str]] = {}
    for name, f in sparse.items():
        by_table.setdefault(f.table, []).append(name)
    out = {}
    for table, names in by_table.items():
        joined = np.concatenate([keys[n][0] for n in names])
        unique, inverse = np.unique(joined, return_inverse=True)
        read = getattr(store, "predict_rows", store.lookup)
        blocks = sparse[names[0]].blocks
        result = read_blocks(read, table, blocks, unique, served)  # VersionMoved: caller retries
        start = 0
        for name in names:
            size = len(keys[name][0])
            out[name] = (result.rows, inverse[start : start + size])
            start += size
    return out


def read_blocks(
    read: Callable[..., LookupResult],
    table: str,
    blocks: Sequence[str],
    keys: np.ndarray,
    at: ServedVersion | None,
) -> LookupResult:
    """``read(table, keys, at=at)``; for a sized table (``blocks``: its
    extension blocks) each block's rows after the table's, the vectors the
    tower takes (zeros past a key's size), found as the table's."""
    result = read(table, keys, at=at)
    if not blocks:
        return result
    rows = [result.rows, *(read(block, keys, at=at).rows for block in blocks)]
    xp = np  # or the device's module, for a device cache's rows
    if not isinstance(result.rows, np.ndarray):
        xp = importlib.import_module(type(result.rows).__module__.split(".")[0])
    return LookupResult(xp.concatenate(rows, axis=1), result.found, result.version)
