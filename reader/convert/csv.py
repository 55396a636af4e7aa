"""Delimited text described by a YAML schema → Parquet (``wuliang convert csv``).

``SCHEMA_HELP`` is the full reference of the schema (every key, every kind,
an example); docs/reader.md ("Converting CSV") holds the same example.

Parsing is vectorised through pyarrow: every column is read as text and
turned into keys, numbers or times per record batch; only a batch with a bad
value takes a slower path, to find the value, its row and what its column's
policy (``missing``, ``invalid``) does with it. Errors name the file, the
column, the row (rows count from 1, the header not included) and the value;
a row with a wrong number of fields is named by its line.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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
from wuliang.reader.io import AnyPath, as_path

KINDS = ("sparse", "sparse_list", "dense", "int64", "timestamp", "label", "skip")
NUMERIC_KINDS = ("dense", "int64", "timestamp", "label")  # parsed; missing/invalid policies
KEY_TYPES = ("auto", "string", "int")
MISSING = ("error", "zero", "drop_row")  # timestamp: error or drop_row
INVALID = ("error", "drop_row")
UNITS = ("s", "ms", "us")
SCHEMA_KEYS = ("columns", "header")
_POLICY_KEYS = {"missing", "invalid", "na_values"}
COLUMN_KEYS: dict[str, frozenset[str]] = {  # the keys a column of each kind accepts
    "sparse": frozenset({"name", "kind", "type"}),
    "sparse_list": frozenset({"name", "kind", "type", "separator"}),
    "dense": frozenset({"name", "kind", "allow_rounding", *_POLICY_KEYS}),
    "int64": frozenset({"name", "kind", *_POLICY_KEYS}),
    "timestamp": frozenset({"name", "kind", "unit", "format", *_POLICY_KEYS}),
    "label": frozenset({"name", "kind", *_POLICY_KEYS}),
    "skip": frozenset({"name", "kind"}),
}
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}
_FLOAT32_EXACT = 2**24  # every integer up to this magnitude is exact in float32
_SHORT_INT = r"^(0|-?[1-9][0-9]{0,17})$"  # at most 18 digits: always an int64
_LONG_INT = r"^[1-9][0-9]{18}$"  # 19 digits: an int64 up to 9223372036854775807
_LONG_NEGATIVE = r"^-[1-9][0-9]{18}$"  # and down to -9223372036854775808
_INTEGER_TEXT = r"^[+-]?[0-9]+$"
# an ISO-8601 time of day followed by a zone (Z, +08:00, -0500, +08)
_ZONE_SUFFIX = r"[0-9]:[0-9]{2}(:[0-9]{2}(\.[0-9]*)?)?(Z|z|[+-][0-9]{2}(:?[0-9]{2})?)$"
_BLOCK_BYTES = 16 << 20

EXAMPLE_SCHEMA = """\
header: true
columns:
  - {name: user, kind: sparse, type: string}
  - {name: item, kind: sparse}
  - {name: tags, kind: sparse_list, separator: "|"}
  - {name: price, kind: dense, missing: zero}
  - {name: dwell, kind: dense, na_values: ["N/A"], missing: drop_row}
  - {name: ts, kind: timestamp}
  - {name: day, kind: int64}
  - {name: click, kind: label}
  - {name: note, kind: skip}
"""

EXAMPLE_CSV = """\
user,item,tags,price,dwell,ts,day,click,note,extra
alice,42,a|b,9.5,1.5,1700000000,19675,1,first,x
bob,sku-7,,,0.25,2023-11-14T22:13:21Z,19675,0,,y
carol,-1,c| d||,3,4,2023-11-15 08:00:00,19676,1,"with, comma",z
dave,42,a,1,N/A,2023-11-15T09:00:00+08:00,19676,0,dropped,w
"""

SCHEMA_HELP = f"""\
The schema (YAML) names the columns of the input and how each is converted.

Top-level keys:
  columns   a list of columns (required), each a mapping with 'name' and 'kind'
  header    true (default): the first line names the columns, which are found
            by name (input columns the schema does not name are not written);
            false: no header, the schema lists every column in input order

The delimiter and the rows per output file are options of the command
(--delimiter, --rows-per-file), not schema keys. A key the schema does not
know is an error naming it.

Column keys by kind (every kind takes 'name' and 'kind'):
  sparse       one key per row, written as uint64; an empty field has no key (null)
               type: auto (default): a canonical integer (0, -?[1-9][0-9]*,
                     within int64) is its own key (negatives as two's
                     complement), any other value is hashed;
                     string: every value hashed, hash_strings(value, column
                     name); the column is tagged as hashed strings;
                     int: every value must be an integer
  sparse_list  keys, written as list<uint64>: the field split at 'separator'
               (default "|"), each part stripped of spaces, empty parts
               dropped; an empty field is an empty list; 'type' as for sparse
  dense        a number, written as float32
               allow_rounding: false (default): an integer beyond 2**24 that
                     float32 cannot hold exactly (an id, a unix time) is an
                     error suggesting kind int64 or timestamp; true: rounded
  int64        an integer, written as int64, exact. The reader reads an
               integer column as single-valued sparse ids, never as a dense
               feature: keep such a column for splitting and filtering
  timestamp    a time, written as timestamp[ms, tz=UTC] (unit us:
               timestamp[us, tz=UTC]; Parquet has no seconds): an integer is
               a unix time in 'unit'; any other value is ISO-8601
               (2023-11-14T22:13:20Z, 2023-11-14T22:13:20+08:00, or without a
               zone: UTC; 2023-11-14 22:13:20; 2023-11-14)
               unit: s (default) | ms | us, the unit of the integers and the
                     precision kept (ISO fractions finer than it are invalid)
               format: a strptime format (%Y-%m-%d %H:%M, %z for a zone);
                     when given, every value is parsed with it
               The reader refuses a timestamp column as a feature: it is for
               splitting and filtering (a time split)
  label        a number, written as float32
  skip         not written

Bad values (dense, int64, timestamp, label), per column:
  missing    an empty field, or one of na_values:
             error (default) | zero | drop_row (timestamp: error | drop_row)
  invalid    NaN, inf, -inf, a number out of float32's range, or text that is
             not a number (int64: not an integer; timestamp: not a time):
             error (default) | drop_row
  na_values  a list of strings that mean "missing" (for example ["N/A", "NULL"]);
             default none: only an empty field is missing
An error names the file, the column, the row (rows count from 1, the header
not included) and the value. Dropped rows are counted per column and
reported in the result. A line with a wrong number of fields is an error
naming its line.

Example schema:
{textwrap.indent(EXAMPLE_SCHEMA, "    ")}
and input:
{textwrap.indent(EXAMPLE_CSV, "    ")}
write one file with the columns user, item, tags, price, dwell, ts, day, click
(note and extra are not written) and the rows alice, bob and carol: user
hash_strings("alice", "user") …; item 42, hash_strings("sku-7", "item"),
2**64 - 1; tags [a, b], [], [c, d] hashed by "tags"; price 9.5, 0.0, 3.0;
dwell 1.5, 0.25, 4.0; ts 2023-11-14T22:13:20Z, 2023-11-14T22:13:21Z,
2023-11-15T08:00:00Z; day 19675, 19675, 19676; click 1.0, 0.0, 1.0. Dave's row
is dropped (dwell "N/A" is missing), counted as dwell: 1 missing.
"""


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: str
    separator: str = "|"  # sparse_list
    type: str = "auto"  # sparse, sparse_list: "auto", "string" or "int"
    missing: str = "error"  # numeric kinds: "error", "zero" or "drop_row"
    invalid: str = "error"  # numeric kinds: "error" or "drop_row"
    na_values: tuple[str, ...] = ()  # numeric kinds: strings that mean missing
    allow_rounding: bool = False  # dense
    unit: str = "s"  # timestamp
    format: str | None = None  # timestamp: a strptime format


def timestamp_type(unit: str) -> pa.DataType:
    """The written type of a timestamp column of unit: Parquet has no seconds,
    so seconds are written as milliseconds."""
    return pa.timestamp("us" if unit == "us" else "ms", "UTC")


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
            "int64": pa.int64(),
            "label": pa.float32(),
        }
        fields = []
        for c in self.output:
            t = timestamp_type(c.unit) if c.kind == "timestamp" else types[c.kind]
            f = pa.field(c.name, t, nullable=c.kind == "sparse")
            hashed = c.kind in ("sparse", "sparse_list") and c.type == "string"
            fields.append(tag_hashed(f) if hashed else f)
        return pa.schema(fields)

    @classmethod
    def from_dict(cls, data: Any, source: str = "schema") -> CsvSchema:
        """A checked schema; ValueError naming the bad entry otherwise."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a mapping with 'columns', got {data!r}")
        unknown = set(data) - set(SCHEMA_KEYS)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {_names(unknown)}; expected 'columns' and "
                "optionally 'header' (the delimiter and rows per file are options of "
                "the command, not schema keys)"
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


def _names(keys: Any) -> str:
    return ", ".join(map(repr, sorted(map(str, keys))))


def _choice(item: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...],
            where: str) -> str:  # fmt: skip
    value = item.get(key, default)
    if value not in choices:
        raise ValueError(f"{where}: {key} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


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
    allowed = COLUMN_KEYS[kind]
    unknown = set(item) - allowed
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {_names(unknown)} for kind {kind!r}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    separator = item.get("separator", "|")
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"{where}: 'separator' must be a non-empty string")
    key_type = item.get("type", "auto")
    if key_type not in KEY_TYPES:
        raise ValueError(f"{where}: unknown type {key_type!r}; types: {', '.join(KEY_TYPES)}")
    missing_choices = ("error", "drop_row") if kind == "timestamp" else MISSING
    missing = _choice(item, "missing", "error", missing_choices, where)
    invalid = _choice(item, "invalid", "error", INVALID, where)
    na_values = item.get("na_values", [])
    if not isinstance(na_values, list) or not all(isinstance(v, str) for v in na_values):
        raise ValueError(
            f"{where}: 'na_values' must be a list of strings (quote numbers: [\"-1\"]), "
            f"got {na_values!r}"
        )
    if "" in na_values:
        raise ValueError(f"{where}: 'na_values' need not list \"\": an empty field is missing")
    allow_rounding = item.get("allow_rounding", False)
    if not isinstance(allow_rounding, bool):
        raise ValueError(f"{where}: 'allow_rounding' must be true or false")
    unit = _choice(item, "unit", "s", UNITS, where)
    fmt = item.get("format")
    if fmt is not None and (not isinstance(fmt, str) or "%" not in fmt):
        raise ValueError(f"{where}: 'format' must be a strptime format like '%Y-%m-%d %H:%M:%S'")
    return ColumnSpec(
        name, kind, separator, key_type, missing, invalid, tuple(na_values), allow_rounding,
        unit, fmt,
    )  # fmt: skip


def load_schema(path: str | os.PathLike) -> CsvSchema:
    """Reads and checks a YAML schema file (``SCHEMA_HELP`` describes it)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"schema file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    return CsvSchema.from_dict(data, str(path))


# -- where a value is ------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """Names the file and the rows of one record batch in error messages."""

    source: str = ""
    first_row: int = 0  # input rows before the batch
    header: bool = True

    def row(self, index: int) -> str:
        """The row of the batch's index-th input row, counted as the docs say."""
        after = ", the header not counted" if self.header else ""
        return f"row {self.first_row + index + 1} (rows count from 1{after})"

    def error(self, column: ColumnSpec, index: int, message: str) -> ValueError:
        return ValueError(
            f"{self.source}: column {column.name!r} ({column.kind}), {self.row(index)}: {message}"
        )


# -- keys --------------------------------------------------------------------------


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
    place: Place | None = None,
    rows: np.ndarray | None = None,
) -> pa.Array:
    """uint64 keys of string values (nulls stay null), by the column's key type.
    rows: the input row (index in the batch) of each value, if not its index."""
    if column.type == "string":
        return hash_strings(values, column.name)
    is_int = _canonical_int64(values)
    if column.type == "int":
        bad = np.flatnonzero(~is_int & ~values.is_null().to_numpy(zero_copy_only=False))
        if len(bad):
            row = int(bad[0] if rows is None else rows[bad[0]])
            value = values[int(bad[0])].as_py()
            raise (place or Place()).error(
                column, row, f"{value!r} is not an integer (type: int; auto hashes other values)"
            )
    keys = hash_strings(values, column.name).fill_null(0).to_numpy()
    if is_int.any():
        exact = pc.cast(values.filter(pa.array(is_int)), pa.int64()).to_numpy()
        keys = np.array(keys, dtype=np.uint64)
        keys[is_int] = exact.view(np.uint64)
    return pa.array(keys, type=pa.uint64(), mask=values.is_null().to_numpy(zero_copy_only=False))


def _list_keys(
    text: pa.Array, column: ColumnSpec, place: Place, rows: np.ndarray | None
) -> pa.Array:
    lists = pc.split_pattern(text.fill_null(""), column.separator)
    parts = pc.utf8_trim_whitespace(lists.flatten())
    keep = pc.not_equal(parts, "").to_numpy(zero_copy_only=False)
    kept_before = np.concatenate([[0], np.cumsum(keep)]).astype(np.int32)
    offsets = lists.offsets.to_numpy()
    part_rows = np.repeat(np.arange(len(lists)), np.diff(offsets))[keep]
    if rows is not None:
        part_rows = rows[part_rows]
    keys = value_keys(parts.filter(pa.array(keep)), column, place, part_rows)
    return pa.ListArray.from_arrays(pa.array(kept_before[offsets]), keys)


# -- numbers and times ---------------------------------------------------------------


def _cast_each(
    text: pa.Array, cast: Callable[[pa.Array], pa.Array], out_type: pa.DataType
) -> tuple[pa.Array, np.ndarray]:
    """(cast(text) with null where a value does not cast, mask of those values).
    One vectorised cast when every value casts; otherwise the failing halves
    are split again, down to the single bad values."""
    try:
        return cast(text), np.zeros(len(text), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if len(text) == 1:
            return pa.nulls(1, out_type), np.ones(1, dtype=bool)
    half = len(text) // 2
    a, bad_a = _cast_each(text.slice(0, half), cast, out_type)
    b, bad_b = _cast_each(text.slice(half), cast, out_type)
    return pa.concat_arrays([a, b]), np.concatenate([bad_a, bad_b])


def _cast_text(
    text: pa.Array, cast: Callable[[pa.Array], pa.Array], out_type: pa.DataType
) -> tuple[pa.Array, np.ndarray]:
    """_cast_each of text, surrounding spaces allowed (trimmed only if some value fails)."""
    try:
        return cast(text), np.zeros(len(text), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return _cast_each(pc.utf8_trim_whitespace(text), cast, out_type)


def _mask(array: pa.Array) -> np.ndarray:
    return pc.fill_null(array, False).to_numpy(zero_copy_only=False)


def _int64s(array: pa.Array) -> np.ndarray:
    return pc.cast(array, pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)


def _times(text: pa.Array, column: ColumnSpec) -> tuple[np.ndarray, np.ndarray]:
    """(int64 time in the column's unit, invalid mask) of non-null text."""
    unit = column.unit
    if column.format is not None:
        parsed = pc.strptime(text, format=column.format, unit=unit, error_is_null=True)
        return _int64s(parsed), _mask(pc.and_(parsed.is_null(), text.is_valid()))
    text = pc.utf8_trim_whitespace(text)
    values = np.zeros(len(text), dtype=np.int64)
    bad = np.zeros(len(text), dtype=bool)
    integer = _mask(pc.match_substring_regex(text, _INTEGER_TEXT))
    zoned = _mask(pc.match_substring_regex(text, _ZONE_SUFFIX)) & ~integer
    naive = ~integer & ~zoned & ~text.is_null().to_numpy(zero_copy_only=False)
    for which, out_type in (
        (integer, pa.int64()),
        (zoned, pa.timestamp(unit, "UTC")),
        (naive, pa.timestamp(unit)),
    ):
        if which.any():
            part, part_bad = _cast_each(
                text.filter(pa.array(which)), lambda a, t=out_type: pc.cast(a, t), out_type
            )
            values[which] = _int64s(part)
            bad[which] = part_bad
    if unit == "s":  # written as milliseconds
        bad |= np.abs(values) > (2**63 - 1) // 1000
    return values, bad


@dataclass
class Parsed:
    """One numeric column of a batch: values (any value on a missing or
    invalid row), and which rows are missing and invalid."""

    values: np.ndarray  # float32 (dense, label) or int64 (int64, timestamp)
    missing: np.ndarray
    invalid: np.ndarray


def _arrow(values: np.ndarray, column: ColumnSpec) -> pa.Array:
    """The output array of a numeric column's values."""
    if column.kind == "timestamp":
        times = pa.array(values, pa.int64()).cast(pa.timestamp(column.unit, "UTC"))
        return times.cast(timestamp_type(column.unit))
    return pa.array(values, pa.int64() if column.kind == "int64" else pa.float32())


def parse_numbers(text: pa.Array, column: ColumnSpec) -> Parsed:
    """The values of a dense, int64, timestamp or label column of text (null: empty)."""
    if column.na_values:
        na = _mask(pc.is_in(text, value_set=pa.array(column.na_values, pa.string())))
        if na.any():
            text = pc.if_else(pa.array(na), pa.scalar(None, pa.string()), text)
    missing = text.is_null().to_numpy(zero_copy_only=False)
    if column.kind == "timestamp":
        values, invalid = _times(text, column)
    elif column.kind == "int64":
        ints, invalid = _cast_text(text, lambda a: pc.cast(a, pa.int64()), pa.int64())
        values = ints.fill_null(0).to_numpy(zero_copy_only=False)
    else:
        floats, _ = _cast_text(text, lambda a: pc.cast(a, pa.float64()), pa.float64())
        wide = floats.to_numpy(zero_copy_only=False)  # null -> nan
        with np.errstate(over="ignore", invalid="ignore"):
            values = wide.astype(np.float32)
        invalid = ~missing & ~np.isfinite(values)  # not a number, NaN, inf, beyond float32
    return Parsed(values, missing, invalid & ~missing)


def _rounded(text: pa.Array, parsed: Parsed, rows: np.ndarray) -> np.ndarray:
    """Which of rows hold an integer that float32 does not hold exactly."""
    wide = pc.cast(pc.utf8_trim_whitespace(text.take(pa.array(rows))), pa.float64())
    wide = wide.to_numpy(zero_copy_only=False)
    narrow = parsed.values[rows].astype(np.float64)
    return (wide != narrow) & (wide == np.trunc(wide)) & (np.abs(wide) < 2.0**63)


def _reason(column: ColumnSpec, value: str | None, missing: bool) -> str:
    """Why the text value of a missing or invalid row is bad, and what accepts it."""
    if missing:
        what = "an empty value" if value is None else f"missing value {value!r} (na_values)"
        options = "missing: drop_row" if column.kind == "timestamp" else "missing: zero or drop_row"
        return f"{what}; {options} in the column's schema accepts it"
    hint = "invalid: drop_row in the column's schema drops such rows"
    if column.kind == "int64":
        return f"{value!r} is not an integer within int64; {hint}"
    if column.kind == "timestamp":
        if column.format is not None:
            return f"{value!r} does not match format {column.format!r}; {hint}"
        return (
            f"{value!r} is neither a unix time in {_UNIT_NAMES[column.unit]} nor an "
            f"ISO-8601 date/time (with at most {_UNIT_NAMES[column.unit]} precision); {hint}"
        )
    try:
        number = float(str(value).strip())
    except ValueError:
        return f"{value!r} is not a number (na_values: [{value!r}] makes it missing); {hint}"
    if np.isfinite(number):
        return f"{value!r} is beyond float32's range; {hint}"
    return f"{value!r} is not finite; {hint}"


@dataclass
class DropCounts:
    """Rows dropped by the schema's drop_row policies."""

    rows: int = 0
    by_column: dict[str, dict[str, int]] = field(default_factory=dict)  # column -> reason -> rows

    def add(self, column: str, reason: str, rows: int) -> None:
        if rows:
            counts = self.by_column.setdefault(column, {})
            counts[reason] = counts.get(reason, 0) + rows

    def summary(self) -> str:
        """'dropped 2 rows (dwell: 1 missing, 1 invalid)', or '' when none were dropped."""
        if not self.rows:
            return ""
        parts = [
            f"{name}: " + ", ".join(f"{n:,} {reason}" for reason, n in counts.items())
            for name, counts in self.by_column.items()
        ]
        return f"dropped {self.rows:,} row{'s' if self.rows != 1 else ''} ({'; '.join(parts)})"


def convert_batch(
    batch: pa.RecordBatch, schema: CsvSchema, place: Place, dropped: DropCounts | None = None
) -> pa.RecordBatch:
    """One batch of input text (nulls: empty fields) as output columns. Rows a
    drop_row policy drops are left out and counted in dropped."""
    for c in schema.output:
        _check_utf8(batch.column(c.name), c, place)
    numeric = [c for c in schema.output if c.kind in NUMERIC_KINDS]
    parsed = {c.name: parse_numbers(batch.column(c.name), c) for c in numeric}
    drop = np.zeros(batch.num_rows, dtype=bool)
    for c in numeric:
        p = parsed[c.name]
        if c.missing == "drop_row":
            drop |= p.missing
        if c.invalid == "drop_row":
            drop |= p.invalid
    first_bad: tuple[int, int, ColumnSpec, bool] | None = (
        None  # (row, column order, column, missing)
    )
    for order, c in enumerate(numeric):
        p = parsed[c.name]
        for bad, policy, is_missing in (
            (p.missing, c.missing, True),
            (p.invalid, c.invalid, False),
        ):
            if policy == "error":
                rows = np.flatnonzero(bad & ~drop)
                if len(rows) and (first_bad is None or (rows[0], order) < first_bad[:2]):
                    first_bad = (int(rows[0]), order, c, is_missing)
    if first_bad is not None:
        row, _, c, is_missing = first_bad
        raise place.error(c, row, _reason(c, batch.column(c.name)[row].as_py(), is_missing))
    for c in numeric:
        p = parsed[c.name]
        if c.kind == "dense" and not c.allow_rounding:
            _check_rounding(batch.column(c.name), p, c, place, drop)
        if c.missing == "zero":
            p.values[p.missing] = 0
        if dropped is not None and c.missing == "drop_row":
            dropped.add(c.name, "missing", int(p.missing.sum()))
        if dropped is not None and c.invalid == "drop_row":
            dropped.add(c.name, "invalid", int((p.invalid & ~p.missing).sum()))
    rows = None  # the input row of each kept row, if any was dropped
    if drop.any():
        rows = np.flatnonzero(~drop)
        batch = batch.filter(pa.array(~drop))
        if dropped is not None:
            dropped.rows += int(drop.sum())
    arrays = []
    for c in schema.output:
        if c.kind in NUMERIC_KINDS:
            values = parsed[c.name].values
            arrays.append(_arrow(values if rows is None else values[rows], c))
        elif c.kind == "sparse":
            arrays.append(value_keys(batch.column(c.name), c, place, rows))
        else:
            arrays.append(_list_keys(batch.column(c.name), c, place, rows))
    return pa.RecordBatch.from_arrays(arrays, schema=schema.arrow_schema())


def _check_utf8(text: pa.Array, column: ColumnSpec, place: Place) -> None:
    try:
        text.validate(full=True)
    except pa.ArrowInvalid:
        raw = text.view(pa.binary()).to_pylist()
        for i, value in enumerate(raw):
            try:
                if value is not None:
                    value.decode()
            except UnicodeDecodeError:
                raise place.error(column, i, f"{value!r} is not valid UTF-8") from None
        raise


def _check_rounding(
    text: pa.Array, parsed: Parsed, column: ColumnSpec, place: Place, drop: np.ndarray
) -> None:
    """Raises if a kept row holds an integer float32 cannot hold exactly."""
    values = parsed.values
    with np.errstate(invalid="ignore"):
        large = np.abs(values) >= _FLOAT32_EXACT  # only such integers can round
    candidates = np.flatnonzero(large & ~parsed.missing & ~parsed.invalid & ~drop)
    if not len(candidates):
        return
    rounded = candidates[_rounded(text, parsed, candidates)]
    if len(rounded):
        row = int(rounded[0])
        value = text[row].as_py()
        raise place.error(
            column,
            row,
            f"{value!r} is an integer that float32 cannot hold exactly (it would read "
            f"{float(values[row])!r}): ids and unix times need kind: int64 or kind: timestamp "
            "(allow_rounding: true accepts the rounding)",
        )


# -- files ---------------------------------------------------------------------------


class CsvResult(list[Path | str]):
    """The files convert_csv wrote, in order, with what it counted: ``rows``
    written and ``dropped`` (a DropCounts); ``summary()`` is the status line."""

    def __init__(self, files: list[Path | str], rows: int, dropped: DropCounts) -> None:
        super().__init__(files)
        self.rows = rows
        self.dropped = dropped

    def summary(self) -> str:
        """'wrote 3 rows in 1 files; dropped 1 row (dwell: 1 missing)'."""
        line = f"wrote {self.rows:,} rows in {len(self)} files"
        return f"{line}; {self.dropped.summary()}" if self.dropped.rows else line


def read_header(path: AnyPath, parse_options: pacsv.ParseOptions) -> list[str]:
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
) -> CsvResult:
    """Converts a delimited text file into Parquet files in out_dir.

    Args:
        in_path, out_dir: local paths or URIs (``s3://bucket/key``).
        schema: a CsvSchema or the path of its YAML file (``SCHEMA_HELP``).

    Returns:
        the files written (a list of paths; URIs for a remote out_dir), with
        the rows written and the
        rows dropped by drop_row policies (``CsvResult.summary()``).

    Raises:
        FileNotFoundError: in_path or the schema file does not exist.
        ValueError: a bad schema, a schema column not in the header, a line
            with a wrong number of fields (naming the file and line), a bad
            value (naming the file, column, row and value).
    """
    path = as_path(in_path)
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
    # Every column as text: values are parsed per batch, where their rows are known.
    types = {c.name: pa.string() for c in schema.output}
    writer = PartWriter(make_out_dir(out_dir), rows_per_file, schema.arrow_schema())
    bar = progress_bar(path.stat().st_size, "csv", "B", progress)
    dropped = DropCounts()
    written = [0]

    def convert(batch: pa.RecordBatch, done: int) -> pa.RecordBatch:
        before = dropped.rows
        out = convert_batch(batch, schema, Place(str(path), done, schema.header), dropped)
        written[0] += out.num_rows
        if bar is not None and dropped.rows != before:
            bar.set_postfix(dropped=dropped.rows)
        return out

    batches = iter_csv(
        path,
        pacsv.ReadOptions(column_names=None if schema.header else names, block_size=_BLOCK_BYTES),
        pacsv.ParseOptions(delimiter=delimiter),
        pacsv.ConvertOptions(
            column_types=types,
            include_columns=list(types),
            null_values=[""],
            strings_can_be_null=True,
            check_utf8=False,  # checked per batch, to name the row
        ),
        byte_progress(bar),
        names=names,
    )
    files = write_converted(batches, convert, writer, bar)
    return CsvResult(files, written[0], dropped)
