"""Arrow record batches to CSR columns, and the row operations on them.

A ``Chunk`` is a run of rows of one file, already in the shape of a
``CsrBatch``: list and integer columns as ``Csr`` (integer list values are
read-only views of the Arrow buffers: no copy), float columns stacked into one
float32 matrix, labels as float32. ``Schema`` decides, from the first file,
how each requested column is read and checks every other file against it.

Column kinds, from the Arrow type:

* ``list<int>`` / ``large_list<int>``: multi-valued sparse. Null lists are
  empty; null elements are dropped or raise (``null_values``).
* ``int*`` / ``uint*``: single-valued sparse; a null makes the row empty.
  An integer column is always read as ids, exactly, never as a dense
  feature (no float32 rounding): a number meant as a dense feature is
  stored as ``float``.
* ``string`` / ``large_string`` / ``dictionary<string>``: single-valued
  sparse, uint64 keys ``hash_strings(value, column name)`` (hashed in C++
  in the reader threads); a null makes the row empty.
* ``list<string>`` (any of the above string types, ``list`` or
  ``large_list``): multi-valued sparse, each element hashed as above; nulls
  as for ``list<int>``.
* ``float*`` / ``bool``: one dense column (null = 0; NaN and infinities are
  refused, or their rows dropped: ``finite_chunks``).
* ``fixed_size_list<float>``: d dense columns.
* weights: a ``list<float>`` column paired with a multi-valued feature.
* ``timestamp`` / ``date`` / ``time`` / ``duration``: refused as a feature or
  label, naming the column: times are for splitting and filtering files (a
  time split); a feature derived from a time (hour of day, age in days) is a
  column of its own.

Files may differ in how a string is stored (string, large_string,
dictionary; list or large_list), not in whether a column holds strings.
``Schema.hashed_features`` names the features whose keys are hashed strings:
the string columns, and key columns whose field metadata carries a
``wuliang.reader.hashing.HASH_METADATA`` tag (written by the converters).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from wuliang.reader.batch import Csr, CsrBatch
from wuliang.reader.hashing import hashed_field, is_string_type, string_keys

_EMPTY_KEYS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # "multi", "single" or "dense"
    type: pa.DataType
    width: int = 1  # dense columns
    strings: bool = False  # sparse keys hashed from strings, seeded by the name


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _string_kind(t: pa.DataType) -> str | None:
    """The sparse kind of a string or list<string> type ("single", "multi"), else None."""
    if is_string_type(t):
        return "single"
    if _is_list(t) and is_string_type(t.value_type):
        return "multi"
    return None


_TIME_FEATURE = (
    "column {name!r} has type {type}: a time is not read as a feature or label; "
    "times are for splitting and filtering files (a time split). Store a feature "
    "derived from it (hour of day, age in days) as an int or float column of its own"
)


def _is_time(t: pa.DataType) -> bool:
    return (
        pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_duration(t)
    )


def _column(name: str, t: pa.DataType) -> Column:
    strings = _string_kind(t)
    if strings is not None:
        return Column(name, strings, t, strings=True)
    if _is_list(t) and pa.types.is_integer(t.value_type):
        return Column(name, "multi", t)
    if pa.types.is_fixed_size_list(t) and pa.types.is_floating(t.value_type):
        return Column(name, "dense", t, t.list_size)
    if pa.types.is_integer(t):
        return Column(name, "single", t)
    if pa.types.is_floating(t) or pa.types.is_boolean(t):
        return Column(name, "dense", t)
    if _is_time(t):
        raise ValueError(_TIME_FEATURE.format(name=name, type=t))
    raise ValueError(
        f"column {name!r} has type {t}; the reader reads int, string, list<int>, "
        "list<string>, float, bool and fixed_size_list<float> columns"
    )


class Schema:
    """How each requested column is read; fixed by the first file."""

    def __init__(
        self,
        arrow: pa.Schema,
        source: str,
        features: Sequence[str],
        labels: Sequence[str],
        weights: Mapping[str, str],
    ) -> None:
        self.source = source
        self.features = [_column(name, self._field(arrow, name).type) for name in features]
        # sparse feature -> seed field of its hashed-string keys
        self.hashed_features: dict[str, str] = {}
        for c in self.features:
            seed = c.name if c.strings else hashed_field(self._field(arrow, c.name))
            if seed is not None and c.kind in ("single", "multi"):
                self.hashed_features[c.name] = seed
        self.labels = [Column(n, "label", self._field(arrow, n).type) for n in labels]
        for n in labels:
            t = self._field(arrow, n).type
            if _is_time(t):
                raise ValueError(_TIME_FEATURE.format(name=n, type=t))
            if not (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)):
                raise ValueError(f"label column {n!r} has type {t}; expected a number or bool")
        kinds = {c.name: c.kind for c in self.features}
        self.weights: dict[str, Column] = {}
        for feature, column in weights.items():
            if kinds.get(feature) != "multi":
                raise ValueError(f"weights {column!r}: {feature!r} is not a multi-valued feature")
            t = self._field(arrow, column).type
            if not (
                (pa.types.is_list(t) or pa.types.is_large_list(t))
                and pa.types.is_floating(t.value_type)
            ):
                raise ValueError(f"weights column {column!r} has type {t}; expected list<float>")
            self.weights[feature] = Column(column, "weights", t)
        self.dense_columns: dict[str, slice] = {}
        width = 0
        for c in self.features:
            if c.kind == "dense":
                self.dense_columns[c.name] = slice(width, width + c.width)
                width += c.width
        self.dense_width = width

    def _field(self, arrow: pa.Schema, name: str) -> pa.Field:
        index = arrow.get_field_index(name)
        if index < 0:
            raise ValueError(
                f"{self.source}: no column {name!r} (columns: {', '.join(arrow.names)})"
            )
        return arrow.field(index)

    @property
    def column_names(self) -> list[str]:
        names = [c.name for c in self.features] + [c.name for c in self.labels]
        return list(dict.fromkeys(names + [c.name for c in self.weights.values()]))

    def check(self, arrow: pa.Schema, source: str) -> None:
        """Raises ValueError naming the file and column that differ."""
        for c in [*self.features, *self.labels, *self.weights.values()]:
            index = arrow.get_field_index(c.name)
            if index < 0:
                raise ValueError(
                    f"{source}: no column {c.name!r} (columns: {', '.join(arrow.names)})"
                )
            t = arrow.field(index).type
            if not _same_type(t, c.type):
                raise ValueError(
                    f"{source}: column {c.name!r} is {t}, expected {c.type} (as in {self.source})"
                )


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal types, ignoring whether list elements are declared nullable and
    how strings are stored (string, large_string, dictionary; list or large_list)."""
    if a == b:
        return True
    if _string_kind(a) is not None or _string_kind(b) is not None:
        return _string_kind(a) == _string_kind(b)
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    for is_list in lists:
        if is_list(a) and is_list(b):
            if pa.types.is_fixed_size_list(a) and a.list_size != b.list_size:
                return False
            return a.value_type == b.value_type
    return False


@dataclass
class Chunk:
    """Rows [first_row, first_row + size) of one file, as batch columns."""

    sparse: dict[str, Csr]
    dense: np.ndarray  # float32 [n, k]
    labels: dict[str, np.ndarray]  # float32 [n] per label column
    size: int
    source: str = ""
    first_row: int = 0

    def to_batch(self, single_label: bool) -> CsrBatch:
        labels: np.ndarray | dict[str, np.ndarray] | None = self.labels or None
        if single_label and self.labels:
            labels = next(iter(self.labels.values()))
        return CsrBatch(self.sparse, self.dense, labels, self.size)


def _plain(array: pa.Array) -> pa.Array:
    """A dictionary array whose dictionary holds nulls, decoded (so that
    null_count counts them); any other array as it is."""
    if pa.types.is_dictionary(array.type) and array.dictionary.null_count:
        return array.dictionary_decode()
    return array


def _numbers(child: pa.Array) -> np.ndarray:
    """Values of a numeric array (a null slot's value is meaningless)."""
    return (child.fill_null(0) if child.null_count else child).to_numpy(zero_copy_only=False)


def _list_csr(
    array: pa.Array,
    name: str,
    null_values: str,
    source: str,
    first_row: int,
    values_of: Callable[[pa.Array], np.ndarray] = _numbers,
) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list array; values_of(child) gives the value of
    every child slot. Without nulls, integer values stay a view of the Arrow buffer."""
    offsets = array.offsets.to_numpy().astype(np.int64)
    child = _plain(array.values.slice(offsets[0], offsets[-1] - offsets[0]))
    offsets -= offsets[0]
    keep = None  # the child slots kept, if not all
    if array.null_count:  # a null list is empty, whatever its offsets say
        valid = ~array.is_null().to_numpy(zero_copy_only=False)
        keep = np.repeat(valid, np.diff(offsets))
    if child.null_count:
        nulls = child.is_null().to_numpy(zero_copy_only=False)
        if keep is not None:
            nulls &= keep
        if null_values == "raise" and nulls.any():
            row = int(np.searchsorted(offsets, np.flatnonzero(nulls)[0], side="right") - 1)
            raise ValueError(
                f"{source}: feature {name!r} has a null value at row {first_row + row}"
            )
        keep = ~nulls if keep is None else keep & ~nulls
    values = values_of(child)
    if keep is None:
        return values, offsets
    kept_before = np.concatenate([[0], np.cumsum(keep)])  # kept values before each slot
    return values[keep], kept_before[offsets].astype(np.int64)


def _as_keys(values: np.ndarray) -> np.ndarray:
    if values.dtype == np.int64 or values.dtype == np.uint64:
        return values
    return values.astype(np.uint64 if values.dtype.kind == "u" else np.int64)


def _single_csr(array: pa.Array, name: str, strings: bool) -> tuple[np.ndarray, np.ndarray]:
    array = _plain(array)
    values = string_keys(array, name) if strings else _as_keys(_numbers(array))
    if array.null_count:
        valid = ~array.is_null().to_numpy(zero_copy_only=False)
        return values[valid], np.concatenate([[0], np.cumsum(valid)]).astype(np.int64)
    return values, np.arange(len(array) + 1, dtype=np.int64)


def _floats(array: pa.Array, width: int) -> np.ndarray:
    if width > 1:
        flat = (array.fill_null([0.0] * width) if array.null_count else array).flatten()
        values = flat.to_numpy(zero_copy_only=False).astype(np.float32)
        if flat.null_count:  # null elements are 0 too
            values[flat.is_null().to_numpy(zero_copy_only=False)] = 0.0
        return values.reshape(-1, width)
    if pa.types.is_boolean(array.type):
        array = array.cast(pa.float32())
    if array.null_count:
        array = array.fill_null(0)
    return array.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, 1)


def _keys_of(c: Column) -> Callable[[pa.Array], np.ndarray]:
    if c.strings:
        return lambda child: string_keys(child, c.name)
    return _numbers


def chunk_from_record_batch(
    rb: pa.RecordBatch, schema: Schema, null_values: str, source: str, first_row: int
) -> Chunk:
    n = rb.num_rows
    sparse: dict[str, Csr] = {}
    dense_parts = []
    for c in schema.features:
        array = rb.column(c.name)
        if c.kind == "multi":
            values, offsets = _list_csr(array, c.name, null_values, source, first_row, _keys_of(c))
            weights = None
            if c.name in schema.weights:
                w_column = schema.weights[c.name].name
                w_values, w_offsets = _list_csr(
                    rb.column(w_column), w_column, "raise", source, first_row
                )
                if not np.array_equal(w_offsets, offsets):
                    raise ValueError(
                        f"{source}: weights of feature {c.name!r} do not line up with its values"
                    )
                weights = w_values.astype(np.float32, copy=False)
            sparse[c.name] = Csr(_as_keys(values), offsets, weights)
        elif c.kind == "single":
            values, offsets = _single_csr(array, c.name, c.strings)
            sparse[c.name] = Csr(values, offsets)
        else:
            dense_parts.append(_floats(array, c.width))
    dense = (
        np.hstack(dense_parts).astype(np.float32, copy=False)
        if dense_parts
        else np.zeros((n, 0), dtype=np.float32)
    )
    labels = {}
    for c in schema.labels:
        array = rb.column(c.name)
        if pa.types.is_boolean(array.type):
            array = array.cast(pa.float32())
        labels[c.name] = array.to_numpy(zero_copy_only=False).astype(np.float32)  # nulls -> nan
    return Chunk(sparse, dense, labels, n, source, first_row)


def finite_chunks(chunk: Chunk, schema: Schema, non_finite: str) -> tuple[list[Chunk], int]:
    """The chunk without rows whose dense values or labels are NaN or infinite
    (a null label is NaN): ``non_finite="raise"`` raises ValueError naming the
    file, feature and row of the first; ``"drop"`` returns the runs of good
    rows as chunks (each keeps its place in the file) and how many rows went."""
    bad = np.zeros(chunk.size, dtype=bool)
    if chunk.dense.shape[1]:
        bad |= ~np.isfinite(chunk.dense).all(axis=1)
    for values in chunk.labels.values():
        bad |= ~np.isfinite(values)
    if not bad.any():
        return [chunk], 0
    if non_finite == "raise":
        row = int(np.flatnonzero(bad)[0])
        at = f"at row {chunk.first_row + row}"
        hint = "(ParquetReader(non_finite='drop') drops such rows)"
        for name, values in chunk.labels.items():
            if not np.isfinite(values[row]):
                raise ValueError(
                    f"{chunk.source}: label {name!r} is null or not finite {at} {hint}"
                )
        for name, columns in schema.dense_columns.items():
            values = chunk.dense[row, columns]
            if not np.isfinite(values).all():
                value = values[~np.isfinite(values)][0]
                raise ValueError(f"{chunk.source}: dense feature {name!r} is {value} {at} {hint}")
    good = np.flatnonzero(~bad)
    runs = np.split(good, np.flatnonzero(np.diff(good) != 1) + 1) if len(good) else []
    return [slice_chunk(chunk, int(r[0]), int(r[-1]) + 1) for r in runs], int(bad.sum())


def slice_chunk(chunk: Chunk, start: int, stop: int) -> Chunk:
    """Rows [start, stop) without copying values."""
    sparse = {}
    for name, csr in chunk.sparse.items():
        a, b = csr.offsets[start], csr.offsets[stop]
        weights = None if csr.weights is None else csr.weights[a:b]
        sparse[name] = Csr(csr.values[a:b], csr.offsets[start : stop + 1] - a, weights)
    labels = {k: v[start:stop] for k, v in chunk.labels.items()}
    return Chunk(
        sparse, chunk.dense[start:stop], labels, stop - start, chunk.source, chunk.first_row + start
    )


def concat_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """The rows of several chunks, in order (copies)."""
    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    sparse = {}
    for name, csr in first.sparse.items():
        parts = [c.sparse[name] for c in chunks]
        starts = np.cumsum([0] + [p.nnz for p in parts[:-1]])
        offsets = np.concatenate(
            [parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts, strict=True)]
        )
        weights = None
        if csr.weights is not None:
            weights = np.concatenate([p.weights for p in parts])
        sparse[name] = Csr(np.concatenate([p.values for p in parts]), offsets, weights)
    labels = {k: np.concatenate([c.labels[k] for c in chunks]) for k in first.labels}
    return Chunk(
        sparse,
        np.concatenate([c.dense for c in chunks]),
        labels,
        sum(c.size for c in chunks),
        first.source,
        first.first_row,
    )


def gather_rows(chunk: Chunk, rows: np.ndarray) -> Chunk:
    """The given rows of a chunk, in that order (copies)."""
    sparse = {}
    for name, csr in chunk.sparse.items():
        starts = csr.offsets[rows]
        lengths = csr.offsets[rows + 1] - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        weights = None if csr.weights is None else csr.weights[index]
        values = csr.values[index] if len(index) else _EMPTY_KEYS.astype(csr.values.dtype)
        sparse[name] = Csr(values, offsets, weights)
    labels = {k: v[rows] for k, v in chunk.labels.items()}
    return Chunk(sparse, chunk.dense[rows], labels, len(rows), chunk.source, chunk.first_row)
