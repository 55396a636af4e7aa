"""Rows files: a table's rows as Arrow record batches, and back.

A rows file (``tables/<table>/part-NNNNN.arrow``, an uncompressed Arrow IPC
file) has the columns ``key`` (uint64), ``vector`` (fixed-size list of
``dim`` float32), ``state`` (fixed-size list of the optimizer's state
floats; absent where the version stores no state, as exports do), ``count``
(uint32), ``step`` (uint64), ``time`` (uint32), ``version`` (uint64),
``shows`` and ``clicks`` (float32, as of ``step``; files written before them
lack both, and read as zeros): everything ``ParameterServer.load`` takes, so
a restore is exact. Arrow IPC
(not Parquet) because rows are written and read at memory speed: no
encoding, and the reader maps the file and hands the columns on as views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from wuliang.ps_server.chunk import RowChunk
from wuliang.ps_server.storage.location import Location, RemotePath


def _fsl(values: np.ndarray, width: int) -> pa.Array:
    flat = pa.array(np.ascontiguousarray(values, np.float32).reshape(-1), pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, width)


def rows_schema(dim: int, state_dim: int) -> pa.Schema:
    """The rows-file schema; without ``state`` when state_dim is 0."""
    fields = [("key", pa.uint64()), ("vector", pa.list_(pa.float32(), dim))]
    if state_dim:
        fields.append(("state", pa.list_(pa.float32(), state_dim)))
    fields += [("count", pa.uint32()), ("step", pa.uint64()), ("time", pa.uint32())]
    fields += [("version", pa.uint64()), ("shows", pa.float32()), ("clicks", pa.float32())]
    return pa.schema(fields)


def rows_to_batch(rows: RowChunk, dim: int, state_dim: int) -> pa.RecordBatch:
    """A RecordBatch of a ``RowChunk`` (its state left out when state_dim is 0)."""
    columns = [pa.array(rows.keys, pa.uint64()), _fsl(rows.weights, dim)]
    if state_dim:
        columns.append(_fsl(rows.state, state_dim))
    columns += [
        pa.array(rows.counts, pa.uint32()),
        pa.array(rows.steps, pa.uint64()),
        pa.array(rows.times, pa.uint32()),
        pa.array(rows.versions, pa.uint64()),
        pa.array(rows.shows, pa.float32()),
        pa.array(rows.clicks, pa.float32()),
    ]
    return pa.record_batch(columns, schema=rows_schema(dim, state_dim))


def _fsl_numpy(column: pa.Array, width: int) -> np.ndarray:
    flat = column.values.to_numpy(zero_copy_only=False)
    offset = column.offset * width
    return flat[offset : offset + len(column) * width].reshape(len(column), width)


def batch_to_rows(batch: pa.RecordBatch) -> RowChunk:
    """A rows-file RecordBatch as a ``RowChunk`` (numpy views where Arrow allows)."""
    dim = batch.schema.field("vector").type.list_size
    if batch.schema.get_field_index("state") >= 0:
        state = _fsl_numpy(batch.column("state"), batch.schema.field("state").type.list_size)
    else:
        state = np.zeros((batch.num_rows, 0), np.float32)
    return RowChunk(
        keys=batch.column("key").to_numpy(),
        weights=_fsl_numpy(batch.column("vector"), dim),
        state=state,
        counts=batch.column("count").to_numpy(),
        steps=batch.column("step").to_numpy(),
        times=batch.column("time").to_numpy(),
        versions=batch.column("version").to_numpy(),
        shows=_optional(batch, "shows"),
        clicks=_optional(batch, "clicks"),
    )


def _optional(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A float32 column that files written before it lack (zeros there)."""
    if batch.schema.get_field_index(name) < 0:
        return np.zeros(batch.num_rows, np.float32)
    return batch.column(name).to_numpy()


def select_rows(chunk: RowChunk, which: slice | np.ndarray) -> RowChunk:
    """The rows of a chunk that ``which`` (a slice or a mask) selects."""
    return RowChunk(**{f.name: getattr(chunk, f.name)[which] for f in dataclasses.fields(chunk)})


def read_part(path: Location) -> Iterator[RowChunk]:
    """The rows of one part file (mapped, not copied; a file in an object
    store: read whole into memory), batch by batch."""
    opened = (
        pa.BufferReader(path.read_buffer())
        if isinstance(path, RemotePath)
        else pa.memory_map(str(path))
    )
    with opened as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield batch_to_rows(reader.get_batch(i))
