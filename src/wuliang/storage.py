"""The on-disk format of checkpoints and exports. Checkpoint, export and
serving read and write versions only through this module.

A *version* is a directory::

    <root>/<name>/
        manifest.json                     what is here, with a sha256 per file
        tables/<table>/part-00000.arrow   rows (Arrow IPC file, uncompressed)
        tables/<table>/removed.arrow      removal records: key, version
        tables/<table>/pending.arrow      admission counts (checkpoints): key, count
        dense/..., serving/...            TF checkpoint, SavedModel files

A rows file has the columns ``key`` (uint64), ``vector`` (fixed-size list of
``dim`` float32), ``state`` (fixed-size list of the optimizer's state floats;
absent where the version stores no state, as exports do), ``count``
(uint32), ``step`` (uint64), ``time`` (uint32) and ``version`` (uint64):
everything ``Engine.load`` takes, so a restore is exact. Arrow IPC
(not Parquet) because rows are written and read at memory speed: no encoding,
and the reader maps the file and hands the columns to the engine as views.
Parts hold at most ``PART_ROWS`` rows; the part files are independent of the
engine's shard count, so a version restores into any number of shards.

``manifest.json``::

    {"format": "wuliang-version/1", "kind": "checkpoint" | "full" | "delta",
     "created": unix time, ...caller's fields (step, version, parent, ...),
     "tables": {name: {"dim", "state_dim" (stored; 0: none), "optimizer",
                       "rows", "parts", "removed", "removed_floor", "pending"}},
     "files": {relative path: {"sha256", "bytes", "rows"}}}

Writes are atomic: ``VersionWriter`` writes under ``<root>/.tmp-<name>-*``,
fsyncs every file, writes the manifest last and renames the directory into
place; a crash at any point leaves the versions already there intact (and a
``.tmp-`` directory that the next writer in the same root removes). Reads
check each file's size and sha256 before using it: a missing, truncated or
altered file raises ``CorruptVersionError`` naming it, never loads silently.

Test-only crash points: the tests SIGKILL writers at named points of a write
to check the claim above. ``WULIANG_TEST_CRASH_AT=<point>[:<n>]``, read once
at import, makes the process print ``WULIANG_TEST_CRASH_AT reached
<point>:<n>`` on stdout the n-th time (default 1) a writer reaches that point,
and block there (the test kills it; it exits by itself after
``_CRASH_BLOCK_S``); a value naming no point is a ValueError at import.
Unset, ``crash_point`` returns at once. The points (``CRASH_POINTS``), in the
order a write reaches them:

* ``writer-open``: the ``.tmp-`` directory exists, nothing is in it;
* ``rows-file``: a rows part file is written and recorded (n: the n-th);
* ``before-manifest``: every file is written, the manifest is not;
* ``before-rename``: the manifest is written and synced, the directory is
  still ``.tmp-``;
* ``after-rename``: the version is in place; the caller's follow-up (a
  checkpoint's rotation, an export's ``LATEST``) has not run;
* ``checkpoint-rotate`` (``wuliang.checkpoint``): an old checkpoint is
  renamed out of sight, not yet removed;
* ``latest-temp`` (``wuliang.export``): the new ``LATEST`` is written to its
  temporary file, not yet renamed over ``LATEST``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from wuliang.ps_server import RowChunk, TableSpec

FORMAT = "wuliang-version/1"
MANIFEST = "manifest.json"
PART_ROWS = 1 << 20
TMP_PREFIX = ".tmp-"
_HASH_BLOCK = 1 << 24

CRASH_ENV = "WULIANG_TEST_CRASH_AT"
CRASH_POINTS = (
    "writer-open",
    "rows-file",
    "before-manifest",
    "before-rename",
    "after-rename",
    "checkpoint-rotate",
    "latest-temp",
)
_CRASH_BLOCK_S = 600.0  # a crashed-on-purpose process nobody kills exits after this


def _crash_at(value: str | None) -> tuple[str, int] | None:
    """``<point>[:<n>]`` of the environment variable, or None when unset."""
    if not value:
        return None
    point, _, n = value.partition(":")
    if point not in CRASH_POINTS or (n and (not n.isdigit() or int(n) < 1)):
        raise ValueError(
            f"{CRASH_ENV}={value!r}: expected <point>[:<n>], n >= 1, "
            f"point one of {', '.join(CRASH_POINTS)}"
        )
    return point, int(n or 1)


_CRASH_AT = _crash_at(os.environ.get(CRASH_ENV))
_crash_hits = 0


def crash_point(name: str) -> None:
    """Test-only (see the module docstring): announces and blocks at the
    point ``WULIANG_TEST_CRASH_AT`` names, its n-th time; returns at once
    when the variable is unset."""
    global _crash_hits
    if _CRASH_AT is None or name != _CRASH_AT[0]:
        return
    _crash_hits += 1
    if _crash_hits != _CRASH_AT[1]:
        return
    print(f"{CRASH_ENV} reached {name}:{_crash_hits}", flush=True)
    sys.stderr.flush()
    time.sleep(_CRASH_BLOCK_S)  # the test SIGKILLs us here
    os._exit(70)  # never go on writing after a crash point


class CorruptVersionError(ValueError):
    """A version directory whose manifest or files do not check out."""


def _fsl(values: np.ndarray, width: int) -> pa.Array:
    flat = pa.array(np.ascontiguousarray(values, np.float32).reshape(-1), pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, width)


def rows_schema(dim: int, state_dim: int) -> pa.Schema:
    """The rows-file schema; without ``state`` when state_dim is 0."""
    fields = [("key", pa.uint64()), ("vector", pa.list_(pa.float32(), dim))]
    if state_dim:
        fields.append(("state", pa.list_(pa.float32(), state_dim)))
    fields += [("count", pa.uint32()), ("step", pa.uint64()), ("time", pa.uint32())]
    return pa.schema([*fields, ("version", pa.uint64())])


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
    )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                for start in range(0, size, _HASH_BLOCK):
                    digest.update(view[start : start + _HASH_BLOCK])  # releases the GIL
                view.release()
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SPEC_FIELDS = ("optimizer", "initializer", "seed")  # of a table, kept in manifests


def spec_info(spec: TableSpec) -> dict[str, Any]:
    """What a manifest keeps of a table's spec besides its dims: the
    optimizer (for reading), the initializer and seed (so a server can give
    keys never trained their initial vectors, as training did)."""
    return {
        "optimizer": repr(spec.optimizer),
        "initializer": spec.initializer.to_dict(),
        "seed": spec.seed,
    }


class VersionWriter:
    """Writes one version directory atomically (see the module docstring).

    Use as a context manager: leaving the block without ``commit()`` (an
    exception) removes the temporary directory.
    """

    def __init__(self, root: str | os.PathLike, name: str, kind: str) -> None:
        if kind not in ("checkpoint", "full", "delta"):
            raise ValueError(f"kind must be checkpoint, full or delta, got {kind!r}")
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad version name {name!r}")
        self.root = Path(root)
        self.name = name
        self.kind = kind
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.root)
        self.final = self.root / name
        if self.final.exists():
            raise FileExistsError(f"version {self.final} already exists")
        self.dir = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=self.root))
        self.files: dict[str, dict[str, Any]] = {}
        self.tables: dict[str, dict[str, Any]] = {}
        self.committed = False
        crash_point("writer-open")

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self.committed:
            shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, relative: str) -> Path:
        """Where a file of this version goes (its folder created)."""
        p = self.dir / relative
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def add_file(self, relative: str, rows: int | None = None) -> None:
        """Records a file written under ``path(relative)`` in the manifest."""
        p = self.dir / relative
        _fsync_path(p)
        entry: dict[str, Any] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        if rows is not None:
            entry["rows"] = rows
        self.files[relative] = entry

    def add_tree(self, relative: str) -> None:
        """Records every file under the folder ``path(relative)``."""
        base = self.dir / relative
        for p in sorted(base.rglob("*")):
            if p.is_file():
                self.add_file(str(p.relative_to(self.dir)))

    def write_table(
        self,
        table: str,
        dim: int,
        state_dim: int,
        chunks: Iterable[RowChunk],
        info: Mapping[str, Any] | None = None,
    ) -> int:
        """Writes a table's rows (``RowChunk`` s) in parts of at most
        ``PART_ROWS`` rows; returns the rows. ``state_dim`` 0 leaves the
        optimizer state out. ``info``: more of the table's manifest entry
        (``spec_info``: optimizer, initializer, seed)."""
        schema = rows_schema(dim, state_dim)
        total = part = 0
        writer: pa.ipc.RecordBatchFileWriter | None = None
        sink: pa.OSFile | None = None
        in_part = 0
        relative = ""

        def close_part() -> None:
            nonlocal writer, sink
            if writer is not None and sink is not None:
                writer.close()
                sink.close()
                self.add_file(relative, in_part)
                crash_point("rows-file")
            writer = sink = None

        for chunk in chunks:
            start = 0
            while start < len(chunk.keys):
                if writer is None:
                    relative = f"tables/{table}/part-{part:05d}.arrow"
                    sink = pa.OSFile(str(self.path(relative)), "wb")
                    writer = pa.ipc.new_file(sink, schema)
                    part += 1
                    in_part = 0
                take = min(len(chunk.keys) - start, PART_ROWS - in_part)
                piece = chunk if take == len(chunk.keys) else _slice_rows(chunk, start, take)
                writer.write_batch(rows_to_batch(piece, dim, state_dim))
                in_part += take
                total += take
                start += take
                if in_part == PART_ROWS:
                    close_part()
        close_part()
        self.tables[table] = {
            **(info or {}),
            "dim": dim,
            "state_dim": state_dim,
            "rows": total,
            "parts": part,
        }
        return total

    def write_removed(
        self,
        table: str,
        keys: np.ndarray,
        versions: np.ndarray | None = None,
        floor: int | None = None,
    ) -> None:
        """Writes a table's removal records (after ``write_table``): keys and
        the versions they were removed at; ``floor``: records of versions up
        to it are incomplete (the engine's log had dropped them)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        if versions is None:
            versions = np.zeros(len(keys), np.uint64)
        self._write_records(table, "removed", keys, "version", np.asarray(versions, np.uint64))
        if floor is not None:
            self.tables[table]["removed_floor"] = int(floor)

    def write_pending(self, table: str, keys: np.ndarray, counts: np.ndarray) -> None:
        """Writes a table's admission counts (after ``write_table``): keys
        seen but not admitted yet, and how often each was seen."""
        keys = np.ascontiguousarray(keys, np.uint64)
        self._write_records(table, "pending", keys, "count", np.asarray(counts, np.uint32))

    def _write_records(
        self, table: str, kind: str, keys: np.ndarray, name: str, values: np.ndarray
    ) -> None:
        """``tables/<table>/<kind>.arrow``: a key column and one value column."""
        batch = pa.record_batch([pa.array(keys), pa.array(values)], names=["key", name])
        relative = f"tables/{table}/{kind}.arrow"
        with (
            pa.OSFile(str(self.path(relative)), "wb") as sink,
            pa.ipc.new_file(sink, batch.schema) as w,
        ):
            w.write_batch(batch)
        self.add_file(relative, len(keys))
        self.tables[table][kind] = len(keys)

    def commit(self, **fields: Any) -> Path:
        """Writes the manifest and renames the version into place."""
        crash_point("before-manifest")
        manifest = {
            "format": FORMAT,
            "kind": self.kind,
            "name": self.name,
            "created": time.time(),
            **fields,
            "tables": self.tables,
            "files": self.files,
        }
        write_json_atomic(self.dir / MANIFEST, manifest)
        _fsync_path(self.dir)
        crash_point("before-rename")
        os.rename(self.dir, self.final)  # atomic; fails if final appeared meanwhile
        crash_point("after-rename")
        _fsync_path(self.root)
        self.committed = True
        return self.final


def _slice_rows(chunk: RowChunk, start: int, n: int) -> RowChunk:
    return select_rows(chunk, slice(start, start + n))


def select_rows(chunk: RowChunk, which: slice | np.ndarray) -> RowChunk:
    """The rows of a chunk that ``which`` (a slice or a mask) selects."""
    return RowChunk(**{f.name: getattr(chunk, f.name)[which] for f in dataclasses.fields(chunk)})


def load_args(rows: RowChunk) -> dict[str, np.ndarray | None]:
    """``Engine.load`` keyword arguments of a chunk (same names as its fields;
    no state where none was stored)."""
    args = {f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)}
    if rows.state.shape[1] == 0:
        args["state"] = None
    return args


def write_json_atomic(path: Path, value: Any) -> None:
    """Writes JSON to path via a temporary file, fsync and rename."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_stale_temporaries(root: Path) -> None:
    """Removes what crashed writers left in root (``.tmp-*``)."""
    for p in root.glob(f"{TMP_PREFIX}*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


class Version:
    """A committed version directory, read with every file checked."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CorruptVersionError(f"{manifest_path} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptVersionError(f"{manifest_path} is not valid JSON: {e}") from None
        if self.manifest.get("format") != FORMAT:
            raise CorruptVersionError(
                f"{manifest_path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}"
            )

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def tables(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest["tables"])

    def __getitem__(self, field: str) -> Any:
        return self.manifest[field]

    def get(self, field: str, default: Any = None) -> Any:
        return self.manifest.get(field, default)

    def checked(self, relative: str) -> Path:
        """The path of one of the version's files, after checking its size and
        sha256 against the manifest."""
        entry = self.manifest["files"].get(relative)
        p = self.path / relative
        if entry is None:
            raise CorruptVersionError(f"{p} is not in {self.path / MANIFEST}")
        if not p.is_file():
            raise CorruptVersionError(f"{p} is missing")
        if p.stat().st_size != entry["bytes"]:
            raise CorruptVersionError(
                f"{p} has {p.stat().st_size} bytes, the manifest says {entry['bytes']}"
            )
        if sha256_file(p) != entry["sha256"]:
            raise CorruptVersionError(f"{p} does not match its sha256 in the manifest")
        return p

    def verify(self) -> None:
        """Checks every file of the version."""
        for relative in self.manifest["files"]:
            self.checked(relative)

    def link_tree(self, folder: str, writer: VersionWriter) -> None:
        """Puts this version's files under folder into writer's version, as
        hard links where the file system allows (versions never change), and
        records them."""
        for relative in self.files_under(folder):
            target = writer.path(relative)
            try:
                os.link(self.path / relative, target)
            except OSError:
                shutil.copyfile(self.path / relative, target)
        writer.add_tree(folder)

    def files_under(self, folder: str) -> list[str]:
        prefix = folder.rstrip("/") + "/"
        return sorted(f for f in self.manifest["files"] if f.startswith(prefix))

    def read_rows(self, table: str, verified: bool = False) -> Iterator[RowChunk]:
        """The table's rows, part by part (each file checked first, unless
        ``verify()`` already checked them all: ``verified=True``)."""
        if table not in self.manifest["tables"]:
            known = ", ".join(sorted(self.manifest["tables"])) or "none"
            raise KeyError(f"{self.path} has no table {table!r} (tables: {known})")
        for relative in self.files_under(f"tables/{table}"):
            if not relative.rsplit("/", 1)[-1].startswith("part-"):
                continue
            path = self.path / relative if verified else self.checked(relative)
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield batch_to_rows(reader.get_batch(i))

    def removed_keys(self, table: str, verified: bool = False) -> np.ndarray:
        """The table's removed keys (uint64; none if it has no records)."""
        return self.removed_log(table, verified)[0]

    def removed_log(self, table: str, verified: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The table's removal records: (keys, versions), uint64 (the file
        checked first, unless ``verify()`` already did: ``verified=True``)."""
        return self._records(table, "removed", "version", np.uint64, verified)

    def pending_counts(self, table: str, verified: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The table's admission counts: (keys uint64, counts uint32); none in
        versions written without them."""
        return self._records(table, "pending", "count", np.uint32, verified)

    def _records(
        self, table: str, kind: str, name: str, dtype: type, verified: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        relative = f"tables/{table}/{kind}.arrow"
        keys: list[np.ndarray] = []
        values: list[np.ndarray] = []
        if relative in self.manifest["files"]:
            path = self.path / relative if verified else self.checked(relative)
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    keys.append(batch.column("key").to_numpy())
                    values.append(batch.column(name).to_numpy())
        if not keys:
            return np.zeros(0, np.uint64), np.zeros(0, dtype)
        return np.concatenate(keys), np.concatenate(values)
