"""The parameter-server interface: what every implementation offers.

Everything above the engine (session, pipeline, checkpoint, export, hooks,
serving) talks to a ``ParameterServer``, never to one implementation, and an
implementation is chosen by address (``wuliang.ps_server.parameter_server``):
``"embedded"`` is the C++ engine in this process (``Engine``); remote servers
(a list of ``"host:port"``) and a GPU-cached front plug in the same way.

Data half (any number of threads at once):

* ``pull_many(parts, train, step)``: the rows of several tables' keys in one
  call, into each part's ``out``; ``pull(table, keys)`` for one table.
  ``train=True`` counts a sighting of each key and creates its row once
  admission allows; ``train=False`` is a pure lookup. Keys without a row read
  as their initial vector.
* ``push_many(parts, unique, only, step)``: applies each table's optimizer to
  the rows of the keys with the given gradients, and adds the parts' show
  and click increments to the rows' statistics; ``push`` for one table.
* ``pull_many_async`` / ``push_many_async``: the same, started now; the
  returned ``Handle`` 's ``wait()`` returns the result or raises the error.
  The arrays passed in must not change (nor ``out`` be read) until then.
  A caller's asynchronous pulls run one after the other in the order they
  were started, and so do its pushes (a pull may overlap a push): the pulls
  of consecutive steps count sightings and admit rows in step order.

Admin half: tables (``create_table``, ``drop_table``, ``tables``, ``spec``),
``stats``, chunked ``export`` (rows modified after a version) and ``load``,
``top_keys`` (the keys with the most shows), ``read_rows`` (whole rows,
every column, of some keys),
the removal log (``removed_log``, ``load_removed``, ``trim_removed``), the
admission counts of keys not admitted yet (``pending_counts``,
``load_pending``), ``erase``, ``contains``, ``evict``, the clock
(``set_clock``, ``clock``), versions (``version``, ``advance_version``,
``restore_version``), and
``apply_update``: a version applied atomically for concurrent readers
(``lookup``), as a serving process does every hour.

The training step travels with the calls that stamp rows with it
(``pull_many``, ``push_many``, ``load``, ``evict``): a server holds no
trainer's step, so several workers can share one. The version is the
server's own: every modified row carries the version current when it
changed, and ``advance_version`` (at a checkpoint or export cut) starts the
next one; ``export(table, since=v)`` and ``removed_log(table, since=v)`` give
what changed after ``v``. The clock is the server's too: the time (unix
seconds) stamped on the rows it updates and that TTLs in seconds count back
from, the wall clock unless ``set_clock`` sets one (a trainer that follows
time-partitioned data sets each partition's time).

Keys are uint64 (int64 arrays are taken as their two's-complement twins);
rows are float32 ``[n, dim]``. A bad argument raises ``TypeError`` or
``ValueError`` naming it; an unknown table ``UnknownTableError`` listing the
tables there are.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import numpy as np

from wuliang.ps_server import _engine
from wuliang.ps_server.checks import as_keys
from wuliang.ps_server.chunk import RowChunk, concat_rows, take_rows
from wuliang.ps_server.job import JobBoard, JobState
from wuliang.ps_server.spec import TableSpec
from wuliang.ps_server.threads import check_background, set_background

if TYPE_CHECKING:
    from wuliang.ps_server.storage.location import Location
    from wuliang.ps_server.storage.manifest import FileEntry

T = TypeVar("T")
KeyArray = np.ndarray | Sequence[int]
ONLY = ("all", "updated", "rest")  # push_many's halves
MISSING = ("zeros", "initial")  # what lookup reads for a key without a row


UnknownTableError = _engine.UnknownTableError
"""A table name (or id) that names no live table: a ``KeyError`` whose
``str`` is its message. Every implementation raises this class (the C++
engine too, for a call on a table dropped while it was starting)."""


@dataclass(frozen=True)
class PushResult:
    applied: int  # row updates applied
    dropped_nan: int  # gradient rows with NaN or Inf, skipped
    dropped_pending: int  # keys not admitted yet, skipped
    duplicates: int  # repeated keys, summed into their first occurrence

    def __add__(self, other: PushResult) -> PushResult:
        return PushResult(
            self.applied + other.applied,
            self.dropped_nan + other.dropped_nan,
            self.dropped_pending + other.dropped_pending,
            self.duplicates + other.duplicates,
        )


@dataclass(frozen=True)
class PullPart:
    """One table's part of ``pull_many``: the arguments of a ``pull``.

    ``shard_offsets`` (int64, ``num_servers * num_shards + 1``): the keys
    are already grouped by (server, shard) cell (``wuliang.reader.
    KeyPreparer``), so the server skips grouping them (and checks the
    grouping).

    ``counts`` (float32 ``[n]``): each key's occurrences in the batch, for a
    cache's policy (``CachedServer``); other servers ignore it.
    """

    table: str
    keys: KeyArray
    out: np.ndarray | None = None  # float32 [n, dim], written
    shard_offsets: np.ndarray | None = None
    counts: np.ndarray | None = None  # float32 [n]: occurrences in the batch (caches)


@dataclass(frozen=True)
class PushPart:
    """One table's part of ``push_many``: the arguments of a ``push``.

    ``updated`` (float32, C-contiguous) receives each key's weights after the
    push (what a lookup would read next): key i's at ``updated[i]``, or with
    ``updated_rows`` (int32 ``[n]``) at ``updated[updated_rows[i]]`` (nowhere
    where -1; no row twice). A trainer refreshes the next step's rows this way.

    ``shows`` and ``clicks`` (float32 ``[n]``, aligned with ``keys``; None:
    no change) are added to the statistics of the rows the push updates,
    after their decay to the push's step (``TableSpec.stats_half_life``);
    a repeated key's are summed. ``count`` is not affected.
    """

    table: str
    keys: KeyArray
    grads: np.ndarray  # float32 [n, dim]
    shard_offsets: np.ndarray | None = None
    updated: np.ndarray | None = None
    updated_rows: np.ndarray | None = None
    shows: np.ndarray | None = None  # float32 [n]
    clicks: np.ndarray | None = None  # float32 [n]


@dataclass(frozen=True)
class ExchangePart:
    """One table's part of ``exchange_many``: what a hot cache in front of
    the server gives back and takes in for one training pull.

    ``back``: whole rows the cache gives back (its victims' newest values,
    every column as ``load`` takes them), loaded first. ``keys``: the keys
    the cache lacks, as the batch has them (repeats and order kept), pulled
    for training into ``out`` (float32 ``[n, dim]``, written) with
    ``shard_offsets`` as a ``PullPart``'s. ``incoming``: the keys that
    come into the cache (some of ``keys``), whose whole rows are read after
    the pull, as ``read_rows`` gives them. A column of ``back`` that is None
    takes ``load``'s default (``versions`` None: the server's version now).

    ``merge=True``: ``back`` holds changes to add instead (Geo-SGD: what a
    trainer's cache changed in its rows since it fetched them, other
    trainers changing the same rows meanwhile): weights and optimizer state
    added, ``counts`` added (saturating), ``shows`` and ``clicks`` added
    after the row's decay to the change's ``steps``, step and time the later
    of the row's and the change's, the version the server's now (``versions``
    must be None); a key without a row gets a new one first (initial weights
    and state, no admission). fp32 tables only. Atomic per row.
    """

    table: str
    keys: KeyArray
    out: np.ndarray
    incoming: KeyArray
    back: RowChunk | None = None
    shard_offsets: np.ndarray | None = None
    merge: bool = False


class Exchanged(NamedTuple):
    """What ``exchange_many`` gives of one part's incoming keys: their whole
    rows (those that have one, in the keys' order, as ``read_rows``),
    which keys have one (``found``, bool ``[k]``), and which had none before
    the exchange's pull (``created``, bool ``[k]``: the rows it admitted)."""

    rows: RowChunk
    found: np.ndarray
    created: np.ndarray


@dataclass
class TableUpdate:
    """One table's part of a version to apply (``apply_update``).

    ``full``: the rows replace the whole table (keys absent from them are
    gone); else a delta: the rows replace or join the table's, then the
    ``removed`` keys go. Rows come with every column (``RowChunk``: an
    export's, a version file's); ``state`` may have no columns when the
    table keeps no optimizer state. ``spec`` creates the table when the
    server lacks it (the mapping key names the table).
    """

    spec: TableSpec
    full: bool
    rows: Iterable[RowChunk]
    removed: np.ndarray | None = None  # uint64 keys (deltas)


class LookupResult(NamedTuple):
    """What ``lookup`` read: the rows, which keys had one, and the label of
    the version they were read at."""

    rows: np.ndarray  # float32 [n, dim]
    found: np.ndarray  # bool [n]
    version: int


class Handle(Generic[T]):
    """A call in flight: ``wait()`` returns its result or raises its error."""

    def __init__(self, future: Future[T]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> T:
        """The result, once the call is done (TimeoutError after ``timeout`` s)."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, callback: Callable[[Handle[T]], None]) -> None:
        """Calls ``callback(handle)`` once the call is done (at once if it
        is), on the thread that finished it."""
        self._future.add_done_callback(lambda _: callback(self))


class ParameterServer(abc.ABC):
    """Embedding tables of a parameter server. See the module docstring."""

    def __init__(self) -> None:
        self._executors: dict[str, ThreadPoolExecutor] = {}  # "pull", "push": in order
        self._executor_lock = threading.Lock()
        self._background = "normal"
        self._job_board = JobBoard()

    # -- lifecycle -----------------------------------------------------------

    @property
    @abc.abstractmethod
    def num_shards(self) -> int:
        """Shards of each server (``shard_of``); key preparation groups a
        batch's keys by (server, shard) ahead of ``pull_many``."""

    @property
    def num_servers(self) -> int:
        """Servers the keys are partitioned over (``server_of``); 1 for an
        embedded engine."""
        return 1

    def close(self) -> None:
        """Releases the server (its tables, for an embedded one)."""
        with self._executor_lock:
            executors, self._executors = self._executors, {}
        for executor in executors.values():
            executor.shutdown(wait=True)

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def worker_thread_ids(self) -> list[int]:
        """OS ids of the threads in this process that do the server's work
        (to set their scheduling); none for a remote server."""
        return []

    def set_background(self, background: str) -> None:
        """Schedules the threads that do this server's work in this process
        (its workers, and the threads that run its ``*_async`` calls, from
        their start) under ``background`` (``wuliang.ps_server.threads``)."""
        self._background = check_background(background)
        for thread_id in self.worker_thread_ids():
            set_background(background, thread_id)

    # -- data half -----------------------------------------------------------

    @abc.abstractmethod
    def pull_many(
        self, parts: Sequence[PullPart], *, train: bool = True, step: int | None = None
    ) -> None:
        """``pull`` into each part's ``out`` (required), for many tables at once.

        ``step``: the training step of the batch; rows the pull creates carry
        it, and a ``push_many(step=s)`` leaves alone the rows that a pull of a
        later step admitted (a trainer that pulls ahead of its pushes gets
        what running the steps one by one gives). None: the server's own."""

    def exchange_many(
        self, parts: Sequence[ExchangePart], *, step: int | None = None
    ) -> list[Exchanged]:
        """A hot cache's exchange for one training pull, for many tables: per
        part, ``load`` of its ``back`` rows, then ``pull_many`` of its
        ``keys`` into ``out`` (training: sightings counted, rows created as
        admission allows), then ``read_rows`` of its ``incoming`` keys;
        returns each part's ``Exchanged`` (the rows and ``found`` as
        ``read_rows`` gives them, and which rows the pull created). The same
        rows and answers as those calls one after the other (and
        ``contains`` of the incoming keys before the pull). The engine does
        all of it in one round of its shards; this default makes the calls.
        A part that merges changes needs the server's own (a merge is atomic
        per row there): this default raises NotImplementedError for it."""
        merging = [part.table for part in parts if part.merge and part.back is not None]
        if merging:
            raise NotImplementedError(
                f"{type(self).__name__} cannot merge changes into rows (tables {merging}): "
                "use the engine or remote servers"
            )
        for part in parts:
            back = part.back
            if back is not None and len(back):
                self.load(
                    part.table, back.keys, back.weights, back.state, back.counts, back.steps,
                    back.times, back.versions, back.shows, back.clicks, step=step,
                )  # fmt: skip
        had = [self.contains(part.table, part.incoming) for part in parts]
        pulls = [PullPart(p.table, p.keys, p.out, p.shard_offsets) for p in parts if len(p.keys)]
        if pulls:
            self.pull_many(pulls, train=True, step=step)
        answers = []
        for part, before in zip(parts, had, strict=True):
            rows, found = self.read_rows(part.table, part.incoming)
            answers.append(Exchanged(rows, found, found & ~before))
        return answers

    @abc.abstractmethod
    def push_many(
        self,
        parts: Sequence[PushPart],
        *,
        unique: bool = False,
        only: str = "all",
        step: int | None = None,
    ) -> PushResult:
        """``push`` for many tables at once; the results are summed.

        ``unique=True`` promises no key repeats within a part. ``only=
        "updated"`` applies just the keys with ``updated_rows[i] >= 0``,
        ``"rest"`` the others (both need ``unique``): a push in two halves,
        the rows the next step shares first. ``step``: as for ``pull_many``."""

    def pull_many_async(
        self, parts: Sequence[PullPart], *, train: bool = True, step: int | None = None
    ) -> Handle[None]:
        """``pull_many`` started now, after the pulls started before it;
        ``wait()`` on the handle for the rows."""
        return self._start("pull", lambda: self.pull_many(parts, train=train, step=step))

    @property
    def prefetches(self) -> bool:
        """Whether ``prefetch_many`` brings rows in (a disk tier): a trainer
        calls it ahead of its pulls only then."""
        return False

    @property
    def takes_column_rows(self) -> bool:
        """Whether ``pull_many``'s ``out`` and ``push_many``'s ``grads`` and
        ``updated`` may be columns of wider arrays (each row contiguous): a
        trainer then pulls and pushes a sized table's blocks in place."""
        return False

    def prefetch_many(self, parts: Sequence[PullPart]) -> int:
        """Brings the rows of the parts' keys (their ``out`` is not used)
        into memory ahead of their pull: a server with a disk tier reads
        the cold ones now (docs/disk_tier.md). Changes no row; returns the
        rows read (0 here: nothing to bring)."""
        return 0

    def prefetch_many_async(self, parts: Sequence[PullPart]) -> Handle[int]:
        """``prefetch_many`` on a thread of its own (after the prefetches
        started before it), so its reads overlap the pulls and pushes in
        flight instead of queueing with them; it changes no row, so order
        with them does not matter (a pull that comes first reads what it
        needs itself)."""
        return self._start("prefetch", lambda: self.prefetch_many(parts))

    def push_many_async(
        self,
        parts: Sequence[PushPart],
        *,
        unique: bool = False,
        only: str = "all",
        step: int | None = None,
    ) -> Handle[PushResult]:
        """``push_many`` started now, after the pushes started before it;
        ``wait()`` returns its ``PushResult``."""
        return self._start(
            "push", lambda: self.push_many(parts, unique=unique, only=only, step=step)
        )

    def lookup(self, table: str, keys: KeyArray, *, missing: str = "zeros") -> LookupResult:
        """A pure lookup for serving: ``LookupResult(rows float32 [n, dim],
        found bool [n], version)``; a key without a row reads as zeros
        (``missing="zeros"``) or as its initial vector (``"initial"``). The
        rows are wholly at one version while ``apply_update`` runs, and
        ``version`` is that version's label (``apply_update(label=...)``)."""
        keys = as_keys(keys)
        if missing not in MISSING:
            raise ValueError(f"missing must be 'zeros' or 'initial', got {missing!r}")
        rows = self.pull(table, keys, train=False)
        found = self.contains(table, keys)
        if missing == "zeros":
            rows[~found] = 0.0
        return LookupResult(rows, found, 0)

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
        """Rows of keys as float32 ``[len(keys), dim]`` (into ``out`` if given)."""
        keys = as_keys(keys)
        if out is None:
            out = np.empty((len(keys), self.spec(table).dim), np.float32)
        self.pull_many([PullPart(table, keys, out, shard_offsets)], train=train, step=step)
        return out

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
        """Applies the table's optimizer to the rows of keys with float32
        grads ``[n, dim]`` (duplicate keys summed first); ``shows`` and
        ``clicks`` as for ``PushPart``."""
        part = PushPart(table, keys, grads, shard_offsets, updated, updated_rows, shows, clicks)
        return self.push_many([part], unique=unique, step=step)

    def _start(self, kind: str, call: Callable[[], T]) -> Handle[T]:
        """Runs ``call`` on the thread of its kind (``"pull"``, ``"push"``
        or ``"prefetch"``), after the calls of that kind started before it."""
        with self._executor_lock:
            executor = self._executors.get(kind)
            if executor is None:
                executor = self._executors[kind] = ThreadPoolExecutor(
                    1,
                    thread_name_prefix=f"wuliang-ps-call-{kind}",
                    initializer=set_background,
                    initargs=(self._background,),
                )
            return Handle(executor.submit(call))

    # -- admin half: tables --------------------------------------------------

    @abc.abstractmethod
    def create_table(self, spec: TableSpec) -> None:
        """Creates a table; ValueError if the name is taken."""

    @abc.abstractmethod
    def drop_table(self, name: str) -> None:
        """Removes a table and frees its rows."""

    @abc.abstractmethod
    def tables(self) -> list[str]:
        """The tables' names, in creation order."""

    @abc.abstractmethod
    def spec(self, name: str) -> TableSpec:
        """A table's spec."""

    @abc.abstractmethod
    def stats(self, table: str | None = None) -> dict[str, Any]:
        """Rows, bytes and counters of one table, or of every table by name."""

    # -- admin half: rows ----------------------------------------------------

    @abc.abstractmethod
    def export(self, table: str, since: int = 0, chunk_rows: int = 65536) -> Iterator[RowChunk]:
        """The rows modified after version ``since`` (0: all), chunk by chunk.
        Arguments are checked at the call."""

    @abc.abstractmethod
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
        """Inserts or overwrites rows exactly (e.g. a ``RowChunk``'s columns).
        Missing columns default to the optimizer's initial state, count 0,
        ``step`` (default: the server's), the clock's time, the current
        version, and no shows or clicks."""

    def top_keys(
        self, table: str, n: int, *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` keys with the most shows decayed to ``step`` (None:
        the newest step stamped on the table's rows), most first, ties by
        key: (keys uint64 ``[m]``, shows float32 ``[m]``), m = min(n, rows).
        This one scans ``export`` (twice when ``step`` is None); remote
        servers each scan their own rows and the client merges their tops."""
        keys, shows, _ = scan_top_keys(self, table, n, step)
        return keys, shows

    def read_rows(self, table: str, keys: KeyArray) -> tuple[RowChunk, np.ndarray]:
        """Whole rows of some keys, every column as ``export`` gives it (the
        stored counts, steps, times, versions, shows and clicks, not
        decayed): ``(rows, found)``, where ``found`` (bool ``[len(keys)]``)
        says which keys have a row and ``rows`` holds the rows of those, in
        the order of ``keys`` (a repeated key's as often as it is given).
        Changes nothing (no sighting, count, row or version). This one scans
        ``export`` (time in proportion to the table); the engine and remote
        servers read each key's row directly."""
        return scan_rows(self, table, keys)

    @abc.abstractmethod
    def erase(self, table: str, keys: KeyArray) -> int:
        """Removes rows (logged for deltas); returns how many existed."""

    @abc.abstractmethod
    def contains(self, table: str, keys: KeyArray) -> np.ndarray:
        """Bool ``[n]``: which keys have a row."""

    @abc.abstractmethod
    def evict(self, table: str | None = None, *, step: int | None = None) -> dict[str, int]:
        """Applies the eviction policy of one table (or every table) now;
        TTLs in steps count back from ``step`` (default: the server's), TTLs
        in seconds from the server's clock (``set_clock``)."""

    # -- admin half: the clock -------------------------------------------------

    @abc.abstractmethod
    def set_clock(self, seconds: int | None) -> None:
        """Sets the time (unix seconds) the server stamps on the rows it
        updates from now on and counts TTLs in seconds back from; None (or 0)
        returns to the wall clock, the default. A trainer that follows
        time-partitioned data sets it to each partition's time, so that
        replaying old partitions evicts nothing live and a trainer resumed
        after days does not evict everything. Calls already in flight may
        stamp either time. ValueError naming the value unless an int in
        [0, 2**32) or None. Remote servers each keep theirs: one that
        restarts comes back on the wall clock until it is set again."""

    @abc.abstractmethod
    def clock(self) -> int | None:
        """The time ``set_clock`` set, or None on the wall clock."""

    # -- admin half: logs and admission --------------------------------------

    @abc.abstractmethod
    def removed_log(self, table: str, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(keys, versions) of the removals after version ``since``, oldest
        first; complete only when ``since >= stats(table)["removed_floor"]``."""

    def removed_keys(self, table: str, since: int = 0) -> np.ndarray:
        """Keys erased or evicted after version ``since`` (uint64)."""
        return self.removed_log(table, since)[0]

    @abc.abstractmethod
    def load_removed(
        self, table: str, keys: KeyArray, versions: np.ndarray, floor: int = 0
    ) -> None:
        """Restores removal records (a checkpoint's), sorted by version;
        ``floor``: the records are incomplete up to this version."""

    @abc.abstractmethod
    def trim_removed(self, table: str, upto: int) -> None:
        """Forgets removal records of versions <= ``upto``."""

    @abc.abstractmethod
    def pending_counts(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """(keys uint64, counts uint32) of the keys seen but not admitted."""

    @abc.abstractmethod
    def load_pending(self, table: str, keys: KeyArray, counts: np.ndarray) -> None:
        """Sets the sighting counts of keys waiting for admission."""

    @abc.abstractmethod
    def apply_update(self, updates: Mapping[str, TableUpdate], label: int = 0) -> None:
        """Applies a version (full or delta, per table) while readers look
        keys up (``label``: what ``lookup`` reports as their version from
        then on, e.g. the export's version number): a ``lookup`` or
        ``pull(train=False)`` sees each table wholly at the old version or
        wholly at the new one, never a mix, an empty table or a torn row.
        Every table is staged first (a failure while reading the rows
        changes nothing), then each is switched over.
        A delta costs memory in proportion to its rows; a full version holds
        two copies of its table during the switch. Writes to a table while
        its version stages land before the version; writes during the short
        switch are refused (RuntimeError naming the table)."""

    # -- admin half: rows of a version on disk --------------------------------

    def write_rows(
        self, folder: Location, spec: TableSpec, *, since: int = 0, state: bool
    ) -> tuple[list[tuple[str, FileEntry]], int]:
        """Writes a table's rows modified after ``since`` (0: all) as part
        files into a version's folder (``wuliang.ps_server.storage``; with
        the optimizer state when ``state``; a local path or a ``RemotePath``
        of an object store); returns ((relative path, entry) of each file,
        rows). This one streams the rows through this process; remote
        servers write their own parts."""
        from wuliang.ps_server.storage.location import location
        from wuliang.ps_server.storage.version import write_parts

        chunks = self.export(spec.name, since=since)
        return write_parts(location(folder), spec, chunks, state=state)

    def load_rows(
        self,
        folder: Location,
        table: str,
        files: Sequence[str],
        *,
        step: int | None = None,
        since: int = 0,
        owned: tuple[int, int] | None = None,
    ) -> int:
        """Loads a table's rows from part files of a version (relative to
        its folder, checked by the caller), those modified after ``since``;
        returns how many. ``owned=(i, n)``: only the keys of server i of n
        (``server_of``). Remote servers each load the rows they own."""
        from wuliang.ps_server.routing import server_of
        from wuliang.ps_server.storage.location import location
        from wuliang.ps_server.storage.rows import read_part, select_rows

        loaded = 0
        for relative in files:
            for chunk in read_part(location(folder) / relative):
                keep = np.ones(len(chunk), bool)
                if since:
                    keep &= chunk.versions > since
                if owned is not None:
                    keep &= server_of(chunk.keys, owned[1]) == owned[0]
                if not keep.all():
                    chunk = select_rows(chunk, keep)
                if len(chunk):
                    self.load(table, **load_columns(chunk), step=step)
                    loaded += len(chunk)
        return loaded

    # -- admin half: versions ------------------------------------------------

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The current version, stamped on every row modified now."""

    @abc.abstractmethod
    def advance_version(self) -> int:
        """Starts a new version and returns it."""

    @abc.abstractmethod
    def restore_version(self, version: int) -> None:
        """Raises the version to at least ``version`` (after restoring rows);
        ValueError above ``2**63 - 1``, so that advancing never wraps to 0."""

    # -- the job board ---------------------------------------------------------

    def job(
        self,
        *,
        add_steps: int = 0,
        floor: int = 0,
        put: Mapping[str, bytes] | None = None,
        get: Sequence[str] = (),
        prefix: str | None = None,
    ) -> JobState:
        """The trainers' shared step and values (``wuliang.ps_server.job``):
        raises the step to ``floor``, adds ``add_steps``, stores ``put``,
        returns the step and the values asked for (``get``, ``prefix``), in
        one atomic call. An embedded engine keeps the board in its process,
        remote servers on the first server."""
        return self._job_board.apply(
            add_steps=add_steps, floor=floor, put=put, get=get, prefix=prefix
        )


def scan_top_keys(
    server: ParameterServer, table: str, n: Any, step: int | None
) -> tuple[np.ndarray, np.ndarray, int]:
    """``top_keys`` over ``server.export``, and the step the shows are
    decayed to (``step``, or the newest stamped on the rows when None)."""
    n = check_top(n)
    if step is not None and (isinstance(step, bool) or not 0 <= step < 2**63):
        raise ValueError(f"step must be an int in [0, 2**63), got {step!r}")
    half_life = server.spec(table).stats_half_life
    if step is None and half_life > 0:
        steps = (int(c.steps.max()) for c in server.export(table) if len(c))
        step = max(steps, default=0)
    step = step or 0
    chunks = server.export(table)
    keys, shows = top_of(((c.keys, c.decayed(half_life, step)[0]) for c in chunks), n)
    return keys, shows, int(step)


def scan_rows(server: ParameterServer, table: str, keys: KeyArray) -> tuple[RowChunk, np.ndarray]:
    """``read_rows`` over ``server.export``: every row of the table is
    visited, those of ``keys`` kept."""
    keys = as_keys(keys).view(np.uint64)
    spec = server.spec(table)  # an unknown table raises before any export
    wanted = np.unique(keys)
    parts = []
    if len(wanted):
        for chunk in server.export(table):
            keep = np.isin(chunk.keys, wanted)
            if keep.any():
                parts.append(take_rows(chunk, keep))
    rows = concat_rows(parts, spec.dim, spec.state_dim)
    order = np.argsort(rows.keys, kind="stable")
    known = rows.keys[order]
    if not len(known):
        return rows, np.zeros(len(keys), bool)
    at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    found = known[at] == keys
    return take_rows(rows, order[at[found]]), found


def merge_rows(
    parts: Sequence[tuple[np.ndarray, RowChunk, np.ndarray]], n: int, dim: int, state_dim: int
) -> tuple[RowChunk, np.ndarray]:
    """One ``read_rows`` answer of ``n`` keys from the answers for parts of
    them: each part is (positions of its keys among the ``n``, its rows,
    its found), and the rows come out in the order of the ``n`` keys."""
    found = np.zeros(n, bool)
    at = []
    for positions, _, part_found in parts:
        found[positions] = part_found
        at.append(positions[part_found])
    rows = concat_rows([rows for _, rows, _ in parts], dim, state_dim)
    if len(parts) > 1:
        rows = take_rows(rows, np.argsort(np.concatenate(at), kind="stable"))
    return rows, found


def check_top(n: Any) -> int:
    """``top_keys``'s ``n``: an int >= 0."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return int(n)


def top_of(parts: Iterable[tuple[np.ndarray, np.ndarray]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` (key, shows) pairs with the most shows over parts of
    (keys uint64, shows float32), most first, ties by key (a partial sort of
    each part, merged)."""
    best_keys = np.zeros(0, np.uint64)
    best_shows = np.zeros(0, np.float32)
    for keys, shows in parts:
        keys = np.concatenate([best_keys, np.asarray(keys, np.uint64)])
        shows = np.concatenate([best_shows, np.asarray(shows, np.float32)])
        if len(keys) > n:
            keep = np.argpartition(-shows, n - 1)[:n] if n else np.zeros(0, np.int64)
            # ties at the cut: keep the smallest keys among those equal to it
            if n:
                cut = shows[keep].min()
                above = np.flatnonzero(shows > cut)
                at = np.flatnonzero(shows == cut)
                at = at[np.argsort(keys[at], kind="stable")[: n - len(above)]]
                keep = np.concatenate([above, at])
            keys, shows = keys[keep], shows[keep]
        best_keys, best_shows = keys, shows
    order = np.lexsort((best_keys, -best_shows))
    return best_keys[order], best_shows[order]


def load_columns(rows: RowChunk) -> dict[str, np.ndarray | None]:
    """``load`` keyword arguments of a chunk (its field names; no state
    where none was stored)."""
    args = {f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)}
    if rows.state.shape[1] == 0:
        args["state"] = None
    return args
