"""Exports for serving: full and delta versions of a model, and applying them.

::

    export_dir/
        LATEST     the newest version's name; written last
        1/         full: every live row
        2/         delta of 1: rows changed since 1, keys removed since 1
        3/         delta of 2 ...

Each version is a ``wuliang.ps_server.storage`` directory (atomic, every
file checksummed) of kind ``full`` or ``delta``:

* ``tables/<t>/part-*.arrow``: rows (key, vector, count, step, time,
  version), without optimizer state: serving does not train;
* ``tables/<t>/removed.arrow`` (deltas): keys removed since the parent;
* ``serving/``: the tower as a SavedModel (``wuliang.saved_model``);
* ``manifest.json``: ``version``, ``parent`` (None for a full one), ``kind``,
  ``engine_version`` and ``step`` of the source, ``model`` (features and how
  they pool), tables (each with its training spec), files (sha256, rows),
  ``created``.

Versions are numbered 1, 2, ... in the order written. A delta holds the rows
whose engine version (``Engine`` stamps every modification) is above its
parent's ``engine_version``, and the keys removed after it that did not come
back; applying one is: remove its keys, then load its rows. The engine's
change log makes a live delta cost what it contains; a delta made from a
checkpoint filters the checkpoint's rows by version.

A full version is written instead of a delta when asked, when there is no
previous version, when the source is older than the previous version (a
trainer restarted from an earlier checkpoint), when the tables differ from
the parent's, or when the removal log no longer reaches the parent's version
(``ExportResult.reason`` says which).

Exporting is idempotent: a source at the engine version and step of the
newest export writes nothing. Sources record the version that
``wuliang.checkpoint.cut_version`` gives, the same for a checkpoint and a
live session holding the same rows, so the ``wuliang export`` job and the
trainer's hook continue each other's chains in one export_dir. Writers of
one export_dir take turns (a lock file, ``.lock``), so the trainer's hook
and a cron job may share it. It is safe
to crash anywhere: a version is renamed into place complete or not at all,
and ``LATEST`` (which may lag after a crash) is set from the newest
committed version by the next run.

Sources: ``LiveSource`` (a model in memory, in sync: the ``IncrementalExport``
hook) and ``CheckpointSource`` (a checkpoint: the ``wuliang export`` job).

Retention (``prune``): old versions go, oldest first, until at most
``keep_versions`` versions and ``keep_bytes`` bytes (each when given)
remain, but never one that
``LATEST`` needs: its chain (the newest full version at or below it and the
deltas after it) and every version after its base stay, even over the
budget (``PruneResult.over_budget``; ``compact`` shortens the chain). A
version is renamed to a ``.tmp-`` name (in an object store: its manifest
deleted) before its files go, so a listing never shows a half-removed one.

``export_dir`` (and a checkpoint) may be a URI of an object store
(``s3://bucket/prefix``): each file of a version is uploaded whole and its
manifest last (``wuliang.ps_server.storage``), and ``LATEST`` is uploaded
whole after it. An object store has no lock file: give such an export
directory one writer.

This module writes. The read side, which an online server needs without the
writer or TensorFlow, is below it: listing (``versions``, ``latest``,
``chain``) in ``wuliang.ps_server.storage``, applying (``apply``,
``apply_chain``) in ``wuliang.serving.versions``; their names are
re-exported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from wuliang.checkpoint import cut_version
from wuliang.ps_server import RowChunk, TableSpec, parameter_server
from wuliang.ps_server.storage import (
    LATEST,
    MANIFEST,
    SERVING,
    Location,
    ModelDescription,
    RemotePath,
    Version,
    VersionWriter,
    chain,
    crash_point,
    latest,
    location,
    remove_stale_temporaries,
    remove_version,
    select_rows,
    versions,
)
from wuliang.serving.versions import apply, apply_chain

if TYPE_CHECKING:
    from wuliang.context import Context
    from wuliang.tower import TowerState

__all__ = [
    "LATEST",
    "LOCK",
    "CheckpointSource",
    "ExportResult",
    "ExportSource",
    "LiveSource",
    "PruneResult",
    "SessionSource",
    "apply",
    "apply_chain",
    "chain",
    "compact",
    "export",
    "latest",
    "prune",
    "versions",
]

LOCK = ".lock"
log = logging.getLogger("wuliang.export")


class ExportSource(Protocol):
    """What an export reads: rows by version, removals, the SavedModel."""

    engine_version: int  # every row it holds has a version <= this
    step: int
    tables: dict[str, TableSpec]  # by name
    model: ModelDescription
    origin: str  # for messages: "session", "ckpt-1200"

    def write_rows(self, writer: VersionWriter, spec: TableSpec, since: int) -> int:
        """Writes the table's rows modified after version since (0: all)
        into the version; returns how many."""
        ...

    def removed(self, table: str, since: int) -> np.ndarray | None:
        """Keys removed after version since; None when the log does not
        reach back that far."""
        ...

    def still_removed(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Those of ``keys`` that are not back (after ``write_rows``: a key
        removed, then back, is among the rows written)."""
        ...

    def write_serving(self, writer: VersionWriter) -> None: ...


class LiveSource:
    """A model in memory: its parameter server and tower (``wuliang.tower``).
    Call in sync (no step in flight); cuts the version (``cut_version``) so
    that changes made later go to the next delta."""

    def __init__(self, context: Context, tower: TowerState) -> None:
        ps = context.ps
        self.ps = ps
        self.tower = tower
        self.engine_version = cut_version(ps)
        self.step = context.global_step
        self.tables = {name: ps.spec(name) for name in context.tables}
        self.model = tower.model_description()
        self.origin = "session"

    def write_rows(self, writer: VersionWriter, spec: TableSpec, since: int) -> int:
        # each parameter server writes its own part files
        files, rows = self.ps.write_rows(writer.dir, spec, since=since, state=False)
        writer.record_table(spec, files, rows, state=False)
        return rows

    def removed(self, table: str, since: int) -> np.ndarray | None:
        if self.ps.stats(table)["removed_floor"] > since:
            return None
        return self.ps.removed_keys(table, since)

    def still_removed(self, table: str, keys: np.ndarray) -> np.ndarray:
        return keys[~self.ps.contains(table, keys)] if len(keys) else keys

    def write_serving(self, writer: VersionWriter) -> None:
        restored = self.tower.restored_version()
        if restored is not None:  # no step since a restore: that checkpoint's tower
            restored.link_tree(SERVING, writer)
            return
        self.tower.write_saved_model(writer.path(SERVING))
        writer.add_tree(SERVING)


def SessionSource(session: Any) -> LiveSource:
    """The ``LiveSource`` of a session (its ``context`` and ``tower``)."""
    return LiveSource(session.context, session.tower)


class CheckpointSource:
    """A checkpoint directory (``wuliang.checkpoint``), every file verified."""

    def __init__(self, path: str | os.PathLike | RemotePath) -> None:
        self.version = Version(path)
        path = self.version.path  # messages name a URI without its query
        if self.version.kind != "checkpoint":
            raise ValueError(f"{path} is a {self.version.kind} export, not a checkpoint")
        if self.version.model is None:
            raise ValueError(f"{path} was written by an older wuliang: it has no serving model")
        self.version.verify()
        self.engine_version = self.version.engine_version
        self.step = self.version.step
        self.tables = {name: t.spec for name, t in self.version.tables.items()}
        self.model = self.version.model
        self.origin = self.version.path.name
        self._written: dict[str, np.ndarray] = {}  # keys write_rows wrote, by table

    def write_rows(self, writer: VersionWriter, spec: TableSpec, since: int) -> int:
        written: list[np.ndarray] = []
        rows = writer.write_table(spec, _keys_into(self._rows(spec.name, since), written),
                                  state=False)  # fmt: skip
        self._written[spec.name] = np.concatenate(written) if written else np.zeros(0, np.uint64)
        return rows

    def still_removed(self, table: str, keys: np.ndarray) -> np.ndarray:
        back = self._written.get(table)
        return keys if back is None or not len(keys) else keys[~np.isin(keys, back)]

    def _rows(self, table: str, since: int) -> Iterator[RowChunk]:
        for chunk in self.version.read_rows(table):
            if since:
                keep = chunk.versions > since
                if not keep.any():
                    continue
                chunk = select_rows(chunk, keep)
            yield chunk

    def removed(self, table: str, since: int) -> np.ndarray | None:
        if self.version.tables[table].removed_floor > since:
            return None
        keys, versions = self.version.removed_log(table)
        return keys[versions > since]

    def write_serving(self, writer: VersionWriter) -> None:
        self.version.link_tree(SERVING, writer)


@dataclass
class ExportResult:
    """What ``export`` or ``compact`` did; ``status()`` is its one-line summary."""

    path: Location
    version: int
    kind: str
    _: KW_ONLY
    parent: int | None
    step: int
    rows: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    written: bool = True
    reason: str = ""  # why a full version, where a delta was possible to ask for
    seconds: float = 0.0

    def status(self) -> str:
        """One line for logs and cron mail."""
        if not self.written:
            return f"export {self.version} is up to date (step {self.step}); nothing written"
        what = "full" if self.kind == "full" else f"delta of {self.parent}"
        tables = ", ".join(
            f"{t} {n:,} rows" + (f" {self.removed[t]:,} removed" if self.removed.get(t) else "")
            for t, n in self.rows.items()
        )
        why = f" ({self.reason})" if self.reason else ""
        return (
            f"export {self.version}: {what}{why} at step {self.step}: {tables}; "
            f"{self.seconds:.2f} s -> {self.path}"
        )


def export(
    source: ExportSource, export_dir: str | os.PathLike | RemotePath, kind: str = "auto"
) -> ExportResult:
    """Writes the next version of export_dir from source: a delta of the
    newest version when possible (``kind="auto"``), or a full one
    (``kind="full"``). See the module docstring."""
    if kind not in ("auto", "full"):
        raise ValueError(f"kind must be 'auto' or 'full', got {kind!r}")
    with _exclusive(export_dir) as root:
        return _export(source, root, kind)


def _export(source: ExportSource, root: Location, kind: str) -> ExportResult:
    start = time.perf_counter()
    remove_stale_temporaries(root)
    newest = latest(root)
    if newest is not None:
        _point_latest(root, newest)
        same = (newest.engine_version, newest.step) == (source.engine_version, source.step)
        if same and (kind == "auto" or newest.kind == "full"):
            return ExportResult(
                newest.path,
                newest.number,
                newest.kind,
                parent=newest.parent,
                step=newest.step,
                written=False,
            )
    since, reason, removed = _delta_base(source, newest, kind)
    number = 1 if newest is None else newest.number + 1
    delta = newest is not None and not reason and kind == "auto"
    result = ExportResult(
        root / str(number),
        number,
        "delta" if delta else "full",
        parent=newest.number if delta and newest is not None else None,
        step=source.step,
        reason=reason,
    )
    with VersionWriter(root, str(number), result.kind) as writer:
        for table, spec in source.tables.items():
            result.rows[table] = source.write_rows(writer, spec, since if delta else 0)
            if delta:  # removed, then back: the rows say so
                gone = np.unique(source.still_removed(table, removed[table]))
                writer.write_removed(table, gone)
                result.removed[table] = len(gone)
        source.write_serving(writer)
        writer.commit(
            number=number,
            parent=result.parent,
            engine_version=source.engine_version,
            step=source.step,
            model=source.model,
            source=source.origin,
            reason=reason,
        )
    _point_latest(root, Version(result.path))
    result.seconds = time.perf_counter() - start
    return result


def _delta_base(
    source: ExportSource, newest: Version | None, kind: str
) -> tuple[int, str, dict[str, np.ndarray]]:
    """(since, why a full version is needed or "", removed keys per table)."""
    if newest is None:
        return 0, "" if kind == "full" else "no previous export", {}
    if kind == "full":
        return 0, "", {}
    since = newest.engine_version
    if source.engine_version < since:
        return 0, f"{source.origin} is older than export {newest.number}", {}
    parent_tables = {t: v.dim for t, v in newest.tables.items()}
    if parent_tables != {t: spec.dim for t, spec in source.tables.items()}:
        return 0, f"tables differ from export {newest.number}'s", {}
    removed = {}
    for table in source.tables:
        keys = source.removed(table, since)
        if keys is None:
            why = f"the removal log of {table!r} no longer reaches export {newest.number}"
            return 0, why, {}
        removed[table] = keys
    return since, "", removed


@contextlib.contextmanager
def _exclusive(export_dir: str | os.PathLike | RemotePath) -> Iterator[Location]:
    """Holds export_dir's lock: one writer at a time (the hook and the cron
    job may share a folder); the next one waits. An object store has no
    lock: one writer there."""
    root = location(export_dir)
    if isinstance(root, RemotePath):
        yield root
        return
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield root
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _keys_into(chunks: Iterable[RowChunk], keys: list[np.ndarray]) -> Iterator[RowChunk]:
    for chunk in chunks:
        keys.append(chunk.keys)
        yield chunk


def _point_latest(root: Location, version: Version) -> None:
    """Sets LATEST to version's name unless it says so already (in an
    object store: uploaded whole, which replaces it at once)."""
    path = root / LATEST
    name = version.path.name
    try:
        if path.read_text().strip() == name:
            return
    except FileNotFoundError:
        pass
    if isinstance(path, RemotePath):
        path.write_text(name + "\n")
        return
    assert isinstance(root, Path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-LATEST-", dir=root)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    crash_point("latest-temp")
    os.replace(tmp, path)


def compact(export_dir: str | os.PathLike | RemotePath) -> ExportResult:
    """Merges LATEST's chain (a full version and its deltas) into a new full
    version. Nothing is written when LATEST is already a full version.

    Raises:
        FileNotFoundError: export_dir is missing or holds no version (nothing
            is created then).
    """
    root = location(export_dir)
    if not versions(root):  # before _exclusive, which would create the folder and its lock
        if root.is_dir():
            raise FileNotFoundError(f"{root} has no export")
        if root.exists():
            raise NotADirectoryError(f"{root} has no export (it is not a folder)")
        raise FileNotFoundError(f"{root} has no export (no such folder)")
    with _exclusive(root) as locked:
        return _compact(locked)


def _compact(root: Location) -> ExportResult:
    start = time.perf_counter()
    versions_ = chain(root)
    top = versions_[-1]
    number = top.number
    if top.kind == "full":
        return ExportResult(top.path, number, "full", parent=None, step=top.step, written=False)
    with parameter_server("embedded", num_shards=2) as engine:
        apply_chain(engine, root, number)
        result = ExportResult(
            root / str(number + 1), number + 1, "full", parent=None, step=top.step
        )
        with VersionWriter(root, str(number + 1), "full") as writer:
            for table, entry in top.tables.items():
                result.rows[table] = writer.write_table(
                    entry.spec, engine.export(table), state=False
                )
            top.link_tree(SERVING, writer)  # verified by apply_chain
            writer.commit(
                number=number + 1,
                parent=None,
                engine_version=top.engine_version,
                step=top.step,
                model=top.model,
                source=f"compacted {'+'.join(v.path.name for v in versions_)}",
                reason="",
            )
    _point_latest(root, Version(result.path))
    result.reason = f"compacted versions {', '.join(v.path.name for v in versions_)}"
    result.seconds = time.perf_counter() - start
    return result


@dataclass
class PruneResult:
    """What ``prune`` did; ``status()`` is its one-line summary.

    ``removed``: the versions removed, oldest first; ``kept``: the versions
    left; ``needed``: LATEST's chain (base first), which is always kept;
    ``kept_bytes``: the bytes of the versions left (their files and
    manifests), counted when ``keep_bytes`` was given; ``over_budget``:
    what is left is still over a budget because LATEST's chain (and the
    versions after its base) alone is.
    """

    path: Location
    removed: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    needed: list[int] = field(default_factory=list)
    _: KW_ONLY
    keep_versions: int | None = None
    keep_bytes: int | None = None
    kept_bytes: int | None = None
    removed_bytes: int | None = None
    over_budget: bool = False
    seconds: float = 0.0

    def status(self) -> str:
        """One line for logs and cron mail."""
        if self.removed:
            gone = _numbers(self.removed)
            size = "" if self.removed_bytes is None else f", {_size(self.removed_bytes)}"
            what = f"pruned {len(self.removed)} version(s) ({gone}{size})"
        else:
            what = "pruned nothing"
        left = f"{len(self.kept)} version(s) left ({_numbers(self.kept) or 'none'}"
        left += ")" if self.kept_bytes is None else f", {_size(self.kept_bytes)})"
        line = f"{what}; {left} in {self.path}"
        if self.over_budget:
            budget = " and ".join(
                text
                for text in (
                    None if self.keep_versions is None else f"keep_versions={self.keep_versions}",
                    None if self.keep_bytes is None else f"keep_bytes={self.keep_bytes:,}",
                )
                if text
            )
            line += (
                f"; over the budget ({budget}): LATEST's chain ({_numbers(self.needed)}) "
                "is kept whole; compact it (wuliang export --compact) so that the next "
                "prune can remove the versions it rests on"
            )
        return line


def prune(
    export_dir: str | os.PathLike | RemotePath,
    *,
    keep_versions: int | None = None,
    keep_bytes: int | None = None,
) -> PruneResult:
    """Removes the oldest versions of export_dir until at most
    ``keep_versions`` versions and ``keep_bytes`` bytes (their files and
    manifests) are left; None: no such limit (both None: nothing removed).

    Never removed: LATEST's chain (``chain``: the newest full version at or
    below LATEST and the deltas after it) and any version after that chain's
    base (a version written after a crash left LATEST behind), so a replica
    following LATEST always finds what it needs. When they alone are over
    the budget they are kept, the result says so (``over_budget``, in
    ``status()``) and a warning is logged: ``compact`` writes LATEST as one
    full version, after which the versions below it can go.

    Each version is first renamed to a ``.tmp-`` name, which listings skip,
    and then deleted (in an object store: its manifest goes first, then its
    files), so a crash leaves no half-removed version in sight; what it
    leaves is cleared by the next prune or export. Holds export_dir's lock,
    as ``export`` does.

    Raises:
        FileNotFoundError: export_dir does not exist.
        CorruptVersionError: LATEST's chain is broken (nothing is removed).
    """
    for name, value, low in (("keep_versions", keep_versions, 1), ("keep_bytes", keep_bytes, 0)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < low
        ):
            raise ValueError(f"{name} must be an int >= {low} or None, got {value!r}")
    root = location(export_dir)
    if not root.is_dir():  # before _exclusive, which would create the folder and its lock
        what = "is not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"export directory {root} {what}")
    with _exclusive(root) as locked:
        result = _prune(locked, keep_versions, keep_bytes)
    if result.over_budget:
        log.warning("%s", result.status())
    return result


def _prune(root: Location, keep_versions: int | None, keep_bytes: int | None) -> PruneResult:
    start = time.perf_counter()
    remove_stale_temporaries(root)  # what a crashed prune or writer left
    found = versions(root)
    result = PruneResult(root, keep_versions=keep_versions, keep_bytes=keep_bytes)
    if not found:
        return result
    needed = chain(root)  # CorruptVersionError when broken: then nothing goes
    base = needed[0].number
    result.needed = [v.number for v in needed]
    sizes: dict[int, int] = {}
    if keep_bytes is not None:
        known = {v.number: v for v in needed}
        for number, path in found:
            sizes[number] = _version_bytes(known.get(number) or Version(path))
    kept = [number for number, _ in found]
    paths = dict(found)

    def over() -> bool:
        if keep_versions is not None and len(kept) > keep_versions:
            return True
        return keep_bytes is not None and sum(sizes[n] for n in kept) > keep_bytes

    removed_bytes = 0
    for number in [n for n, _ in found if n < base]:  # oldest first
        if not over():
            break
        remove_version(paths[number], "export-prune", "pruned")
        kept.remove(number)
        result.removed.append(number)
        removed_bytes += sizes.get(number, 0)
    result.over_budget = over()
    result.kept = kept
    if keep_bytes is not None:
        result.kept_bytes = sum(sizes[n] for n in kept)
        result.removed_bytes = removed_bytes
    if isinstance(root, RemotePath):  # folders without a manifest below the base: leftovers
        listed = set(kept)
        for p in root.iterdir():
            if not p.name.isdigit() or int(p.name) >= base or int(p.name) in listed:
                continue
            if not (p / MANIFEST).is_file():
                p.rmtree()
    result.seconds = time.perf_counter() - start
    return result


def _version_bytes(version: Version) -> int:
    """A version's bytes: its files as its manifest lists them, and the manifest."""
    return (
        sum(f.bytes for f in version.manifest.files.values())
        + (version.path / MANIFEST).stat().st_size
    )


def _numbers(numbers: list[int]) -> str:
    """``1-4, 7, 9-10``: runs of consecutive numbers."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n:,} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"
