"""Categorical values to uint64 keys: ``key = hash(field, value)``.

Strings are hashed by a stable 64-bit function seeded by the field name
(C++, ``reader/csrc/string_hash.cc``); integer ids can be salted by their
field the same way, so equal values of different fields never share a key.
Keys are part of the data format: these functions never change ("v1").

A key column made by hashing strings says so in its Arrow field metadata:
``HASH_METADATA`` → ``hash_tag(field)`` (``b"strings/v1:<field>"``), so a
reader of the file (or a server of a model trained on it) knows to hash raw
strings with ``hash_strings(value, field)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, overload

import numpy as np
import pyarrow as pa

from wuliang.reader import _reader

HASH_METADATA = b"wuliang.hash"  # Arrow field metadata key
_STRINGS_V1 = b"strings/v1:"


def hash_tag(field: str) -> bytes:
    """The metadata value of a column of ``hash_strings(value, field)`` keys."""
    return _STRINGS_V1 + field.encode()


def parse_hash_tag(tag: bytes | None) -> str | None:
    """The field of a ``hash_tag`` value; None if tag is None or not such a tag."""
    if tag is None or not tag.startswith(_STRINGS_V1):
        return None
    return tag[len(_STRINGS_V1) :].decode()


def tag_hashed(field: pa.Field, seed: str | None = None) -> pa.Field:
    """field with the metadata of ``hash_strings`` keys seeded by seed (default: its name)."""
    metadata = dict(field.metadata or {})
    metadata[HASH_METADATA] = hash_tag(field.name if seed is None else seed)
    return field.with_metadata(metadata)


def hashed_field(field: pa.Field) -> str | None:
    """The seed field recorded in an Arrow field's metadata, if any."""
    return parse_hash_tag((field.metadata or {}).get(HASH_METADATA))


def field_seed(field: str) -> int:
    return _reader.field_seed(field)


def is_string_type(t: pa.DataType) -> bool:
    """string, large_string, or a dictionary of either."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def string_keys(values: pa.Array, field: str) -> np.ndarray:
    """uint64 key of every slot of a string, large_string or dictionary<string>
    array, hashed in C++ from the Arrow buffers without the GIL. A null
    slot's key is meaningless: mask it with ``values.is_null()``."""
    if pa.types.is_dictionary(values.type) and is_string_type(values.type):
        if len(values.dictionary) > len(values):  # cheaper to hash the values
            return string_keys(values.dictionary_decode(), field)
        indices = values.indices
        index = (indices.fill_null(0) if indices.null_count else indices).to_numpy()
        words = string_keys(values.dictionary, field)
        return words[index] if len(words) else np.zeros(len(values), np.uint64)
    if pa.types.is_large_string(values.type):
        offsets_type = np.int64
    elif pa.types.is_string(values.type):
        offsets_type = np.int32
    else:
        raise TypeError(f"field {field!r}: expected strings, got {values.type}")
    if len(values) == 0:
        return np.zeros(0, np.uint64)
    _, offsets_buf, data_buf = values.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offsets_type)[
        values.offset : values.offset + len(values) + 1
    ]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    )
    return _reader.hash_strings(np.ascontiguousarray(offsets), data, field_seed(field))


@overload
def hash_strings(values: pa.Array | pa.ChunkedArray, field: str) -> pa.Array: ...


@overload
def hash_strings(values: np.ndarray | Iterable[str], field: str) -> np.ndarray: ...


def hash_strings(
    values: pa.Array | pa.ChunkedArray | np.ndarray | Iterable[str], field: str
) -> pa.Array | np.ndarray:
    """uint64 keys ``hash(field, value)`` of strings, the keys the reader and
    the converters make of them. What comes back follows what goes in:

    * Arrow (a string, large_string or dictionary<string> ``pa.Array`` or
      ``pa.ChunkedArray``): a ``pa.UInt64Array``; nulls stay null.
    * a numpy array of strings (``str`` dtype, or ``object`` holding ``str``)
      or any other iterable of ``str`` (list, tuple, generator): a 1-D numpy
      ``uint64`` array. numpy has no null: a ``None`` (or any element that is
      not a ``str``) raises TypeError naming its position; drop missing
      values first, or pass an Arrow array to keep them as nulls.

    A single ``str`` raises TypeError (it is not a list of strings).
    """
    if isinstance(values, pa.ChunkedArray):
        return pa.chunked_array(
            [hash_strings(c, field) for c in values.chunks], type=pa.uint64()
        ).combine_chunks()
    if isinstance(values, pa.Array):
        keys = string_keys(values, field)
        mask = values.is_null().to_numpy(zero_copy_only=False)
        return pa.array(keys, type=pa.uint64(), mask=mask)
    return string_keys(_python_strings(values, field), field)


def _python_strings(values: np.ndarray | Iterable[str], field: str) -> pa.Array:
    """values (numpy or an iterable of str) as an Arrow string array without nulls."""
    if isinstance(values, (str, bytes)):
        raise TypeError(
            f"field {field!r}: hash_strings takes a list of strings, got the single value "
            f"{values!r}: pass [value]"
        )
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"field {field!r}: expected a 1-D array, got shape {values.shape}")
        items: Any = values if values.dtype.kind == "U" else values.tolist()
    else:
        items = list(values)
    try:
        array = pa.array(items, type=pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        array = None
    if array is None or array.null_count:
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise TypeError(
                    f"field {field!r}: element {i} is {item!r} ({type(item).__name__}), not a "
                    "string; numpy keys have no null: drop missing values first, or pass an "
                    "Arrow array (nulls stay null)"
                )
    assert array is not None
    return array


def hash_ints(values: np.ndarray, field: str) -> np.ndarray:
    """uint64 keys of int64 ids, salted by the field."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    return _reader.hash_ints(values, field_seed(field))
