"""Arrays on the wire: raw little-endian bytes, checked on the way in.

Every array field of ``ps.proto`` is bytes: keys, steps and versions
uint64, rows and gradients float32 row-major, counts and times uint32,
offsets int64, masks one byte per key. ``array`` reads one with its length
checked against what the message says it holds, raising ``WireError``
(a ``ValueError``: the server answers INVALID_ARGUMENT) naming the field;
numpy reads the bytes in place, without a copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wuliang.ps_server.chunk import RowChunk

__all__ = ["WireError", "array", "chunk_of", "chunk_to_message", "to_bytes"]

KEY = np.dtype("<u8")
FLOAT = np.dtype("<f4")
U32 = np.dtype("<u4")
I64 = np.dtype("<i8")
MASK = np.dtype("u1")


class WireError(ValueError):
    """Bytes that are not the array their field should hold."""


def array(data: bytes, dtype: np.dtype, what: str, rows: int | None = None, width: int = 1) -> Any:
    """The array in ``data``: ``rows`` values (or rows of ``width``), or as
    many whole values as there are; WireError naming ``what`` otherwise."""
    size = dtype.itemsize * width
    if len(data) % size:
        raise WireError(f"{what}: {len(data)} bytes is not a whole number of {size}-byte values")
    n = len(data) // size
    if rows is not None and n != rows:
        raise WireError(f"{what}: {n} values, expected {rows}")
    values = np.frombuffer(data, dtype)
    return values if width == 1 else values.reshape(n, width)


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
    )
