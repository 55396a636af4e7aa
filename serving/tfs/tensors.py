"""``TensorProto`` s in and out of TensorFlow Serving's ``Predict``.

In: a ``PredictRequest`` 's ``inputs`` (feature name -> tensor) become
wuliang's feature arrays (``FeatureInput``), read with the model description
of the version that answers (``features``):

* a tensor's values come from ``tensor_content`` (raw little-endian bytes,
  what ``tf.make_tensor_proto`` writes for numbers) or from the repeated
  field of its dtype (``int64_val``, ``float_val``, ``string_val`` …); as in
  TensorFlow, fewer values than the shape holds repeat the last one (none:
  zeros, empty strings), more are an error;
* a **sparse** feature takes ids: ``DT_INT64`` / ``DT_INT32`` (negative ids
  are int64 keys, read as their uint64 bits, as everywhere in wuliang),
  ``DT_UINT64`` / ``DT_UINT32``, or ``DT_STRING`` (hashed as training
  hashed them when the feature was trained on hashed strings, else strings
  of digits). Shape ``[batch]`` is one id per row; ``[batch, n]`` is a list
  per row, padded with ``PAD_ID`` (-1; for an unsigned dtype its largest
  value, the same bits) or the empty string, which are dropped, so rows of
  different lengths travel in one tensor;
* a **dense** feature takes ``DT_FLOAT`` (or ``DT_DOUBLE``, ``DT_HALF``,
  ``DT_INT32``, ``DT_INT64``, converted to float32), shape ``[batch]`` for
  dim 1 or ``[batch, dim]``;
* every input's first dimension is the batch, the same for all.

Out: each output array becomes a ``DT_FLOAT`` tensor of its shape, values
in ``tensor_content``.

Errors are ``InvalidArgument`` naming the input and what it should be.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from wuliang.ps_server.storage import ModelDescription, SparseInput
from wuliang.serving.errors import InvalidArgument
from wuliang.serving.features import string_keys_of_bytes
from wuliang.serving.predict import FeatureInput
from wuliang.serving.signature import PAD_STRING
from wuliang.serving.tfs import proto

__all__ = ["features", "output_tensor", "values"]

# dtype number -> (numpy dtype, the repeated field holding its values)
_NUMERIC = {
    1: ("<f4", "float_val"),  # DT_FLOAT
    2: ("<f8", "double_val"),  # DT_DOUBLE
    3: ("<i4", "int_val"),  # DT_INT32
    4: ("<u1", "int_val"),  # DT_UINT8
    5: ("<i2", "int_val"),  # DT_INT16
    6: ("<i1", "int_val"),  # DT_INT8
    9: ("<i8", "int64_val"),  # DT_INT64
    10: ("?", "bool_val"),  # DT_BOOL
    17: ("<u2", "int_val"),  # DT_UINT16
    19: ("<f2", "half_val"),  # DT_HALF (half_val: the bits, as int32)
    22: ("<u4", "uint32_val"),  # DT_UINT32
    23: ("<u8", "uint64_val"),  # DT_UINT64
}
DT_STRING = 7
_IDS = {3, 9, 22, 23}  # dtypes a sparse feature takes, besides strings
_FLOATS = {1, 2, 19, 3, 9}  # dtypes a dense feature takes


def dtype_name(dtype: int) -> str:
    value = proto.DataType.values_by_number.get(dtype)
    return value.name if value is not None else f"dtype {dtype}"


def _shape(tensor: Any, what: str) -> tuple[int, ...]:
    tensor_shape = tensor.tensor_shape
    shape = tuple([d.size for d in tensor_shape.dim])
    if tensor_shape.unknown_rank or (shape and min(shape) < 0):
        raise InvalidArgument(f"{what}: the tensor's shape {list(shape)} is not fully known")
    return shape


def values(
    tensor: Any, what: str, shape: tuple[int, ...] | None = None
) -> tuple[np.ndarray | list[bytes], tuple[int, ...]]:
    """A tensor's values, flat (a numpy array, or a list of bytes for
    ``DT_STRING``), and its shape (``shape``: already read)."""
    if shape is None:
        shape = _shape(tensor, what)
    size = math.prod(shape)
    dtype = tensor.dtype
    if dtype == DT_STRING:
        strings = list(tensor.string_val)
        return _filled(strings, size, b"", what), shape
    if dtype not in _NUMERIC:
        raise InvalidArgument(f"{what}: {dtype_name(dtype)} tensors are not read here")
    numpy_dtype, field_name = _NUMERIC[dtype]
    content = tensor.tensor_content
    if content:
        itemsize = np.dtype(numpy_dtype).itemsize
        if len(content) != size * itemsize:
            raise InvalidArgument(
                f"{what}: tensor_content has {len(content)} bytes, shape {list(shape)} of "
                f"{dtype_name(dtype)} needs {size * itemsize}"
            )
        return np.frombuffer(content, numpy_dtype), shape
    field_values = getattr(tensor, field_name)
    if dtype == 19:  # half_val holds each half's 16 bits in an int32
        array = np.asarray(field_values, np.int32).astype(np.uint16).view(np.float16)
    else:
        array = np.asarray(field_values, numpy_dtype)
    return _filled(array, size, None, what), shape


def _filled(items: Any, size: int, empty: Any, what: str) -> Any:
    """TensorFlow's rule: fewer values than the shape holds repeat the last
    one (none at all: zeros, or empty strings)."""
    n = len(items)
    if n == size:
        return items
    if n > size:
        raise InvalidArgument(f"{what}: {n} values for a shape of {size}")
    if isinstance(items, list):
        return items + [items[-1] if n else empty] * (size - n)
    if n == 0:
        return np.zeros(size, items.dtype)
    return np.concatenate([items, np.full(size - n, items[-1], items.dtype)])


def features(inputs: Any, description: ModelDescription) -> tuple[dict[str, FeatureInput], int]:
    """A ``PredictRequest`` 's inputs as feature arrays, and the batch size
    (see the module docstring)."""
    names = description.feature_names
    missing = [name for name in names if name not in inputs]
    if len(inputs) != len(names) - len(missing):  # some input is not a feature
        unknown = sorted(set(inputs) - set(names))
        raise InvalidArgument(
            f"input {unknown[0]!r}: the model has no such feature (inputs: {', '.join(names)})"
        )
    if missing:
        raise InvalidArgument(
            f"input {missing[0]!r} is missing (inputs: {', '.join(names)}; the metadata, "
            "GetModelMetadata, describes each)"
        )
    out: dict[str, FeatureInput] = {}
    batch = -1
    for name in names:
        tensor = inputs[name]
        what = f"input {name!r}"
        shape = _shape(tensor, what)
        if not shape:
            raise InvalidArgument(f"{what}: a scalar; the first dimension is the batch")
        if batch >= 0 and shape[0] != batch:
            first = names[0]
            raise InvalidArgument(
                f"{what} has {shape[0]} rows (first dimension), input {first!r} has {batch}"
            )
        batch = shape[0]
        spec = description.sparse_by_name.get(name)
        if spec is not None:
            out[name] = _sparse(tensor, spec, what, shape)
        else:
            out[name] = _dense(tensor, description.dense_by_name[name].dim, what, shape)
    if batch == 0:
        raise InvalidArgument("the request has no rows (every input's first dimension is 0)")
    return out, batch


def _sparse(tensor: Any, spec: SparseInput, what: str, shape: tuple[int, ...]) -> FeatureInput:
    dtype = tensor.dtype
    if dtype != DT_STRING and dtype not in _IDS:
        raise InvalidArgument(
            f"{what}: sparse feature ids are DT_INT64 (or DT_INT32, DT_UINT64, DT_UINT32) or "
            f"DT_STRING, got {dtype_name(dtype)}"
        )
    flat, shape = values(tensor, what, shape)
    if len(shape) > 2:
        raise InvalidArgument(
            f"{what}: ids are [batch] (one per row) or [batch, n] (a padded list per row), "
            f"got shape {list(shape)}"
        )
    rows = shape[0]
    per_row = shape[1] if len(shape) == 2 else 1
    if isinstance(flat, list):  # strings
        keep = [s != PAD_STRING for s in flat]
        kept = [s for s, k in zip(flat, keep, strict=True) if k]
        lengths = np.array(keep, bool).reshape(rows, per_row).sum(axis=1)
        bounds = np.zeros(len(kept) + 1, np.int64)
        np.cumsum([len(s) for s in kept], out=bounds[1:])
        keys = string_keys_of_bytes(b"".join(kept), bounds, spec, f"{what} strings")
    else:
        unsigned = flat.dtype.kind == "u"
        pad = np.iinfo(flat.dtype).max if unsigned else -1
        mask = flat != pad
        if len(shape) == 1 and mask.all():  # one id per row: no offsets
            return FeatureInput(_as_keys(flat, unsigned))
        lengths = mask.reshape(rows, per_row).sum(axis=1)
        keys = _as_keys(flat[mask], unsigned)
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return FeatureInput(keys, offsets)


def _as_keys(ids: np.ndarray, unsigned: bool) -> np.ndarray:
    """Ids as uint64 keys: negative int64 ids keep their bits."""
    if ids.dtype == np.uint64 or ids.dtype == np.int64:
        return ids.view(np.uint64)
    if unsigned:
        return ids.astype(np.uint64)
    return ids.astype(np.int64).view(np.uint64)


def _dense(tensor: Any, dim: int, what: str, shape: tuple[int, ...]) -> FeatureInput:
    dtype = tensor.dtype
    if dtype not in _FLOATS:
        raise InvalidArgument(
            f"{what}: dense features are DT_FLOAT (or DT_DOUBLE, DT_HALF, DT_INT32, DT_INT64), "
            f"got {dtype_name(dtype)}"
        )
    flat, shape = values(tensor, what, shape)
    assert isinstance(flat, np.ndarray)
    rows = shape[0]
    if math.prod(shape[1:]) != dim or (len(shape) == 1 and dim != 1):
        want = f"[batch, {dim}]" + (" or [batch]" if dim == 1 else "")
        raise InvalidArgument(f"{what}: a dense feature of dim {dim} is {want}, got {list(shape)}")
    if flat.dtype != np.float32:
        wide = flat.astype(np.float64)
        too_big = np.abs(wide) > np.finfo(np.float32).max
        if too_big.any():
            raise InvalidArgument(f"{what}: {wide[too_big][0]} is outside float32's range")
        flat = wide.astype(np.float32)
    return FeatureInput(flat.reshape(rows, dim))


def output_tensor(target: Any, array: np.ndarray) -> None:
    """Writes a float32 array into a ``TensorProto`` (its dtype, shape, bytes)."""
    array = np.ascontiguousarray(array, "<f4")
    target.dtype = 1  # DT_FLOAT
    for size in array.shape:
        target.tensor_shape.dim.add(size=size)
    target.tensor_content = array.tobytes()
