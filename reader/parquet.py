"""ParquetReader: Parquet files to exact-size CSR batches, in background threads.

Pipeline of one iteration (``iter(reader)``)::

    files of this worker (sorted; shuffled per epoch when shuffling)
      │  unit u = (epoch, file) is read by reader thread u % num_threads
      ▼
    reader threads ── Arrow record batches → Chunks (list values not copied)
      │  one bounded queue per thread; taken back in unit order, so the row
      │  order never depends on thread timing
      ▼
    assembler thread ── exact batch_size rows across row-group and file
      │                 boundaries (a batch inside one chunk is a view),
      │                 optional shuffle buffer
      ▼  key preparation and validation, on a pool of num_threads threads
    bounded output queue of batches (or futures of them, in order)
      ──► for batch in reader: ...

Files may be local or in a ``pyarrow.fs.FileSystem`` (a URI such as
``s3://bucket/prefix/``, or ``filesystem=``; see ``wuliang.reader.storage``):
local files are memory-mapped, the row groups of remote ones are fetched
``read_ahead`` row groups ahead by each reader thread.

Failures: a missing path or empty glob raises at construction; a file whose
schema differs from the first file's raises ValueError naming the file and
column; a corrupt or truncated file raises naming the file, or with
``on_bad_file="skip"`` is skipped and counted (rows read before the damage
are kept). An exception in any background thread is re-raised in the
consumer with its original traceback. ``close()`` (also on ``with`` exit,
``break`` + garbage collection, or interpreter exit) stops and joins every
thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from wuliang.ps_server.cluster import Cluster
from wuliang.ps_server.threads import check_background, set_background
from wuliang.reader.batch import CsrBatch
from wuliang.reader.columns import (
    Chunk,
    Schema,
    chunk_from_record_batch,
    concat_chunks,
    finite_chunks,
    gather_rows,
    slice_chunk,
)
from wuliang.reader.prepare import KeyPreparer
from wuliang.reader.storage import RemoteFile, RowGroupFetcher, locate

log = logging.getLogger("wuliang")

_END = object()  # end of a unit (reader queues) or of the iteration (output queue)
_CHUNK_ROWS = 1 << 16  # Arrow record batch size asked of the Parquet reader


@dataclass
class _Failure:
    """An exception raised in a background thread, carried to the consumer."""

    error: BaseException


@dataclass
class ReaderStats:
    files_read: int = 0
    skipped_files: int = 0
    rows: int = 0
    batches: int = 0
    dropped_rows: int = 0  # non-finite dense values or labels, with non_finite="drop"


@dataclass(frozen=True)
class ReaderPosition:
    """Where a reader stands after a batch (``batch.position``); a reader built
    with the same arguments and ``start=position`` yields exactly the batches
    that followed it.

    Without shuffling the reader seeks: it skips the first ``unit`` files of
    the file sequence (over all epochs) and the first ``row`` rows of the
    next one, ``file``. With shuffling the shuffle buffer's content is part
    of the state, so the reader replays: it reads and drops the first
    ``batches`` batches (same seed, same files: the same batches).

    The last batch of a pass over a bounded number of epochs says so
    (``finished_epochs``: the epochs read). A reader started there reads
    the epochs after them from their beginning, whatever its own
    ``epochs`` (more epochs than the run that wrote the position: the new
    ones are read whole; as many or fewer: nothing is left).
    """

    batches: int  # batches yielded from the beginning
    unit: int  # files of the sequence (all epochs) before `file`
    file: str  # the file the next row comes from ("" at the end)
    row: int  # rows of `file` already yielded
    finished_epochs: int | None = None  # the pass ended here, after this many epochs

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batches": self.batches,
            "unit": self.unit,
            "file": self.file,
            "row": self.row,
        }
        if self.finished_epochs is not None:
            out["finished_epochs"] = self.finished_epochs
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ReaderPosition:
        try:
            finished = d.get("finished_epochs")
            return ReaderPosition(
                int(d["batches"]),
                int(d["unit"]),
                str(d["file"]),
                int(d["row"]),
                None if finished is None else int(finished),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a reader position: {d!r} ({e})") from None


def resolve_paths(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    filesystem: pafs.FileSystem | None = None,
) -> list[str]:
    """Files named by a path, a directory (its *.parquet, recursively), a glob or a
    list of them: each file once, sorted by name. Paths may be URIs
    (``s3://bucket/prefix/*.parquet``), or paths in ``filesystem``; remote
    files are named by their URI (without its query) or their path in
    ``filesystem``."""
    return list(locate(paths, filesystem))


class ParquetReader:
    """Reads Parquet files as ``CsrBatch`` es of exactly ``batch_size`` rows.

    Args:
        paths: a file, a directory, a glob, or a list of them; local, or URIs
            of any filesystem ``pyarrow.fs.FileSystem.from_uri`` opens
            (``s3://bucket/prefix/``, ``gs://…``, ``hdfs://…``; credentials
            from the environment, as pyarrow reads them).
        batch_size: rows per batch (the last one may be smaller).
        features: columns to read; the kind of each follows its Arrow type
            (see ``wuliang.reader.columns``); strings are read as keys
            ``hash_strings(value, column name)`` (see ``hashed_features``).
        label: label column, or a list of them (``batch.labels`` is then a
            dict), or None.
        shuffle_buffer: rows in the shuffle buffer (0: keep file order); when
            shuffling, the file order is also shuffled per epoch.
        seed: seed of every shuffle (same seed, same order).
        num_threads: reader threads (default: the number of CPUs, at most 8).
        worker_index, num_workers: this worker reads files
            ``sorted(files)[worker_index::num_workers]``. Default: in a
            trainer of a ``TF_CONFIG`` cluster (``wuliang.ps_server.
            cluster``) its own shard (``trainer_index`` of ``num_trainers``),
            else every file; pass ``worker_index=0, num_workers=1`` to read
            every file in a cluster (an evaluation).
        epochs: passes over the files (None: forever).
        drop_remainder: drop the last, smaller batch.
        prefetch: batches kept ready ahead of the consumer.
        on_bad_file: ``"raise"`` or ``"skip"`` corrupt or truncated files.
        null_values: null elements in list columns: ``"drop"`` or ``"raise"``.
        non_finite: a NaN or infinite dense value or label (a null label
            too): ``"raise"`` ValueError naming the file, feature and row, or
            ``"drop"`` the row (counted in ``stats.dropped_rows``, logged).
        weights: multi-valued feature -> ``list<float>`` column of its weights.
        prepare: a ``KeyPreparer``; each batch then carries ``prepared`` keys,
            computed in the background.
        validate: check every batch (``CsrBatch.validate``).
        start: a ``ReaderPosition`` (or its dict) to resume from: iteration
            begins with the batch that followed it (see ``ReaderPosition``).
            Each batch's ``position`` says where the reader is after it.
        background: scheduling of the reader's threads, ``"idle"`` or
            ``"normal"`` (see ``wuliang.ps_server.threads``); None: ``"normal"``, or the
            ``Context``'s setting when a training session iterates it.
        filesystem: a ``pyarrow.fs.FileSystem`` (such as ``S3FileSystem(
            endpoint_override=…)``) that the paths are in; paths are then
            not URIs.
        read_ahead: row groups of a remote file that each reader thread
            fetches ahead of the one it converts (0: none). Local files are
            memory-mapped.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        batch_size: int,
        features: Sequence[str] | None = None,
        label: str | Sequence[str] | None = None,
        *,
        shuffle_buffer: int = 0,
        seed: int = 0,
        num_threads: int | None = None,
        worker_index: int | None = None,
        num_workers: int | None = None,
        epochs: int | None = 1,
        drop_remainder: bool = False,
        prefetch: int = 4,
        on_bad_file: str = "raise",
        null_values: str = "drop",
        non_finite: str = "raise",
        weights: Mapping[str, str] | None = None,
        prepare: KeyPreparer | None = None,
        validate: bool = True,
        start: ReaderPosition | Mapping[str, Any] | None = None,
        background: str | None = None,
        filesystem: pafs.FileSystem | None = None,
        read_ahead: int = 2,
    ) -> None:
        _require(
            _is_int(batch_size) and batch_size >= 1,
            f"batch_size must be an int >= 1, got {batch_size!r}",
        )
        _require(
            _is_int(shuffle_buffer) and shuffle_buffer >= 0,
            f"shuffle_buffer must be an int >= 0, got {shuffle_buffer!r}",
        )
        worker_index, num_workers = _shard_of(worker_index, num_workers)
        _require(
            isinstance(num_workers, int) and num_workers >= 1 and 0 <= worker_index < num_workers,
            f"worker_index must be in [0, num_workers), got {worker_index} of {num_workers}",
        )
        _require(
            epochs is None or (_is_int(epochs) and epochs >= 1),
            f"epochs must be an int >= 1 or None, got {epochs!r}",
        )
        _require(
            _is_int(prefetch) and prefetch >= 1, f"prefetch must be an int >= 1, got {prefetch!r}"
        )
        _require(
            _is_int(read_ahead) and read_ahead >= 0,
            f"read_ahead must be an int >= 0, got {read_ahead!r}",
        )
        _require(
            on_bad_file in ("raise", "skip"),
            f"on_bad_file must be 'raise' or 'skip', got {on_bad_file!r}",
        )
        _require(
            null_values in ("drop", "raise"),
            f"null_values must be 'drop' or 'raise', got {null_values!r}",
        )
        _require(
            non_finite in ("drop", "raise"),
            f"non_finite must be 'drop' or 'raise', got {non_finite!r}",
        )
        if isinstance(features, str):
            features = [features]
        _require(features is None or len(features) > 0, "features must name at least one column")
        located = locate(paths, filesystem)
        files = list(located)
        mine = files[worker_index::num_workers]
        if not mine:
            raise ValueError(
                f"worker {worker_index} of {num_workers} has no files ({len(files)} files in all)"
            )
        self.files = mine
        self._remote = {f: r for f in mine if (r := located[f]) is not None}
        self.labels = [] if label is None else [label] if isinstance(label, str) else list(label)
        self.single_label = isinstance(label, str)
        self._first = _first_schema(mine, self._remote, on_bad_file)
        self._weights = dict(weights or {})
        self.schema: Schema | None = None  # until the features are known
        if features is not None:
            self.schema = Schema(self._first[1], self._first[0], list(features), self.labels,
                                 self._weights)  # fmt: skip
        self.batch_size = batch_size
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        _require(self.num_threads >= 1, "num_threads must be >= 1")
        self.epochs = epochs
        self.drop_remainder = drop_remainder
        self.prefetch = prefetch
        self.read_ahead = read_ahead
        self.on_bad_file = on_bad_file
        self.null_values = null_values
        self.non_finite = non_finite
        self.prepare = prepare
        self.validate = validate
        self.background = None if background is None else check_background(background)
        self.start = start
        self.stats = ReaderStats()  # since construction, over all iterations
        self._runs: set[_Run] = set()
        self._finalizer = weakref.finalize(self, _close_runs, self._runs)

    @property
    def features(self) -> list[str] | None:
        """The columns read as features (None: not given yet, see ``read_model``)."""
        return None if self.schema is None else [c.name for c in self.schema.features]

    def read_model(
        self, *, sparse: Sequence[str], dense: Sequence[str], label: str | Sequence[str] | None
    ) -> None:
        """What a model reads (``Session`` and ``Estimator`` call it before
        iterating): a reader built without ``features`` (or ``label``)
        reads the model's; one built with them is checked now, before any
        thread starts, so a feature it lacks, or reads as the wrong kind,
        is a ValueError naming it instead of a failure in a reader thread."""
        if self.schema is None:
            if label is not None and not self.labels:
                self.labels = [label] if isinstance(label, str) else list(label)
                self.single_label = isinstance(label, str)
            path, arrow = self._first
            self.schema = Schema(arrow, path, [*sparse, *dense], self.labels, self._weights)
        kinds = {c.name: c.kind for c in self.schema.features}
        types = {c.name: c.type for c in self.schema.features}
        missing = [name for name in [*sparse, *dense] if name not in kinds]
        if missing:
            raise ValueError(
                f"the model reads feature(s) {', '.join(map(repr, missing))}, which this reader "
                f"does not (features={list(kinds)}): add them to features=, or build the reader "
                "without features= and it reads what the model needs"
            )
        for name in dense:
            if kinds[name] != "dense":
                raise ValueError(
                    f"DenseFeature {name!r}: the column is {types[name]}, which the "
                    "reader reads as ids (a SparseFeature); a dense feature needs a float or "
                    "bool column (or a fixed-size list of floats): store it as a float column "
                    "(`wuliang convert csv` kind dense), or use it as a SparseFeature"
                )
        for name in sparse:
            if kinds[name] == "dense":
                raise ValueError(
                    f"SparseFeature {name!r}: the column is {types[name]}, which "
                    "the reader reads as numbers (a DenseFeature); a sparse feature needs "
                    "integer ids or strings (or lists of them)"
                )

    @property
    def hashed_features(self) -> dict[str, str]:
        """Requested sparse features whose keys are hashed strings, each mapped
        to the field that seeds the hash (``hash_strings(value, field)``):
        string columns (field: the column name) and key columns whose field
        metadata in the first file carries a ``hashing.HASH_METADATA`` tag."""
        return {} if self.schema is None else dict(self.schema.hashed_features)

    @property
    def start(self) -> ReaderPosition | None:
        return self._start

    @start.setter
    def start(self, position: ReaderPosition | Mapping[str, Any] | None) -> None:
        """Where the next iteration begins (checked against the files)."""
        if position is not None and not isinstance(position, ReaderPosition):
            position = ReaderPosition.from_dict(position)
        if position is not None and self.shuffle_buffer == 0 and position.file:
            expected = self.files[position.unit % len(self.files)] if position.unit >= 0 else ""
            if expected != position.file:
                raise ValueError(
                    f"reader position is in file #{position.unit} {position.file!r}, "
                    f"but this reader's file #{position.unit} is {expected!r}: "
                    "resume with the files of the run that wrote the position"
                )
        self._start = position

    def __iter__(self) -> Iterator[CsrBatch]:
        """A new pass over the data, on its own threads (iterations are independent)."""
        if self.schema is None:
            raise ValueError(
                "the reader has no features: give features=[...], or hand it to an Estimator "
                "or Session, which tells it what the model reads"
            )
        run = _Run(self, self._runs.discard)
        self._runs.add(run)
        return run.batches(owner=self)

    def close(self) -> None:
        """Stops the background threads of every iteration and waits for them;
        their iterators then end."""
        _close_runs(self._runs)

    def __enter__(self) -> ParquetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_runs(runs: set[_Run]) -> None:
    for run in list(runs):
        run.close()


def _first_schema(
    files: list[str], remote: Mapping[str, RemoteFile], on_bad_file: str
) -> tuple[str, pa.Schema]:
    """The first readable file and its schema (bad files before it: per on_bad_file)."""
    for path in files:
        try:
            where = remote.get(path)
            return path, pq.read_schema(path) if where is None else where.read_schema()
        except (OSError, pa.ArrowException) as e:
            if on_bad_file == "raise":
                raise ValueError(f"corrupt or truncated Parquet file {path}: {e}") from e
    raise ValueError(f"none of the {len(files)} files is a readable Parquet file")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class _Run:
    """The threads and queues of one iteration. The threads hold no reference
    to the reader; the iterator does, so a reader lives while it is iterated
    and an abandoned one is garbage collected (and closes its runs)."""

    def __init__(self, reader: ParquetReader, on_close: Callable[[_Run], None]) -> None:
        self.cfg = _Config(reader)
        self.stats = reader.stats
        self.on_close = on_close
        self.stop = threading.Event()
        k = self.cfg.num_threads
        self.unit_queues: list[queue.Queue] = [queue.Queue(maxsize=2) for _ in range(k)]
        self.out: queue.Queue = queue.Queue(maxsize=self.cfg.prefetch)
        self.threads = [
            threading.Thread(
                target=self._read_units, args=(j,), name=f"wuliang-read-{j}", daemon=True
            )
            for j in range(k)
        ]
        self.threads.append(
            threading.Thread(target=self._assemble, name="wuliang-assemble", daemon=True)
        )
        self.pool: ThreadPoolExecutor | None = None
        if self.cfg.prepare is not None or self.cfg.validate:
            self.pool = ThreadPoolExecutor(
                k,
                thread_name_prefix="wuliang-prepare",
                initializer=set_background,
                initargs=(self.cfg.background,),
            )
        for t in self.threads:
            t.start()

    # -- consumer side -------------------------------------------------------

    def batches(self, owner: ParquetReader) -> Iterator[CsrBatch]:
        try:
            while True:
                item = self._get(self.out)  # _END once closed
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item.result() if isinstance(item, Future) else item
        finally:
            self.close()

    def close(self) -> None:
        self.on_close(self)
        self.stop.set()
        for q in [*self.unit_queues, self.out]:
            _drain(q)
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    # -- producer side -------------------------------------------------------

    def _put(self, q: queue.Queue, item: object) -> bool:
        """Puts unless stopped; returns False once stopped."""
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue) -> object:
        while True:
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                if self.stop.is_set():
                    return _END

    def _units(self) -> Iterator[str]:
        epoch = 0
        while self.cfg.epochs is None or epoch < self.cfg.epochs:
            files = list(self.cfg.files)
            if self.cfg.shuffle_buffer > 0:
                np.random.default_rng([self.cfg.seed, epoch]).shuffle(files)
            yield from files
            epoch += 1

    def _read_units(self, thread: int) -> None:
        set_background(self.cfg.background)
        k = self.cfg.num_threads
        q = self.unit_queues[thread]
        fetcher = RowGroupFetcher(
            self.cfg.read_ahead, f"wuliang-fetch-{thread}", set_background, (self.cfg.background,)
        )
        try:
            skip_units = self.cfg.skip_units
            for u, path in enumerate(self._units()):
                if u % k != thread or u < skip_units:
                    continue
                skip = self.cfg.skip_rows if u == skip_units else 0
                for chunk in self._read_file(path, fetcher, skip):
                    if not self._put(q, chunk):
                        return
                if not self._put(q, _END):
                    return
        except BaseException as e:
            self._put(q, _Failure(e))
        finally:
            fetcher.close()

    def _read_file(
        self, path: str, fetcher: RowGroupFetcher, skip_rows: int = 0
    ) -> Iterator[Chunk]:
        """The file's rows from row skip_rows on, chunk by chunk."""
        remote = self.cfg.remote.get(path)
        try:
            source = path if remote is None else remote.open()
        except (OSError, pa.ArrowException) as e:
            yield from self._bad_file(path, e)
            return
        try:
            yield from self._read_source(path, source, fetcher, skip_rows)
        finally:
            if remote is not None:
                source.close()  # type: ignore[union-attr]

    def _read_source(
        self, path: str, source: str | pa.NativeFile, fetcher: RowGroupFetcher, skip_rows: int
    ) -> Iterator[Chunk]:
        cfg = self.cfg
        try:
            if isinstance(source, str):
                pf = pq.ParquetFile(source, memory_map=True)
            else:
                pf = pq.ParquetFile(source, pre_buffer=True)
        except (OSError, pa.ArrowException) as e:
            yield from self._bad_file(path, e)
            return
        cfg.schema.check(pf.schema_arrow, path)
        groups = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
        first_group = first_row = 0
        while first_group < len(groups) and first_row + groups[first_group] <= skip_rows:
            first_row += groups[first_group]  # whole row groups before the start: not read
            first_group += 1
        chunk_rows = max(_CHUNK_ROWS, cfg.batch_size)
        if isinstance(source, str):
            batches = pf.iter_batches(
                batch_size=chunk_rows,
                row_groups=range(first_group, len(groups)),
                columns=cfg.schema.column_names,
                use_threads=False,
            )
        else:  # remote: row groups read ahead on the fetcher's threads
            batches = fetcher.batches(
                source,
                pf.metadata,
                range(first_group, len(groups)),
                cfg.schema.column_names,
                chunk_rows,
            )
        try:
            whole = yield from self._convert(path, batches, first_row, skip_rows)
        finally:
            batches.close()
        if whole:
            with self.cfg.lock:
                self.stats.files_read += 1

    def _convert(
        self, path: str, batches: Iterator[pa.RecordBatch], first_row: int, skip_rows: int
    ) -> Generator[Chunk, None, bool]:
        """Chunks of the record batches (first_row: the file's row of the first
        one); returns False if the file turned out bad (and is skipped)."""
        cfg = self.cfg
        while True:
            try:
                rb = next(batches)
            except StopIteration:
                break
            except (OSError, pa.ArrowException) as e:
                yield from self._bad_file(path, e)
                return False
            if first_row < skip_rows:  # the part of the first row group before the start
                cut = min(skip_rows - first_row, rb.num_rows)
                rb, first_row = rb.slice(cut), first_row + cut
                if rb.num_rows == 0:
                    continue
            chunk = chunk_from_record_batch(rb, cfg.schema, cfg.null_values, path, first_row)
            kept, dropped = finite_chunks(chunk, cfg.schema, cfg.non_finite)
            if dropped:
                with cfg.lock:
                    self.stats.dropped_rows += dropped
                log.warning("%s: dropped %d rows with non-finite values", path, dropped)
            yield from kept
            first_row += rb.num_rows
        return True

    def _bad_file(self, path: str, error: Exception) -> Iterator[Chunk]:
        if self.cfg.on_bad_file == "raise":
            raise ValueError(f"corrupt or truncated Parquet file {path}: {error}") from error
        with self.cfg.lock:
            self.stats.skipped_files += 1
        return iter(())

    def _chunks(self) -> Iterator[Chunk]:
        """Chunks of every unit, in unit order; ``chunk.unit`` set."""
        k = self.cfg.num_threads
        for u, _ in enumerate(self._units()):
            if u < self.cfg.skip_units:
                continue
            q = self.unit_queues[u % k]
            while True:
                item = self._get(q)
                if item is _END:
                    break
                if isinstance(item, _Failure):
                    raise item.error
                item.unit = u  # type: ignore[union-attr]
                yield item  # type: ignore[misc]
            if self.stop.is_set():
                return

    def _assemble(self) -> None:
        cfg = self.cfg
        set_background(cfg.background)
        held: CsrBatch | None = None  # one batch back: the last one learns it is
        try:
            batcher = _ShuffleBatcher(cfg) if cfg.shuffle_buffer > 0 else _Batcher(cfg)
            count = cfg.first_batch - cfg.replay  # batches before the first one read
            for chunk, (unit, source, row) in batcher.batches(self._chunks()):
                count += 1
                if count <= cfg.first_batch:  # replaying up to a shuffled reader's start
                    continue
                batch = chunk.to_batch(cfg.single_label)
                batch.dense_columns = cfg.schema.dense_columns
                batch.position = ReaderPosition(count, unit, source, row)
                last, held = held, batch
                if last is not None and not self._emit(last):
                    return
            last, held = held, None
            if last is not None:
                if cfg.epochs is not None:
                    last.position = dataclasses.replace(last.position, finished_epochs=cfg.epochs)
                if not self._emit(last):
                    return
            self._put(self.out, _END)
        except BaseException as e:
            if held is not None:
                self._emit(held)  # the batches before the failure come first
            self._put(self.out, _Failure(e))

    def _emit(self, batch: CsrBatch) -> bool:
        """Counts the batch and hands it on (to the pool first, if any)."""
        with self.cfg.lock:
            self.stats.rows += batch.size
            self.stats.batches += 1
        item = batch if self.pool is None else self.pool.submit(_finish, batch, self.cfg)
        return self._put(self.out, item)


def _finish(batch: CsrBatch, cfg: _Config) -> CsrBatch:
    """Validation and key preparation, on the pool (C++ work runs without the GIL)."""
    if cfg.validate:
        batch.validate()  # sets batch.validated
    if cfg.prepare is not None:
        batch.prepared = cfg.prepare(batch)
    return batch


class _Config:
    """What the threads need of the reader (a copy: no reference to it)."""

    def __init__(self, r: ParquetReader) -> None:
        self.files = list(r.files)
        self.schema = r.schema
        self.batch_size = r.batch_size
        self.shuffle_buffer = r.shuffle_buffer
        self.seed = r.seed
        self.num_threads = r.num_threads
        self.epochs = r.epochs
        self.drop_remainder = r.drop_remainder
        self.prefetch = r.prefetch
        self.remote = dict(r._remote)
        self.read_ahead = r.read_ahead
        self.on_bad_file = r.on_bad_file
        self.null_values = r.null_values
        self.non_finite = r.non_finite
        self.single_label = r.single_label
        self.prepare = r.prepare
        self.validate = r.validate
        self.background = r.background or "normal"
        self.start = r.start
        # seeking (no shuffle): skip `skip_units` files and `skip_rows` rows of the next
        seek = r.start is not None and r.shuffle_buffer == 0
        self.skip_units = r.start.unit if seek and r.start else 0
        self.skip_rows = r.start.row if seek and r.start else 0
        self.replay = r.start.batches if r.start is not None and not seek else 0
        self.first_batch = r.start.batches if r.start is not None else 0
        finished = None if r.start is None else r.start.finished_epochs
        if finished is not None:  # a pass that ended: the epochs after it, from their start
            self.skip_units = finished * len(self.files)
            self.skip_rows = self.replay = 0
        self.lock = threading.Lock()


_End = tuple[int, str, int]  # (unit, file, row) just past a batch's rows


class _Batcher:
    """Exact-size batches in input order; a batch inside one chunk is a view."""

    def __init__(self, cfg: _Config) -> None:
        self.size = cfg.batch_size
        self.drop_remainder = cfg.drop_remainder

    def batches(self, chunks: Iterator[Chunk]) -> Iterator[tuple[Chunk, _End]]:
        """Batches, each with the (unit, file, row) just past its last row."""
        pending: list[Chunk] = []
        have = 0
        for chunk in chunks:
            unit = getattr(chunk, "unit", -1)
            start = 0
            if pending:  # complete the batch begun by earlier chunks
                take = min(self.size - have, chunk.size)
                pending.append(slice_chunk(chunk, 0, take))
                have += take
                start = take
                if have == self.size:
                    yield concat_chunks(pending), (unit, chunk.source, chunk.first_row + take)
                    pending, have = [], 0
            while chunk.size - start >= self.size:
                end = (unit, chunk.source, chunk.first_row + start + self.size)
                yield slice_chunk(chunk, start, start + self.size), end
                start += self.size
            if start < chunk.size:
                pending.append(slice_chunk(chunk, start, chunk.size))
                have += chunk.size - start
            if pending:  # the batch so far ends with this chunk
                last = (unit, chunk.source, chunk.first_row + chunk.size)
        if pending and not self.drop_remainder:
            yield concat_chunks(pending), last


class _ShuffleBatcher:
    """Batches drawn at random from a buffer of ``shuffle_buffer`` rows.

    The buffer holds references (chunk, row); each batch takes batch_size
    random references, whose places are refilled by the next input rows.
    The draw is seeded, so the order is a function of the seed and the input.
    """

    def __init__(self, cfg: _Config) -> None:
        self.size = cfg.batch_size
        self.capacity = max(cfg.shuffle_buffer, cfg.batch_size)
        self.drop_remainder = cfg.drop_remainder
        self.rng = np.random.default_rng(cfg.seed)

    def batches(self, chunks: Iterator[Chunk]) -> Iterator[tuple[Chunk, _End]]:
        """Batches, each with the input's (unit, file, row) when it was drawn."""
        store: dict[int, Chunk] = {}
        read: _End = (-1, "", 0)
        refs_chunk = np.zeros(0, dtype=np.int64)
        refs_row = np.zeros(0, dtype=np.int64)
        for chunk_id, chunk in enumerate(chunks):
            store[chunk_id] = chunk
            read = (getattr(chunk, "unit", -1), chunk.source, chunk.first_row + chunk.size)
            refs_chunk = np.concatenate([refs_chunk, np.full(chunk.size, chunk_id)])
            refs_row = np.concatenate([refs_row, np.arange(chunk.size)])
            while len(refs_row) >= self.capacity + self.size:
                refs_chunk, refs_row, batch = self._draw(store, refs_chunk, refs_row)
                yield batch, read
        while len(refs_row) >= self.size or (len(refs_row) and not self.drop_remainder):
            refs_chunk, refs_row, batch = self._draw(store, refs_chunk, refs_row)
            yield batch, read

    def _draw(
        self, store: dict[int, Chunk], refs_chunk: np.ndarray, refs_row: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, Chunk]:
        # Draw among the first `capacity` rows; rows behind them move up into
        # the places taken (the buffer refills from the input in order).
        window = min(len(refs_row), self.capacity)
        take = min(self.size, window)
        picked = self.rng.choice(window, size=take, replace=False)
        out_chunk, out_row = refs_chunk[picked], refs_row[picked]
        keep = np.ones(len(refs_row), dtype=bool)
        keep[picked] = False
        refs_chunk, refs_row = refs_chunk[keep], refs_row[keep]
        parts = []
        for cid in np.unique(out_chunk):
            rows = out_row[out_chunk == cid]
            parts.append(gather_rows(store[int(cid)], rows))
        batch = concat_chunks(parts)  # rows grouped by chunk: a batch is a set
        live = set(np.unique(refs_chunk).tolist())
        for cid in [c for c in store if c not in live]:
            del store[cid]
        return refs_chunk, refs_row, batch


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def _shard_of(worker_index: int | None, num_workers: int | None) -> tuple[int, int]:
    """The shard a reader reads: as given, or, when neither is given, this
    trainer's of its TF_CONFIG cluster, or all files."""
    if worker_index is not None or num_workers is not None:
        return (0 if worker_index is None else worker_index), (
            1 if num_workers is None else num_workers
        )
    cluster = Cluster.from_env()
    if cluster is None or not cluster.is_trainer:
        return 0, 1
    return cluster.trainer_index, cluster.num_trainers
