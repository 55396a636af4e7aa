"""Writing Parquet files the way every wuliang writer does: atomically."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(table: pa.Table, path: str | os.PathLike, row_group_rows: int = 65_536) -> None:
    """Writes table to path atomically: to a temporary name in the same folder,
    renamed into place last, so a crash never leaves a partial file under
    path.

    Key columns (integers and lists of integers) are stored plain and
    uncompressed: hashed keys are high-entropy, so compression saves little
    and decoding them is the reader's main cost (snappy made it 1.6x slower);
    other columns are snappy-compressed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    compression = {f.name: "none" if _is_key(f.type) else "snappy" for f in table.schema}
    try:
        pq.write_table(
            table,
            tmp,
            row_group_size=row_group_rows,
            compression=compression,
            use_dictionary=False,
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _is_key(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_integer(t)
