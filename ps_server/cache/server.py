"""``CachedServer``: a GPU hot cache in front of any parameter server.

The hottest rows of each table live in device arrays indexed by slot
(weights, optimizer state, count, step, time; ``kernels``); which key has
which slot, and which keys come and go, is decided on the host
(``policy.HotSet``), where a batch's keys already are. The inner server
(embedded or remote) holds every row; a cached row's newest value is the
cache's until it is written back.

Per training pull (``pull_many(train=True)``), for all tables at once:
the hits are gathered on the device; the policy picks which misses come in
and which cached keys leave; the leaving rows that were updated are written
back to the inner server (one ``load`` per table); all misses come from the
inner server in one ``pull_many`` (which counts their sightings and creates
rows as admission allows, exactly as without the cache); the incoming rows
are copied to their slots in one transfer per table. Pushes update cached
rows on the device with the engine's own arithmetic (``kernels``) and
forward the rest to the inner server in one ``push_many``.

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
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wuliang.ps_server.cache.kernels import (
    F32,
    NumpyKernels,
    OptimizerMath,
    array_module,
    engine_float_model,
    kernels_for,
    libm_exp2,
)
from wuliang.ps_server.cache.policy import HotSet
from wuliang.ps_server.checks import as_column, as_float32, check_float32, check_step
from wuliang.ps_server.interface import (
    MISSING,
    ONLY,
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
    "hits",  # training-pull keys found in the cache (batch-unique keys)
    "misses",  # training-pull keys not found
    "hit_occurrences",  # key occurrences of the hits
    "occurrences",  # key occurrences of training pulls
    "swapped_in",  # rows copied into the cache
    "swapped_in_new",  # of those, rows the pull had just created (no read needed)
    "evicted",  # rows that left the cache for others
    "written_back",  # rows written back to the inner server
    "updated",  # row updates applied in the cache
    "lookups",  # keys read from the cache by lookups and pulls without training
)


@dataclass
class _Table:
    """One table's cache: the device arrays by slot and the host's state."""

    spec: TableSpec
    math: OptimizerMath
    hot: HotSet
    weights: Any  # [rows, dim] float32, on the device
    state: Any  # [rows, state_dim] float32
    counts: Any  # [rows] uint32: updates (and sightings before admission)
    steps: Any  # [rows] uint64: step of the last update
    times: Any  # [rows] uint32: unix seconds of the last update
    dirty: np.ndarray  # [rows] bool, host: updated since it came in
    adam_t: np.ndarray | None  # [rows] float32, host: Adam's t of each row
    admitted_at: np.ndarray  # [rows] uint64, host: step + 1 of an admission no push followed
    extra: dict[str, np.ndarray]  # host: any further RowChunk column by slot, as it came
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # what the inner server's counters miss: (the keys the cache answered)
    pulled_keys: int = 0
    pushed_keys: int = 0
    dropped_nan: int = 0
    dropped_pending: int = 0


@dataclass
class _Pull:
    """One cached table's part of a training or lookup pull, between steps."""

    table: _Table
    part: PullPart
    keys: np.ndarray  # uint64, the part's keys
    unique: np.ndarray  # its unique keys
    inverse: np.ndarray
    counts: np.ndarray
    slots: np.ndarray  # each unique key's slot (-1: uncached)
    hits: np.ndarray  # bool per unique key
    admitted: np.ndarray  # bool per unique key
    misses: np.ndarray  # indices into unique of the keys not cached (before this pull)
    miss_at: np.ndarray  # their positions in keys (repeats too): pulled from the inner server
    miss_rows: np.ndarray  # float32 [len(miss_at), dim]
    miss_first: np.ndarray  # each miss's first row in miss_rows
    miss_offsets: np.ndarray | None = None  # shard_offsets of miss_at's keys
    new: np.ndarray | None = None  # bool per miss: no row before this pull


class CachedServer(ParameterServer):
    """A ``ParameterServer`` over another one, with the hottest rows of each
    table on the device (see the module docstring and docs/gpu_cache.md).

    Args:
        inner: the server that holds every row (embedded or remote); the
            cache owns it (``close`` closes it).
        rows: cache slots per table, or a mapping ``{table: slots}`` (tables
            not in it are not cached). Serving tables and compressed tables
            are never cached.
        xp: the array module: ``"auto"`` (cupy when a GPU is present, else
            numpy), ``"cupy"``, ``"numpy"``, or the module itself.
        policy: ``"stats"`` (decayed show counts, the default) or ``"lru"``
            (``policy.HotSet``).
        half_life: batches after which a sighting counts half (``"stats"``).
        history: uncached keys whose counts the ``"stats"`` policy keeps
            (default: as many as ``rows``, at least 65536).
    """

    def __init__(
        self,
        inner: ParameterServer,
        rows: int | Mapping[str, int],
        *,
        xp: Any = "auto",
        policy: str = "stats",
        half_life: float = 1000.0,
        history: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(inner, ParameterServer):
            raise TypeError(f"inner must be a ParameterServer, got {type(inner).__name__}")
        if isinstance(rows, Mapping):
            for name, n in rows.items():
                _check_rows(n, f"rows[{name!r}]")
        else:
            _check_rows(rows, "rows")
        HotSet(1, policy=policy, half_life=half_life, history=history)  # checks them
        self.inner = inner
        self._rows = rows
        self._policy = dict(policy=policy, half_life=half_life, history=history)
        self.xp = array_module(xp)
        self.kernels: NumpyKernels = kernels_for(self.xp)
        self.float_model, self.exact = engine_float_model()
        self._lock = threading.RLock()
        self._tables: dict[str, _Table | None] = {}  # None: not cached

    def __repr__(self) -> str:
        return f"CachedServer({self.inner!r}, rows={self._rows!r}, xp={self.kernels.name!r})"

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
                for name in list(self._tables):
                    self._flush_table(name)
                self._tables.clear()
        finally:
            super().close()
            self.inner.close()

    def add_restart_listener(self, listener: Callable[[str, int | None], None]) -> None:
        """``listener(address, step)`` when a remote server came back (its
        rows are a checkpoint's): every cached row is marked updated, so the
        next write-back puts the cache's newer rows back on it."""
        listen = getattr(self.inner, "add_restart_listener", None)
        if listen is None:
            return

        def restarted(address: str, step: int | None) -> None:
            with self._lock:
                for cache in self._tables.values():
                    if cache is not None:
                        _, slots = cache.hot.cached()
                        cache.dirty[slots] = True
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
        if cache is not False and (cache is None or cache.spec == spec):
            return cache  # type: ignore[return-value]
        rows = self._rows_for(name)
        made: _Table | None = None
        if rows > 0 and not spec.serving and spec.precision == "fp32":
            xp = self.xp
            math = OptimizerMath(spec.optimizer, spec.dim)
            made = _Table(
                spec=spec,
                math=math,
                hot=HotSet(rows, **self._policy),  # type: ignore[arg-type]
                weights=xp.zeros((rows, spec.dim), F32),
                state=xp.zeros((rows, math.state_dim), F32),
                counts=xp.zeros(rows, np.uint32),
                steps=xp.zeros(rows, np.uint64),
                times=xp.zeros(rows, np.uint32),
                dirty=np.zeros(rows, bool),
                adam_t=np.zeros(rows, F32) if math.kind == "adam" else None,
                admitted_at=np.zeros(rows, np.uint64),
                extra={name: np.zeros(rows, F32) for name in _EXTRA},
            )
        self._tables[name] = made
        return made

    def _flush_table(self, name: str) -> int:
        """Writes the table's updated cached rows back (one ``load``)."""
        cache = self._tables.get(name)
        if cache is None:
            return 0
        slots = np.nonzero(cache.dirty)[0]
        return self._write_back(name, cache, slots)

    def _write_back(
        self, name: str, cache: _Table, slots: np.ndarray, keys: np.ndarray | None = None
    ) -> int:
        """Loads the rows of ``slots`` (those updated; ``keys``: whose rows
        they hold, if no longer the index's) into the inner server with
        their weights, state, count, step and time; the server stamps its
        current version (so they enter its change log)."""
        dirty = cache.dirty[slots]
        slots = slots[dirty]
        if not len(slots):
            return 0
        k = self.kernels
        keys = cache.hot.keys_of(slots) if keys is None else keys[dirty]
        self.inner.load(
            name,
            keys,
            k.to_host(k.gather(cache.weights, slots)),
            k.to_host(k.gather(cache.state, slots)) if cache.math.state_dim else None,
            counts=k.to_host(k.gather(cache.counts, slots)),
            steps=k.to_host(k.gather(cache.steps, slots)),
            times=k.to_host(k.gather(cache.times, slots)),
            **{name: values[slots] for name, values in cache.extra.items()},
        )
        cache.dirty[slots] = False
        cache.counters["written_back"] += len(slots)
        return len(slots)

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
        self._tables.pop(name, None)

    def _forget_keys(self, name: str, keys: np.ndarray) -> None:
        cache = self._tables.get(name)
        if cache is None or not len(keys):
            return
        slots = cache.hot.forget(np.asarray(keys).view(np.uint64))
        cache.dirty[slots] = False
        cache.admitted_at[slots] = 0

    def cache_stats(self, table: str | None = None) -> dict[str, Any]:
        """The cache's counters (``COUNTERS``) and rows of one table or of
        every cached table by name."""
        with self._lock:
            if table is not None:
                return self._table_cache_stats(self._tables.get(table))
            return {
                name: self._table_cache_stats(cache)
                for name, cache in self._tables.items()
                if cache is not None
            }

    @staticmethod
    def _table_cache_stats(cache: _Table | None) -> dict[str, Any]:
        if cache is None:
            return {}
        return {
            **cache.counters,
            "rows": len(cache.hot),
            "slots": cache.hot.rows,
            "dirty": int(cache.dirty.sum()),
        }

    # -- data half: pulls -------------------------------------------------------

    def pull_many(
        self, parts: Sequence[PullPart], *, train: bool = True, step: int | None = None
    ) -> None:
        step = check_step(step)
        with self._lock:
            checked = [self._pull_args(part) for part in parts]
            pulls: list[_Pull] = []
            forward: list[PullPart] = []
            for part, spec, keys in checked:
                cache = self._cache(part.table, spec)
                if cache is None:
                    forward.append(part)
                else:
                    pulls.append(self._plan_pull(cache, part, keys, train))
            admitted = [p for p in pulls if p.admitted.any()]
            try:
                for p in admitted:  # which incoming keys have no row yet
                    p.new = ~self.inner.contains(p.part.table, p.unique[p.misses])
                misses = [
                    PullPart(p.part.table, p.keys[p.miss_at], p.miss_rows, p.miss_offsets)
                    for p in pulls
                ]
                inner_parts = [m for m in misses if len(m.keys)] + forward
                if inner_parts:
                    self.inner.pull_many(inner_parts, train=train, step=step)
                for p in admitted:
                    self._swap_in(p, step)
            except BaseException:
                for p in admitted:  # the incoming keys did not come in
                    slots = p.slots[p.admitted]
                    keep = p.table.hot.slots_of(p.unique[p.admitted]) == slots
                    self._forget_keys(p.part.table, p.unique[p.admitted][keep])
                raise
            for p in pulls:
                self._answer_pull(p)

    def _pull_args(self, part: PullPart) -> tuple[PullPart, TableSpec, np.ndarray]:
        """Checks a part as the engine does, before anything changes."""
        spec = self.inner.spec(part.table)
        keys = as_keys(part.keys)
        if part.out is None:
            raise ValueError(f"pull_many: the part for table {part.table!r} has no out")
        check_float32(part.out, (len(keys), spec.dim), "out")
        if not part.out.flags.c_contiguous or not part.out.flags.writeable:
            raise ValueError("out must be a writeable C-contiguous array")
        self._check_offsets(keys, part.shard_offsets)
        return PullPart(part.table, keys, part.out, part.shard_offsets), spec, keys.view(np.uint64)

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

    def _plan_pull(self, cache: _Table, part: PullPart, keys: np.ndarray, train: bool) -> _Pull:
        """The policy's decisions for one part; the leaving rows written back."""
        unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        if train:
            plan = cache.hot.observe(unique, counts)
            slots, admitted = plan.slots, plan.admitted
            if len(plan.victim_slots):
                self._write_back(part.table, cache, plan.victim_slots, plan.victim_keys)
                cache.admitted_at[plan.victim_slots] = 0
                cache.counters["evicted"] += len(plan.victim_slots)
            hits = plan.hits
            c = cache.counters
            c["hits"] += int(hits.sum())
            c["misses"] += int((~hits).sum())
            c["hit_occurrences"] += int(counts[hits].sum())
            c["occurrences"] += len(keys)
        else:
            slots = cache.hot.slots_of(unique)
            admitted = np.zeros(len(unique), bool)
            hits = slots >= 0
            cache.counters["lookups"] += int(hits.sum())
        misses = np.nonzero(~hits)[0]
        # The misses go to the inner server as the keys came, repeats and
        # order kept: it counts their sightings (and pulls) as without the cache.
        miss_at = np.nonzero(~hits[inverse])[0]
        row_of = np.full(len(unique), -1, np.int64)
        row_of[inverse[miss_at[::-1]]] = np.arange(len(miss_at) - 1, -1, -1)
        offsets = None
        if part.shard_offsets is not None:
            offsets = np.searchsorted(miss_at, np.asarray(part.shard_offsets)).astype(np.int64)
        cache.pulled_keys += len(keys) - len(miss_at)
        return _Pull(
            cache, part, keys, unique, inverse, counts, slots, hits, admitted, misses,
            miss_at, np.empty((len(miss_at), cache.spec.dim), F32), row_of[misses], offsets,
        )  # fmt: skip

    def _swap_in(self, p: _Pull, step: int | None) -> None:
        """Copies the incoming rows to their slots: rows the pull just
        created are known (initial vector and state); the others are read
        whole from the inner server. Keys left without a row (waiting for
        admission) do not come in."""
        cache, name = p.table, p.part.table
        incoming = np.nonzero(p.admitted[p.misses])[0]  # positions in misses
        keys = p.unique[p.misses][incoming]
        slots = p.slots[p.misses][incoming]
        dim, state_dim = cache.spec.dim, cache.math.state_dim
        n = len(keys)
        weights = p.miss_rows[p.miss_first[incoming]]
        state = np.empty((n, state_dim), F32)
        counts = np.zeros(n, np.uint32)
        steps = np.zeros(n, np.uint64)
        times = np.zeros(n, np.uint32)
        found = np.ones(n, bool)
        extra = {column: np.zeros(n, F32) for column in _EXTRA}
        new = p.new[incoming] if p.new is not None else np.zeros(n, bool)
        # min_count 1: a new row is the initial vector and state, count 0
        fresh = cache.spec.admission.min_count == 1 and step is not None
        known = new if fresh else np.zeros(n, bool)
        if known.any():  # rows created by this pull, as the engine creates them
            state[known] = cache.math.initial_state(int(known.sum()))
            steps[known] = np.uint64(step if step is not None else 0)
            times[known] = np.uint32(int(time.time()))
            cache.counters["swapped_in_new"] += int(known.sum())
        read = np.nonzero(~known)[0]
        if len(read):
            rows, got = self.inner.read_rows(name, keys[read])
            found[read] = got
            at = read[got]
            weights[at] = rows.weights
            state[at] = rows.state.reshape(len(at), state_dim)
            counts[at], steps[at], times[at] = rows.counts, rows.steps, rows.times
            for column, values in extra.items():
                values[at] = getattr(rows, column)
        if not found.all():
            self._forget_keys(name, keys[~found])
            p.slots[p.misses[incoming[~found]]] = -1
            p.admitted[p.misses[incoming[~found]]] = False
        keys, slots = keys[found], slots[found]
        k = self.kernels
        k.scatter(cache.weights, slots, k.to_device(weights[found].reshape(-1, dim)))
        if state_dim:
            k.scatter(cache.state, slots, k.to_device(state[found]))
        k.scatter(cache.counts, slots, k.to_device(counts[found]))
        k.scatter(cache.steps, slots, k.to_device(steps[found]))
        k.scatter(cache.times, slots, k.to_device(times[found]))
        cache.dirty[slots] = False
        for column, values in extra.items():
            cache.extra[column][slots] = values[found]
        if cache.adam_t is not None:
            cache.adam_t[slots] = state[found][:, 2 * dim]
        # A row this pull admitted (min_count > 1) carries the engine's
        # "admitted, not pushed since" mark: pushes of earlier steps leave it.
        marked = new[found] & (cache.spec.admission.min_count > 1)
        cache.admitted_at[slots] = np.where(marked, np.uint64(self._step_of(step) + 1), 0)
        cache.counters["swapped_in"] += len(slots)

    def _answer_pull(self, p: _Pull) -> None:
        """The part's ``out``: hits gathered on the device (one row per key
        occurrence, in key order), misses as pulled."""
        out = p.part.out
        assert out is not None
        k = self.kernels
        if not len(p.misses) and len(p.keys):  # every key cached
            k.gather_into(p.table.weights, p.slots[p.inverse], out)
            return
        out[p.miss_at] = p.miss_rows
        at = np.nonzero(p.hits[p.inverse])[0]
        if len(at):
            out[at] = k.to_host(k.gather(p.table.weights, p.slots[p.inverse[at]]))

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
            local: list[tuple[_Table, PushPart, np.ndarray, np.ndarray]] = []
            for part, spec in checked:
                part = _only(part, only)
                cache = self._cache(part.table, spec)
                keys = np.asarray(part.keys).view(np.uint64)
                slots = (
                    cache.hot.slots_of(keys) if cache is not None and len(keys) else
                    np.full(len(keys), -1, np.int64)
                )  # fmt: skip
                cached = slots >= 0
                if cache is not None and cached.any():
                    local.append((cache, part, np.nonzero(cached)[0], slots))
                rest = np.nonzero(~cached)[0]
                if len(rest) == len(keys):
                    forward.append(part)
                elif len(rest):
                    forward.append(_subset(part, rest))
            result = PushResult(0, 0, 0, 0)
            if forward:
                result = self.inner.push_many(forward, unique=unique, step=step)
            for cache, part, where, slots in local:
                result += self._push_cached(cache, part, where, slots, unique, step)
            return result

    def _push_args(self, part: PushPart) -> tuple[PushPart, TableSpec]:
        """Checks a part as the engine does, before anything changes."""
        table = part.table
        spec = self.inner.spec(table)
        keys = as_keys(part.keys)
        grads = as_float32(part.grads, (len(keys), spec.dim), f"grads for table {table!r}")
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
            check_float32(updated, (rows, spec.dim), "updated")
            if not updated.flags.c_contiguous or not updated.flags.writeable:
                raise ValueError("updated must be a writeable C-contiguous array")
        self._check_offsets(keys, part.shard_offsets)
        shows = as_column(part.shows, np.float32, (len(keys),), f"shows for table {table!r}")
        clicks = as_column(part.clicks, np.float32, (len(keys),), f"clicks for table {table!r}")
        if spec.nan_policy == "raise" and len(keys):
            bad = ~np.isfinite(grads).all(axis=1)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"table {table!r}: gradient row {i} (key {int(keys.view(np.uint64)[i])}) "
                    "is not finite"
                )
        checked = replace(
            part,
            keys=keys,
            grads=grads,
            shard_offsets=None,
            updated=updated,
            updated_rows=updated_rows,
            shows=shows,
            clicks=clicks,
        )
        return checked, spec

    def _push_cached(
        self,
        cache: _Table,
        part: PushPart,
        where: np.ndarray,
        slots: np.ndarray,
        unique: bool,
        step: int | None,
    ) -> PushResult:
        """The cached keys of a part (positions ``where``) updated on the
        device, as the engine would: duplicates summed in order, non-finite
        sums dropped, rows admitted by a later step's pull left alone, show
        and click increments added after their rows' decay."""
        dim = cache.spec.dim
        key_slots = slots[where]
        per_key = [np.asarray(part.grads)] + [
            np.zeros(len(part.keys), F32) if v is None else np.asarray(v)
            for v in (part.shows, part.clicks)
        ]
        feeds_stats = part.shows is not None or part.clicks is not None
        if unique:
            targets = key_slots
            sums, shows, clicks = (v[where] for v in per_key)
            duplicates = 0
        else:  # the engine's order: the first occurrence, then the others by position
            targets, first, group = np.unique(key_slots, return_index=True, return_inverse=True)
            group = group.reshape(-1)
            repeat = np.ones(len(where), bool)
            repeat[first] = False
            sums, shows, clicks = (v[where[first]].copy() for v in per_key)
            if repeat.any():
                for total, v in zip((sums, shows, clicks), per_key, strict=True):
                    np.add.at(total, group[repeat], v[where[repeat]])
            duplicates = len(where) - len(targets)
        finite = np.isfinite(sums).all(axis=1)
        later = np.zeros(len(targets), bool)
        if step is not None and cache.spec.admission.min_count > 1:
            mark = cache.admitted_at[targets]
            later = (mark > 0) & (mark - np.uint64(1) > np.uint64(step))
        apply = finite & ~later
        go = targets[apply]
        lr_t = None
        if cache.adam_t is not None:
            t = (cache.adam_t[go] + F32(1)).astype(F32)
            lr_t = cache.math.lr_t(t)
            cache.adam_t[go] = t
        k = self.kernels
        k.update(cache.math, self.float_model, cache.weights, cache.state, go,
                 np.ascontiguousarray(sums[apply]).reshape(-1, dim), lr_t)  # fmt: skip
        stamp = self._step_of(step)
        self._add_stats(cache, go, stamp, shows[apply], clicks[apply], feeds_stats)
        now = int(time.time())
        k.touch(cache.counts, cache.steps, cache.times, go, stamp, now)
        cache.dirty[go] = True
        cache.admitted_at[go] = 0
        if part.updated is not None:
            self._report(cache, part, where, key_slots)
        dropped_nan = int((~finite & ~later).sum())
        dropped_pending = int(later.sum())
        cache.counters["updated"] += len(go)
        cache.pushed_keys += len(where)
        cache.dropped_nan += dropped_nan
        cache.dropped_pending += dropped_pending
        return PushResult(len(go), dropped_nan, dropped_pending, duplicates)

    def _add_stats(
        self,
        cache: _Table,
        slots: np.ndarray,
        step: int,
        shows: np.ndarray,
        clicks: np.ndarray,
        feeds: bool,
    ) -> None:
        """The engine's ``DecayStats`` then ``+=`` for rows about to be
        stamped with ``step``: a row's shows and clicks decay from its last
        update's step (half-life ``stats_half_life``), in double, rounded
        to float32 once, then the push's increments are added in float32."""
        row_shows, row_clicks = cache.extra["shows"], cache.extra["clicks"]
        half_life = float(cache.spec.stats_half_life)
        if half_life > 0 and len(slots):
            held = (row_shows[slots] != 0) | (row_clicks[slots] != 0)
            if held.any():
                at = slots[held]
                k = self.kernels
                since = k.to_host(k.gather(cache.steps, at)).astype(np.uint64)
                later = since < np.uint64(step)
                at, since = at[later], since[later]
                gaps, which = np.unique(np.uint64(step) - since, return_inverse=True)
                factors = np.array([libm_exp2(-float(g) / half_life) for g in gaps], np.float64)
                f = factors[which.reshape(-1)]
                row_shows[at] = (row_shows[at].astype(np.float64) * f).astype(F32)
                row_clicks[at] = (row_clicks[at].astype(np.float64) * f).astype(F32)
        if feeds:
            row_shows[slots] += shows
            row_clicks[slots] += clicks

    def _report(self, cache: _Table, part: PushPart, where: np.ndarray, slots: np.ndarray) -> None:
        """``updated``: each cached key's weights after the push."""
        updated = part.updated
        assert updated is not None
        if part.updated_rows is None:
            targets = where
        else:
            rows = np.asarray(part.updated_rows)[where]
            keep = rows >= 0
            targets, slots = rows[keep], slots[keep]
        if len(targets):
            k = self.kernels
            updated[targets] = k.to_host(k.gather(cache.weights, slots))

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
            slots = cache.hot.slots_of(keys.view(np.uint64))
            hit = slots >= 0
            rest = self.inner.lookup(table, keys[~hit], missing=missing)
            rows = np.empty((len(keys), spec.dim), F32)
            found = np.ones(len(keys), bool)
            rows[~hit], found[~hit] = rest.rows, rest.found
            if hit.any():
                k = self.kernels
                rows[hit] = k.to_host(k.gather(cache.weights, slots[hit]))
                cache.counters["lookups"] += int(hit.sum())
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
            plan = cache.hot.seed(keys, scores)
            if len(plan.victim_slots):
                self._write_back(table, cache, plan.victim_slots, plan.victim_keys)
            misses = np.nonzero(~plan.hits)[0]
            p = _Pull(
                cache, PullPart(table, keys), keys, keys, np.arange(len(keys)),
                np.ones(len(keys)), plan.slots, plan.hits, plan.admitted, misses,
                misses, np.empty((len(misses), spec.dim), F32), np.arange(len(misses)),
            )  # fmt: skip
            before = cache.counters["swapped_in"]
            if p.admitted.any():
                try:
                    self.inner.pull_many([PullPart(table, keys[misses], p.miss_rows)], train=False)
                    self._swap_in(p, None)
                except BaseException:
                    self._forget_keys(table, keys[plan.admitted])
                    raise
            return cache.counters["swapped_in"] - before

    # -- admin half ----------------------------------------------------------------

    def read_rows(self, table: str, keys: KeyArray) -> tuple[RowChunk, np.ndarray]:
        """The inner server's rows, after the updated cached rows among
        ``keys`` were written back."""
        with self._lock:
            cache = self._tables.get(table)
            if cache is not None:
                slots = cache.hot.slots_of(as_keys(keys).view(np.uint64))
                self._write_back(table, cache, np.unique(slots[slots >= 0]))
            return self.inner.read_rows(table, keys)

    def create_table(self, spec: TableSpec) -> None:
        with self._lock:
            self.inner.create_table(spec)
            self._drop(spec.name)

    def drop_table(self, name: str) -> None:
        with self._lock:
            self.inner.drop_table(name)
            self._drop(name)

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
                return self._with_cache(stats, self._tables.get(table))
            return {name: self._with_cache(s, self._tables.get(name)) for name, s in stats.items()}

    def _with_cache(self, stats: dict[str, Any], cache: _Table | None) -> dict[str, Any]:
        if cache is None:
            return stats
        stats = dict(stats)
        for name in ("pulled_keys", "pushed_keys", "dropped_nan", "dropped_pending"):
            if name in stats:
                stats[name] += getattr(cache, name)
        for name, value in self._table_cache_stats(cache).items():
            stats[f"cache_{name}"] = value
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
        keys, shows = self.inner.top_keys(table, cache.hot.rows)
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
                if cache is not None and len(cache.hot):
                    keys, _ = cache.hot.cached()
                    self._forget_keys(name, keys[~self.inner.contains(name, keys)])
            return result

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


_COLUMNS = ("keys", "weights", "state", "counts", "steps", "times", "versions")
# Columns a RowChunk may carry beyond these (per-row statistics): the cache
# keeps them per slot as the rows came and writes them back unchanged.
_EXTRA = tuple(f.name for f in fields(RowChunk) if f.name not in _COLUMNS)


def _check_rows(n: Any, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"{what} must be an int >= 0 (cache slots), got {n!r}")


def _only(part: PushPart, only: str) -> PushPart:
    """The keys a push of ``only="updated"``/``"rest"`` applies, as a plain
    part (the engine's split: by ``updated_rows[i] >= 0``)."""
    if only == "all":
        return part
    rows = part.updated_rows
    has_row = np.zeros(len(part.keys), bool) if rows is None else np.asarray(rows) >= 0
    keep = np.nonzero(has_row if only == "updated" else ~has_row)[0]
    chosen = _subset(part, keep)
    if only == "rest":
        return replace(chosen, updated=None, updated_rows=None)
    return chosen


_ROUTING = ("table", "shard_offsets", "updated", "updated_rows")


def _subset(part: PushPart, where: np.ndarray) -> PushPart:
    """The part's keys at positions ``where`` with what goes with each key
    (gradient, and any other per-key column), and where their ``updated``
    rows go."""
    n = len(part.keys)
    per_key: dict[str, Any] = {}
    for f in fields(PushPart):
        value = getattr(part, f.name)
        if f.name in _ROUTING or value is None:
            continue
        value = np.asarray(value)
        if value.ndim and len(value) == n:
            per_key[f.name] = np.ascontiguousarray(value[where])
    updated_rows = None
    if part.updated is not None:
        if part.updated_rows is None:
            updated_rows = where.astype(np.int32)
        else:
            updated_rows = np.ascontiguousarray(np.asarray(part.updated_rows)[where])
    return replace(part, shard_offsets=None, updated_rows=updated_rows, **per_key)
