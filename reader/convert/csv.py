"""Delimited text described by a YAML schema → Parquet (``wuliang convert csv``).

The schema names each column of the input and its kind::

    columns:
      - {name: user, kind: sparse}                        # one key, uint64
      - {name: tags, kind: sparse_list, separator: "|"}   # keys, list<uint64>
      - {name: age, kind: dense}                          # float32
      - {name: click, kind: label}                        # float32
      - {name: note, kind: skip}                          # not written
    header: true   # optional, default true; if false, columns are positional

With a header, columns are found by name (input columns the schema does not
name are not written); without one, the schema lists every column in order.

Output: ``part-00000.parquet`` … of ``rows_per_file`` rows, written atomically
in input order (part files of an earlier run beyond the last one written are
removed); one column per non-skip schema column, in schema order:

* ``sparse``: uint64 single-valued key; an empty field is null (no key);
* ``sparse_list``: list<uint64>, the field split at ``separator`` (default
  ``|``), each part stripped of surrounding spaces, empty parts dropped; an
  empty field is an empty list;
* ``dense``: float32; empty or NaN → 0;
* ``label``: float32; an empty or non-numeric label is an error.

Errors name the file and the line (a wrong number of fields) or the column and
row (a bad value; rows count from 1, the header not included).

Keys of a value (``type`` of a sparse or sparse_list column): ``auto`` (the
default) uses a value written as a canonical integer (``0``, ``-?[1-9][0-9]*``
within int64) as the key itself (two's complement as uint64) and hashes any
other value, ``hash_strings(value, column name)``, so a value always gets the
same key, whatever the rest of the file holds; ``string`` hashes every value;
``int`` requires integers. Only ``string`` columns carry the field metadata
tag of hashed strings (``hashing.hash_tag(column name)``): ``auto`` keys are
not all hashes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import yaml

from wuliang.reader.convert._common import (
    PartWriter,
    byte_progress,
    iter_csv,
    make_out_dir,
    open_input,
    progress_bar,
    write_converted,
)
from wuliang.reader.hashing import hash_strings, tag_hashed

KINDS = ("sparse", "sparse_list", "dense", "label", "skip")
KEY_TYPES = ("auto", "string", "int")
_SHORT_INT = r"^(0|-?[1-9][0-9]{0,17})$"  # at most 18 digits: always an int64
_LONG_INT = r"^[1-9][0-9]{18}$"  # 19 digits: an int64 up to 9223372036854775807
_LONG_NEGATIVE = r"^-[1-9][0-9]{18}$"  # and down to -9223372036854775808
_BLOCK_BYTES = 16 << 20


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: str
    separator: str = "|"  # sparse_list
    type: str = "auto"  # sparse, sparse_list: "auto", "string" or "int"


@dataclass(frozen=True)
class CsvSchema:
    columns: tuple[ColumnSpec, ...]
    header: bool = True

    @property
    def output(self) -> list[ColumnSpec]:
        return [c for c in self.columns if c.kind != "skip"]

    def arrow_schema(self) -> pa.Schema:
        types = {
            "sparse": pa.uint64(),
            "sparse_list": pa.list_(pa.uint64()),
            "dense": pa.float32(),
            "label": pa.float32(),
        }
        fields = []
        for c in self.output:
            field = pa.field(c.name, types[c.kind], nullable=c.kind == "sparse")
            hashed = c.kind in ("sparse", "sparse_list") and c.type == "string"
            fields.append(tag_hashed(field) if hashed else field)
        return pa.schema(fields)

    @classmethod
    def from_dict(cls, data: Any, source: str = "schema") -> CsvSchema:
        """A checked schema; ValueError naming the bad entry otherwise."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a mapping with 'columns', got {data!r}")
        unknown = set(data) - {"columns", "header"}
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {', '.join(map(repr, sorted(map(str, unknown))))}; "
                "expected 'columns' and optionally 'header'"
            )
        header = data.get("header", True)
        if not isinstance(header, bool):
            raise ValueError(f"{source}: 'header' must be true or false, got {header!r}")
        items = data.get("columns")
        if not isinstance(items, list) or not items:
            raise ValueError(f"{source}: 'columns' must be a non-empty list of columns")
        columns = tuple(_column(item, i, source) for i, item in enumerate(items, 1))
        seen: set[str] = set()
        for c in columns:
            if c.name in seen:
                raise ValueError(f"{source}: column {c.name!r} is listed twice")
            seen.add(c.name)
        if all(c.kind == "skip" for c in columns):
            raise ValueError(f"{source}: every column is skipped; nothing to write")
        return cls(columns, header)


def _column(item: Any, number: int, source: str) -> ColumnSpec:
    where = f"{source}: column #{number}"
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}: expected a mapping like {{name: x, kind: sparse}}")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: missing 'name' (a non-empty string)")
    where = f"{source}: column {name!r}"
    kind = item.get("kind")
    if kind not in KINDS:
        got = "missing 'kind'" if kind is None else f"unknown kind {kind!r}"
        raise ValueError(f"{where}: {got}; kinds: {', '.join(KINDS)}")
    allowed = {"name", "kind"}
    if kind in ("sparse", "sparse_list"):
        allowed.add("type")
    if kind == "sparse_list":
        allowed.add("separator")
    unknown = set(item) - allowed
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(map(repr, sorted(map(str, unknown))))} "
            f"for kind {kind!r}; allowed: {', '.join(sorted(allowed))}"
        )
    separator = item.get("separator", "|")
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"{where}: 'separator' must be a non-empty string")
    key_type = item.get("type", "auto")
    if key_type not in KEY_TYPES:
        raise ValueError(f"{where}: unknown type {key_type!r}; types: {', '.join(KEY_TYPES)}")
    return ColumnSpec(name, kind, separator, key_type)


def load_schema(path: str | os.PathLike) -> CsvSchema:
    """Reads and checks a YAML schema file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"schema file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    return CsvSchema.from_dict(data, str(path))


def _canonical_int64(values: pa.Array) -> np.ndarray:
    """Which values are canonical decimal integers within int64 (bool mask)."""
    short = pc.match_substring_regex(values, _SHORT_INT)
    # Among numbers of the same length, string order is numeric order.
    long = pc.and_(
        pc.match_substring_regex(values, _LONG_INT),
        pc.less_equal(values, str(2**63 - 1)),
    )
    negative = pc.and_(
        pc.match_substring_regex(values, _LONG_NEGATIVE),
        pc.less_equal(values, str(-(2**63))),
    )
    mask = pc.fill_null(pc.or_(short, pc.or_(long, negative)), False)
    return mask.to_numpy(zero_copy_only=False)


def value_keys(
    values: pa.Array,
    column: ColumnSpec,
    source: str = "",
    first_row: int = 0,
    rows: np.ndarray | None = None,
) -> pa.Array:
    """uint64 keys of string values (nulls stay null), by the column's key type.
    rows: the row (from first_row) of each value, if not its index."""
    if column.type == "string":
        return hash_strings(values, column.name)
    is_int = _canonical_int64(values)
    if column.type == "int":
        bad = np.flatnonzero(~is_int & ~values.is_null().to_numpy(zero_copy_only=False))
        if len(bad):
            row = first_row + int(bad[0] if rows is None else rows[bad[0]]) + 1
            raise ValueError(
                f"{source}: column {column.name!r}: {values[int(bad[0])].as_py()!r} in row "
                f"{row} is not an integer (type: int)"
            )
    keys = hash_strings(values, column.name).fill_null(0).to_numpy()
    if is_int.any():
        exact = pc.cast(values.filter(pa.array(is_int)), pa.int64()).to_numpy()
        keys = np.array(keys, dtype=np.uint64)
        keys[is_int] = exact.view(np.uint64)
    return pa.array(keys, type=pa.uint64(), mask=values.is_null().to_numpy(zero_copy_only=False))


def convert_batch(
    batch: pa.RecordBatch, schema: CsvSchema, source: str = "", first_row: int = 0
) -> pa.RecordBatch:
    """One batch of parsed input (sparse columns as strings, numbers as float32)."""
    arrays = []
    for c in schema.output:
        array = batch.column(c.name)
        if c.kind == "sparse":
            arrays.append(value_keys(array, c, source, first_row))
        elif c.kind == "sparse_list":
            lists = pc.split_pattern(array.fill_null(""), c.separator)
            parts = pc.utf8_trim_whitespace(lists.flatten())
            keep = pc.not_equal(parts, "").to_numpy(zero_copy_only=False)
            kept_before = np.concatenate([[0], np.cumsum(keep)]).astype(np.int32)
            offsets = lists.offsets.to_numpy()
            rows = np.repeat(np.arange(len(lists)), np.diff(offsets))[keep]
            keys = value_keys(parts.filter(pa.array(keep)), c, source, first_row, rows)
            offsets = pa.array(kept_before[offsets])
            arrays.append(pa.ListArray.from_arrays(offsets, keys))
        elif c.kind == "dense":
            values = array.fill_null(0).to_numpy(zero_copy_only=False)
            values = np.where(np.isnan(values), np.float32(0), values)
            arrays.append(pa.array(values, type=pa.float32()))
        else:
            values = array.to_numpy(zero_copy_only=False)  # nulls → nan
            bad = np.flatnonzero(~np.isfinite(values))
            if len(bad):
                raise ValueError(
                    f"{source}: label {c.name!r} is missing or not finite in row "
                    f"{first_row + int(bad[0]) + 1}"
                )
            arrays.append(pa.array(values, type=pa.float32()))
    return pa.RecordBatch.from_arrays(arrays, schema=schema.arrow_schema())


def read_header(path: Path, parse_options: pacsv.ParseOptions) -> list[str]:
    """The column names in the first line of path."""
    stream, raw = open_input(path)
    try:
        head = b""
        while b"\n" not in head and len(head) < _BLOCK_BYTES:
            block = stream.read(1 << 16)
            if not block:
                break
            head += block
    finally:
        stream.close()
        raw.close()
    line = head.split(b"\n", 1)[0]
    if not line.strip():
        raise ValueError(f"{path}: empty file or empty first line; expected a header")
    return pacsv.read_csv(pa.py_buffer(line + b"\n"), parse_options=parse_options).column_names


def convert_csv(
    in_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    schema: CsvSchema | str | os.PathLike,
    rows_per_file: int = 1_000_000,
    delimiter: str = ",",
    progress: bool = True,
) -> list[Path]:
    """Converts a delimited text file into Parquet files in out_dir; returns them.

    Args:
        schema: a CsvSchema or the path of its YAML file.

    Raises:
        FileNotFoundError: in_path or the schema file does not exist.
        ValueError: a bad schema, a schema column not in the header, a line
            with a wrong number of fields, a bad value (naming file, column
            and line or row).
    """
    path = Path(in_path)
    if not isinstance(schema, CsvSchema):
        schema = load_schema(schema)
    if len(delimiter) != 1:
        raise ValueError(f"the delimiter must be one character, got {delimiter!r}")
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    names = [c.name for c in schema.columns]
    if schema.header:
        names = read_header(path, pacsv.ParseOptions(delimiter=delimiter))
        missing = [c.name for c in schema.columns if c.name not in names]
        if missing:
            raise ValueError(
                f"{path}: schema column(s) {', '.join(map(repr, missing))} not in the header "
                f"(header: {', '.join(names)})"
            )
    types = {
        c.name: pa.float32() if c.kind in ("dense", "label") else pa.string() for c in schema.output
    }
    writer = PartWriter(make_out_dir(out_dir), rows_per_file, schema.arrow_schema())
    bar = progress_bar(path.stat().st_size, "csv", "B", progress)

    batches = iter_csv(
        path,
        pacsv.ReadOptions(column_names=None if schema.header else names, block_size=_BLOCK_BYTES),
        pacsv.ParseOptions(delimiter=delimiter),
        pacsv.ConvertOptions(
            column_types=types,
            include_columns=list(types),
            null_values=[""],
            strings_can_be_null=True,
        ),
        byte_progress(bar),
        names=names,
    )
    return write_converted(
        batches, lambda batch, done: convert_batch(batch, schema, str(path), done), writer, bar
    )
