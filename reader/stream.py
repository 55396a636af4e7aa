"""Batches of a partitioned dataset followed as it lands: ``StreamReader``.

A ``StreamReader`` reads the partitions a ``PartitionSource`` gives
(complete ones, oldest first, waiting for the next), each with a
``ParquetReader`` over this trainer's share of its files
(``Partition.files_for``), and yields their batches one partition after
another: a batch never holds rows of two partitions, and says which it is
of (``batch.partition``). Once a partition's first batch is out, the next
complete partition's reader starts (its threads read ahead), so a
partition boundary costs no wait for the first batches of the next; if
another partition comes first after all (a late one), that reader is
closed unused.

Its position (``batch.position``, a ``StreamPosition``) is where the
stream stands after the batch: the source's state (the partitions done)
and, unless the batch ended its partition, the partition and the
``ReaderPosition`` inside it. The last batch of a partition records the
partition done in the same position. So a checkpoint that keeps the
position of the last batch trained (as ``Session.save`` does) resumes
exactly after it: no row trained twice, none skipped, across restarts.

The model tells it what to read (``read_model``, as ``Session`` and
``Estimator`` do); the columns of the first partition then decide the
features' kinds and hashing, so ``read_model`` waits for the first
complete partition (up to ``timeout``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wuliang.reader.batch import CsrBatch
from wuliang.reader.parquet import ParquetReader, ReaderPosition, _shard_of
from wuliang.reader.partitions import Partition, PartitionSource

__all__ = ["StreamPosition", "StreamReader", "ends_partition"]


@dataclass(frozen=True)
class _Ahead:
    """A partition's reader started before its turn."""

    partition: Partition
    reader: ParquetReader
    batches: Iterator[CsrBatch]


@dataclass(frozen=True)
class StreamPosition:
    """Where a ``StreamReader`` stands after a batch (see the module docstring)."""

    partitions: Mapping[str, Any]  # PartitionSource.state() after the batch
    partition: str | None = None  # the partition being read, unless the batch ended it
    inner: ReaderPosition | None = None  # where in it

    def to_dict(self) -> dict[str, Any]:
        return {
            "partitions": dict(self.partitions),
            "partition": self.partition,
            "inner": None if self.inner is None else self.inner.to_dict(),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> StreamPosition:
        try:
            inner = d.get("inner")
            partition = d.get("partition")
            if partition is not None and not isinstance(partition, str):
                raise TypeError("partition is not a name")
            return StreamPosition(
                dict(d["partitions"]),
                partition,
                None if inner is None else ReaderPosition.from_dict(inner),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a stream position: {d!r} ({e})") from None


def ends_partition(batch: CsrBatch) -> Partition | None:
    """The partition a batch of a ``StreamReader`` ends (its last batch for
    this trainer), else None."""
    position = getattr(batch, "position", None)
    if isinstance(position, StreamPosition) and position.partition is None:
        return batch.partition
    return None


class StreamReader:
    """The batches of the partitions ``source`` follows (see the module
    docstring).

    Args:
        source: the partitions, and what is done of them.
        batch_size: rows of a batch.
        features: the columns read as features (None: the model's).
        label: the label column(s) (None: the model's).
        worker_index, num_workers: this trainer's share of each partition's
            files (default: from ``TF_CONFIG``, else all).
        timeout: seconds to wait for a partition (None: for ever); then the
            iteration ends.
        start: a position to resume from (or its dict).
        **reader_args: for each partition's ``ParquetReader`` (``shuffle_buffer``,
            ``num_threads``, ``on_bad_file``, ``non_finite``, ``weights``,
            ``filesystem`` ...; not ``epochs``: a partition is read once).
    """

    def __init__(
        self,
        source: PartitionSource,
        batch_size: int,
        features: Sequence[str] | None = None,
        label: str | Sequence[str] | None = None,
        *,
        worker_index: int | None = None,
        num_workers: int | None = None,
        timeout: float | None = None,
        start: StreamPosition | Mapping[str, Any] | None = None,
        **reader_args: Any,
    ) -> None:
        if "epochs" in reader_args or "start" in reader_args:
            raise ValueError("a StreamReader reads each partition once: no epochs= or inner start=")
        self.source = source
        self.batch_size = batch_size
        self.features = None if features is None else list(features)
        self.label = label
        self.index, self.count = _shard_of(worker_index, num_workers)
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"worker_index must be in [0, num_workers), got {self.index} of {self.count}"
            )
        self.timeout = timeout
        self.prepare = reader_args.pop("prepare", None)
        self.background = reader_args.pop("background", None)
        self._reader_args = reader_args
        self._model: dict[str, Any] | None = None
        self._hashed: dict[str, str] = {}
        self.labels: list[str] | None = None
        self.start = start

    @property
    def start(self) -> StreamPosition | None:
        return self._start

    @start.setter
    def start(self, position: StreamPosition | Mapping[str, Any] | None) -> None:
        if position is not None and not isinstance(position, StreamPosition):
            position = StreamPosition.from_dict(position)
        self._start = position

    @property
    def hashed_features(self) -> dict[str, str]:
        """The sparse features read from strings (see ``ParquetReader``)."""
        return dict(self._hashed)

    def read_model(
        self, *, sparse: Sequence[str], dense: Sequence[str], label: str | Sequence[str] | None
    ) -> None:
        """What the model reads; checked against the first complete
        partition's columns, waited for up to ``timeout``."""
        self._model = {"sparse": list(sparse), "dense": list(dense), "label": label}
        pending = self.source.wait(self.timeout)
        first = pending[0] if pending else None
        if first is None:
            raise TimeoutError(
                f"no complete partition in {self.source.root} within {self.timeout} s: the "
                "model's features are read from the first one"
            )
        template = self._reader(first.files, None)
        self.labels = template.labels
        self._hashed = template.hashed_features

    def _reader(self, files: Sequence[str], start: ReaderPosition | None) -> ParquetReader:
        reader = ParquetReader(
            list(files),
            self.batch_size,
            self.features,
            self.label,
            worker_index=0,
            num_workers=1,
            epochs=1,
            start=start,
            prepare=self.prepare,
            background=self.background,
            **self._reader_args,
        )
        if self._model is not None:
            reader.read_model(**self._model)
        return reader

    def __iter__(self) -> Iterator[CsrBatch]:
        """The batches from where ``start`` says (or the source stands) on,
        partition after partition, until no partition comes within
        ``timeout``. ``start`` is taken now, not when the first batch is
        asked for (``Session`` sets it only around this call)."""
        return self._batches(self._start)

    def stop(self) -> None:
        """Ends the iteration: a wait for a partition ends at once, and no
        batch follows the one being read (``Session.train`` calls it on
        SIGTERM). The position of the last batch trained stays exact."""
        self.source.stop()

    def _batches(self, position: StreamPosition | None) -> Iterator[CsrBatch]:
        resume: tuple[str, ReaderPosition | None] | None = None
        if position is not None:
            self.source.restore(position.partitions)
            if position.partition is not None:
                resume = position.partition, position.inner
        ahead: _Ahead | None = None  # the next partition, opened while this one is read
        try:
            while True:
                if resume is not None:
                    partition = self._resumed(resume[0])
                    inner_start, resume = resume[1], None
                else:
                    partition = self.source.next(self.timeout)
                    inner_start = None
                    if partition is None or self.source.stopped:
                        return
                opened = None
                if ahead is not None:
                    if ahead.partition.name == partition.name and inner_start is None:
                        opened = ahead.batches
                    else:
                        ahead.reader.close()
                    ahead = None
                for k, batch in enumerate(self._partition(partition, inner_start, opened)):
                    yield batch
                    if k == 0:  # its first batch is out: start reading the next one
                        ahead = self._open_next(partition)
        finally:
            if ahead is not None:
                ahead.reader.close()

    def _open_next(self, current: Partition) -> _Ahead | None:
        """The partition ``next`` will most likely give after ``current``
        (the oldest complete one not done), its reader started."""
        for partition in self.source.ready():
            if partition.name == current.name:
                continue
            files = partition.files_for(self.index, self.count)
            if not files:
                return None
            reader = self._reader(files, None)
            return _Ahead(partition, reader, iter(reader))
        return None

    def _resumed(self, name: str) -> Partition:
        for partition in self.source.ready():
            if partition.name == name:
                return partition
        raise ValueError(
            f"the position is inside partition {name!r} of {self.source.root}, which is no "
            "longer a complete partition there: resume with the data of the run that wrote it"
        )

    def _partition(
        self,
        partition: Partition,
        start: ReaderPosition | None,
        opened: Iterator[CsrBatch] | None = None,
    ) -> Iterator[CsrBatch]:
        """Its batches (from ``opened``, its reader started ahead, if given)."""
        files = partition.files_for(self.index, self.count)
        if files:
            for batch in opened if opened is not None else self._reader(files, start):
                inner = batch.position
                last = inner.finished_epochs is not None
                if last:
                    self.source.done(partition)
                batch.position = StreamPosition(
                    self.source.state(),
                    None if last else partition.name,
                    None if last else inner,
                )
                batch.partition = partition
                yield batch
                if self.source.stopped:
                    return
        if not self.source.is_done(partition):  # nothing of it for this trainer
            self.source.done(partition)
