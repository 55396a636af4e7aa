"""``ModelStore``: one export directory served from an embedded engine (a
``ServedModel``, ``model.py``).

``ModelStore(export_dir)`` loads the newest valid version (a full export and
its chain of deltas: ``wuliang.serving.versions``) into a parameter server,
then follows the directory: ``refresh()`` (called every ``poll_secs`` by a
watcher thread) applies each new version while lookups go on. An empty or
missing directory is served as soon as its first version appears.

* Atomic: each table switches wholly from one version to the next
  (``ParameterServer.apply_update``), and every lookup reports the version
  its rows were read at. A version's SavedModel is loaded before its tables
  switch; the snapshot (``served()``) moves to the new version once every
  table has, and a lookup at a snapshot (``lookup(..., at=)``) whose rows
  come from another version raises ``VersionMoved``.
* Refusal: a version whose manifest or checksums fail (or whose SavedModel
  does not load) is refused: logged, counted (``refused``), remembered, and
  the previous version keeps serving; so is every later delta resting on it,
  until a new full version arrives.
* Restart: the newest version whose whole chain verifies is served; corrupt
  newer ones are skipped (and counted).
* Pruned versions (``wuliang.export.prune`` removes old versions, never
  LATEST's chain): a new delta needs only the versions from the served one
  to it, so it applies even when older ones (the served one included) are
  gone; a new version resting on one that is gone is passed by (logged,
  not refused) and the store moves on through the newest full version.
* Keys without a row read as zeros (``missing="zeros"``, found False) or as
  the training table's initial vector (``missing="initial"``: the manifest
  keeps each table's initializer and seed).
* Device cache (``gpu_cache_rows=N``): the N hottest rows of each table
  by the exported shows live on the device (cupy where a GPU is present,
  numpy otherwise), switched with each version before it is served
  (``wuliang.serving.device_cache``). Predictions read their rows there
  (``predict_rows``) and hand them to the tower on the device; a lookup,
  whose answer leaves over the network, reads the engine and never takes
  a round trip through the device.
* Object storage: ``export_dir`` may be a URI (``s3://bucket/prefix``); a
  version there exists once its manifest does (uploaded last), its files
  are checked as they are read and its SavedModel is downloaded to a
  temporary folder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from wuliang.ps_server import LookupResult, ParameterServer, UnknownTableError, parameter_server
from wuliang.ps_server.interface import MISSING
from wuliang.ps_server.storage import (
    MANIFEST,
    CorruptVersionError,
    ModelDescription,
    RemotePath,
    Version,
    chain,
    location,
    versions,
)
from wuliang.serving.device_cache import DeviceCache, check_cache_rows
from wuliang.serving.errors import NotFound, Unavailable, VersionMoved
from wuliang.serving.model import ServedVersion, StoreCounters, Tower, load_tower
from wuliang.serving.versions import apply

__all__ = ["PRECISIONS", "ModelStore", "ServedVersion", "StoreCounters", "Tower", "load_tower"]

log = logging.getLogger("wuliang.serving")
PRECISIONS = ("fp32", "fp16", "int8")


class ModelStore:
    """One served model: an export directory applied to a parameter server.

    Args:
        export_dir: the trainer's export directory (a folder, or a URI).
        name: the model's name in requests (default: the directory's name).
        missing: ``"zeros"`` or ``"initial"`` (see the module docstring).
        precision: how the served vectors are stored (``"fp32"``, ``"fp16"``,
            ``"int8"``: smaller, slightly lossy).
        poll_secs: how often the watcher looks for new versions (0: never;
            call ``refresh()``).
        num_shards: shard threads of the engine.
        load_towers: load each version's SavedModel (for predictions).
        gpu_cache_rows: rows of each table kept on the device (0: none; see
            ``wuliang.serving.device_cache``).
        gpu_cache_xp: its array module (``"auto"``: cupy when a GPU is
            present, else numpy; ``"numpy"``; ``"cupy"``).
        disk_dir: keep the rows beyond ``memory_gb`` in row files in this
            folder (the engine's disk tier, docs/disk_tier.md): a model
            larger than the replica's memory. Lookups of rows on disk read
            them on the request's thread.
        memory_gb: the RAM budget of the rows with ``disk_dir`` (default 1).
        refused: the set of refused versions to keep (shared by the stores
            of one ``VersionedModel``, each holding one of its versions).
    """

    def __init__(
        self,
        export_dir: str | Path | RemotePath,
        name: str | None = None,
        *,
        missing: str = "zeros",
        precision: str = "fp32",
        poll_secs: float = 10.0,
        num_shards: int = 2,
        load_towers: bool = True,
        gpu_cache_rows: int = 0,
        gpu_cache_xp: str = "auto",
        disk_dir: str | Path | None = None,
        memory_gb: float | None = None,
        refused: set[int] | None = None,
    ) -> None:
        if missing not in MISSING:
            raise ValueError(f"missing must be one of {', '.join(MISSING)}, got {missing!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if poll_secs < 0:
            raise ValueError(f"poll_secs must be >= 0, got {poll_secs!r}")
        gpu_cache_rows = check_cache_rows(gpu_cache_rows)
        self.export_dir = location(export_dir)
        self.name = name or self.export_dir.resolve().name
        self.source = str(self.export_dir)
        self.missing = missing
        self.precision = precision
        self.poll_secs = poll_secs
        self.load_towers = load_towers
        address = "embedded"
        if disk_dir is not None:
            address += f"?disk_dir={disk_dir}"
            if memory_gb is not None:
                address += f"&memory_gb={memory_gb}"
        elif memory_gb is not None:
            raise ValueError("memory_gb is the disk tier's budget: it needs disk_dir")
        self.ps: ParameterServer = parameter_server(address, num_shards)
        self.device_cache: DeviceCache | None = None
        if gpu_cache_rows:
            try:
                self.device_cache = DeviceCache(self.ps, gpu_cache_rows, xp=gpu_cache_xp)
            except BaseException:
                self.ps.close()
                raise
        self.counters = StoreCounters()
        self._current: ServedVersion | None = None  # the snapshot requests start from
        self._chain: list[int] = []  # the versions applied, base first
        self._refused: set[int] = set() if refused is None else refused
        self._passed: set[int] = set()  # versions passed by (resting on pruned ones), logged
        self._lock = threading.Lock()  # one refresh at a time
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.on_apply: list[Callable[[ServedVersion, float], None]] = []
        self.on_refuse: list[Callable[[int, str], None]] = []

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> ModelStore:
        """Loads the newest valid version and starts the watcher."""
        self.refresh()
        if self.poll_secs > 0 and self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name=f"wuliang-watch-{self.name}", daemon=True
            )
            self._watcher.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        if self.device_cache is not None:
            self.device_cache.close()
        self.ps.close()

    def __enter__(self) -> ModelStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_secs):
            try:
                self.refresh()
            except Exception:  # never let the watcher die; the next poll retries
                log.exception("model %s: refreshing from %s failed", self.name, self.export_dir)

    # -- what is served ------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version served now (0: none yet)."""
        current = self._current
        return 0 if current is None else current.number

    def served(self) -> ServedVersion:
        """A snapshot of the version served now (its model description and tower)."""
        current = self._current
        if current is None:
            raise Unavailable(f"model {self.name!r} has no version loaded yet")
        return current

    def tables(self) -> dict[str, int]:
        """The served tables and their dims."""
        return {name: self.ps.spec(name).dim for name in self.ps.tables()}

    def table_stats(self) -> dict[str, dict[str, Any]]:
        """Rows, bytes and counters of each served table."""
        return self.ps.stats()

    def lookup(self, table: str, keys: Any, at: ServedVersion | None = None) -> LookupResult:
        """The rows of keys, which were found, and the version they were read
        at; with ``at``, that version's rows or ``VersionMoved``. Read from
        the engine (host memory: the answer leaves over the network)."""
        return self._read(table, at, lambda: self.ps.lookup(table, keys, missing=self.missing))

    def predict_rows(self, table: str, keys: Any, at: ServedVersion | None = None) -> LookupResult:
        """A prediction's rows: as ``lookup``, but with a device cache its
        hits come from the device snapshot and the rows stay in the
        cache's memory (a cupy array on a GPU), for a tower there."""
        cache = self.device_cache
        if cache is None:
            return self.lookup(table, keys, at)
        return self._read(table, at, lambda: cache.read(table, keys, self.missing))

    def _read(
        self, table: str, at: ServedVersion | None, read: Callable[[], LookupResult]
    ) -> LookupResult:
        if self._current is None:
            raise Unavailable(f"model {self.name!r} has no version loaded yet")
        try:
            result = read()  # it checks the keys
        except UnknownTableError:
            if at is not None and at is not self._current:  # a new base dropped it
                raise VersionMoved(
                    f"model {self.name!r} moved on from version {at.number}"
                ) from None
            known = ", ".join(sorted(self.ps.tables())) or "none"
            raise NotFound(
                f"model {self.name!r} has no table {table!r} (tables: {known})"
            ) from None
        if at is not None and result.version != at.number:
            raise VersionMoved(
                f"model {self.name!r}: table {table!r} is at version {result.version}, "
                f"not {at.number}"
            )
        return result

    # -- following the directory ---------------------------------------------------

    def refresh(self) -> list[int]:
        """Applies the versions newer than the served one; returns them."""
        with self._lock:
            on_disk = [n for n, _ in versions(self.export_dir)]
            if not self._chain:
                return self._load_newest(on_disk)
            applied = []
            for target in (n for n in on_disk if n > self.version and n not in self._refused):
                try:
                    path = self._path_to(target)
                except _Gone as gone:  # pruned while this store was behind: pass it by
                    if target not in self._passed:
                        self._passed.add(target)
                        log.warning("model %s: version %d passed by: %s", self.name, target, gone)
                    continue
                if not self._apply_through(target, path):
                    break
                applied.append(target)
            return applied

    def load(self, target: int) -> bool:
        """Serves exactly version ``target``: the deltas from the served
        version to it when it rests on that version, else its whole chain
        (into the same engine, each table switched atomically). False when
        the version, or one it rests on, is refused."""
        with self._lock:
            if self.version == target:
                return True
            if target in self._refused:
                return False
            return self._apply_through(target)

    def _load_newest(self, on_disk: list[int]) -> list[int]:
        """The newest version whose whole chain verifies, applied."""
        for target in reversed(on_disk):
            if target in self._refused:
                continue
            try:
                path = chain(self.export_dir, target)
                for version in path:
                    version.verify()
            except (CorruptVersionError, OSError, ValueError) as error:
                self._refuse(target, error)
                continue
            if self._apply_chain(path):
                return [v.number for v in path]
        return []

    def _apply_through(self, target: int, path: list[Version] | None = None) -> bool:
        """Applies what leads from the served version to ``target`` (``path``
        when the caller has it: ``_path_to(target)``)."""
        if path is None:
            try:
                path = self._path_to(target)
            except (CorruptVersionError, OSError, ValueError) as error:  # _Gone too
                self._refuse(target, error)
                return False
        numbers = [v.number for v in path]
        if any(n in self._refused for n in numbers):
            self._refuse(target, f"it rests on refused version {min(self._refused & set(numbers))}")
            return False
        return self._apply_chain(path)

    def _path_to(self, target: int) -> list[Version]:
        """The versions that lead to ``target``, base first: its parents back
        to the served version (not included: deltas on top of it) or else to
        a full version (its whole chain). Versions older than that are not
        read, so a delta on top of the served version applies even when the
        versions below it were pruned.

        Raises:
            _Gone: a version of the path is no longer there (pruned).
            CorruptVersionError, OSError: one cannot be read.
        """
        path: list[Version] = []
        current: int | None = target
        while current is not None and current != self.version:
            folder = self.export_dir / str(current)
            if not (folder / MANIFEST).is_file():
                if not path:
                    raise _Gone(f"version {current} is gone")
                raise _Gone(
                    f"version {current}, which version {path[-1].number} rests on, is gone "
                    "(pruned); moving on to a later full version"
                )
            version = Version(folder)
            if version.parent is not None and version.parent >= current:
                raise CorruptVersionError(
                    f"{folder}: parent {version.parent} is not older than the version"
                )
            path.append(version)
            current = version.parent
        return path[::-1]

    def _apply_chain(self, path: list[Version]) -> bool:
        for version in path:
            number = version.number
            start = time.perf_counter()
            try:
                version.verify()
                tower = self._load_tower(version)
                served = ServedVersion(
                    number,
                    version.step,
                    version.model or ModelDescription(),
                    tower,
                    version.kind,
                    version.path,
                    no_tower="" if tower else "its towers are not loaded (load_towers=False)",
                )
                # The tower is loaded before any table switches; the snapshot
                # moves once every table has.
                touched = _Touched()  # a delta's keys, for the device cache
                tell = touched if self.device_cache is not None and version.kind != "full" else None
                apply(self.ps, version, self.precision, tell)
            except (CorruptVersionError, OSError, ValueError) as error:
                if not _there(version):  # pruned while it was read: not its fault
                    self._passed.add(number)
                    log.warning("model %s: version %d was removed while it was applied: %s",
                                self.name, number, error)  # fmt: skip
                    return False
                self._refuse(number, error)
                return False
            if self.device_cache is not None:  # switched before the version is served
                self.device_cache.switch(version.kind, version.tables, touched)
            if version.kind == "full":
                self._chain = [number]
            else:
                self._chain.append(number)
            self._current = served
            if version.kind == "full":  # tables the new base no longer has
                for gone in set(self.ps.tables()) - set(version.tables):
                    self.ps.drop_table(gone)
            took = time.perf_counter() - start
            self.counters.applied += 1
            self.counters.apply_seconds = [*self.counters.apply_seconds[-99:], took]
            log.info("model %s: version %d (%s) applied in %.3f s", self.name, number,
                     version.kind, took)  # fmt: skip
            for callback in self.on_apply:
                callback(served, took)
        return True

    def _load_tower(self, version: Version) -> Tower | None:
        return load_tower(version) if self.load_towers else None

    def _refuse(self, number: int, error: object) -> None:
        if number in self._refused:
            return
        self._refused.add(number)
        self.counters.refused += 1
        log.error("model %s: version %d refused: %s", self.name, number, error)
        for callback in self.on_refuse:
            callback(number, str(error))


def _there(version: Version) -> bool:
    """Whether a version is still in its export directory."""
    try:
        return (version.path / MANIFEST).is_file()
    except OSError:
        return True  # cannot tell: an error of the store, not a removal


class _Gone(CorruptVersionError):
    """A version a path needs is no longer in the export directory."""


class _Touched(dict[str, list[np.ndarray]]):
    """Keys a version writes or removes, per table (``versions.apply``'s
    ``touched``)."""

    def __call__(self, table: str, keys: np.ndarray) -> None:
        self.setdefault(table, []).append(keys)
