"""Writing Parquet files the way every wuliang writer does: atomically."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(table: pa.Table, path: str | os.PathLike, row_group_rows: int = 65_536) -> None:
    """Writes table to path atomically: to a temporary name in the same folder,
    renamed into place last, so a crash never leaves a partial file under
    path. Keys are written without dictionary encoding (they rarely repeat
    enough to pay for it) and snappy-compressed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(
            table, tmp, row_group_size=row_group_rows, compression="snappy", use_dictionary=False
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
