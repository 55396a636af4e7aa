"""Keys from what clients send: integers, strings of digits, and raw strings
of features trained on hashed strings. Shared by the HTTP/JSON and gRPC
transports and the Python client, so all three read a value alike.

* An integer key is in [-2^63, 2^64 - 1]; a negative one is an int64 key,
  read as its uint64 bit pattern.
* A string value of a sparse feature whose ``SparseInput.hash_field`` is set
  (its keys were made by hashing strings in training) is hashed exactly as
  the reader hashed it: ``wuliang.reader.hash_strings(value, hash_field)``,
  a string of digits included. Integers sent for such a feature are taken as
  keys already hashed.
* Elsewhere (lookups, features of integer ids) a string must be a string of
  digits (optionally ``-``): the key it spells, for clients whose JSON
  numbers are doubles (JavaScript loses keys above 2^53).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pyarrow as pa

from wuliang.ps_server.storage import SparseInput
from wuliang.serving.errors import InvalidArgument

__all__ = ["describe", "hash_keys", "parse_keys", "sparse_keys", "string_keys_of_bytes"]

_DIGITS = re.compile(r"-?[0-9]{1,20}", re.ASCII)
_INT64_MIN = -(1 << 63)
_UINT64_END = 1 << 64


def describe(value: Any) -> str:
    """A JSON value's type and a short excerpt, for error messages."""
    kinds = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{kinds.get(type(value), type(value).__name__)} ({text})"


def _where(what: str, index: int, offsets: list[int] | np.ndarray | None) -> str:
    if offsets is None:
        return f"{what}[{index}]"
    return f"{what}, row {int(np.searchsorted(offsets, index, side='right')) - 1}"


def parse_keys(
    values: list[Any],
    what: str,
    offsets: list[int] | np.ndarray | None = None,
    strings: str = "a key must be an integer or a string of digits",
) -> np.ndarray:
    """Integers and strings of digits as uint64 keys; ``offsets`` (CSR, one
    entry per row and one more) lets errors name the row, ``strings`` says
    what a value that is neither should have been.

    Raises:
        InvalidArgument: naming the value, its position and what it should be.
    """
    if set(map(type, values)) <= {int}:  # the common case, at C speed
        try:
            array = np.array(values, dtype=None) if values else np.zeros(0, np.uint64)
        except OverflowError:  # beyond uint64: the loop below names it
            array = None
        if array is not None and array.dtype == np.int64:
            return array.view(np.uint64)
        if array is not None and array.dtype == np.uint64:
            return array
    out = np.empty(len(values), np.uint64)
    for i, value in enumerate(values):
        kind = type(value)
        if kind is int:
            key = value
        elif kind is str and _DIGITS.fullmatch(value):
            key = int(value)
        else:
            raise InvalidArgument(f"{_where(what, i, offsets)}: {strings}, got {describe(value)}")
        if not _INT64_MIN <= key < _UINT64_END:
            raise InvalidArgument(
                f"{_where(what, i, offsets)}: key {key} is outside uint64 [0, 2^64 - 1] "
                "(negative keys are int64, down to -2^63)"
            )
        out[i] = key & (_UINT64_END - 1)
    return out


def hash_keys(strings: list[str] | pa.Array, field: str, what: str = "strings") -> np.ndarray:
    """The keys training made of these strings: ``hash_strings(s, field)``.

    Raises:
        InvalidArgument: a string is not valid Unicode (a lone surrogate).
    """
    from wuliang.reader.hashing import string_keys

    if not isinstance(strings, pa.Array):
        try:
            strings = pa.array(strings, pa.string())
        except UnicodeEncodeError:
            bad = next(i for i, s in enumerate(strings) if not _encodes(s))
            raise InvalidArgument(f"{what}: string {strings[bad]!r} is not valid Unicode") from None
    return string_keys(strings, field)


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def sparse_keys(
    values: list[Any], feature: SparseInput, what: str, offsets: list[int] | np.ndarray | None
) -> np.ndarray:
    """The keys of one sparse feature's values (integers and strings, see
    the module docstring)."""
    if feature.hash_field is None:
        return parse_keys(
            values,
            what,
            offsets,
            f"a key must be an integer or a string of digits (feature {feature.name!r} takes "
            "integer ids: it was not trained on hashed strings)",
        )
    where = [i for i, v in enumerate(values) if type(v) is str]
    if not where:
        return parse_keys(values, what, offsets)
    placeholders = [0 if type(v) is str else v for v in values]  # positions kept for errors
    keys = parse_keys(
        placeholders, what, offsets, "a key must be an integer or a string (hashed as in training)"
    )
    keys[where] = hash_keys([values[i] for i in where], feature.hash_field, what)
    return keys


def string_keys_of_bytes(
    data: bytes, bounds: np.ndarray, feature: SparseInput, what: str
) -> np.ndarray:
    """The keys of raw strings sent as bytes: string i is
    ``data[bounds[i]:bounds[i + 1]]``, UTF-8 (the gRPC ``string_values``).

    Raises:
        InvalidArgument: the bounds do not cut ``data`` into strings, a
            string is not UTF-8, or (a feature of integer ids) not a string
            of digits.
    """
    n = len(bounds) - 1
    if n < 0:
        if data:
            raise InvalidArgument(f"{what}: string_values come without string_offsets")
        return np.zeros(0, np.uint64)
    if bounds[0] != 0 or bounds[-1] != len(data) or (np.diff(bounds) < 0).any():
        raise InvalidArgument(
            f"{what}: string_offsets must rise from 0 to the {len(data)} bytes of string_values"
        )
    array = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(np.ascontiguousarray(bounds, np.int64)), pa.py_buffer(data)
    )
    try:
        array.validate(full=True)  # UTF-8
    except pa.ArrowInvalid:
        bad = next(i for i in range(n) if not _utf8(data[bounds[i] : bounds[i + 1]]))
        raise InvalidArgument(f"{what}: string {bad} is not UTF-8") from None
    if feature.hash_field is not None:
        return hash_keys(array, feature.hash_field, what)
    return sparse_keys(array.to_pylist(), feature, what, None)


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
