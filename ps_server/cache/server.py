"""``CachedServer``: a GPU hot cache in front of any parameter server,
device-first.

Everything about a cached row lives on the device (cupy; numpy arrays for
the CPU twin): its weights, optimizer state, count, step, time, shows,
clicks, whether it changed since it came in, the key → slot index and the
policy's scores (``index.SlotIndex``, all tables in one key space). The
inner server (embedded or remote) holds every row; a cached row's newest
value is the cache's until it is written back. The host sees the keys a
batch brings (the reader's) and the misses; a pull's ``out`` and a push's
gradients and ``updated`` rows may be device arrays (the trainer's DLPack
path to TensorFlow), or host arrays (everything else).

Per training pull (``pull_many(train=True)``), all tables at once: the
keys go to the device and through the index (one launch per stage: lookup,
score, populate); the victims' updated rows are copied out; then **one**
``exchange_many`` with the inner server, for every table of the pull (one
round of the engine's shards, one request per remote server): the
victims' rows go back, all misses are pulled (which counts their
sightings and creates rows as admission allows, exactly as without the
cache), and the incoming rows come back whole, with which of them the pull
created; the incoming rows are copied to their slots; the hits are
gathered into ``out`` on the device. The uncached tables' keys ride in the
same exchange. The pipeline runs this for step i + 1 while step i trains:
the rows step i uses are locked (the index's epochs), and a key that step
i sent to the inner server is not brought in before step i's push has
landed (its row there is not final).

Per push: the keys' slots come from their pull (or a lookup); cached rows
are updated on the device with the engine's own arithmetic (``kernels``),
the rest go to the inner server in one ``push_many``.

A failed exchange. Its victims' rows were copied out and their slots
taken: they are kept as a write-back in flight, which every later call on
the inner server first tries again (the ``inner`` property; a training
pull at its start), once; failing again, the call raises naming the
tables, and the rows are kept for the next try: an update is never
dropped.

Every call that reads or changes the inner server's rows as a whole
(``export``, ``write_rows``, ``evict``, ``stats``, ``advance_version``,
``restore_version``, ``close``) first writes the updated rows back, so its
result is what the server alone gives; calls that change rows there
(``load``, ``erase``, ``load_rows``, ``apply_update``, ``drop_table``)
drop the keys (or tables) they touch from the cache. See docs/gpu_cache.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wuliang.ps_server.cache.index import INTO_EMPTY, OVER_VICTIM, SlotIndex
from wuliang.ps_server.cache.kernels import (
    F32,
    NumpyKernels,
    OptimizerMath,
    SlotRows,
    array_module,
    engine_float_model,
    kernels_for,
)
from wuliang.ps_server.cache.key_index import KeyIndex
from wuliang.ps_server.checks import as_column, check_clock, check_step
from wuliang.ps_server.chunk import take_rows
from wuliang.ps_server.interface import (
    MISSING,
    ONLY,
    Exchanged,
    ExchangePart,
    KeyArray,
    LookupResult,
    ParameterServer,
    PullPart,
    PushPart,
    PushResult,
    RowChunk,
    TableUpdate,
    as_keys,
)
from wuliang.ps_server.routing import server_of, shard_of
from wuliang.ps_server.spec import TableSpec

if TYPE_CHECKING:
    from wuliang.ps_server.storage.manifest import FileEntry

COUNTERS = (
    "synced",  # shared rows: changes sent (victims, flushes, every sync_steps pulls)
    "refreshed",  # shared rows: rows read back merged after their changes were sent
    "hits",  # training-pull keys found in the cache
    "misses",  # training-pull keys not found
    "hit_occurrences",  # key occurrences of the hits (the pull's counts)
    "occurrences",  # key occurrences of training pulls
    "swapped_in",  # rows copied into the cache
    "evicted",  # rows that left the cache for others
    "written_back",  # rows written back to the inner server
    "updated",  # row updates applied in the cache
    "lookups",  # keys read from the cache by lookups and pulls without training
)


@dataclass
class _Table:
    """One table's cache: its rows by slot (device) and its counters (host)."""

    spec: TableSpec
    math: OptimizerMath
    region: Any  # index.Region
    rows: SlotRows
    base: SlotRows | None = None  # shared rows: each slot's row as fetched (or last sent)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # what the inner server's counters miss: (the keys the cache answered)
    pulled_keys: int = 0
    pushed_keys: int = 0
    dropped_nan: int = 0
    dropped_pending: int = 0


@dataclass
class _Load:
    """Evicted rows of one table copied out, on their way to the inner server."""

    table: str
    keys: np.ndarray
    columns: tuple[np.ndarray, np.ndarray | None]  # weights, state
    named: dict[str, np.ndarray]  # counts, steps, times, shows, clicks
    merge: bool = False  # the changes since the rows were fetched (shared rows), to add


@dataclass
class _Used:
    """A training pull's keys of one table and where they are cached, for
    the push of the same step (its slots locked until the pull after next)."""

    keys: np.ndarray  # uint64, as pulled
    cached: np.ndarray  # bool [n], host
    slots: Any  # int64 [n] on the device: table-local slot, -1 where not cached
    epoch: int
    generation: int


class CachedServer(ParameterServer):
    """A ``ParameterServer`` over another one, with the hottest rows of each
    table on the device (see the module docstring and docs/gpu_cache.md).

    Args:
        inner: the server that holds every row (embedded or remote); the
            cache owns it (``close`` closes it).
        rows: cache slots per table, or a mapping ``{table: slots}`` (tables
            not in it are not cached); rounded up to whole sets of 32.
            Serving tables and compressed tables are never cached.
        xp: the array module: ``"auto"`` (cupy when a GPU is present, else
            numpy), ``"cupy"``, ``"numpy"``, or the module itself.
        policy: ``"stats"`` (decayed show counts, the default) or ``"lru"``
            (``index.SlotIndex``).
        half_life: batches after which a sighting counts half (``"stats"``).
        sync_steps: None (the default): the cache's rows are this trainer's
            alone, written back whole. k >= 1: shared rows (a job of several
            trainers on one set of servers, Geo-SGD): every k training pulls,
            and whenever a row leaves the cache, the change it made to each
            row since the row was fetched is merged into the server's row
            (``ExchangePart(merge=True)``), and the rows changed are read
            back merged. docs/gpu_cache.md, "Several trainers".
    """

    def __init__(
        self,
        inner: ParameterServer,
        rows: int | Mapping[str, int],
        *,
        xp: Any = "auto",
        policy: str = "stats",
        half_life: float = 1000.0,
        sync_steps: int | None = None,
    ) -> None:
        super().__init__()
        if sync_steps is not None and (
            isinstance(sync_steps, bool) or not isinstance(sync_steps, int) or sync_steps < 1
        ):
            raise ValueError(f"sync_steps must be an int >= 1 or None, got {sync_steps!r}")
        if not isinstance(inner, ParameterServer):
            raise TypeError(f"inner must be a ParameterServer, got {type(inner).__name__}")
        if isinstance(rows, Mapping):
            for name, n in rows.items():
                _check_rows(n, f"rows[{name!r}]")
        else:
            _check_rows(rows, "rows")
        self._inner = inner
        self._rows = rows
        self.xp = array_module(xp)
        self.kernels: NumpyKernels = kernels_for(self.xp)
        self.index = SlotIndex(self.kernels, policy=policy, half_life=half_life)
        self.float_model, self.exact = engine_float_model()
        self._lock = threading.RLock()
        self._tables: dict[str, _Table | None] = {}  # None: not cached
        self._grow_bases: set[str] = set()  # tables a sized table's blocks grow from
        self._used: dict[tuple[str, int | None], _Used] = {}
        self._generation = 0  # bumped when keys leave the index other than by a pull
        self._admitted: list[tuple[int, str, np.ndarray]] = []  # (epoch, table, keys) came in
        self.inner_seconds = 0.0  # time the data half spent waiting on the inner server
        self._timed_lock = threading.Lock()
        self._in_flight: list[tuple[Future, list[_Load]]] = []  # failed write-backs, oldest first
        self._settle_lock = threading.Lock()
        self._clock: int | None = None  # set_clock's: the time pushes stamp (None: wall clock)
        self.sync_steps = sync_steps
        self._pulls = 0  # training pulls (shared rows: synced every sync_steps)

    @property
    def inner(self) -> ParameterServer:
        """The server behind the cache, once the write-backs in flight have
        landed there."""
        self._settle()
        return self._inner

    def _settle(self) -> None:
        """Waits for the write-backs in flight; one that failed is tried
        again now, and failing again raises (its rows kept for the next try)."""
        if not self._in_flight:
            return
        with self._settle_lock:
            while self._in_flight:
                future, loads = self._in_flight[0]
                try:
                    future.result()
                except BaseException as first:
                    try:
                        self._load_all(loads)
                    except BaseException as error:
                        tables = sorted({load.table for load in loads})
                        rows = sum(len(load.keys) for load in loads)
                        raise RuntimeError(
                            f"cache: writing {rows} evicted rows of tables {tables} back to "
                            f"the inner server failed twice ({first}; {error}); they are kept "
                            "and the next call tries again"
                        ) from error
                self._in_flight.pop(0)

    def _load_all(self, loads: list[_Load]) -> None:
        for load in loads:
            if load.merge:
                dim = load.columns[0].shape[1]
                part = ExchangePart(load.table, [], np.empty((0, dim), F32), [], _rows_of(load),
                                    merge=True)  # fmt: skip
                self._timed(self._inner.exchange_many, [part])
            else:
                self._timed(self._inner.load, load.table, load.keys, *load.columns, **load.named)

    def __repr__(self) -> str:
        shared = "" if self.sync_steps is None else f", sync_steps={self.sync_steps}"
        return (
            f"CachedServer({self.inner!r}, rows={self._rows!r}, xp={self.kernels.name!r}{shared})"
        )

    # -- lifecycle -----------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return self.inner.num_shards

    @property
    def num_servers(self) -> int:
        return self.inner.num_servers

    @property
    def array_module_name(self) -> str:
        """``"numpy"`` or ``"cupy"``."""
        return self.kernels.name

    def worker_thread_ids(self) -> list[int]:
        return self.inner.worker_thread_ids()

    def set_background(self, background: str) -> None:
        super().set_background(background)
        self.inner.set_background(background)

    def close(self) -> None:
        """Writes the updated rows back, then closes the inner server."""
        try:
            with self._lock:
                self._settle()
                for name in list(self._tables):
                    self._flush_table(name)
                self._tables.clear()
        finally:
            super().close()
            self._inner.close()

    def add_restart_listener(self, listener: Callable[[str, int | None], None]) -> None:
        """``listener(address, step)`` when a remote server came back (its
        rows are a checkpoint's): every cached row is marked updated, so the
        next write-back puts the cache's newer rows back on it."""
        listen = getattr(self.inner, "add_restart_listener", None)
        if listen is None:
            return

        def restarted(address: str, step: int | None) -> None:
            with self._lock:
                for name, cache in self._tables.items():
                    if cache is not None and cache.base is None:  # shared: changes merge anyway
                        _, slots = self.index.cached(name)
                        cache.rows.dirty[self.kernels.to_device(slots)] = True
            listener(address, step)

        listen(restarted)

    # -- the tables' caches ----------------------------------------------------

    def _rows_for(self, name: str) -> int:
        if isinstance(self._rows, Mapping):
            return int(self._rows.get(name, 0))
        return int(self._rows)

    def _cache(self, name: str, spec: TableSpec) -> _Table | None:
        """The cache of a table (made on first use), or None when the table
        is not cached; a table recreated with another spec starts afresh."""
        cache = self._tables.get(name, False)
        if cache is not False and (cache is None or cache.spec is spec or cache.spec == spec):
            return cache  # type: ignore[return-value]
        rows = self._rows_for(name)
        made: _Table | None = None
        if (
            rows > 0
            and not spec.serving
            and spec.precision == "fp32"
            and spec.grow is None
            and not self._grows_from(name)
        ):
            self._forget_table(name)
            region = self.index.add(name, rows)
            math = OptimizerMath(spec.optimizer, spec.dim)
            made = _Table(
                spec=spec,
                math=math,
                region=region,
                rows=SlotRows.zeros(self.xp, region.slots, spec.dim, math.state_dim),
            )
            if self.sync_steps is not None:
                made.base = SlotRows.zeros(self.xp, region.slots, spec.dim, math.state_dim)
        self._tables[name] = made
        return made

    def _grows_from(self, name: str) -> bool:
        """Whether a sized table's extension block grows from this table:
        neither is cached (a block grows on the server's statistics of its
        base rows, which must be the server's own)."""
        if name not in self._grow_bases:
            for table in self.inner.tables():
                grow = self.inner.spec(table).grow
                if grow is not None:
                    self._grow_bases.add(grow.base)
        return name in self._grow_bases

    def _forget_table(self, name: str) -> None:
        """Empties a table's region of the index."""
        self.index.clear(name)
        self._generation += 1
        self._used = {k: v for k, v in self._used.items() if k[0] != name}

    def _flush_table(self, name: str) -> int:
        """Writes the table's updated cached rows back (one ``load``)."""
        cache = self._tables.get(name)
        if cache is None:
            return 0
        slots = np.nonzero(self.kernels.to_host(cache.rows.dirty))[0]
        return self._write_back(name, cache, slots)

    def _write_back(
        self,
        name: str,
        cache: _Table,
        slots: np.ndarray,
        keys: np.ndarray | None = None,
        loads: list[_Load] | None = None,
    ) -> int:
        """Loads the rows of ``slots`` (those updated; ``keys``: whose rows
        they hold, if no longer the index's) into the inner server with
        every column but the version: the server stamps its current version
        (so they enter its change log). With ``loads``, the rows are copied
        out and the load is appended there, for later."""
        k = self.kernels
        slots = np.asarray(slots, np.int64)
        if not len(slots):
            return 0
        d_slots = k.to_device(slots)
        dirty = k.to_host(cache.rows.dirty[d_slots])
        slots, d_slots = slots[dirty], d_slots[k.to_device(dirty)]
        if not len(slots):
            return 0
        if keys is None:
            keys = k.to_host(self.index.keys[d_slots + cache.region.entry_base])
        else:
            keys = np.asarray(keys)[dirty]
        rows = cache.rows
        if cache.base is None:
            columns = {c: k.to_host(k.gather(getattr(rows, c), d_slots)) for c in SlotRows.COLUMNS}
        else:
            columns = self._changes(cache, d_slots)
            cache.counters["synced"] += len(slots)
        load = _Load(
            name,
            keys,
            (columns["weights"], columns["state"] if cache.math.state_dim else None),
            {c: columns[c] for c in ("counts", "steps", "times", "shows", "clicks")},
            merge=cache.base is not None,
        )
        if loads is None:
            self._settle()  # older rows of these keys land first
            self._load_all([load])
        else:
            loads.append(load)
        rows.dirty[d_slots] = False
        cache.counters["written_back"] += len(slots)
        return len(slots)

    def _changes(self, cache: _Table, d_slots: Any) -> dict[str, np.ndarray]:
        """Shared rows: what this cache changed in the rows of ``d_slots``
        since they were fetched (or last sent), as host columns to merge
        (``ExchangePart(merge=True)``); the rows become their own base (the
        change is on its way). Weights and state: the difference; counts:
        the updates since; shows and clicks: the row's less its base's
        decayed to the row's step; step and time: the row's."""
        k, xp = self.kernels, self.xp
        rows, base = cache.rows, cache.base
        assert base is not None
        now = {c: k.gather(getattr(rows, c), d_slots) for c in SlotRows.COLUMNS}
        was = {c: k.gather(getattr(base, c), d_slots) for c in SlotRows.COLUMNS}
        half_life = cache.spec.stats_half_life
        later = now["steps"] > was["steps"]
        if half_life > 0:
            gap = xp.where(later, now["steps"] - was["steps"], 0).astype(np.float64)
            decay = xp.exp2(-gap / half_life)
        else:
            decay = xp.ones(len(later), np.float64)
        changes = {
            "weights": now["weights"] - was["weights"],
            "state": now["state"] - was["state"],
            "counts": xp.where(now["counts"] >= was["counts"], now["counts"] - was["counts"], 0),
            "steps": now["steps"],
            "times": now["times"],
            "shows": (now["shows"] - was["shows"] * decay).astype(F32),
            "clicks": (now["clicks"] - was["clicks"] * decay).astype(F32),
        }
        for c in SlotRows.COLUMNS:
            getattr(base, c)[d_slots] = now[c]
        return {c: np.ascontiguousarray(k.to_host(v)).astype(getattr(rows, c).dtype, copy=False)
                for c, v in changes.items()}  # fmt: skip

    def _send_cached(self, name: str, cache: _Table, keys: np.ndarray) -> None:
        """Writes back (shared rows: merges the changes of) the updated
        cached rows among ``keys``."""
        cached, slots = self._slots_of(cache, keys)
        self._write_back(name, cache, np.unique(self.kernels.to_host(slots)[cached]))

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A call on the inner server from the data half, its time counted
        in ``inner_seconds`` (what the misses cost)."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            with self._timed_lock:  # the writer thread counts too
                self.inner_seconds += took

    def flush(self, table: str | None = None) -> int:
        """Writes the updated cached rows of one table (or all) back to the
        inner server now; returns how many. The calls that need it do it."""
        with self._lock:
            names = list(self._tables) if table is None else [table]
            return sum(self._flush_table(name) for name in names)

    def _flush(self, table: str | None) -> None:
        names = list(self._tables) if table is None else [table]
        for name in names:
            self._flush_table(name)

    def _drop(self, name: str) -> None:
        """Forgets a table's cache (its rows changed or went elsewhere)."""
        if self._tables.pop(name, None) is not None:
            self._forget_table(name)

    def _forget_keys(self, name: str, keys: np.ndarray) -> None:
        cache = self._tables.get(name)
        if cache is None or not len(keys):
            return
        k = self.kernels
        keys = np.ascontiguousarray(keys).view(np.uint64)
        entries = self.index.forget(k.to_device(keys), self._region_ids(cache, len(keys)))
        held = entries[entries >= 0] - cache.region.entry_base
        if len(held):
            cache.rows.dirty[held] = False
            cache.rows.admitted_at[held] = 0
        self._generation += 1

    def _region_ids(self, cache: _Table, n: int) -> Any:
        return self.xp.full(n, cache.region.id, np.int32)

    def _slots_of(self, cache: _Table, keys: np.ndarray) -> tuple[np.ndarray, Any]:
        """(cached bool on the host, table-local slots on the device, -1
        where not cached) of keys; changes nothing."""
        k = self.kernels
        entries = self.index.lookup(k.to_device(keys), self._region_ids(cache, len(keys)))
        slots = self.xp.where(entries >= 0, entries - cache.region.entry_base, -1)
        return k.to_host(entries) >= 0, slots

    def cache_stats(self, table: str | None = None) -> dict[str, Any]:
        """The cache's counters (``COUNTERS``) and rows of one table or of
        every cached table by name."""
        with self._lock:
            if table is not None:
                return self._table_cache_stats(table, self._tables.get(table))
            return {
                name: self._table_cache_stats(name, cache)
                for name, cache in self._tables.items()
                if cache is not None
            }

    def _table_cache_stats(self, name: str, cache: _Table | None) -> dict[str, Any]:
        if cache is None:
            return {}
        return {
            **cache.counters,
            "rows": self.index.size(name),
            "slots": cache.region.slots,
            "dirty": int(cache.rows.dirty.sum()),
        }

    # -- data half: pulls -------------------------------------------------------

    def pull_many(
        self, parts: Sequence[PullPart], *, train: bool = True, step: int | None = None
    ) -> None:
        step = check_step(step)
        with self._lock:
            local: list[tuple[_Table, PullPart, np.ndarray]] = []
            forward: list[PullPart] = []
            for part, spec, keys in [self._pull_args(part) for part in parts]:
                cache = self._cache(part.table, spec)
                if cache is None:
                    forward.append(part)
                else:
                    local.append((cache, part, keys))
            if not local:
                if forward:
                    self.inner.pull_many(forward, train=train, step=step)
                return
            if train:
                self._training_pull(local, forward, step)
            else:
                self._reading_pull(local, forward)

    def _pull_args(self, part: PullPart) -> tuple[PullPart, TableSpec, np.ndarray]:
        """Checks a part as the engine does, before anything changes."""
        spec = self.inner.spec(part.table)
        keys = as_keys(part.keys)
        if part.out is None:
            raise ValueError(f"pull_many: the part for table {part.table!r} has no out")
        self._check_rows_array(part.out, (len(keys), spec.dim), "out")
        self._check_offsets(keys, part.shard_offsets)
        counts = as_column(part.counts, np.float32, (len(keys),), "counts")
        checked = PullPart(part.table, keys, part.out, part.shard_offsets, counts)
        return checked, spec, keys.view(np.uint64)

    def _check_rows_array(self, array: Any, shape: tuple[int, ...], what: str) -> None:
        """A float32 array of ``shape`` the cache may write: on the host, or
        in the cache's device memory."""
        if not (isinstance(array, np.ndarray) or self.kernels.on_device(array)):
            raise TypeError(
                f"{what} must be a numpy float32 array (or a {self.kernels.name} array), "
                f"got {type(array).__name__}"
            )
        if array.dtype != np.float32:
            raise TypeError(f"{what} must be float32, got dtype {array.dtype}")
        if tuple(array.shape) != shape:
            raise ValueError(f"{what} has shape {tuple(array.shape)}, expected {shape}")
        if not array.flags.c_contiguous or (
            isinstance(array, np.ndarray) and not array.flags.writeable
        ):
            raise ValueError(f"{what} must be a writeable C-contiguous array")

    def _check_offsets(self, keys: np.ndarray, offsets: np.ndarray | None) -> None:
        """Keys grouped by (server, shard) cell as ``shard_offsets`` say, or
        ValueError (the cache regroups its misses, so it checks them here)."""
        if offsets is None:
            return
        servers, shards = self.num_servers, self.num_shards
        cells = servers * shards
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if offsets.shape != (cells + 1,):
            raise ValueError(
                f"shard_offsets must have num_servers * num_shards + 1 = {cells + 1} entries, "
                f"got shape {offsets.shape}"
            )
        if offsets[0] != 0 or offsets[-1] != len(keys) or (np.diff(offsets) < 0).any():
            raise ValueError(
                f"shard_offsets must rise from 0 to the number of keys ({len(keys)}), "
                f"got {offsets.tolist()}"
            )
        cell = server_of(keys, servers).astype(np.int64) * shards + shard_of(keys, shards)
        expected = np.repeat(np.arange(cells), np.diff(offsets))
        wrong = np.nonzero(cell != expected)[0]
        if len(wrong):
            i = int(wrong[0])
            raise ValueError(
                f"key {int(keys.view(np.uint64)[i])} at position {i} belongs to cell "
                f"{int(cell[i])}, not {int(expected[i])}: keys are not grouped as "
                "shard_offsets say"
            )

    def _reading_pull(
        self, local: list[tuple[_Table, PullPart, np.ndarray]], forward: list[PullPart]
    ) -> None:
        """A pull without training: cached keys from the device, the rest
        from the inner server; nothing comes in. Shared rows: the cached
        copies may lack the other trainers' newest changes, so this cache's
        changes among the keys are merged and every key is read there."""
        if self.sync_steps is not None:
            for cache, part, keys in local:
                self._send_cached(part.table, cache, keys)
                forward.append(part)
            self._timed(self.inner.pull_many, forward, train=False)
            return
        answers = []
        for cache, part, keys in local:
            cached, slots = self._slots_of(cache, keys)
            rest = np.nonzero(~cached)[0]
            rows = np.empty((len(rest), cache.spec.dim), F32)
            if len(rest):
                forward.append(PullPart(part.table, keys[rest], rows))
            answers.append((cache, part, cached, slots, rest, rows))
            cache.counters["lookups"] += len(keys) - len(rest)
            cache.pulled_keys += len(keys) - len(rest)
        if forward:
            self._timed(self.inner.pull_many, forward, train=False)
        for cache, part, cached, slots, rest, rows in answers:
            self._answer(cache, part.out, cached, slots, rest, rows)

    def _answer(
        self, cache: _Table, out: Any, cached: np.ndarray, slots: Any, rest: np.ndarray, rows: Any
    ) -> None:
        """A pull's ``out``: cached rows gathered on the device, ``rows`` (on
        the host) at the positions ``rest``."""
        k = self.kernels
        if not len(rest):
            if len(cached):
                k.gather_into(cache.rows.weights, slots, out)
            return
        at = np.nonzero(cached)[0]
        if len(at):
            k.put_rows(out, at, k.gather(cache.rows.weights, slots[k.to_device(at)]))
        k.put_rows(out, rest, rows)

    def _training_pull(
        self,
        local: list[tuple[_Table, PullPart, np.ndarray]],
        forward: list[PullPart],
        step: int | None,
    ) -> None:
        k, xp = self.kernels, self.xp
        self._settle()  # a miss may be an earlier pull's victim
        keys = np.concatenate([keys for _, _, keys in local]) if len(local) > 1 else local[0][2]
        bounds = np.cumsum([0] + [len(keys) for _, _, keys in local])
        region = np.repeat([c.region.id for c, _, _ in local], np.diff(bounds)).astype(np.int32)
        counts = None
        if any(part.counts is not None for _, part, _ in local):
            counts = np.concatenate(
                [np.ones(len(k_), F32) if p.counts is None else p.counts for _, p, k_ in local]
            )
        plan = self.index.observe(
            k.to_device(keys), k.to_device(region), None if counts is None else k.to_device(counts)
        )
        pulls = []
        try:
            for i, (cache, part, part_keys) in enumerate(local):
                pulls.append(self._part_of_plan(cache, part, part_keys, plan, bounds[i], counts))
            victims = self._copy_victims(plan)
            refresh = self._due_refresh(victims)
            self._exchange(pulls, forward, victims, step, pull=True, refresh=refresh)
        except BaseException:
            for p in pulls:  # the incoming keys did not come in
                self._forget_keys(p.part.table, p.keys[p.miss[p.incoming]])
            raise
        epoch = self.index.epoch
        self._admitted = [a for a in self._admitted if a[0] >= epoch - 1]
        for p in pulls:
            came = p.incoming.copy()
            came[p.failed] = False
            if came.any():
                self._admitted.append((epoch, p.part.table, p.keys[p.miss[came]]))
            slots = plan.entries[int(p.start) : int(p.start) + len(p.keys)]
            slots = xp.where(slots >= 0, slots - p.cache.region.entry_base, -1)
            if len(p.failed):
                slots[k.to_device(p.miss[p.failed])] = -1
            cached = np.ones(len(p.keys), bool)
            cached[p.miss] = p.miss_cached()
            rest = p.miss[~p.miss_cached()]
            self._answer(p.cache, p.part.out, cached, slots, rest, p.miss_rows[~p.miss_cached()])
            self._used[(p.part.table, step)] = _Used(
                p.keys, cached, slots, self.index.epoch, self._generation
            )
        floor = self.index.epoch - 1
        self._used = {  # the pulls whose slots are still locked
            key: u
            for key, u in self._used.items()
            if u.epoch >= floor and u.generation == self._generation
        }

    def _part_of_plan(
        self,
        cache: _Table,
        part: PullPart,
        keys: np.ndarray,
        plan: Any,
        start: int,
        counts: np.ndarray | None,
    ) -> _PartPull:
        """One table's share of a training pull's plan, and its counters."""
        lo, hi = np.searchsorted(plan.miss, [start, start + len(keys)])
        miss = plan.miss[lo:hi] - start
        how = plan.how[lo:hi]
        entries = plan.miss_entries[lo:hi]
        incoming = (how == INTO_EMPTY) | (how == OVER_VICTIM)
        offsets = None
        if part.shard_offsets is not None:
            offsets = np.searchsorted(miss, np.asarray(part.shard_offsets)).astype(np.int64)
        c = cache.counters
        hits = len(keys) - len(miss)
        c["hits"] += hits
        c["misses"] += len(miss)
        if counts is None:
            c["hit_occurrences"] += hits
            c["occurrences"] += len(keys)
        else:
            part_counts = counts[start : start + len(keys)]
            c["occurrences"] += int(part_counts.sum())
            c["hit_occurrences"] += int(part_counts.sum() - part_counts[miss].sum())
        cache.pulled_keys += hits
        return _PartPull(
            cache, part, keys, start, miss, how, entries - cache.region.entry_base, incoming,
            np.empty((len(miss), cache.spec.dim), F32), offsets,
        )  # fmt: skip

    def _copy_victims(self, plan: Any) -> list[_Load]:
        """The victims' updated rows, copied out before their slots take the
        incoming rows (a ``_Load`` per table)."""
        loads: list[_Load] = []
        if not len(plan.victims):
            return loads
        bases = np.array([r.entry_base for r in self.index.regions.values()])
        names = list(self.index.regions)
        region = np.searchsorted(bases, plan.victim_entries, side="right") - 1
        for r in np.unique(region):
            name = names[int(r)]
            cache = self._tables.get(name)
            if cache is None:
                continue
            at = region == r
            slots = plan.victim_entries[at] - cache.region.entry_base
            self._write_back(name, cache, slots, plan.victims[at], loads)
            cache.rows.admitted_at[self.kernels.to_device(slots)] = 0
            cache.counters["evicted"] += int(at.sum())
        return loads

    def _exchange(
        self,
        pulls: list[_PartPull],
        forward: list[PullPart],
        victims: list[_Load],
        step: int | None,
        pull: bool,
        refresh: list[_Refresh] | None = None,
    ) -> None:
        """One ``exchange_many`` with the inner server: the victims' rows go
        back (shared rows: their changes, merged), the misses (``pull``) and
        the uncached tables' keys are pulled, the incoming rows come in
        (``_swap_in``); shared rows due for a sync (``refresh``: their
        changes among ``victims``) are read back merged. If it fails, the
        rows given back stay as a write-back in flight (``_settle`` tries
        again)."""
        refresh = refresh or []
        back = _rows_by_table(victims)
        again = {r.table: r for r in refresh}
        merge = self.sync_steps is not None
        parts, tails = [], []
        for p in pulls:
            misses = p.miss if pull else p.miss[:0]
            incoming = p.keys[p.miss[p.incoming]]
            r = again.pop(p.part.table, None)
            tails.append(r)
            if r is not None:
                incoming = np.concatenate([incoming, r.keys])
            parts.append(ExchangePart(
                p.part.table, p.keys[misses], p.miss_rows[: len(misses)], incoming,
                back.pop(p.part.table, None), p.miss_offsets if pull else None, merge,
            ))  # fmt: skip
        for part in forward:
            parts.append(ExchangePart(part.table, part.keys, part.out, [], None,
                                      part.shard_offsets))  # fmt: skip
        rest = list(again.values())
        for r in rest:  # shared rows of tables this pull does not read
            dim = r.cache.spec.dim
            parts.append(ExchangePart(r.table, [], np.empty((0, dim), F32), r.keys,
                                      back.pop(r.table, None), merge=merge))  # fmt: skip
        for table, rows in back.items():  # victims of tables this pull does not read
            dim = rows.weights.shape[1]
            parts.append(ExchangePart(table, [], np.empty((0, dim), F32), [], rows, merge=merge))
        if not any(len(x.keys) or len(x.incoming) or x.back is not None for x in parts):
            return
        try:
            answers = self._timed(self._inner.exchange_many, parts, step=step)
        except BaseException as error:
            if victims:
                failed: Future = Future()
                failed.set_exception(error)
                self._in_flight.append((failed, victims))
            raise
        for p, r, answer in zip(pulls, tails, answers, strict=False):
            if r is not None:
                answer, refreshed = _split_answer(answer, int(p.incoming.sum()))
                self._refreshed(r, refreshed)
            if p.incoming.any():
                self._swap_in(p, step, answer)
        at = len(pulls) + len(forward)
        for r, answer in zip(rest, answers[at : at + len(rest)], strict=True):
            self._refreshed(r, answer)

    def _due_refresh(self, victims: list[_Load]) -> list[_Refresh]:
        """Shared rows, every ``sync_steps`` training pulls: the changes of
        every updated cached row (appended to ``victims``, to merge), and
        the rows to read back merged."""
        if self.sync_steps is None:
            return []
        self._pulls += 1
        if self._pulls % self.sync_steps:
            return []
        due = []
        for name, cache in self._tables.items():
            if cache is None:
                continue
            slots = np.nonzero(self.kernels.to_host(cache.rows.dirty))[0]
            if not len(slots):
                continue
            keys = self.kernels.to_host(self.index.keys[self.kernels.to_device(slots)
                                                        + cache.region.entry_base])  # fmt: skip
            self._write_back(name, cache, slots, keys, victims)
            due.append(_Refresh(name, cache, slots, keys))
        return due

    def _refreshed(self, r: _Refresh, answer: Exchanged) -> None:
        """Shared rows read back merged: they replace the cache's (the
        changes they had since were sent), and become their base."""
        rows, found, _ = answer
        if not found.all():  # a merge makes a row: none is missing but by a bug
            raise RuntimeError(
                f"cache: table {r.table!r}: {int((~found).sum())} rows merged on the server "
                "were not found there when read back"
            )
        k = self.kernels
        d_slots = k.to_device(r.slots)
        columns = {c: getattr(rows, c) for c in SlotRows.COLUMNS}
        columns["state"] = rows.state.reshape(len(rows.keys), r.cache.math.state_dim)
        admitted_at = k.to_host(r.cache.rows.admitted_at[d_slots])
        dirty = k.to_host(r.cache.rows.dirty[d_slots])
        if dirty.any():  # updated after the sync was planned: not possible under the lock
            raise RuntimeError(f"cache: table {r.table!r}: rows changed during their sync")
        self._put_slots(r.cache, r.slots, columns, admitted_at, swapped=False)
        r.cache.counters["refreshed"] += len(r.slots)

    def _swap_in(self, p: _PartPull, step: int | None, answer: Exchanged) -> None:
        """Copies the incoming rows to their slots, whole as the exchange's
        pull left them. Keys left without a row (waiting for admission) do
        not come in (``p.failed``)."""
        cache, name = p.cache, p.part.table
        incoming = np.nonzero(p.incoming)[0]  # positions in miss
        keys = p.keys[p.miss[incoming]]
        slots = p.slots[incoming]
        rows, found, created = answer
        if not found.all():
            self._forget_keys(name, keys[~found])
            p.failed = incoming[~found]
        if cache.spec.admission.min_count > 1:  # rows this pull admitted
            new = created[found]
        else:
            new = np.zeros(len(rows.keys), bool)
        admitted_at = np.where(new, np.uint64(self._step_of(step) + 1), np.uint64(0))
        columns = {c: getattr(rows, c) for c in SlotRows.COLUMNS}
        columns["state"] = rows.state.reshape(len(rows.keys), cache.math.state_dim)
        self._put_slots(cache, slots[found], columns, admitted_at)

    def _put_slots(
        self,
        cache: _Table,
        slots: np.ndarray,
        columns: dict[str, np.ndarray],
        admitted_at: np.ndarray,
        swapped: bool = True,
    ) -> None:
        """Whole rows (host columns) into slots, marked clean (``swapped``:
        rows that came in; else shared rows read back)."""
        if not len(slots):
            return
        slots = np.asarray(slots, np.int64)
        self.kernels.put_slots(cache.rows, slots, columns, admitted_at)
        if cache.base is not None:
            self.kernels.put_slots(cache.base, slots, columns, admitted_at)
        if swapped:
            cache.counters["swapped_in"] += len(slots)

    # -- data half: pushes ------------------------------------------------------

    def push_many(
        self,
        parts: Sequence[PushPart],
        *,
        unique: bool = False,
        only: str = "all",
        step: int | None = None,
    ) -> PushResult:
        if only not in ONLY:
            raise ValueError(f"only must be one of {', '.join(ONLY)}, got {only!r}")
        if only != "all" and not unique:
            raise ValueError(f"push_many(only={only!r}) needs unique=True")
        step = check_step(step)
        with self._lock:
            checked = [self._push_args(part) for part in parts]
            forward: list[PushPart] = []
            copy_back: list[tuple[Any, np.ndarray, np.ndarray]] = []
            local: list[tuple[_Table, PushPart, np.ndarray, Any]] = []
            locked = True  # every cached key found by its pull, its slot locked since
            for part, spec in checked:
                cache = self._cache(part.table, spec)
                keys = np.asarray(part.keys).view(np.uint64)
                chosen = _chosen(part, only)
                if cache is None or not len(keys):
                    cached = np.zeros(len(keys), bool)
                    slots = None
                else:
                    used = self._used_of(part.table, keys, step)
                    locked = locked and used is not None
                    cached, slots = self._used_slots(cache, part.table, keys, used)
                where = chosen[cached[chosen]]
                if len(where):
                    local.append((cache, part, where, slots))
                rest = chosen[~cached[chosen]]
                if len(rest):
                    host_part, back = self._host_part(part, rest, only == "rest")
                    forward.append(host_part)
                    if back is not None:
                        copy_back.append(back)
            result = PushResult(0, 0, 0, 0)
            if forward:  # a locked key is no write-back's victim: no need to wait for them
                inner = self._inner if locked else self.inner
                result = self._timed(inner.push_many, forward, unique=unique, step=step)
                for updated, rows, staged in copy_back:
                    self.kernels.put_rows(updated, rows, staged)
            for cache, part, where, slots in local:
                result += self._push_cached(cache, part, where, slots, unique, step, only)
            return result

    def _used_slots(
        self, cache: _Table, table: str, keys: np.ndarray, used: _Used | None
    ) -> tuple[np.ndarray, Any]:
        """(cached on the host, slots on the device) of a push's keys. The
        training pull of the same step found them while its slots are
        locked, so its cached keys are still where it found them; its other
        keys (and every key without such a pull) are looked up: a later
        pull may have brought them in, and the push then goes to the cache."""
        if used is None:
            return self._slots_of(cache, keys)
        rest = np.nonzero(~used.cached)[0]
        came = [a[2] for a in self._admitted if a[0] > used.epoch and a[1] == table]
        if not len(rest) or not came:  # no pull since brought anything in
            return used.cached, used.slots
        if self.kernels.name == "numpy":  # on the host: probe the few that came in
            index = KeyIndex(sum(len(c) for c in came))
            arrived = np.concatenate(came)
            index.insert(arrived, np.arange(len(arrived), dtype=np.int64))
            rest = rest[index.lookup(keys[rest]) >= 0]
            if not len(rest):
                return used.cached, used.slots
        now, slots = self._slots_of(cache, keys[rest])
        if not now.any():
            return used.cached, used.slots
        cached, merged = used.cached.copy(), used.slots.copy()
        cached[rest] = now
        merged[self.kernels.to_device(rest)] = slots
        return cached, merged

    def _used_of(self, table: str, keys: np.ndarray, step: int | None) -> _Used | None:
        """The training pull of ``keys`` for this step, if its slots are
        still locked (no pull but the next one since)."""
        used = self._used.get((table, step))
        if (
            used is None
            or used.generation != self._generation
            or used.epoch < self.index.epoch - 1
            or not (used.keys is keys or np.array_equal(used.keys, keys))
        ):
            return None
        return used

    def _push_args(self, part: PushPart) -> tuple[PushPart, TableSpec]:
        """Checks a part as the engine does, before anything changes."""
        table = part.table
        spec = self._inner.spec(table)
        keys = as_keys(part.keys)
        self._check_rows_array(part.grads, (len(keys), spec.dim), f"grads for table {table!r}")
        updated, updated_rows = part.updated, part.updated_rows
        if updated_rows is not None:
            updated_rows = np.asarray(updated_rows)
            if updated_rows.dtype != np.int32 or updated_rows.shape != (len(keys),):
                raise ValueError(
                    f"updated_rows must be int32 [{len(keys)}], got "
                    f"{updated_rows.dtype} {list(updated_rows.shape)}"
                )
            if updated is None:
                raise ValueError("updated_rows needs updated")
            updated_rows = np.ascontiguousarray(updated_rows)
        if updated is not None:
            rows = len(keys) if updated_rows is None else getattr(updated, "shape", (0,))[0]
            self._check_rows_array(updated, (rows, spec.dim), "updated")
        self._check_offsets(keys, part.shard_offsets)
        shows = as_column(part.shows, np.float32, (len(keys),), f"shows for table {table!r}")
        clicks = as_column(part.clicks, np.float32, (len(keys),), f"clicks for table {table!r}")
        if spec.nan_policy == "raise" and len(keys):
            bad = ~self.kernels.finite_rows(part.grads)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"table {table!r}: gradient row {i} (key {int(keys.view(np.uint64)[i])}) "
                    "is not finite"
                )
        checked = replace(
            part,
            keys=keys,
            shard_offsets=None,
            updated=updated,
            updated_rows=updated_rows,
            shows=shows,
            clicks=clicks,
        )
        return checked, spec

    def _host_part(
        self, part: PushPart, where: np.ndarray, rest: bool
    ) -> tuple[PushPart, tuple[Any, np.ndarray, np.ndarray] | None]:
        """The keys of a part at positions ``where``, for the inner server:
        every per-key column on the host. Where the part's ``updated`` rows
        are on the device, they are staged on the host and copied back
        after the push (returned: (updated, its rows, the staged rows))."""
        k = self.kernels
        d_where = k.to_device(where) if k.on_device(part.grads) else where
        grads = np.ascontiguousarray(k.to_host(part.grads[d_where]))
        per_key = {
            name: np.ascontiguousarray(getattr(part, name)[where])
            for name in ("shows", "clicks")
            if getattr(part, name) is not None
        }
        host = PushPart(part.table, np.ascontiguousarray(part.keys[where]), grads, **per_key)
        if part.updated is None or rest:
            return host, None
        rows = where.astype(np.int32) if part.updated_rows is None else part.updated_rows[where]
        if isinstance(part.updated, np.ndarray):
            return replace(host, updated=part.updated, updated_rows=rows), None
        keep = rows >= 0
        staged = np.zeros((int(keep.sum()), part.grads.shape[1]), F32)
        staged_rows = np.full(len(rows), -1, np.int32)
        staged_rows[keep] = np.arange(int(keep.sum()), dtype=np.int32)
        host = replace(host, updated=staged, updated_rows=staged_rows)
        return host, (part.updated, rows[keep].astype(np.int64), staged)

    def _push_cached(
        self,
        cache: _Table,
        part: PushPart,
        where: np.ndarray,
        slots: Any,
        unique: bool,
        step: int | None,
        only: str,
    ) -> PushResult:
        """The cached keys of a part (positions ``where``) updated on the
        device, as the engine would: duplicates summed in order, rows that
        a later step's pull admitted left alone, non-finite sums dropped,
        show and click increments added after their rows' decay."""
        k, xp = self.kernels, self.xp
        dim = cache.spec.dim
        d_where = k.to_device(where)
        key_slots = slots[d_where]
        grads = k.as_device(part.grads)
        shows, clicks = part.shows, part.clicks
        if unique:
            targets, sums = key_slots, grads[d_where]
            shows = None if shows is None else shows[where]
            clicks = None if clicks is None else clicks[where]
            duplicates = 0
        else:  # the engine's order: the first occurrence, then the others by position
            keys = np.asarray(part.keys).view(np.uint64)[where]
            _, first, group = np.unique(keys, return_index=True, return_inverse=True)
            group = group.reshape(-1)
            targets = key_slots[k.to_device(first)]
            sums = xp.zeros((len(first), dim), F32)
            k.scatter_add_rows(sums, k.to_device(group), grads[d_where])
            shows = None if shows is None else _ordered_sums(group, shows[where], len(first))
            clicks = None if clicks is None else _ordered_sums(group, clicks[where], len(first))
            duplicates = len(where) - len(first)
        later = np.zeros(len(targets), bool)
        if step is not None and cache.spec.admission.min_count > 1:
            mark = k.to_host(cache.rows.admitted_at[targets])
            later = (mark > 0) & (mark - np.uint64(1) > np.uint64(step))
        go = np.nonzero(~later)[0]
        d_go = k.to_device(go)
        stamp = self._step_of(step)
        applied = k.apply(
            cache.spec, cache.math, self.float_model, cache.rows, targets[d_go], sums[d_go],
            None if shows is None else k.to_device(shows[go]),
            None if clicks is None else k.to_device(clicks[go]),
            stamp, self._clock or int(time.time()),
        )  # fmt: skip
        if part.updated is not None and only != "rest":
            self._report(cache, part, where, key_slots)
        n_applied = int(applied.sum())  # the one copy to the host a push makes
        dropped_nan = len(go) - n_applied
        dropped_pending = int(later.sum())
        cache.counters["updated"] += n_applied
        cache.pushed_keys += len(where)
        cache.dropped_nan += dropped_nan
        cache.dropped_pending += dropped_pending
        return PushResult(n_applied, dropped_nan, dropped_pending, duplicates)

    def _report(self, cache: _Table, part: PushPart, where: np.ndarray, slots: Any) -> None:
        """``updated``: each cached key's weights after the push."""
        k = self.kernels
        if part.updated_rows is None:
            targets, chosen = where, slots
        else:
            rows = part.updated_rows[where]
            keep = np.nonzero(rows >= 0)[0]
            targets, chosen = rows[keep].astype(np.int64), slots[k.to_device(keep)]
        if len(targets):
            k.put_rows(part.updated, targets, k.gather(cache.rows.weights, chosen))

    def _step_of(self, step: int | None) -> int:
        """The step a call stamps: its own, or the inner server's."""
        return step if step is not None else int(getattr(self.inner, "step", 0))

    def lookup(self, table: str, keys: KeyArray, *, missing: str = "zeros") -> LookupResult:
        if missing not in MISSING:
            raise ValueError(f"missing must be 'zeros' or 'initial', got {missing!r}")
        with self._lock:
            spec = self.inner.spec(table)
            keys = as_keys(keys)
            cache = self._cache(table, spec)
            if cache is None:
                return self.inner.lookup(table, keys, missing=missing)
            if self.sync_steps is not None:  # shared rows: the server's merged ones
                self._send_cached(table, cache, keys.view(np.uint64))
                return self.inner.lookup(table, keys, missing=missing)
            hit, slots = self._slots_of(cache, keys.view(np.uint64))
            rest = self.inner.lookup(table, keys[~hit], missing=missing)
            rows = np.empty((len(keys), spec.dim), F32)
            found = np.ones(len(keys), bool)
            rows[~hit], found[~hit] = rest.rows, rest.found
            if hit.any():
                k = self.kernels
                at = np.nonzero(hit)[0]
                rows[at] = k.to_host(k.gather(cache.rows.weights, slots[k.to_device(at)]))
                cache.counters["lookups"] += len(at)
            return LookupResult(rows, found, rest.version)

    def seed(self, table: str, keys: KeyArray, scores: np.ndarray | None = None) -> int:
        """Caches rows ahead of training: ``keys`` best first (e.g. what a
        server's ``top_keys`` returns), ``scores`` their decayed counts.
        Keys without a row are skipped; returns the rows cached."""
        with self._lock:
            spec = self.inner.spec(table)
            cache = self._cache(table, spec)
            if cache is None:
                return 0
            keys = as_keys(keys).view(np.uint64)
            if scores is None:
                scores = np.arange(len(keys), 0, -1, dtype=np.float64)
            _, first = np.unique(keys, return_index=True)
            first.sort()  # the first of repeated keys, in the order given
            keys, scores = keys[first], np.asarray(scores, np.float64)[first]
            k = self.kernels
            plan = self.index.observe(
                k.to_device(keys), self._region_ids(cache, len(keys)),
                k.to_device(scores.astype(F32)),
            )  # fmt: skip
            p = self._part_of_plan(cache, PullPart(table, keys), keys, plan, 0, None)
            before = cache.counters["swapped_in"]
            try:
                self._exchange([p], [], self._copy_victims(plan), None, pull=False)
            except BaseException:
                self._forget_keys(table, keys[p.miss[p.incoming]])
                raise
            self._generation += 1  # seeding is not a training step
            return cache.counters["swapped_in"] - before

    def exchange_many(
        self, parts: Sequence[ExchangePart], *, step: int | None = None
    ) -> list[Exchanged]:
        """The inner server's, after the updated cached rows among the
        parts' keys were written back; those keys leave the cache (their
        rows there are the exchange's now)."""
        with self._lock:
            for part in parts:
                cache = self._tables.get(part.table)
                if cache is None:
                    continue
                given = [] if part.back is None else [as_keys(part.back.keys)]
                keys = np.unique(
                    np.concatenate([as_keys(part.keys), as_keys(part.incoming), *given])
                ).view(np.uint64)
                self._send_cached(part.table, cache, keys)
                self._forget_keys(part.table, keys)
            return self.inner.exchange_many(parts, step=step)

    # -- admin half ----------------------------------------------------------------

    def read_rows(self, table: str, keys: KeyArray) -> tuple[RowChunk, np.ndarray]:
        """The inner server's rows, after the updated cached rows among
        ``keys`` were written back."""
        with self._lock:
            cache = self._tables.get(table)
            if cache is not None:
                self._send_cached(table, cache, as_keys(keys).view(np.uint64))
            return self.inner.read_rows(table, keys)

    def create_table(self, spec: TableSpec) -> None:
        with self._lock:
            self.inner.create_table(spec)
            spec = self.inner.spec(spec["name"] if isinstance(spec, Mapping) else spec.name)
            if spec.grow is not None:  # its base is no longer cached: its rows go back first
                self._flush_table(spec.grow.base)
                self._drop(spec.grow.base)
                self._grow_bases.add(spec.grow.base)
            self._drop(spec.name)

    def drop_table(self, name: str) -> None:
        with self._lock:
            self.inner.drop_table(name)
            self._drop(name)

    @property
    def prefetches(self) -> bool:
        return self._inner.prefetches

    def prefetch_many(self, parts: Sequence[PullPart]) -> int:
        """The inner server's: its cold rows into its memory, for the misses."""
        return self.inner.prefetch_many(parts)

    def tables(self) -> list[str]:
        return self.inner.tables()

    def spec(self, name: str) -> TableSpec:
        return self.inner.spec(name)

    def stats(self, table: str | None = None) -> dict[str, Any]:
        """The inner server's stats after a write-back, with the keys the
        cache answered counted in (``pulled_keys``, ``pushed_keys``,
        ``dropped_nan``, ``dropped_pending``: what the server alone counts)
        and the cache's own counters as ``cache_*``."""
        with self._lock:
            self._flush(table)
            stats = self.inner.stats(table)
            if table is not None:
                return self._with_cache(table, stats, self._tables.get(table))
            return {
                name: self._with_cache(name, s, self._tables.get(name)) for name, s in stats.items()
            }

    def _with_cache(self, name: str, stats: dict[str, Any], cache: _Table | None) -> dict[str, Any]:
        if cache is None:
            return stats
        stats = dict(stats)
        for key in ("pulled_keys", "pushed_keys", "dropped_nan", "dropped_pending"):
            if key in stats:
                stats[key] += getattr(cache, key)
        for key, value in self._table_cache_stats(name, cache).items():
            stats[f"cache_{key}"] = value
        return stats

    def export(self, table: str, since: int = 0, chunk_rows: int = 65536) -> Iterator[RowChunk]:
        with self._lock:
            self._flush_table(table)
            return self.inner.export(table, since=since, chunk_rows=chunk_rows)

    def write_rows(
        self, folder: Path, spec: TableSpec, *, since: int = 0, state: bool
    ) -> tuple[list[tuple[str, FileEntry]], int]:
        with self._lock:
            self._flush_table(spec.name)
            return self.inner.write_rows(folder, spec, since=since, state=state)

    def load_rows(
        self,
        folder: Path,
        table: str,
        files: Sequence[str],
        *,
        step: int | None = None,
        since: int = 0,
        owned: tuple[int, int] | None = None,
    ) -> int:
        """The inner server's ``load_rows``; then the table's hottest rows by
        their decayed shows (``top_keys``) come into the cache, so that the
        first steps after a restore find them there."""
        with self._lock:
            self._flush_table(table)
            self._drop(table)
            loaded = self.inner.load_rows(folder, table, files, step=step, since=since, owned=owned)
            self._seed_hottest(table)
            return loaded

    def _seed_hottest(self, table: str) -> int:
        cache = self._cache(table, self.inner.spec(table))
        if cache is None:
            return 0
        keys, shows = self.inner.top_keys(table, cache.region.slots)
        shown = shows > 0
        return self.seed(table, keys[shown], shows[shown]) if shown.any() else 0

    def load(
        self,
        table: str,
        keys: KeyArray,
        weights: np.ndarray,
        *columns: np.ndarray | None,
        step: int | None = None,
        **named: np.ndarray | None,
    ) -> None:
        """The inner server's ``load`` (every column it takes); the keys
        leave the cache (their rows are the loaded ones now)."""
        with self._lock:
            self.inner.load(table, keys, weights, *columns, step=step, **named)
            self._forget_keys(table, as_keys(keys))

    def erase(self, table: str, keys: KeyArray) -> int:
        with self._lock:
            erased = self.inner.erase(table, keys)
            self._forget_keys(table, as_keys(keys))
            return erased

    def contains(self, table: str, keys: KeyArray) -> np.ndarray:
        return self.inner.contains(table, keys)  # every cached key has a row there

    def evict(self, table: str | None = None, *, step: int | None = None) -> dict[str, int]:
        """The inner server's eviction after a write-back (so it sees every
        count and step); evicted keys leave the cache."""
        with self._lock:
            self._flush(table)
            result = self.inner.evict(table, step=step)
            names = list(self._tables) if table is None else [table]
            for name in names:
                cache = self._tables.get(name)
                if cache is not None:
                    keys, _ = self.index.cached(name)
                    if len(keys):
                        self._forget_keys(name, keys[~self.inner.contains(name, keys)])
            return result

    def set_clock(self, seconds: int | None) -> None:
        """The inner server's clock, and the time this cache stamps on the
        cached rows its pushes update (``ParameterServer.set_clock``)."""
        seconds = check_clock(seconds)
        self._inner.set_clock(seconds)
        self._clock = seconds

    def clock(self) -> int | None:
        """The inner server's clock (TTLs count back from it)."""
        return self._inner.clock()

    def removed_log(self, table: str, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.removed_log(table, since)

    def load_removed(
        self, table: str, keys: KeyArray, versions: np.ndarray, floor: int = 0
    ) -> None:
        self.inner.load_removed(table, keys, versions, floor)

    def trim_removed(self, table: str, upto: int) -> None:
        self.inner.trim_removed(table, upto)

    def pending_counts(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.pending_counts(table)

    def load_pending(self, table: str, keys: KeyArray, counts: np.ndarray) -> None:
        self.inner.load_pending(table, keys, counts)

    def apply_update(self, updates: Mapping[str, TableUpdate], label: int = 0) -> None:
        with self._lock:
            for name in updates:
                self._flush_table(name)
                self._drop(name)
            self.inner.apply_update(updates, label)

    @property
    def version(self) -> int:
        return self.inner.version

    def advance_version(self) -> int:
        """Writes the updated rows back first: they belong to the version
        that ends (and enter its delta)."""
        with self._lock:
            self._flush(None)
            return self.inner.advance_version()

    def restore_version(self, version: int) -> None:
        with self._lock:
            self._flush(None)
            self.inner.restore_version(version)

    def job(self, **kwargs: Any) -> Any:
        return self.inner.job(**kwargs)


@dataclass
class _PartPull:
    """One cached table's part of a training pull, between its stages."""

    cache: _Table
    part: PullPart
    keys: np.ndarray  # uint64, the part's keys
    start: int  # where they begin in the pull's keys
    miss: np.ndarray  # int64: positions of the keys that were not cached
    how: np.ndarray  # uint8 per miss: what the index did (index.INTO_EMPTY, ...)
    slots: np.ndarray  # int64 per miss: the slot it took (negative: none)
    incoming: np.ndarray  # bool per miss: came in (its row is to be loaded)
    miss_rows: np.ndarray  # float32 [len(miss), dim]: pulled from the inner server
    miss_offsets: np.ndarray | None = None  # shard_offsets of the misses' keys
    failed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions in miss

    def miss_cached(self) -> np.ndarray:
        """bool per miss: cached after the pull (came in, or a repeat of one
        that did)."""
        cached = self.slots >= 0
        if len(self.failed):
            lost = self.keys[self.miss[self.failed]]
            cached &= ~np.isin(self.keys[self.miss], lost)
        return cached


@dataclass
class _Refresh:
    """Shared rows of one table whose changes a sync sends, to read back."""

    table: str
    cache: _Table
    slots: np.ndarray  # int64: table-local slots
    keys: np.ndarray  # uint64: their keys


def _rows_by_table(loads: list[_Load]) -> dict[str, RowChunk]:
    """The rows given back, one chunk per table (in the loads' order)."""
    by_table: dict[str, list[RowChunk]] = {}
    for load in loads:
        by_table.setdefault(load.table, []).append(_rows_of(load))
    return {table: chunks[0] if len(chunks) == 1 else _concat_rows(chunks)
            for table, chunks in by_table.items()}  # fmt: skip


def _concat_rows(chunks: list[RowChunk]) -> RowChunk:
    columns = {}
    for name in ("keys", "weights", "state", "counts", "steps", "times", "shows", "clicks"):
        columns[name] = np.concatenate([getattr(c, name) for c in chunks])
    return RowChunk(**columns, versions=None)


def _split_answer(answer: Exchanged, m: int) -> tuple[Exchanged, Exchanged]:
    """An exchange's answer for incoming keys split after the first ``m``."""
    rows, found, created = answer
    cut = int(found[:m].sum())
    return (
        Exchanged(take_rows(rows, slice(0, cut)), found[:m], created[:m]),
        Exchanged(take_rows(rows, slice(cut, None)), found[m:], created[m:]),
    )


def _rows_of(load: _Load) -> RowChunk:
    """A write-back's rows as rows given back to the inner server (the
    version left to it: its current one)."""
    weights, state = load.columns
    n = len(load.keys)
    return RowChunk(
        keys=load.keys, weights=weights,
        state=np.zeros((n, 0), F32) if state is None else state,
        versions=None, **load.named,
    )  # fmt: skip


def _check_rows(n: Any, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"{what} must be an int >= 0 (cache slots), got {n!r}")


def _chosen(part: PushPart, only: str) -> np.ndarray:
    """Positions of the keys a push of ``only`` applies (the engine's split:
    by ``updated_rows[i] >= 0``)."""
    n = len(part.keys)
    if only == "all":
        return np.arange(n)
    rows = part.updated_rows
    has_row = np.zeros(n, bool) if rows is None else np.asarray(rows) >= 0
    return np.nonzero(has_row if only == "updated" else ~has_row)[0]


def _ordered_sums(group: np.ndarray, values: np.ndarray, groups: int) -> np.ndarray:
    """float32 sums of ``values`` per group, added in order (as the engine)."""
    sums = np.zeros(groups, F32)
    np.add.at(sums, group, values.astype(F32))
    return sums
