"""The embedded parameter-server engine, as Python sees it.

``Engine`` wraps the C++ engine (``_engine.Engine``): it names tables instead
of numbering them, checks every argument and turns mistakes into clear
exceptions, and releases the GIL inside every batch call, so many Python
threads can pull and push at once. Arrays are passed without copies when they
are already contiguous and of the right dtype.

Semantics in one place:

* ``pull(table, keys)``: rows as float32 ``[n, dim]``. In training mode
  (default) a pull counts one sighting of each key and creates the row of a
  new key once admission allows; ``train=False`` is a pure lookup. Keys without
  a row read as their initial vector.
* ``push(table, keys, grads)``: applies the table's optimizer. Duplicate keys
  in one push have their gradients summed and are updated once; non-finite
  gradient rows are dropped and counted (or raise, per table). Pushes to keys
  still waiting for admission are dropped and counted.
* Keys are uint64; int64 arrays are reinterpreted (-1 is 2**64 - 1).
* Rows are float32 whatever a table's ``precision``; a compressed table
  (``"fp16"``, ``"int8"``) serves only: training calls on it raise
  ``ValueError`` (see ``TableSpec``).
* Tables may be dropped and created while other threads call: a call on a
  table name resolves it once, to the table of that name at that moment, and
  either runs on that table or raises ``UnknownTableError`` (the table was
  dropped first); it never reaches a table created later under the same name.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from wuliang.ps_server import _engine
from wuliang.ps_server.checks import (
    as_column,
    as_float32,
    check_clock,
    check_float32,
    check_restored_version,
    check_step,
    check_version,
    load_columns,
    rows_contiguous,
)
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
    UnknownTableError,
    as_keys,
)
from wuliang.ps_server.spec import TableSpec

_ONLY = {name: i for i, name in enumerate(ONLY)}  # C++ Engine::Only


class Engine(ParameterServer):
    """Embedding tables held in this process by a sharded C++ engine: the
    ``"embedded"`` parameter server (``wuliang.ps_server.interface``).

    Args:
        num_shards: worker threads; each owns 1/num_shards of every table's
            keys. Use about the number of cores left over by the trainer.
        disk_dir: a directory on a local disk for the disk tier
            (docs/disk_tier.md): rows beyond ``memory_bytes`` live in row
            files there (scratch: made afresh, deleted on close), each
            keeping a 19-byte locator in RAM. None: every row in RAM.
        memory_bytes: with ``disk_dir``, the RAM for rows of all tables
            (serving tables excepted), split evenly among the shards;
            0: 1 GiB.
        row_file_bytes: with ``disk_dir``, the size a row file grows to
            before the next one starts (default 64 MiB; at least 1 MiB;
            small ones compact sooner: tests).
    """

    def __init__(
        self, num_shards: int = 2, *, disk_dir: str | os.PathLike[str] | None = None,
        memory_bytes: int = 0, row_file_bytes: int = 64 << 20,
    ) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(num_shards, int) or not 1 <= num_shards <= 1024:
            raise ValueError(f"num_shards must be an int in [1, 1024], got {num_shards!r}")
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
            raise ValueError(f"memory_bytes must be an int >= 0, got {memory_bytes!r}")
        if memory_bytes and disk_dir is None:
            raise ValueError("memory_bytes is the disk tier's budget: it needs disk_dir")
        if not isinstance(row_file_bytes, int) or row_file_bytes < 1 << 20:
            raise ValueError(f"row_file_bytes must be an int >= 1 MiB, got {row_file_bytes!r}")
        self.disk_dir = None if disk_dir is None else os.fspath(disk_dir)
        self._native: _engine.Engine | None = _engine.Engine(
            num_shards, self.disk_dir or "", memory_bytes, row_file_bytes
        )
        # name -> (native id, spec), replaced whole, so that one lookup gives
        # an id and the spec of the same table. Native ids are never reused
        # for another table (the engine raises on a dropped table's id).
        self._tables: dict[str, tuple[int, TableSpec]] = {}
        self._lock = threading.Lock()  # create/drop only

    # -- lifecycle -----------------------------------------------------------

    @property
    def native(self) -> _engine.Engine:
        if self._native is None:
            raise RuntimeError("engine is closed")
        return self._native

    def close(self) -> None:
        """Frees every table and stops the shard threads."""
        super().close()
        self._native = None
        self._tables = {}

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_shards(self) -> int:
        return self.native.num_shards

    def worker_thread_ids(self) -> list[int]:
        """The OS thread id of each shard's worker thread (``wuliang-shard``)."""
        return self.native.worker_thread_ids()

    @property
    def step(self) -> int:
        """The step stamped on rows by calls given none (``step=None``): for
        users of the engine alone; a trainer passes each call its step."""
        return self.native.step

    @step.setter
    def step(self, value: int) -> None:
        if not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"step must be a non-negative int, got {value!r}")
        self.native.step = int(value)

    def set_clock(self, seconds: int | None) -> None:
        """The time (unix seconds) stamped on rows updated from now on and
        that TTLs in seconds count back from; None (or 0): the wall clock
        (see ``ParameterServer.set_clock``)."""
        self.native.clock = check_clock(seconds) or 0

    def clock(self) -> int | None:
        return self.native.clock or None

    @property
    def version(self) -> int:
        """Current version, stamped on every modified row (for delta export)."""
        return self.native.version

    def advance_version(self) -> int:
        """Starts a new version and returns it; rows changed later carry it."""
        return self.native.advance_version()

    def restore_version(self, version: int) -> None:
        """Raises the version to at least ``version`` (after restoring rows);
        at most ``MAX_VERSION``, so that advancing never wraps to 0."""
        self.native.restore_version(check_restored_version(version))

    # -- tables --------------------------------------------------------------

    def create_table(self, spec: TableSpec) -> None:
        if not isinstance(spec, TableSpec):
            raise TypeError(f"create_table takes a TableSpec, got {type(spec).__name__}")
        with self._lock:
            if spec.name in self._tables:
                raise ValueError(f"table {spec.name!r} already exists")
            self._tables[spec.name] = (self.native.create_table(spec.to_native()), spec)

    def drop_table(self, name: str) -> None:
        """Frees the table's rows and its id. Calls on it that are running
        finish first; calls that start later raise ``UnknownTableError``."""
        with self._lock:
            self._table(name)
            self.native.drop_table(name)
            del self._tables[name]

    def tables(self) -> list[str]:
        return list(self._tables)

    def spec(self, name: str) -> TableSpec:
        return self._table(name)[1]

    def _id(self, name: str) -> int:
        return self._table(name)[0]

    def _table(self, name: str) -> tuple[int, TableSpec]:
        """(native id, spec) of a table, from one consistent lookup."""
        if self._native is None:
            raise RuntimeError("engine is closed")
        try:
            return self._tables[name]
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise UnknownTableError(f"unknown table {name!r} (tables: {known})") from None

    # -- batch calls ---------------------------------------------------------

    def pull(
        self,
        table: str,
        keys: KeyArray,
        *,
        train: bool = True,
        out: np.ndarray | None = None,
        shard_offsets: np.ndarray | None = None,
        step: int | None = None,
    ) -> np.ndarray:
        """Rows of keys as float32 ``[len(keys), dim]`` (into ``out`` if given).

        ``shard_offsets`` (int64, num_shards + 1): keys are already grouped by
        shard, as the reader's key preparation leaves them; the engine then
        skips splitting them (and checks the grouping).
        """
        if step is not None:
            return super().pull(
                table, keys, train=train, out=out, shard_offsets=shard_offsets, step=step
            )
        tid, keys, out, offsets = self._pull_args(PullPart(table, keys, out, shard_offsets))
        return self.native.pull(tid, keys, train, out, offsets)

    def pull_many(
        self, parts: Sequence[PullPart], *, train: bool = True, step: int | None = None
    ) -> None:
        """``pull`` into each part's ``out`` (required), for many tables at once:
        one hand-off to each shard's worker instead of one per table.

        ``step``: the training step of the batch (default: ``self.step``),
        for a trainer that pulls step s + 1 before pushing step s: rows the
        pull creates carry it, and ``push_many(step=s)`` then leaves alone
        the rows that a pull of a later step admitted, as running the steps
        one after the other would (their keys had no row yet at step s)."""
        args = []
        for part in parts:
            if part.out is None:
                raise ValueError(f"pull_many: the part for table {part.table!r} has no out")
            args.append(self._pull_args(part, strided=True))
        self.native.pull_many(args, train, check_step(step))

    def exchange_many(
        self, parts: Sequence[ExchangePart], *, step: int | None = None
    ) -> list[Exchanged]:
        """``ParameterServer.exchange_many`` in one round of the shards: each
        shard's worker loads, pulls and reads its keys of every part."""
        args = []
        for part in parts:
            tid, keys, out, offsets = self._pull_args(
                PullPart(part.table, part.keys, part.out, part.shard_offsets)
            )
            if out is None:
                raise ValueError(f"exchange_many: the part for table {part.table!r} has no out")
            back = None
            if part.back is not None:
                if part.merge and part.back.versions is not None:
                    raise ValueError(
                        f"exchange_many: changes merged into table {part.table!r} take the "
                        "server's version: versions must be None"
                    )
                back = self._load_columns(part.table, part.back)
            args.append((tid, keys, out, offsets, back, as_keys(part.incoming), part.merge))
        answers = self.native.exchange_many(args, check_step(step))
        return [Exchanged(RowChunk(**rows), found, created) for rows, found, created in answers]

    @property
    def prefetches(self) -> bool:
        return self.disk_dir is not None

    def prefetch_many(self, parts: Sequence[PullPart]) -> int:
        """With a disk tier, reads the cold rows of the parts' keys into RAM
        now (``out`` is not used), ahead of their pull, and keeps them there
        until two more training pulls; returns the rows read. Without one,
        nothing to do (0)."""
        if self.disk_dir is None:
            return 0
        args = [self._pull_args(replace(part, out=None)) for part in parts]
        return self.native.prefetch_many(args)

    def push(
        self,
        table: str,
        keys: KeyArray,
        grads: np.ndarray,
        *,
        unique: bool = False,
        shard_offsets: np.ndarray | None = None,
        updated: np.ndarray | None = None,
        updated_rows: np.ndarray | None = None,
        step: int | None = None,
        shows: np.ndarray | None = None,
        clicks: np.ndarray | None = None,
    ) -> PushResult:
        """Applies the optimizer to the rows of keys with float32 grads ``[n, dim]``.

        ``unique=True`` promises that keys has no repeats and skips the check;
        ``shard_offsets`` as for ``pull``. ``updated`` (float32, C-contiguous)
        receives each key's weights after the push: what ``pull(train=False)``
        would return next, without that pull. Key i's go to ``updated[i]``
        (``[n, dim]``), or with ``updated_rows`` (int32 ``[n]``) to
        ``updated[updated_rows[i]]`` (``[rows, dim]``; nowhere where -1; no
        row twice): how a trainer refreshes the next step's pulled rows.
        ``shows`` and ``clicks``: as for ``PushPart``.
        """
        part = PushPart(table, keys, grads, shard_offsets, updated, updated_rows, shows, clicks)
        if step is not None or shows is not None or clicks is not None:
            return self.push_many([part], unique=unique, step=step)
        tid, keys, grads, offsets, updated, updated_rows, _, _ = self._push_args(part)
        return PushResult(
            **self.native.push(tid, keys, grads, unique, offsets, updated, updated_rows)
        )

    def push_many(
        self,
        parts: Sequence[PushPart],
        *,
        unique: bool = False,
        only: str = "all",
        step: int | None = None,
    ) -> PushResult:
        """``push`` for many tables at once (one hand-off per shard); the
        results are summed. ``only="updated"`` applies just the keys with
        ``updated_rows[i] >= 0``, ``only="rest"`` the others (both need
        ``unique=True``; the rest writes no rows, so its ``updated_rows``
        are not checked): a push in two halves, the rows the next step
        shares first. ``step``: the batch's training step (see ``pull_many``)."""
        if only not in _ONLY:
            raise ValueError(f"only must be one of {', '.join(_ONLY)}, got {only!r}")
        if only != "all" and not unique:
            raise ValueError(f"push_many(only={only!r}) needs unique=True")
        args = [self._push_args(part, strided=True) for part in parts]
        return PushResult(**self.native.push_many(args, unique, _ONLY[only], check_step(step)))

    @property
    def takes_column_rows(self) -> bool:
        return True

    def _pull_args(self, part: PullPart, strided: bool = False) -> tuple:
        """``strided``: out may be columns of a wider array (``pull_many``)."""
        tid, spec = self._table(part.table)
        keys = as_keys(part.keys)
        out = part.out
        if out is not None:
            check_float32(out, (len(keys), spec.dim), "out")
            whole = out.flags.c_contiguous or (strided and rows_contiguous(out))
            if not whole or not out.flags.writeable:
                raise ValueError(
                    "out must be a writeable C-contiguous array"
                    + (" (or columns of one)" if strided else "")
                )
        return tid, keys, out, self._offsets(part.shard_offsets)

    def _push_args(self, part: PushPart, strided: bool = False) -> tuple:
        """``strided``: grads and updated may be columns of wider arrays
        (``push_many``)."""
        table = part.table
        tid, spec = self._table(table)
        keys = as_keys(part.keys)
        grads = part.grads
        if not (strided and isinstance(grads, np.ndarray) and rows_contiguous(grads)):
            grads = as_float32(grads, (len(keys), spec.dim), f"grads for table {table!r}")
        else:
            check_float32(grads, (len(keys), spec.dim), f"grads for table {table!r}")
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
            whole = updated.flags.c_contiguous or (strided and rows_contiguous(updated))
            if not whole or not updated.flags.writeable:
                raise ValueError("updated must be a writeable C-contiguous array")
        offsets = self._offsets(part.shard_offsets)
        shows = as_column(part.shows, np.float32, (len(keys),), f"shows for table {table!r}")
        clicks = as_column(part.clicks, np.float32, (len(keys),), f"clicks for table {table!r}")
        return tid, keys, grads, offsets, updated, updated_rows, shows, clicks

    def _offsets(self, shard_offsets: np.ndarray | None) -> np.ndarray | None:
        if shard_offsets is None:
            return None
        offsets = np.ascontiguousarray(shard_offsets, dtype=np.int64)
        if offsets.shape != (self.num_shards + 1,):
            raise ValueError(
                f"shard_offsets must have num_shards + 1 = {self.num_shards + 1} entries, "
                f"got shape {offsets.shape}"
            )
        return offsets

    def lookup(self, table: str, keys: KeyArray, *, missing: str = "zeros") -> LookupResult:
        """A pure lookup (rows, found, version) in one pass, atomic with
        ``apply_update`` (see ``ParameterServer.lookup``)."""
        if missing not in MISSING:
            raise ValueError(f"missing must be 'zeros' or 'initial', got {missing!r}")
        tid, spec = self._table(table)
        keys = as_keys(keys)
        out = np.empty((len(keys), spec.dim), np.float32)
        found = np.empty(len(keys), np.uint8)
        label = self.native.lookup(tid, keys, out, found, missing == "initial")
        return LookupResult(out, found.view(np.bool_), label)

    def apply_update(self, updates: Mapping[str, TableUpdate], label: int = 0) -> None:
        """See ``ParameterServer.apply_update``: every table staged in C++
        (full: a new table beside the live one; delta: an overlay of its rows
        and removals), then each switched over in turn."""
        label = check_version(label, "label")
        staged: list[tuple[str, int, TableSpec]] = []
        native = self.native
        try:
            for name, update in updates.items():
                spec = self._update_spec(name, update)
                tid = self._tables[name][0] if name in self._tables else -1
                handle = native.begin_apply(spec.to_native(), tid, bool(update.full), label)
                staged.append((name, handle, spec))
                for rows in update.rows:
                    state = rows.state if spec.state_dim and rows.state.size else None
                    n = len(rows.keys)
                    native.stage_rows(
                        handle,
                        as_keys(rows.keys),
                        as_float32(rows.weights, (n, spec.dim), f"rows of table {name!r}"),
                        None if state is None else as_float32(state, (n, spec.state_dim), "state"),
                        as_column(rows.counts, np.uint32, (n,), "counts"),
                        as_column(rows.steps, np.uint64, (n,), "steps"),
                        as_column(rows.times, np.uint32, (n,), "times"),
                        as_column(rows.versions, np.uint64, (n,), "versions"),
                        as_column(rows.shows, np.float32, (n,), "shows"),
                        as_column(rows.clicks, np.float32, (n,), "clicks"),
                    )
                if update.removed is not None and len(update.removed):
                    if update.full:
                        raise ValueError(f"table {name!r}: a full update removes no keys")
                    native.stage_removed(handle, as_keys(update.removed, "removed"))
        except BaseException:
            for _, handle, _ in staged:
                native.abort_apply(handle)
            raise
        for i, (name, handle, spec) in enumerate(staged):
            try:
                tid = native.commit_apply(handle)
            except BaseException:
                for _, later, _ in staged[i + 1 :]:
                    native.abort_apply(later)
                raise
            with self._lock:
                self._tables[name] = (tid, spec)

    def _update_spec(self, name: str, update: TableUpdate) -> TableSpec:
        """The spec an update stages with: the live table's (dims checked),
        or the update's for a new table."""
        if not isinstance(update, TableUpdate):
            raise TypeError(f"table {name!r}: expected a TableUpdate, got {type(update).__name__}")
        if name in self._tables:
            spec = self._tables[name][1]
            if spec.dim != update.spec.dim:
                raise ValueError(
                    f"table {name!r} has dim {spec.dim}, the update's has {update.spec.dim}"
                )
            return spec
        return update.spec.with_name(name)

    def erase(self, table: str, keys: KeyArray) -> int:
        """Removes rows; returns how many existed."""
        return self.native.erase(self._id(table), as_keys(keys))

    def contains(self, table: str, keys: KeyArray) -> np.ndarray:
        """Bool array: which keys have a row."""
        return self.native.contains(self._id(table), as_keys(keys))

    def read_rows(self, table: str, keys: KeyArray) -> tuple[RowChunk, np.ndarray]:
        """Whole rows of keys, every column as ``export`` writes it, and
        which keys have one (``ParameterServer.read_rows``): each shard reads
        its keys' rows on its own thread, in place (no scan, nothing
        changed). Raises RuntimeError while ``apply_update`` switches the
        table to a new version, as ``export`` does."""
        rows, found = self.native.read_rows(self._id(table), as_keys(keys))
        return RowChunk(**rows), found

    def evict(self, table: str | None = None, *, step: int | None = None) -> dict[str, int]:
        """Applies the eviction policy of one table (or all) now; TTLs in
        steps count back from ``step`` (default: ``self.step``), TTLs in
        seconds from the clock (``set_clock``; default: the wall clock)."""
        return self.native.evict(-1 if table is None else self._id(table), check_step(step))

    # -- eviction's phases, for one table spread over several engines --------

    def evict_by_age(self, table: str, *, step: int | None = None) -> dict[str, int]:
        """The table's TTL and min-count criteria only (``Eviction``)."""
        return self.native.evict_by_age(self._id(table), check_step(step))

    def count_histogram(self, table: str) -> np.ndarray:
        """Rows per update count, uint64 ``[65536]`` (the last bucket: every
        larger count): what a cut by count needs."""
        return self.native.count_histogram(self._id(table))

    def steps_at_count(self, table: str, count: int) -> np.ndarray:
        """The last-update step of every row whose count is in bucket ``count``."""
        return self.native.steps_at_count(self._id(table), int(count))

    def evict_least_frequent(
        self, table: str, threshold: int, cutoff: int, quota: int, *, step: int | None = None
    ) -> dict[str, int]:
        """Evicts the rows below count bucket ``threshold``, those at it
        updated before step ``cutoff``, and ``quota`` of those updated at
        ``cutoff``: one engine's part of a cut found over several engines
        the way ``evict`` finds it over shards (``max_rows``)."""
        return self.native.evict_least_frequent(
            self._id(table), int(threshold), int(cutoff), int(quota), check_step(step)
        )

    def stats(self, table: str | None = None) -> dict[str, Any]:
        """Rows, bytes and counters of one table, or of every table by name."""
        native = self.native
        if table is not None:
            return native.stats(self._id(table))
        stats = {}
        for name, (tid, _) in list(self._tables.items()):
            with contextlib.suppress(UnknownTableError):  # dropped meanwhile
                stats[name] = native.stats(tid)
        return stats

    # -- export and load -----------------------------------------------------

    def export(self, table: str, since: int = 0, chunk_rows: int = 65536) -> Iterator[RowChunk]:
        """Yields the rows modified after version ``since`` (0: all rows).

        Arguments are checked at the call. Each shard is read on its own
        thread, chunk by chunk. A delta (``since`` > 0) that the engine's
        change log still reaches (``since`` >= ``stats(table)["change_floor"]``)
        visits only the rows changed; otherwise every row is scanned, and a
        scan raises RuntimeError if rows are removed or the index is resized
        in the shard being read: pause training while exporting.
        """
        tid = self._id(table)
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows!r}")
        return self._export_chunks(tid, check_version(since, "since"), chunk_rows)

    def _export_chunks(self, tid: int, since: int, chunk_rows: int) -> Iterator[RowChunk]:
        cursor = _engine.ExportCursor()
        while not cursor.done:
            chunk = self.native.export_chunk(tid, since, chunk_rows, cursor)
            if len(chunk["keys"]):
                yield RowChunk(**chunk)

    def removed_log(self, table: str, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(keys, versions) of the removals after version ``since``, oldest
        first. The log is bounded: it is complete only when ``since`` >=
        ``stats(table)["removed_floor"]``."""
        tid = self._id(table)
        return self.native.removed_log(tid, check_version(since, "since"))

    def load_removed(
        self, table: str, keys: KeyArray, versions: np.ndarray, floor: int = 0
    ) -> None:
        """Restores removal records (e.g. a checkpoint's), sorted by version;
        ``floor``: the records are incomplete up to this version."""
        keys = as_keys(keys)
        versions = as_column(versions, np.uint64, (len(keys),), "versions")
        tid = self._id(table)
        self.native.load_removed(tid, keys, versions, check_version(floor, "floor"))

    def pending_counts(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """(keys uint64, counts uint32) of the keys seen but not admitted yet
        (``Admission(min_count > 1)``), sorted by key."""
        return self.native.pending_counts(self._id(table))

    def load_pending(self, table: str, keys: KeyArray, counts: np.ndarray) -> None:
        """Sets the sighting counts of keys waiting for admission (e.g. a
        checkpoint's). Keys that have a row are skipped; a count of 0 forgets
        the key."""
        keys = as_keys(keys)
        counts = as_column(counts, np.uint32, (len(keys),), "counts")
        self.native.load_pending(self._id(table), keys, counts)

    def trim_removed(self, table: str, upto: int) -> None:
        """Forgets removal records of versions <= upto (after exporting them)."""
        tid = self._id(table)
        self.native.trim_removed(tid, check_version(upto, "upto"))

    def load(
        self,
        table: str,
        keys: KeyArray,
        weights: np.ndarray,
        state: np.ndarray | None = None,
        counts: np.ndarray | None = None,
        steps: np.ndarray | None = None,
        times: np.ndarray | None = None,
        versions: np.ndarray | None = None,
        shows: np.ndarray | None = None,
        clicks: np.ndarray | None = None,
        *,
        step: int | None = None,
    ) -> None:
        """Inserts or overwrites rows exactly (e.g. from a RowChunk).

        Missing columns default to the optimizer's initial state, count 0,
        ``step`` (default ``self.step``), now, the current version, and no
        shows or clicks.
        """
        tid, spec = self._table(table)
        keys = as_keys(keys)
        columns = load_columns(spec, keys, weights, state, counts, steps, times, versions,
                               shows, clicks)  # fmt: skip
        self.native.load(tid, *columns.values(), check_step(step))

    def _load_columns(self, table: str, rows: RowChunk) -> dict[str, Any]:
        """A RowChunk's columns as the native calls take them, checked."""
        _, spec = self._table(table)
        return load_columns(
            spec, as_keys(rows.keys), rows.weights, rows.state, rows.counts, rows.steps,
            rows.times, rows.versions, rows.shows, rows.clicks,
        )  # fmt: skip
