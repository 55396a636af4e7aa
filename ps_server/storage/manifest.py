"""A version's manifest, typed: what the directory holds and what it stands for.

``manifest.json`` (format ``wuliang-version/2``)::

    {"format": "wuliang-version/2", "kind": "checkpoint" | "full" | "delta",
     "name": directory name, "created": unix time,
     "step": training step of the rows, "engine_version": the parameter
       server's version the rows stand for (every row's version <= it),
     "version": export number, "parent": its parent's number or null,
     "source": what it was made from, "reason": why full      (exports)
     "reader_position": {...} or null, "num_shards": int      (checkpoints)
     "trainer_positions": {trainer index: {...}} (a cluster's checkpoints)
     "model": ModelDescription.to_dict() or null,
     "tables": {name: {"spec": TableSpec.to_dict(), "state_dim", "rows",
                       "parts", "removed", "removed_floor", "pending"}},
     "files": {relative path: {"sha256", "bytes", "rows"}}}

Every reader goes through ``Manifest.from_dict``, which checks the fields
and types and raises ``CorruptVersionError`` naming the manifest and the
field; code then uses attributes, never string keys.

A table's entry holds its whole ``TableSpec`` (optimizer and
hyper-parameters, initializer and seed, admission, eviction, non-finite
policy, reserve, precision), so a process with nothing but the directory
recreates the tables exactly. ``state_dim`` is what the files store (0:
no optimizer state, as exports).

Format 1 (``wuliang-version/1``) still reads: its table entries held
``dim``, ``state_dim``, the optimizer's ``repr``, and from some point the
initializer and seed; the spec is rebuilt from those (defaults for the rest;
the zeros initializer where none was recorded, as serving then used).
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from wuliang.ps_server.spec import SGD, Initializer, Optimizer, TableSpec, Zeros

FORMAT = "wuliang-version/2"
FORMAT_1 = "wuliang-version/1"
KINDS = ("checkpoint", "full", "delta")
SIGNATURE = "serving_default"  # the SavedModel signature a version's tower serves
COMBINERS = ("sum", "mean", "sqrtn", None)


class CorruptVersionError(ValueError):
    """A version directory whose manifest or files do not check out."""


# -- the model ----------------------------------------------------------------


@dataclass(frozen=True)
class SparseInput:
    """A sparse feature as serving sees it: the table its keys are looked
    up in, how its rows pool, and how raw strings become its keys.

    ``hash_field``: the feature's keys are ``wuliang.reader.hash_strings(
    value, hash_field)`` of string values (the reader hashed a string column,
    or a converter did), so a client may send those strings; None: integer
    ids (or unknown)."""

    name: str
    table: str
    combiner: str | None = "sum"  # None: a padded sequence and its mask
    max_len: int | None = None  # of a sequence
    hash_field: str | None = None
    # a sized table's extension blocks: their columns follow the table's
    # (zeros where a key has no row there); () for a plain table
    blocks: tuple[str, ...] = ()

    @property
    def is_sequence(self) -> bool:
        return self.combiner is None


@dataclass(frozen=True)
class DenseInput:
    """A dense feature: ``dim`` float32 values per row."""

    name: str
    dim: int = 1


@dataclass(frozen=True)
class ModelDescription:
    """What serving needs besides the SavedModel: the features, in the order
    the model lists them, and the tower's signature."""

    sparse: tuple[SparseInput, ...] = ()
    dense: tuple[DenseInput, ...] = ()
    signature: str = SIGNATURE

    @functools.cached_property
    def sparse_by_name(self) -> dict[str, SparseInput]:
        return {f.name: f for f in self.sparse}

    @functools.cached_property
    def dense_by_name(self) -> dict[str, DenseInput]:
        return {f.name: f for f in self.dense}

    @property
    def feature_names(self) -> list[str]:
        return [*(f.name for f in self.sparse), *(f.name for f in self.dense)]

    @property
    def tables(self) -> list[str]:
        """The tables its sparse features read, each once, in order."""
        return list(dict.fromkeys(f.table for f in self.sparse))

    def to_dict(self) -> dict[str, Any]:
        return {
            "signature": self.signature,
            "sparse": [_sparse_dict(f) for f in self.sparse],
            "dense": [_fields_of(f) for f in self.dense],
        }

    @staticmethod
    def from_dict(data: Any) -> ModelDescription:
        """The description ``to_dict`` wrote (format 1's too: no ``hash_field``);
        ValueError naming the bad field."""
        data = _object(data, "model")
        _known(data, ("signature", "sparse", "dense"), "model")
        sparse = tuple(
            _sparse_input(f, f"model.sparse[{i}]") for i, f in enumerate(_list(data, "sparse"))
        )
        dense = tuple(
            _dense_input(f, f"model.dense[{i}]") for i, f in enumerate(_list(data, "dense"))
        )
        names = [f.name for f in (*sparse, *dense)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"model: feature {twice[0]!r} is described twice")
        signature = data.get("signature", SIGNATURE)
        if not isinstance(signature, str) or not signature:
            raise ValueError(f"model.signature must be a non-empty string, got {signature!r}")
        return ModelDescription(sparse, dense, signature)


def _sparse_dict(f: SparseInput) -> dict[str, Any]:
    out = _fields_of(f)
    out["blocks"] = list(f.blocks)
    if not f.blocks:
        del out["blocks"]  # a plain table's description is as before
    return out


def _sparse_input(data: Any, where: str) -> SparseInput:
    data = _object(data, where)
    _known(data, [f.name for f in fields(SparseInput)], where)
    combiner = data.get("combiner", "sum")
    if combiner not in COMBINERS:
        raise ValueError(f"{where}.combiner must be sum, mean, sqrtn or null, got {combiner!r}")
    max_len = _optional_int(data, "max_len", where)
    if combiner is None and (max_len is None or max_len < 1):
        raise ValueError(f"{where}: a sequence (combiner null) needs max_len >= 1")
    hash_field = data.get("hash_field")
    if hash_field is not None and not isinstance(hash_field, str):
        raise ValueError(f"{where}.hash_field must be a string or null, got {hash_field!r}")
    blocks = data.get("blocks", [])
    if not isinstance(blocks, list | tuple) or not all(isinstance(b, str) and b for b in blocks):
        raise ValueError(f"{where}.blocks must be a list of table names, got {blocks!r}")
    return SparseInput(
        _str(data, "name", where),
        _str(data, "table", where),
        combiner,
        max_len,
        hash_field,
        tuple(blocks),
    )


def _dense_input(data: Any, where: str) -> DenseInput:
    data = _object(data, where)
    _known(data, ("name", "dim"), where)
    dim = _int(data, "dim", where, default=1)
    if dim < 1:
        raise ValueError(f"{where}.dim must be >= 1, got {dim}")
    return DenseInput(_str(data, "name", where), dim)


# -- tables and files ---------------------------------------------------------


@dataclass(frozen=True)
class TableEntry:
    """One table of a version: its spec, what its files hold."""

    spec: TableSpec
    state_dim: int  # optimizer state floats per row in the files (0: none)
    rows: int
    parts: int  # rows files, part-00000.arrow ...
    removed: int | None = None  # removal records (None: no removed.arrow)
    removed_floor: int = 0  # records of versions <= this are incomplete
    pending: int | None = None  # admission counts (None: no pending.arrow)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dim(self) -> int:
        return self.spec.dim

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "spec": self.spec.to_dict(),
            "state_dim": self.state_dim,
            "rows": self.rows,
            "parts": self.parts,
            "removed_floor": self.removed_floor,
        }
        if self.removed is not None:
            out["removed"] = self.removed
        if self.pending is not None:
            out["pending"] = self.pending
        return out

    @staticmethod
    def from_dict(name: str, data: Any, legacy: bool = False) -> TableEntry:
        where = f"tables.{name}"
        data = _object(data, where)
        if legacy:
            spec = _legacy_spec(name, data, where)
        else:
            _known(data, [*_ENTRY_FIELDS, "spec"], where)
            try:
                spec = TableSpec.from_dict(_object(data.get("spec"), f"{where}.spec"))
            except ValueError as error:
                raise ValueError(f"{where}.spec: {error}") from None
            if spec.name != name:
                raise ValueError(f"{where}.spec names table {spec.name!r}")
        return TableEntry(
            spec,
            _int(data, "state_dim", where),
            _int(data, "rows", where),
            _int(data, "parts", where),
            _optional_int(data, "removed", where),
            _int(data, "removed_floor", where, default=0),
            _optional_int(data, "pending", where),
        )


_ENTRY_FIELDS = ("state_dim", "rows", "parts", "removed", "removed_floor", "pending")


@dataclass(frozen=True)
class FileEntry:
    """A file of a version: its checksum and size (and rows, for rows files)."""

    sha256: str
    bytes: int
    rows: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sha256": self.sha256, "bytes": self.bytes}
        if self.rows is not None:
            out["rows"] = self.rows
        return out

    @staticmethod
    def from_dict(path: str, data: Any) -> FileEntry:
        where = f"files.{path}"
        data = _object(data, where)
        digest = _str(data, "sha256", where)
        return FileEntry(digest, _int(data, "bytes", where), _optional_int(data, "rows", where))


# -- the manifest -------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A version's ``manifest.json`` (see the module docstring)."""

    kind: str
    name: str
    step: int
    engine_version: int
    tables: Mapping[str, TableEntry]
    files: Mapping[str, FileEntry]
    model: ModelDescription | None = None
    created: float = 0.0
    number: int | None = None  # an export's version number ("version")
    parent: int | None = None  # a delta's parent number
    source: str = ""  # an export's origin ("session", "ckpt-1200", "compacted 1+2")
    reason: str = ""  # why an export is full
    reader_position: Mapping[str, Any] | None = None  # a checkpoint's
    num_shards: int | None = None  # shards of the engine a checkpoint came from
    # a cluster's checkpoint: each trainer's reader position, by trainer index
    trainer_positions: Mapping[str, Mapping[str, Any]] | None = None
    format: str = field(default=FORMAT)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.format,
            "kind": self.kind,
            "name": self.name,
            "created": self.created,
            "step": self.step,
            "engine_version": self.engine_version,
            "model": None if self.model is None else self.model.to_dict(),
            "tables": {name: entry.to_dict() for name, entry in self.tables.items()},
            "files": {path: entry.to_dict() for path, entry in self.files.items()},
        }
        if self.kind == "checkpoint":
            out["reader_position"] = (
                None if self.reader_position is None else dict(self.reader_position)
            )
            out["num_shards"] = self.num_shards
            if self.trainer_positions is not None:
                out["trainer_positions"] = {k: dict(v) for k, v in self.trainer_positions.items()}
        else:
            out.update(
                version=self.number, parent=self.parent, source=self.source, reason=self.reason
            )
        return out

    @staticmethod
    def from_dict(data: Any, where: str) -> Manifest:
        """The manifest of ``data`` (parsed JSON); CorruptVersionError naming
        ``where`` (the file) and the field when it does not check out."""
        if not isinstance(data, dict):
            raise CorruptVersionError(f"{where}: expected a JSON object")
        form = data.get("format")
        if form not in (FORMAT, FORMAT_1):
            raise CorruptVersionError(
                f"{where}: format {form!r}, expected {FORMAT!r} (or {FORMAT_1!r})"
            )
        try:
            return _manifest(data, legacy=form == FORMAT_1)
        except ValueError as error:
            raise CorruptVersionError(f"{where}: {error}") from None


def _manifest(data: dict[str, Any], legacy: bool) -> Manifest:
    kind = data.get("kind")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    tables = {
        name: TableEntry.from_dict(name, entry, legacy)
        for name, entry in _object(data.get("tables"), "tables").items()
    }
    files = {
        path: FileEntry.from_dict(path, entry)
        for path, entry in _object(data.get("files"), "files").items()
    }
    model = data.get("model")
    position = data.get("reader_position")
    if position is not None:
        position = dict(_object(position, "reader_position"))
    trainers = data.get("trainer_positions")
    if trainers is not None:
        trainers = {
            str(k): dict(_object(v, f"trainer_positions[{k!r}]"))
            for k, v in _object(trainers, "trainer_positions").items()
        }
    created = data.get("created", 0.0)
    if not isinstance(created, int | float) or not math.isfinite(created):
        raise ValueError(f"created must be a unix time, got {created!r}")
    return Manifest(
        kind=kind,
        name=str(data.get("name", "")),
        step=_int(data, "step", "manifest", default=0),
        engine_version=_int(data, "engine_version", "manifest", default=0),
        tables=tables,
        files=files,
        model=None if model is None else ModelDescription.from_dict(model),
        created=float(created),
        number=_optional_int(data, "version", "manifest"),
        parent=_optional_int(data, "parent", "manifest"),
        source=str(data.get("source") or ""),
        reason=str(data.get("reason") or ""),
        reader_position=position,
        num_shards=_optional_int(data, "num_shards", "manifest"),
        trainer_positions=trainers,
        format=FORMAT,
    )


# -- format 1 -----------------------------------------------------------------


def _legacy_spec(name: str, data: Mapping[str, Any], where: str) -> TableSpec:
    """The spec of a format-1 table entry (dim, the optimizer's repr, and the
    initializer and seed where recorded)."""
    dim = _int(data, "dim", where)
    optimizer = data.get("optimizer")
    initializer: Initializer = Zeros()
    if data.get("initializer") is not None:
        initializer = Initializer.from_dict(_object(data["initializer"], f"{where}.initializer"))
    return TableSpec(
        name,
        dim,
        optimizer=_optimizer_of_repr(optimizer, where) if optimizer else SGD(),
        initializer=initializer,
        seed=_int(data, "seed", where, default=0),
    )


def _optimizer_of_repr(text: Any, where: str) -> Optimizer:
    """``Adagrad(learning_rate=0.05, clip_norm=0.0, ...)`` (a dataclass's
    repr, as format 1 recorded it) as the optimizer."""
    try:
        call = ast.parse(str(text), mode="eval").body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise ValueError("not a call with keywords")
        values = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"{where}.optimizer {text!r} is not an optimizer ({error})") from None
    return Optimizer.from_dict({"kind": call.func.id, **values})


# -- checking JSON values -----------------------------------------------------


def _fields_of(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in fields(value)}


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object, got {value!r}")
    return value


def _list(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"model.{key} must be a list, got {value!r}")
    return value


def _known(data: Mapping[str, Any], names: Any, where: str) -> None:
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{where} has an unknown field {unknown[0]!r}")


def _str(data: Mapping[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


_NO_DEFAULT = object()


def _int(data: Mapping[str, Any], key: str, where: str, default: Any = _NO_DEFAULT) -> int:
    value = data.get(key, default)
    if value is _NO_DEFAULT:
        raise ValueError(f"{where}.{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}.{key} must be an integer >= 0, got {value!r}")
    return value


def _optional_int(data: Mapping[str, Any], key: str, where: str) -> int | None:
    return None if data.get(key) is None else _int(data, key, where)
