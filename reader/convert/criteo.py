"""Criteo Display Advertising TSV → Parquet (``wuliang convert criteo``).

Input: one example per line, 40 tab-separated fields, no header: the label,
13 integer features, 26 categorical features (hashed values written as hex
strings); an empty field is missing. ``.gz``/``.bz2``/``.zst`` inputs are
decompressed on the fly. The file is streamed, so it may be larger than memory.

Output: ``part-00000.parquet`` … of ``rows_per_file`` rows, written atomically,
in input order (part files of an earlier run beyond the last one written are
removed), with columns

* ``label``: float32, the label as given (a missing label is an error);
* ``I1`` … ``I13``: float32 dense, ``log1p(max(x, 0))``; missing → 0;
* ``C1`` … ``C26``: uint64 single-valued keys, ``hash_strings(value, "C<k>")``
  of the value's text; missing → null (no key); each field tagged
  ``hashing.hash_tag("C<k>")`` in its metadata;
* with ``bucketize``, ``I1_bucket`` … ``I13_bucket``: uint64 single-valued
  keys, ``hash_ints(bucket, "I<k>_bucket")`` where bucket is
  ``floor(log2(x + 1))`` for x ≥ 0, ``NEGATIVE_BUCKET`` for x < 0 and
  ``MISSING_BUCKET`` for a missing value (every row has a key); not tagged.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from wuliang.reader.convert._common import (
    PartWriter,
    byte_progress,
    iter_csv,
    make_out_dir,
    progress_bar,
    write_converted,
)
from wuliang.reader.hashing import hash_ints, hash_strings, tag_hashed
from wuliang.reader.io import as_path

LABEL = "label"
DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
BUCKETS = [f"{name}_bucket" for name in DENSE]
COLUMNS = [LABEL, *DENSE, *CATEGORICAL]  # the input's fields, in order
NEGATIVE_BUCKET = -1
MISSING_BUCKET = -2
_POWERS = np.uint64(1) << np.arange(64, dtype=np.uint64)  # 2**0 … 2**63
_BLOCK_BYTES = 16 << 20


def output_schema(bucketize: bool = False) -> pa.Schema:
    fields = [pa.field(LABEL, pa.float32(), nullable=False)]
    fields += [pa.field(name, pa.float32(), nullable=False) for name in DENSE]
    fields += [tag_hashed(pa.field(name, pa.uint64())) for name in CATEGORICAL]
    if bucketize:
        fields += [pa.field(name, pa.uint64(), nullable=False) for name in BUCKETS]
    return pa.schema(fields)


def bucket_ids(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """int64 buckets of int64 values: ``floor(log2(x + 1))`` (exact, 0 … 63) for
    x ≥ 0, ``NEGATIVE_BUCKET`` for x < 0, ``MISSING_BUCKET`` where not valid."""
    values = np.asarray(values, dtype=np.int64)
    plus_one = np.maximum(values, 0).astype(np.uint64) + np.uint64(1)  # no overflow
    _, exponent = np.frexp(plus_one.astype(np.float64))  # 2**(e-1) <= x + 1 < 2**e ...
    buckets = exponent.astype(np.int64) - 1
    buckets -= plus_one < _POWERS[buckets]  # ... unless x + 1 was rounded up to 2**e
    buckets[values < 0] = NEGATIVE_BUCKET
    buckets[~np.asarray(valid, dtype=bool)] = MISSING_BUCKET
    return buckets


def convert_batch(
    batch: pa.RecordBatch, bucketize: bool = False, source: str = "", first_row: int = 0
) -> pa.RecordBatch:
    """One batch of parsed input (label float32, I int64, C string) → output columns."""
    label = batch.column(LABEL)
    if label.null_count:
        row = first_row + int(np.flatnonzero(label.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"{source}: the label is missing in row {row + 1}")
    columns: dict[str, pa.Array] = {LABEL: label.cast(pa.float32())}
    buckets: dict[str, pa.Array] = {}
    for name in DENSE:
        array = batch.column(name)
        values = array.fill_null(0).to_numpy()
        dense = np.log1p(np.maximum(values, 0).astype(np.float64)).astype(np.float32)
        columns[name] = pa.array(dense, type=pa.float32())
        if bucketize:
            valid = ~array.is_null().to_numpy(zero_copy_only=False)
            keys = hash_ints(bucket_ids(values, valid), f"{name}_bucket")
            buckets[f"{name}_bucket"] = pa.array(keys, type=pa.uint64())
    for name in CATEGORICAL:
        columns[name] = hash_strings(batch.column(name), name)
    columns.update(buckets)
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=output_schema(bucketize))


def convert_criteo(
    in_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    rows_per_file: int = 1_000_000,
    bucketize: bool = False,
    progress: bool = True,
) -> list[Path | str]:
    """Converts a Criteo TSV file into Parquet files in out_dir; returns them.
    in_path and out_dir may be URIs (``s3://bucket/key``); the files are then
    returned as URIs.

    Raises:
        FileNotFoundError: in_path does not exist.
        ValueError: a line with a wrong number of fields (naming the file and
            line), a value that is not an integer in an integer column, or a
            missing label.
    """
    path = as_path(in_path)
    if not path.is_file():
        raise FileNotFoundError(f"Criteo input {path} does not exist")
    writer = PartWriter(make_out_dir(out_dir), rows_per_file, output_schema(bucketize))
    bar = progress_bar(path.stat().st_size, "criteo", "B", progress)

    types = {LABEL: pa.float32(), **dict.fromkeys(DENSE, pa.int64())}
    types.update(dict.fromkeys(CATEGORICAL, pa.string()))
    batches = iter_csv(
        path,
        pacsv.ReadOptions(column_names=COLUMNS, block_size=_BLOCK_BYTES),
        pacsv.ParseOptions(delimiter="\t", quote_char=False),
        pacsv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=True),
        byte_progress(bar),
        names=COLUMNS,
    )
    return write_converted(
        batches, lambda batch, done: convert_batch(batch, bucketize, str(path), done), writer, bar
    )
