"""The hottest rows of each served table on the device (``wuliang serve
--gpu-cache-rows N``, ``ModelStore(gpu_cache_rows=N)``).

Per served table, a **snapshot** (``TableSnapshot``, immutable once built):
the keys of up to N rows, sorted, on the host; their float32 rows in the
same order in one array ``[N, dim]`` on the device (cupy where a GPU is
present, numpy otherwise: ``wuliang.ps_server.cache.kernels.array_module``;
the training cache's kernels gather and scatter them); and the engine's
version label the rows are of. A key's slot is its position among the
sorted keys, found through a ``KeyIndex`` of their positions built with
the snapshot (the engine's C++ hash map, the training cache's key index;
one call per read: 8 us for 1000 keys among 200K, ``searchsorted`` over the
sorted keys 34 us).

Which rows: the table's top N keys by the shows the export carries (the
engine keeps each row's decayed show count through ``apply_update``;
``ParameterServer.top_keys``). The rows themselves are read back from the
engine (``lookup``) at the version just applied, so a cached row is the
engine's row bit for bit, whatever the served precision.

Switching with the version. ``ModelStore`` applies a version to the engine
(``serving.versions.apply``, atomic per table), then, before the version is
published to readers (``served()``), calls ``switch``: per table of the
version, the old snapshot is taken away (predictions read the engine alone
meanwhile), the new one is built, and installed by one reference
assignment. A full version, or every ``rerank_every``-th delta since the
last ranking, ranks afresh (``top_keys`` scans the table). Other deltas are
cheap: the previous snapshot's keys stay, the rows of the cached keys the
delta wrote or removed (``apply``'s ``touched`` tells them) are read back
from the engine and scattered into a device copy of the rows, and keys the
engine no longer has leave (with their rows); keys new to the table come in
at the next ranking. A table a full version drops loses its snapshot first.

Who reads it: predictions (``ModelStore.predict_rows``), whose rows go on
to a tower; with cupy they stay on the device and reach the tower through
DLPack (``serving/predict.py``). A lookup's answer leaves over the network,
so lookups read the engine and never pay a round trip to the device (with
the cache on they are as fast as with it off).

A read takes the table's snapshot once, splits the keys into hits (among
its keys) and misses, gathers the hits on the device and looks the misses up
in the engine. The engine's answer names its version: if it is not the
snapshot's (the table switched between the two reads), the hits are not
mixed in; the whole read goes to the engine instead, wholly at one
version. A read whose keys all hit reads the snapshot alone and names its
version (the version the store still serves while a switch is under way).
So every answer is one version's rows and names it, and ``ModelStore``'s
``at=`` / ``VersionMoved`` contract holds unchanged.

"Copied in": the misses' rows are copied into the answer (to the device
with cupy). ``copied_bytes`` counts them. Counters per table (``stats()``):
``hits`` and ``misses`` (keys of predictions, a fallback counting all its
keys as misses), ``copied_bytes``, and of the snapshot ``rows``, ``bytes``
(device memory of its rows) and ``version``; ``/metrics`` publishes them
(``wuliang_device_cache_*``).

Cost without a GPU: with numpy the "device" is host memory, as the
engine's rows are, so the cache only adds work to predictions (finding the
hits, a second engine call for the misses, assembling, pooling in
TensorFlow). It is there so that the same code runs (and is tested)
everywhere; on a machine without a GPU leave it off.

Not served this way: the Redis-backed store (``--redis``) reads rows from
Redis through its own host cache and has no engine or show statistics to
rank by; ``wuliang serve`` refuses ``--gpu-cache-rows`` with ``--redis``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from wuliang.ps_server import LookupResult, ParameterServer
from wuliang.ps_server.cache.kernels import array_module, kernels_for
from wuliang.ps_server.cache.key_index import KeyIndex
from wuliang.ps_server.checks import as_keys

__all__ = ["RERANK_EVERY", "DeviceCache", "TableSnapshot", "check_cache_rows"]

log = logging.getLogger("wuliang.serving")
F32 = np.float32
RERANK_EVERY = 10  # deltas between two rankings of a table's keys by shows


def check_cache_rows(rows: Any, what: str = "gpu_cache_rows") -> int:
    """``rows`` as an int >= 0 (0: no device cache); ValueError naming it."""
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < 0:
        raise ValueError(f"{what} must be an int >= 0 (rows per table, 0: off), got {rows!r}")
    return int(rows)


@dataclass(frozen=True)
class TableSnapshot:
    """One table's cached rows at one version (never changed once built)."""

    version: int  # the engine's label of the rows
    keys: np.ndarray  # uint64 [m], sorted: the keys held
    rows: Any  # float32 [m, dim] on the device: row i is keys[i]'s
    deltas: int = 0  # deltas applied since the keys were ranked

    @property
    def size(self) -> int:
        """Keys held."""
        return len(self.keys)

    def __post_init__(self) -> None:
        index = KeyIndex(len(self.keys))  # key -> its position (slot), read-only from here
        index.insert(self.keys, np.arange(len(self.keys), dtype=np.int64))
        object.__setattr__(self, "_index", index)

    def slots(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot of each of ``keys`` (uint64), bool hit); a miss's slot is
        some valid slot."""
        slots = self._index.lookup(keys)  # type: ignore[attr-defined]
        hit = slots >= 0
        np.maximum(slots, 0, out=slots)
        return slots, hit

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)


class _Counters:
    __slots__ = ("copied_bytes", "hits", "lock", "misses")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits = self.misses = self.copied_bytes = 0

    def add(self, hits: int, misses: int, copied: int) -> None:
        with self.lock:
            self.hits += hits
            self.misses += misses
            self.copied_bytes += copied


class DeviceCache:
    """The device snapshots of a server's tables (see the module docstring).

    Args:
        ps: the engine the store applies versions to.
        rows: keys cached per table (>= 1).
        xp: array module: ``"auto"`` (cupy when a GPU is present), ``"numpy"``,
            ``"cupy"``.
        rerank_every: deltas after which a table's keys are ranked afresh.
    """

    def __init__(
        self, ps: ParameterServer, rows: int, *, xp: str = "auto", rerank_every: int = RERANK_EVERY
    ) -> None:
        rows = check_cache_rows(rows, "rows")
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows!r}")
        if isinstance(rerank_every, bool) or not isinstance(rerank_every, int) or rerank_every < 1:
            raise ValueError(f"rerank_every must be an int >= 1, got {rerank_every!r}")
        self.ps = ps
        self.rows = rows
        self.rerank_every = rerank_every
        self.xp = array_module(xp)
        self.kernels = kernels_for(self.xp)
        self.on_device = self.xp is not np
        self.device = self.kernels.device
        self._snapshots: dict[str, TableSnapshot] = {}  # replaced whole, never changed
        self._counters: dict[str, _Counters] = {}
        self._lock = threading.Lock()  # one switch at a time
        if self.on_device:
            log.info("device cache: the %d hottest rows of each table on %s", rows, self.device)
        else:
            log.warning(
                "device cache: the %d hottest rows of each table on host memory (numpy: no "
                "GPU here); without a GPU it only adds work to each prediction",
                rows,
            )

    # -- reading -------------------------------------------------------------------

    def snapshot(self, table: str) -> TableSnapshot | None:
        return self._snapshots.get(table)

    def read(self, table: str, keys: Any, missing: str = "zeros") -> LookupResult:
        """``ps.lookup(table, keys, missing=missing)`` for a prediction: hits
        from the snapshot, misses from the engine, the rows in the cache's
        memory (a device array with cupy, for a tower on the device)."""
        snap = self._snapshots.get(table)
        if snap is None or not snap.size:  # not cached (yet): the engine alone
            return self.ps.lookup(table, keys, missing=missing)
        keys = as_keys(keys)
        n = len(keys)
        slots, hit = snap.slots(keys.view(np.uint64))
        n_hit = int(np.count_nonzero(hit))
        counters = self._counters[table]
        if n_hit == 0:
            answer = self.ps.lookup(table, keys, missing=missing)
            counters.add(0, n, 0)
            return answer
        k = self.kernels
        if n_hit == n:  # the snapshot alone: one version
            counters.add(n, 0, 0)
            return LookupResult(k.gather(snap.rows, slots), np.ones(n, np.bool_), snap.version)
        miss = np.flatnonzero(~hit)
        answer = self.ps.lookup(table, keys[miss], missing=missing)
        if answer.version != snap.version:  # switched meanwhile: never mix versions
            whole = self.ps.lookup(table, keys, missing=missing)
            counters.add(0, n, 0)
            return whole
        # Every key's slot gathered (a miss's is some row), then the misses'
        # rows copied in over theirs.
        rows = k.gather(snap.rows, slots)
        k.put_rows(rows, miss, answer.rows)
        found = np.ones(n, np.bool_)
        found[miss] = answer.found
        counters.add(n_hit, n - n_hit, int(answer.rows.nbytes))
        return LookupResult(rows, found, snap.version)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per cached table: ``hits``, ``misses``, ``copied_bytes`` (since
        start), and of the snapshot served now ``rows``, ``bytes``,
        ``version`` (0 while none is)."""
        out = {}
        snapshots = self._snapshots
        for table, c in list(self._counters.items()):
            snap = snapshots.get(table)
            out[table] = {
                "hits": c.hits,
                "misses": c.misses,
                "copied_bytes": c.copied_bytes,
                "rows": 0 if snap is None else snap.size,
                "bytes": 0 if snap is None else snap.nbytes,
                "version": 0 if snap is None else snap.version,
            }
        return out

    # -- switching -----------------------------------------------------------------

    def switch(
        self,
        kind: str,
        tables: Iterable[str],
        touched: dict[str, list[np.ndarray]] | None = None,
    ) -> None:
        """After a version was applied to the engine, before it is published:
        each of its ``tables`` gets a snapshot of the engine's rows now.
        ``kind``: the version's (``"full"`` or ``"delta"``); ``touched``: a
        delta's keys written or removed per table (``versions.apply``). A
        full version drops the snapshots of tables it does not have. A table
        whose snapshot fails to build is served by the engine alone (logged)."""
        tables = list(tables)
        with self._lock:
            if kind == "full":
                for gone in set(self._snapshots) - set(tables):  # before the engine drops it
                    self._set(gone, None)
            for table in tables:
                old = self._snapshots.get(table)
                self._set(table, None)  # lookups read the engine alone meanwhile
                self._counters.setdefault(table, _Counters())
                try:
                    if kind == "full" or old is None or old.deltas + 1 >= self.rerank_every:
                        snap = self._ranked(table)
                    else:
                        snap = self._patched(table, old, (touched or {}).get(table, []))
                except Exception:
                    log.exception("device cache: table %r is served without it", table)
                    continue
                self._set(table, snap)

    def close(self) -> None:
        with self._lock:
            self._snapshots = {}

    def _set(self, table: str, snap: TableSnapshot | None) -> None:
        """Installs (or removes) a table's snapshot; under ``_lock``."""
        snapshots = dict(self._snapshots)
        if snap is None:
            snapshots.pop(table, None)
        else:
            snapshots[table] = snap
        self._snapshots = snapshots  # one reference assignment

    def _ranked(self, table: str) -> TableSnapshot:
        """The table's top ``rows`` keys by shows, their rows from the engine."""
        keys, _ = self.ps.top_keys(table, self.rows)
        keys = np.sort(keys)
        answer = self.ps.lookup(table, keys)
        found = answer.found  # all of them: the keys come from the table
        rows = self.kernels.to_device(np.ascontiguousarray(answer.rows[found]))
        return TableSnapshot(answer.version, keys[found], rows)

    def _patched(self, table: str, old: TableSnapshot, touched: list[np.ndarray]) -> TableSnapshot:
        """``old`` with the rows a delta wrote or removed read back."""
        keys = np.unique(np.concatenate(touched)) if touched else np.zeros(0, np.uint64)
        if old.size:
            slots, held = old.slots(keys)
            keys, slots = keys[held], slots[held]
        else:
            keys, slots = keys[:0], np.zeros(0, np.int64)
        answer = self.ps.lookup(table, keys)  # also the engine's label when no key is held
        if not len(keys):
            return dataclasses.replace(old, version=answer.version, deltas=old.deltas + 1)
        xp = self.xp
        rows = xp.array(old.rows, copy=True)  # readers keep reading the old rows
        kept = answer.found
        self.kernels.scatter(rows, slots[kept], np.ascontiguousarray(answer.rows[kept]))
        held_keys = old.keys
        if not kept.all():  # keys the delta removed leave, with their rows
            stay = np.ones(old.size, np.bool_)
            stay[slots[~kept]] = False
            held_keys = old.keys[stay]
            rows = rows[xp.asarray(stay)]
        self.kernels.synchronize()
        return TableSnapshot(answer.version, held_keys, rows, old.deltas + 1)
