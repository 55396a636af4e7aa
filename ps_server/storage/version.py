"""Version directories: written atomically, read with every file checked once.

``VersionWriter`` writes under ``<root>/.tmp-<name>-*``, fsyncs every file,
writes the manifest last and renames the directory into place; a crash at
any point leaves the versions already there intact (and a ``.tmp-``
directory that the next writer in the same root removes).

In an object store (a root named by a URI, ``location``), which has no
rename, each file is uploaded whole under its final name
(``<root>/<name>/...``; files the caller writes are staged in a local
temporary folder first, part files written by parameter servers go there
directly), and the manifest is uploaded last: the version exists for
readers once its manifest does. A folder there without a manifest (a crashed
writer's) is not a version; the next writer of that name clears it. One
writer per directory: nothing there stops two writing the same version.

``Version`` reads one: the manifest parsed into a typed ``Manifest``, and
each file checked against its size and sha256 before its first use (a
missing, truncated or altered file raises ``CorruptVersionError`` naming
it, never loads silently). A ``Version`` object checks a file once:
``verify()`` (every file) before a restore or an apply, then reading its
rows, records or SavedModel costs no second hash. A version in an object
store is read the same way: ``verify()`` streams every file through the
hash; rows are read part by part into memory, each part checked again as it
arrives; the files that must be local (a TF checkpoint, a SavedModel:
``local_folder``) are downloaded once, checked, into a temporary folder
that lives as long as the ``Version``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from wuliang.ps_server.chunk import RowChunk
from wuliang.ps_server.spec import TableSpec
from wuliang.ps_server.storage.crash import crash_point
from wuliang.ps_server.storage.location import Location, RemotePath, location
from wuliang.ps_server.storage.manifest import (
    KINDS,
    CorruptVersionError,
    FileEntry,
    Manifest,
    ModelDescription,
    TableEntry,
)
from wuliang.ps_server.storage.rows import (
    batch_to_rows,
    rows_schema,
    rows_to_batch,
    select_rows,
)

MANIFEST = "manifest.json"
PART_ROWS = 1 << 20  # rows per part file
TMP_PREFIX = ".tmp-"
SERVING = "serving"  # the tower's SavedModel inside a version
_HASH_BLOCK = 1 << 24


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


def write_json_atomic(path: Path, value: Any) -> None:
    """Writes JSON to path via a temporary file, fsync and rename."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_version(path: Location, crash: str, why: str = "removed") -> None:
    """Removes a version (a checkpoint or an export) so that no listing ever
    sees it half removed: in a folder it is renamed to a ``.tmp-`` name first
    (synced, so that it stays renamed; the next writer removes what a crash
    leaves), in an object store its manifest goes first. ``crash``: the
    name of the crash point between the two steps; ``why``: in the
    temporary name (``.tmp-<name>-<why>-<pid>``)."""
    if isinstance(path, RemotePath):
        (path / MANIFEST).unlink(missing_ok=True)
        crash_point(crash)
        path.rmtree()
        return
    doomed = path.with_name(f"{TMP_PREFIX}{path.name}-{why}-{os.getpid()}")
    try:
        os.rename(path, doomed)
        _fsync_path(path.parent)
    except OSError:  # cannot be renamed: removed in place
        doomed = path
    crash_point(crash)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(root: Location) -> None:
    """Removes what crashed writers left in root (``.tmp-*``; nothing in an
    object store, where a crashed writer leaves a folder without a manifest,
    cleared by the next writer of that version)."""
    if isinstance(root, RemotePath):
        return
    for p in root.glob(f"{TMP_PREFIX}*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def write_parts(
    folder: Location,
    spec: TableSpec,
    chunks: Iterable[RowChunk],
    *,
    state: bool,
    prefix: str = "part-",
) -> tuple[list[tuple[str, FileEntry]], int]:
    """Writes a table's rows into ``folder/tables/<table>/<prefix>NNNNN.arrow``
    files of at most ``PART_ROWS`` rows, each fsynced and checksummed;
    returns ((relative path, entry) of each file, rows). ``state``: keep the
    optimizer state. Parameter servers write their parts of a version this
    way (each with its own prefix), the client records them. A folder in an
    object store gets each part uploaded whole once written (staged in a
    local temporary folder, one part at a time)."""
    if isinstance(folder, RemotePath):
        with tempfile.TemporaryDirectory(prefix="wuliang-parts-") as staging:
            return _write_parts(Path(staging), spec, chunks, state, prefix, folder)
    return _write_parts(Path(folder), spec, chunks, state, prefix, None)


def _write_parts(
    folder: Path,
    spec: TableSpec,
    chunks: Iterable[RowChunk],
    state: bool,
    prefix: str,
    upload: RemotePath | None,
) -> tuple[list[tuple[str, FileEntry]], int]:
    """``write_parts`` into a local folder; with ``upload``, each part
    then goes there (under the same relative path) and leaves the folder."""
    table, dim = spec.name, spec.dim
    state_dim = spec.state_dim if state else 0
    schema = rows_schema(dim, state_dim)
    files: list[tuple[str, FileEntry]] = []
    total = part = in_part = 0
    writer: pa.ipc.RecordBatchFileWriter | None = None
    sink: pa.OSFile | None = None
    relative = ""

    def close_part() -> None:
        nonlocal writer, sink
        if writer is not None and sink is not None:
            writer.close()
            sink.close()
            path = folder / relative
            _fsync_path(path)
            files.append((relative, FileEntry(sha256_file(path), path.stat().st_size, in_part)))
            if upload is not None:
                (upload / relative).upload(path)
                path.unlink()
            crash_point("rows-file")
        writer = sink = None

    for chunk in chunks:
        start = 0
        while start < len(chunk.keys):
            if writer is None:
                relative = f"tables/{table}/{prefix}{part:05d}.arrow"
                (folder / relative).parent.mkdir(parents=True, exist_ok=True)
                sink = pa.OSFile(str(folder / relative), "wb")
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
    return files, total


class VersionWriter:
    """Writes one version directory atomically (see the module docstring).

    Use as a context manager: leaving the block without ``commit()`` (an
    exception) removes the temporary directory (in an object store: what
    was uploaded).

    ``dir`` is where parameter servers write their part files: the
    temporary directory, or in an object store the version's final folder.
    Files the caller writes go to ``path(relative)`` (always local) and are
    recorded (in an object store: uploaded) by ``add_file``/``add_tree``.
    """

    def __init__(self, root: str | os.PathLike | RemotePath, name: str, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be checkpoint, full or delta, got {kind!r}")
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad version name {name!r}")
        self.root: Location = location(root)
        self.name = name
        self.kind = kind
        self.final: Location = self.root / name
        self.files: dict[str, FileEntry] = {}
        self.tables: dict[str, TableEntry] = {}
        self.committed = False
        self.dir: Location
        if isinstance(self.final, RemotePath):
            if (self.final / MANIFEST).exists():
                raise FileExistsError(f"version {self.final} already exists")
            self.final.rmtree()  # a crashed writer's files: no manifest, no version
            self.dir = self.final
            self._staging = Path(tempfile.mkdtemp(prefix=f"wuliang-{name}-"))
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.root)
            if self.final.exists():
                raise FileExistsError(f"version {self.final} already exists")
            self.dir = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=self.root))
            self._staging = self.dir
        crash_point("writer-open")

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if isinstance(self.dir, RemotePath):
            shutil.rmtree(self._staging, ignore_errors=True)
            if not self.committed:
                self.dir.rmtree()
        elif not self.committed:
            shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, relative: str) -> Path:
        """Where a file of this version goes (its folder created); a local path."""
        p = self._staging / relative
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def add_file(self, relative: str, rows: int | None = None) -> None:
        """Records a file written under ``path(relative)`` in the manifest
        (in an object store: uploads it, and the local copy goes)."""
        p = self._staging / relative
        _fsync_path(p)
        self.files[relative] = FileEntry(sha256_file(p), p.stat().st_size, rows)
        if isinstance(self.dir, RemotePath):
            (self.dir / relative).upload(p)
            p.unlink()

    def add_tree(self, relative: str) -> None:
        """Records every file under the folder ``path(relative)``."""
        base = self._staging / relative
        for p in sorted(base.rglob("*")):
            if p.is_file():
                self.add_file(str(p.relative_to(self._staging)))

    def write_table(self, spec: TableSpec, chunks: Iterable[RowChunk], *, state: bool) -> int:
        """Writes a table's rows (``RowChunk`` s) in parts of at most
        ``PART_ROWS`` rows and records its spec; returns the rows. ``state``:
        keep the optimizer state (checkpoints) or leave it out (exports)."""
        files, total = write_parts(self.dir, spec, chunks, state=state)
        self.record_table(spec, files, total, state=state)
        return total

    def record_table(
        self,
        spec: TableSpec,
        files: Iterable[tuple[str, FileEntry]],
        rows: int,
        *,
        state: bool,
    ) -> None:
        """Records a table whose part files are in place (written here by
        ``write_parts``, or by parameter servers into this version's
        folder, ``dir``), with their checksums."""
        files = list(files)
        for relative, entry in files:
            self.files[relative] = entry
        state_dim = spec.state_dim if state else 0
        self.tables[spec.name] = TableEntry(spec, state_dim, rows, len(files))

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
        entry = self.tables[table]
        self.tables[table] = dataclasses.replace(
            entry, removed=len(keys), removed_floor=entry.removed_floor if floor is None else floor
        )

    def write_pending(self, table: str, keys: np.ndarray, counts: np.ndarray) -> None:
        """Writes a table's admission counts (after ``write_table``): keys
        seen but not admitted yet, and how often each was seen."""
        keys = np.ascontiguousarray(keys, np.uint64)
        self._write_records(table, "pending", keys, "count", np.asarray(counts, np.uint32))
        self.tables[table] = dataclasses.replace(self.tables[table], pending=len(keys))

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

    def commit(
        self,
        *,
        step: int,
        engine_version: int,
        model: ModelDescription | None = None,
        number: int | None = None,
        parent: int | None = None,
        source: str = "",
        reason: str = "",
        reader_position: Mapping[str, Any] | None = None,
        num_shards: int | None = None,
        trainer_positions: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Location:
        """Writes the manifest (``Manifest``'s fields) and renames the
        version into place (in an object store: uploads the manifest)."""
        crash_point("before-manifest")
        manifest = Manifest(
            kind=self.kind,
            name=self.name,
            step=int(step),
            engine_version=int(engine_version),
            tables=self.tables,
            files=self.files,
            model=model,
            created=time.time(),
            number=number,
            parent=parent,
            source=source,
            reason=reason,
            reader_position=reader_position,
            num_shards=num_shards,
            trainer_positions=trainer_positions,
        )
        if isinstance(self.dir, RemotePath):  # no rename: the manifest, last, commits
            (self.dir / MANIFEST).write_text(
                json.dumps(manifest.to_dict(), indent=1, sort_keys=True)
            )
            self.committed = True
            crash_point("after-rename")
            return self.final
        write_json_atomic(self.dir / MANIFEST, manifest.to_dict())
        _fsync_path(self.dir)
        crash_point("before-rename")
        assert isinstance(self.final, Path) and isinstance(self.root, Path)
        os.rename(self.dir, self.final)  # atomic; fails if final appeared meanwhile
        crash_point("after-rename")
        _fsync_path(self.root)
        self.committed = True
        return self.final


def _check(path: Location, entry: FileEntry, size: int, sha256: Any) -> None:
    """CorruptVersionError unless a file's size and sha256 (``sha256(path)``,
    computed only when the size matches) are the manifest's."""
    if size != entry.bytes:
        raise CorruptVersionError(f"{path} has {size} bytes, the manifest says {entry.bytes}")
    if sha256(path) != entry.sha256:
        raise CorruptVersionError(f"{path} does not match its sha256 in the manifest")


def _is_part(relative: str) -> bool:
    """A rows part file (``part-00000.arrow``, or a server's ``part-s1-00000.arrow``)."""
    name = relative.rsplit("/", 1)[-1]
    return name.startswith("part-") and name.endswith(".arrow")


def _slice_rows(chunk: RowChunk, start: int, n: int) -> RowChunk:
    return select_rows(chunk, slice(start, start + n))


class Version:
    """A committed version directory (see the module docstring).

    ``manifest`` is the typed ``Manifest``; ``kind``, ``tables``, ``model``,
    ``step``, ``engine_version``, ``number`` and ``parent`` are its fields.
    """

    def __init__(self, path: str | os.PathLike | RemotePath) -> None:
        self.path: Location = location(path)
        manifest_path = self.path / MANIFEST
        try:
            data = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CorruptVersionError(f"{manifest_path} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptVersionError(f"{manifest_path} is not valid JSON: {e}") from None
        self.manifest = Manifest.from_dict(data, str(manifest_path))
        self._checked: set[str] = set()  # files whose size and sha256 matched
        self._local: Path | None = None  # a remote version's downloaded files
        self._fetched: set[str] = set()  # those of them that are there, checked

    @property
    def remote(self) -> bool:
        """Whether the version is in an object store (``path`` a ``RemotePath``)."""
        return isinstance(self.path, RemotePath)

    def __repr__(self) -> str:
        return f"Version({str(self.path)!r}, kind={self.kind!r})"

    @property
    def kind(self) -> str:
        return self.manifest.kind

    @property
    def tables(self) -> Mapping[str, TableEntry]:
        return self.manifest.tables

    @property
    def model(self) -> ModelDescription | None:
        return self.manifest.model

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def engine_version(self) -> int:
        return self.manifest.engine_version

    @property
    def number(self) -> int:
        """An export's version number (ValueError for a checkpoint)."""
        if self.manifest.number is None:
            raise CorruptVersionError(f"{self.path / MANIFEST} has no export version number")
        return self.manifest.number

    @property
    def parent(self) -> int | None:
        return self.manifest.parent

    def checked(self, relative: str) -> Path:
        """The path of one of the version's files, after checking its size and
        sha256 against the manifest (once per ``Version``); of a remote
        version, the local copy (downloaded once)."""
        if isinstance(self.path, RemotePath):
            return self._downloaded(relative)
        p = self.path / relative
        if relative in self._checked:
            return p
        entry = self._entry(relative)
        if not p.is_file():
            raise CorruptVersionError(f"{p} is missing")
        _check(p, entry, p.stat().st_size, sha256_file)
        self._checked.add(relative)
        return p

    def _entry(self, relative: str) -> FileEntry:
        entry = self.manifest.files.get(relative)
        if entry is None:
            raise CorruptVersionError(f"{self.path / relative} is not in {self.path / MANIFEST}")
        return entry

    def _cache(self) -> Path:
        """The local folder of a remote version's downloaded files."""
        if self._local is None:
            self._local = Path(tempfile.mkdtemp(prefix="wuliang-version-"))
            weakref.finalize(self, shutil.rmtree, self._local, True)
        return self._local

    def _downloaded(self, relative: str) -> Path:
        """A remote file's local copy, checked (downloaded on first use)."""
        assert isinstance(self.path, RemotePath)
        local = self._cache() / relative
        if relative in self._fetched:
            return local
        entry = self._entry(relative)
        local.parent.mkdir(parents=True, exist_ok=True)
        source = self.path / relative
        partial = local.with_name(f"{TMP_PREFIX}{local.name}")
        try:
            size, digest = source.download(partial)
            _check(source, entry, size, lambda _: digest)
        except FileNotFoundError:
            partial.unlink(missing_ok=True)
            raise CorruptVersionError(f"{source} is missing") from None
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, local)
        self._fetched.add(relative)
        self._checked.add(relative)
        return local

    def _read_remote(self, relative: str) -> pa.Buffer:
        """A remote file's bytes, checked against the manifest (every time:
        each read is a new download)."""
        assert isinstance(self.path, RemotePath)
        entry = self._entry(relative)
        source = self.path / relative
        try:
            data = source.read_buffer()
        except FileNotFoundError:
            raise CorruptVersionError(f"{source} is missing") from None
        _check(source, entry, data.size, lambda _: hashlib.sha256(data).hexdigest())
        self._checked.add(relative)
        return data

    def _digest(self, relative: str) -> None:
        """Checks a remote file, read through the hash."""
        assert isinstance(self.path, RemotePath)
        entry = self._entry(relative)
        source = self.path / relative
        try:
            size, digest = source.digest()
        except FileNotFoundError:
            raise CorruptVersionError(f"{source} is missing") from None
        _check(source, entry, size, lambda _: digest)
        self._checked.add(relative)

    @contextlib.contextmanager
    def _open(self, relative: str) -> Iterator[pa.NativeFile]:
        """One of the version's files for reading, checked: mapped (local, or
        a remote file downloaded before) or in memory (a remote one)."""
        if isinstance(self.path, RemotePath) and relative not in self._fetched:
            yield pa.BufferReader(self._read_remote(relative))
            return
        with pa.memory_map(str(self.checked(relative))) as source:
            yield source

    def verify(self) -> None:
        """Checks every file of the version (those not checked yet); a
        remote version's files are read through the hash, not kept."""
        for relative in self.manifest.files:
            if isinstance(self.path, RemotePath):
                if relative not in self._checked:
                    self._digest(relative)
            else:
                self.checked(relative)

    def local_folder(self, folder: str) -> Path:
        """The local folder holding the version's files under ``folder`` (a
        TF checkpoint, a SavedModel), for code that reads local files only:
        a local version's own folder (``verify()`` checks it), a remote
        version's files downloaded and checked (once), kept as long as this
        ``Version``."""
        if not isinstance(self.path, RemotePath):
            return self.path / folder
        for relative in self.files_under(folder):
            self._downloaded(relative)
        return self._cache() / folder

    def link_tree(self, folder: str, writer: VersionWriter) -> None:
        """Puts this version's files under folder into writer's version, as
        hard links where the file system allows (versions never change), and
        records them (a remote version's: downloaded, checked, then written)."""
        for relative in self.files_under(folder):
            target = writer.path(relative)
            source = self.checked(relative)
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
        writer.add_tree(folder)

    def files_under(self, folder: str) -> list[str]:
        prefix = folder.rstrip("/") + "/"
        return sorted(f for f in self.manifest.files if f.startswith(prefix))

    def entry(self, table: str) -> TableEntry:
        """A table's entry; KeyError listing the tables there are."""
        entry = self.manifest.tables.get(table)
        if entry is None:
            known = ", ".join(sorted(self.manifest.tables)) or "none"
            raise KeyError(f"{self.path} has no table {table!r} (tables: {known})")
        return entry

    def part_files(self, table: str) -> list[str]:
        """A table's rows files (relative paths), in order."""
        self.entry(table)
        return [f for f in self.files_under(f"tables/{table}") if _is_part(f)]

    def read_rows(self, table: str) -> Iterator[RowChunk]:
        """The table's rows, part by part (each file checked first)."""
        self.entry(table)
        for relative in self.files_under(f"tables/{table}"):
            if not _is_part(relative):
                continue
            with self._open(relative) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield batch_to_rows(reader.get_batch(i))

    def removed_keys(self, table: str) -> np.ndarray:
        """The table's removed keys (uint64; none if it has no records)."""
        return self.removed_log(table)[0]

    def removed_log(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """The table's removal records: (keys, versions), uint64."""
        return self._records(table, "removed", "version", np.uint64)

    def pending_counts(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """The table's admission counts: (keys uint64, counts uint32); none in
        versions written without them."""
        return self._records(table, "pending", "count", np.uint32)

    def _records(
        self, table: str, kind: str, name: str, dtype: type
    ) -> tuple[np.ndarray, np.ndarray]:
        relative = f"tables/{table}/{kind}.arrow"
        keys: list[np.ndarray] = []
        values: list[np.ndarray] = []
        if relative in self.manifest.files:
            with self._open(relative) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    keys.append(batch.column("key").to_numpy())
                    values.append(batch.column(name).to_numpy())
        if not keys:
            return np.zeros(0, np.uint64), np.zeros(0, dtype)
        return np.concatenate(keys), np.concatenate(values)
