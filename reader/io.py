"""Writing Parquet files the way every wuliang writer does: atomically; and the
paths of object stores the writers and converters take (``RemotePath``, from
``wuliang.ps_server.storage.location``, which versions use too)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from wuliang.ps_server.storage.location import RemotePath, location

AnyPath = Path | RemotePath


def as_path(path: str | os.PathLike) -> AnyPath:
    """A URI as a RemotePath, anything else as a Path."""
    return location(path)


def named(files: list[AnyPath]) -> list[Path | str]:
    """Files as writers return them: Paths, and remote files as URIs."""
    return [f.uri if isinstance(f, RemotePath) else f for f in files]


def write_parquet(table: pa.Table, path: AnyPath | str, row_group_rows: int = 65_536) -> None:
    """Writes table to path atomically: to a temporary name in the same folder,
    renamed into place last, so a crash never leaves a partial file under
    path. A remote file (a RemotePath) is written to memory and uploaded
    whole to its final name (object stores have no rename; S3 shows an
    object only once its upload is complete).

    Key columns (integers and lists of integers) are stored plain and
    uncompressed: hashed keys are high-entropy, so compression saves little
    and decoding them is the reader's main cost (snappy made it 1.6x slower);
    other columns are snappy-compressed.
    """
    compression = {f.name: "none" if _is_key(f.type) else "snappy" for f in table.schema}
    options: dict[str, Any] = {
        "row_group_size": row_group_rows,
        "compression": compression,
        "use_dictionary": False,
    }
    if isinstance(path, RemotePath):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **options)
        path.write_bytes(sink.getvalue())
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, **options)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _is_key(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_integer(t)
