"""Arrays on the wire: raw little-endian bytes, checked on the way in.

Every array field of ``ps.proto`` is bytes: keys, steps and versions
uint64, rows and gradients float32 row-major, counts and times uint32,
offsets int64, masks one byte per key. ``array`` reads one with its length
checked against what the message says it holds, raising ``WireError``
(a ``ValueError``: the server answers INVALID_ARGUMENT) naming the field;
numpy reads the bytes in place, without a copy.

On the way out, ``Encoded`` builds a message whose big array fields are
not copied into a protobuf message first: the small fields are serialized
by protobuf, each array field is appended as its tag, its length and the
array's own buffer, and ``join`` copies everything once into the bytes
gRPC sends. (Serializing a message holding megabytes of rows through
protobuf cost ten times that one copy.) Protobuf's wire format allows it:
fields may come in any order, and a repeated field's entries keep the
order they are appended in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wuliang.ps_server.chunk import RowChunk

__all__ = ["Encoded", "WireError", "array", "chunk_of", "chunk_to_message", "to_bytes"]

KEY = np.dtype("<u8")
FLOAT = np.dtype("<f4")
U32 = np.dtype("<u4")
I64 = np.dtype("<i8")
MASK = np.dtype("u1")


class WireError(ValueError):
    """Bytes that are not the array their field should hold."""


def array(
    data: bytes, dtype: np.dtype, what: str, rows: int | None = None, width: int | None = None
) -> Any:
    """The array in ``data``: ``rows`` values (or rows of ``width``), or as
    many whole values as there are; WireError naming ``what`` otherwise.
    With ``width`` the array is 2-D ``[n, width]`` (also for a width of 1:
    the rows of a table of dim 1), without it 1-D."""
    size = dtype.itemsize * (width or 1)
    if len(data) % size:
        raise WireError(f"{what}: {len(data)} bytes is not a whole number of {size}-byte values")
    n = len(data) // size
    if rows is not None and n != rows:
        raise WireError(f"{what}: {n} values, expected {rows}")
    values = np.frombuffer(data, dtype)
    return values if width is None else values.reshape(n, width)


def to_bytes(values: np.ndarray, dtype: np.dtype) -> bytes:
    """An array's bytes in the wire's dtype (no conversion when it is one)."""
    return np.ascontiguousarray(values, dtype).tobytes()


def chunk_to_message(chunk: RowChunk, message: Any) -> Any:
    """Fills a ``Rows`` message with a chunk's columns."""
    message.keys = to_bytes(chunk.keys, KEY)
    message.weights = to_bytes(chunk.weights, FLOAT)
    message.state = to_bytes(chunk.state, FLOAT)
    message.counts = to_bytes(chunk.counts, U32)
    message.steps = to_bytes(chunk.steps, KEY)
    message.times = to_bytes(chunk.times, U32)
    message.versions = to_bytes(chunk.versions, KEY)
    message.shows = to_bytes(chunk.shows, FLOAT)
    message.clicks = to_bytes(chunk.clicks, FLOAT)
    message.dim = chunk.weights.shape[1] if chunk.weights.ndim == 2 else 0
    message.state_dim = chunk.state.shape[1] if chunk.state.ndim == 2 else 0
    return message


def chunk_of(message: Any, what: str, dim: int | None = None) -> RowChunk:
    """The chunk of a ``Rows`` message; columns left empty come back as
    empty arrays (``LoadRequest``: their defaults)."""
    keys = array(message.keys, KEY, f"{what} keys")
    n = len(keys)
    width = message.dim or (dim or 0)
    if dim is not None and message.dim and message.dim != dim:
        raise WireError(f"{what}: rows of dim {message.dim}, the table's is {dim}")
    weights = array(message.weights, FLOAT, f"{what} weights", n, width) if width else None
    if weights is None:
        raise WireError(f"{what}: the rows' dim is missing")
    state = (
        array(message.state, FLOAT, f"{what} state", n, message.state_dim)
        if message.state_dim
        else np.zeros((n, 0), np.float32)
    )

    def column(data: bytes, dtype: np.dtype, name: str) -> np.ndarray:
        return np.zeros(0, dtype) if not data else array(data, dtype, f"{what} {name}", n)

    return RowChunk(
        keys=keys,
        weights=weights,
        state=state,
        counts=column(message.counts, U32, "counts"),
        steps=column(message.steps, KEY, "steps"),
        times=column(message.times, U32, "times"),
        versions=column(message.versions, KEY, "versions"),
        shows=column(message.shows, FLOAT, "shows"),
        clicks=column(message.clicks, FLOAT, "clicks"),
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class Encoded:
    """A protobuf message as pieces, joined by one copy (the module docstring).

    ``Encoded(M["PullResponse"], **small)`` starts from the message's small
    fields (serialized by protobuf); ``add_array(field, values)`` appends a
    bytes field from any C-contiguous buffer (every call one entry, also an
    empty one, so a repeated field keeps its entries); ``add_message(field,
    inner)`` appends a message field holding another ``Encoded``;
    ``add_fields(**small)`` more small fields. Fields are named as in
    ``ps.proto``; set each singular field once."""

    def __init__(self, kind: Any, **small: Any) -> None:
        self.kind = kind
        self.fields = kind.DESCRIPTOR.fields_by_name
        self.pieces: list[Any] = []
        self.size = 0
        self.add_fields(**small)

    def add_fields(self, **small: Any) -> Encoded:
        """Appends small fields, serialized by protobuf."""
        data = self.kind(**small).SerializeToString() if small else b""
        if data:
            self.pieces.append(data)
            self.size += len(data)
        return self

    def add_array(self, field: str, values: Any) -> Encoded:
        view = memoryview(values)
        if not view.c_contiguous:
            raise ValueError(f"{field}: an array on the wire must be C-contiguous")
        self._add(field, [view], view.nbytes)
        return self

    def add_message(self, field: str, inner: Encoded) -> Encoded:
        self._add(field, inner.pieces, inner.size)
        return self

    def _add(self, field: str, pieces: list[Any], size: int) -> None:
        number = self.fields[field].number
        head = _varint(number << 3 | 2) + _varint(size)  # wire type 2: length-delimited
        self.pieces += [head, *pieces]
        self.size += len(head) + size

    def join(self) -> bytes:
        return b"".join(self.pieces)
