"""Categorical values to uint64 keys: ``key = hash(field, value)``.

Strings are hashed by a stable 64-bit function seeded by the field name
(C++, ``reader/csrc/string_hash.cc``); integer ids can be salted by their
field the same way, so equal values of different fields never share a key.
Keys are part of the data format: these functions never change ("v1").
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from wuliang.reader import _reader


def field_seed(field: str) -> int:
    return _reader.field_seed(field)


def hash_strings(values: pa.Array | pa.ChunkedArray | Iterable[str], field: str) -> pa.Array:
    """uint64 keys of strings; nulls stay null. Accepts Arrow or Python strings."""
    if isinstance(values, pa.ChunkedArray):
        return pa.chunked_array(
            [hash_strings(c, field) for c in values.chunks], type=pa.uint64()
        ).combine_chunks()
    if not isinstance(values, pa.Array):
        values = pa.array(list(values), type=pa.string())
    if pa.types.is_large_string(values.type):
        offsets_type = np.int64
    elif pa.types.is_string(values.type):
        offsets_type = np.int32
    else:
        raise TypeError(f"field {field!r}: expected strings, got {values.type}")
    _, offsets_buf, data_buf = values.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offsets_type)[
        values.offset : values.offset + len(values) + 1
    ]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    )
    keys = _reader.hash_strings(np.ascontiguousarray(offsets), data, field_seed(field))
    return pa.array(keys, type=pa.uint64(), mask=values.is_null().to_numpy(zero_copy_only=False))


def hash_ints(values: np.ndarray, field: str) -> np.ndarray:
    """uint64 keys of int64 ids, salted by the field."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    return _reader.hash_ints(values, field_seed(field))
