"""Following a partitioned dataset as it lands: which partitions are
complete, in what order to train them, and what a trainer of a job reads.

A dataset is a root (a local folder, or a URI the reader reads: ``s3://``,
``gs://``, ``hdfs://``) holding one folder per partition, named by the
time its rows are of:

* **Hive style** (``layout="hive"``, the default): folders of
  ``key=value`` levels, ``dt=2026-11-29/hour=05/``. The keys a time is read
  from: ``dt`` or ``date`` (``2026-11-29`` or ``20261129``), ``year``,
  ``month``, ``day``, ``hour``, ``minute``; other keys are kept in the name
  and ignored for the time.
* **A pattern of time fields** (``layout="{YYYY}{MM}{DD}/{HH}"``, as TFX's
  ExampleGen names spans): ``{YYYY}``, ``{MM}``, ``{DD}``, ``{HH}`` and
  ``{mm}`` (minutes) stand for digits, anything else for itself; the
  pattern's folder levels are the partition's.

A partition is **complete** when its marker is there (``marker``, default
``_SUCCESS``, the empty file Hadoop's and Spark's committers write last),
and then its files are the ``*.parquet`` below it (but none under a
level starting with ``_`` or ``.``, which committers and tools leave); or, with
``manifest=NAME``, when the JSON file NAME is there, listing the partition's
files (``{"files": ["part-0.parquet", ...]}``, relative to the partition),
each of which must exist. A partition without either is still being
written and is not read.

``PartitionSource.ready()`` lists the store again at every call (a late
partition is never missed because a pattern was globbed once) and returns
the complete partitions not yet done, oldest first. ``next(timeout)`` waits
for one with bounded polling (every ``poll_s``), saying in the log what it
waits for. A partition older than one already done is **late**: it is
returned when it lands, its lateness (how much older than the newest done)
logged and counted, unless ``late="skip"``, which records it done without
training it, also logged and counted.

Trainers of one job split each partition's files: trainer ``index`` of
``count`` reads the files ``index``, ``index + count``, ... of the
partition's sorted list (``Partition.files_for``), so no file is read by
two trainers; every trainer walks the same partitions in the same order.

``state()`` is what a checkpoint keeps (the partitions done, the newest
time done, the late counts), ``PartitionSource(..., state=...)`` resumes
from it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from wuliang.ps_server.storage.location import from_uri, is_uri

__all__ = ["DEFAULT_MARKER", "Partition", "PartitionError", "PartitionSource"]

log = logging.getLogger("wuliang")

DEFAULT_MARKER = "_SUCCESS"
LATE_POLICIES = ("train", "skip")
_FIELDS = {"YYYY": 4, "MM": 2, "DD": 2, "HH": 2, "mm": 2}
_HIVE_KEYS = ("dt", "date", "year", "month", "day", "hour", "minute")


class PartitionError(ValueError):
    """A partition that cannot be read as it is (its manifest, its name, a
    file it lists): the message names it."""


@dataclass(frozen=True)
class Partition:
    """A complete partition: its name (the path below the root, the key in
    a source's state), the time its rows are of, and its files (full names,
    sorted)."""

    name: str
    time: dt.datetime  # naive, read as UTC
    files: tuple[str, ...]

    @property
    def seconds(self) -> int:
        """The time in unix seconds (UTC)."""
        return int(self.time.replace(tzinfo=dt.timezone.utc).timestamp())

    def files_for(self, index: int = 0, count: int = 1) -> tuple[str, ...]:
        """The files trainer ``index`` of ``count`` reads."""
        if not 0 <= index < count:
            raise ValueError(f"trainer index {index} is not in [0, {count})")
        return self.files[index::count]


class PartitionSource:
    """The complete partitions of a dataset root, oldest first (see the
    module docstring).

    Args:
        root: the dataset's folder or URI.
        layout: ``"hive"`` or a pattern of time fields.
        marker: the file that completes a partition (without ``manifest``).
        manifest: the JSON file that completes a partition and lists its files.
        poll_s: seconds between two listings while ``next`` waits.
        late: ``"train"`` a partition older than one done when it lands, or
            ``"skip"`` it (recorded done, not trained).
        filesystem: a ``pyarrow.fs.FileSystem`` the root is a path in.
        state: a ``state()`` to resume from.
        clock: seconds, for ``next`` 's waits (tests).
        sleep: waits that many seconds (tests; default: a wait that ``stop``
            ends at once).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        layout: str = "hive",
        marker: str = DEFAULT_MARKER,
        manifest: str | None = None,
        poll_s: float = 5.0,
        late: str = "train",
        filesystem: pafs.FileSystem | None = None,
        state: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if late not in LATE_POLICIES:
            raise ValueError(f"late must be one of {LATE_POLICIES}, got {late!r}")
        if not isinstance(poll_s, int | float) or not 0 < poll_s < float("inf"):
            raise ValueError(f"poll_s must be a positive number of seconds, got {poll_s!r}")
        for name, value in (("marker", marker), ("manifest", manifest)):
            if value is not None and (not value or "/" in value):
                raise ValueError(f"{name} must be a file name (no '/'), got {value!r}")
        self.layout = layout
        self.marker = marker
        self.manifest = manifest
        self.poll_s = float(poll_s)
        self.late = late
        self._clock = clock
        self._stopped = threading.Event()
        self._sleep = sleep if sleep is not None else self._stopped.wait
        self._parse = _hive_time if layout == "hive" else _pattern_parser(layout)
        self._depth = None if layout == "hive" else layout.strip("/").count("/") + 1
        text = os.fspath(root)
        if filesystem is not None:
            self._fs, self._prefix, self._root = filesystem, "", text.rstrip("/")
        elif is_uri(text):
            self._fs, self._prefix, self._root = from_uri(text.partition("?")[0])
        else:
            self._fs, self._prefix = pafs.LocalFileSystem(), ""
            self._root = str(Path(text).resolve())
        self.root = text
        self._done: set[str] = set()
        self._newest: dt.datetime | None = None
        self.late_trained = 0  # late partitions trained when they landed
        self.late_skipped = 0  # late partitions passed by (late="skip")
        self._not_partitions: set[str] = set()  # names logged as no partition time
        if state is not None:
            self.restore(state)

    # -- state ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps to resume from (JSON-ready)."""
        return {
            "done": sorted(self._done),
            "newest": None if self._newest is None else self._newest.isoformat(),
            "late_trained": self.late_trained,
            "late_skipped": self.late_skipped,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Stands where ``state`` (a ``state()``) says."""
        try:
            done = state["done"]
            newest = state["newest"]
            if not isinstance(done, list) or not all(isinstance(n, str) for n in done):
                raise TypeError("done is not a list of partition names")
            self._done = set(done)
            self._newest = None if newest is None else dt.datetime.fromisoformat(newest)
            self.late_trained = int(state.get("late_trained", 0))
            self.late_skipped = int(state.get("late_skipped", 0))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a partition source's state: {error}") from None

    @property
    def newest(self) -> dt.datetime | None:
        """The time of the newest partition done."""
        return self._newest

    def is_done(self, partition: Partition | str) -> bool:
        return (partition.name if isinstance(partition, Partition) else partition) in self._done

    def done(self, partition: Partition) -> None:
        """Records a partition trained (its rows all in the model)."""
        self._done.add(partition.name)
        if self._newest is None or partition.time > self._newest:
            self._newest = partition.time

    # -- listing -------------------------------------------------------------------

    def ready(self) -> list[Partition]:
        """The complete partitions not done yet, oldest first (late ones,
        older than the newest done, among them by their time)."""
        found = []
        for name, files in self._listing().items():
            if name in self._done:
                continue
            partition = self._complete(name, files)
            if partition is not None:
                found.append(partition)
        return sorted(found, key=lambda p: (p.time, p.name))

    def _listing(self) -> dict[str, set[str]]:
        """Partition name -> the names of the files below it (relative)."""
        selector = pafs.FileSelector(self._root, recursive=True, allow_not_found=True)
        try:
            infos = self._fs.get_file_info(selector)
        except OSError as error:
            raise OSError(f"cannot list the partitions of {self.root!r}: {error}") from error
        listing: dict[str, set[str]] = {}
        root = self._root.rstrip("/")
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            relative = info.path[len(root) + 1 :] if info.path.startswith(root + "/") else ""
            parts = relative.split("/")
            depth = self._partition_depth(parts)
            if depth is None or len(parts) <= depth:
                continue
            name = "/".join(parts[:depth])
            listing.setdefault(name, set()).add("/".join(parts[depth:]))
        return listing

    def _partition_depth(self, parts: Sequence[str]) -> int | None:
        """How many of a file's leading folders name its partition."""
        if self._depth is not None:
            return self._depth
        depth = 0
        while depth < len(parts) - 1 and "=" in parts[depth]:
            depth += 1
        return depth or None

    def _complete(self, name: str, files: set[str]) -> Partition | None:
        """The partition ``name`` if it is complete, else None; a name that
        is no partition time is skipped (logged once)."""
        try:
            when = self._parse(name)
        except PartitionError as error:
            if name not in self._not_partitions:
                self._not_partitions.add(name)
                log.warning("%s: %s; not a partition, left alone", self._shown(name), error)
            return None
        if self.manifest is not None:
            if self.manifest not in files:
                return None
            listed = self._manifest_files(name, files)
        else:
            if self.marker not in files:
                return None
            listed = sorted(f for f in files if f.endswith(".parquet") and not _hidden(f))
        full = tuple(sorted(self._full(f"{name}/{f}") for f in listed))
        return Partition(name, when, full)

    def _manifest_files(self, name: str, files: set[str]) -> list[str]:
        path = f"{self._root}/{name}/{self.manifest}"
        shown = self._shown(f"{name}/{self.manifest}")
        try:
            with self._fs.open_input_stream(path) as stream:
                manifest = json.loads(stream.read())
            listed = manifest["files"]
            if not isinstance(listed, list) or not all(isinstance(f, str) for f in listed):
                raise TypeError("'files' is not a list of file names")
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise PartitionError(f'{shown}: not a manifest ({{"files": [...]}}): {error}') from None
        missing = sorted(set(listed) - files)
        if missing:
            raise PartitionError(
                f"{shown} lists {len(missing)} files that are not in the partition: "
                f"{', '.join(missing[:5])}"
            )
        return listed

    def _full(self, relative: str) -> str:
        return f"{self._prefix}{self._root}/{relative}"

    def _shown(self, relative: str) -> str:
        return f"{self.root.rstrip('/')}/{relative}"

    # -- following -----------------------------------------------------------------

    def next(self, timeout: float | None = None) -> Partition | None:
        """The next partition to train: the oldest complete one not done,
        waiting for one (listing every ``poll_s``) up to ``timeout`` seconds
        (None: for ever; then None). A late one is logged and counted, or,
        with ``late="skip"``, recorded done and passed by."""
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            left = None if deadline is None else max(deadline - self._clock(), 0.0)
            ready = self.wait(left)
            if not ready:
                return None
            for partition in ready:
                if self._newest is None or partition.time >= self._newest:
                    return partition
                lateness = self._newest - partition.time
                if self.late == "train":
                    self.late_trained += 1
                    log.warning(
                        "partition %s is %s older than %s, trained already: training it now",
                        self._shown(partition.name),
                        lateness,
                        self._newest.isoformat(),
                    )
                    return partition
                self.late_skipped += 1
                self._done.add(partition.name)
                log.warning(
                    "partition %s landed %s after %s was trained: skipped (late='skip')",
                    self._shown(partition.name),
                    lateness,
                    self._newest.isoformat(),
                )

    def stop(self) -> None:
        """Ends every wait at once, and those to come: ``wait`` returns []
        and ``next`` None (a trainer stopping on SIGTERM)."""
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def wait(self, timeout: float | None = None) -> list[Partition]:
        """``ready()``, waiting (listing every ``poll_s``) up to ``timeout``
        seconds for it to hold a partition (None: for ever); [] after that,
        or once ``stop`` is called."""
        deadline = None if timeout is None else self._clock() + timeout
        waited = False
        while True:
            if self._stopped.is_set():
                return []
            ready = self.ready()
            now = self._clock()
            if ready or (deadline is not None and now >= deadline):
                return ready
            if not waited:
                after = "" if self._newest is None else f" after {self._newest.isoformat()}"
                how = f"{self.manifest} manifest" if self.manifest else f"{self.marker} marker"
                log.info(
                    "waiting for a complete partition%s in %s (a %s); listing every %g s",
                    after,
                    self.root,
                    how,
                    self.poll_s,
                )
                waited = True
            pause = self.poll_s if deadline is None else min(self.poll_s, deadline - now)
            self._sleep(max(pause, 0.0))


def _hidden(relative: str) -> bool:
    """A file a committer or tool left beside the data (``_temporary/``,
    ``.part.crc``): any of its levels starts with ``_`` or ``.``."""
    return any(level.startswith(("_", ".")) for level in relative.split("/"))


# -- partition times -------------------------------------------------------------------


def _hive_time(name: str) -> dt.datetime:
    """The time of a Hive-style partition name (``dt=2026-11-29/hour=05``)."""
    values: dict[str, str] = {}
    for level in name.split("/"):
        key, sep, value = level.partition("=")
        if not sep:
            raise PartitionError(f"level {level!r} is not key=value")
        if key in _HIVE_KEYS:
            values[key] = value
    try:
        day_text = values.get("dt", values.get("date"))
        if day_text is not None:
            day = dt.datetime.strptime(day_text, "%Y-%m-%d" if "-" in day_text else "%Y%m%d")
            year, month, mday = day.year, day.month, day.day
        elif "year" in values:
            year = int(values["year"])
            month, mday = int(values.get("month", 1)), int(values.get("day", 1))
        else:
            raise PartitionError("no date in it (dt=, date= or year=)")
        return dt.datetime(
            year, month, mday, int(values.get("hour", 0)), int(values.get("minute", 0))
        )
    except ValueError as error:
        raise PartitionError(f"its time does not read: {error}") from None


def _pattern_parser(layout: str) -> Callable[[str], dt.datetime]:
    """The time of a name that matches a pattern of time fields."""
    fields: list[str] = []
    regex = ""
    at = 0
    for match in re.finditer(r"\{(\w+)\}", layout):
        field_name = match[1]
        if field_name not in _FIELDS:
            raise ValueError(
                f"layout {layout!r}: unknown field {{{field_name}}}; fields: "
                + ", ".join(f"{{{f}}}" for f in _FIELDS)
            )
        if field_name in fields:
            raise ValueError(f"layout {layout!r}: {{{field_name}}} is given twice")
        regex += re.escape(layout[at : match.start()]) + f"(\\d{{{_FIELDS[field_name]}}})"
        fields.append(field_name)
        at = match.end()
    regex += re.escape(layout[at:])
    if "YYYY" not in fields:
        raise ValueError(f"layout {layout!r} has no {{YYYY}}: a partition's time needs its year")
    compiled = re.compile(regex.strip("/"))

    def parse(name: str) -> dt.datetime:
        found = compiled.fullmatch(name)
        if found is None:
            raise PartitionError(f"the name does not match the layout {layout!r}")
        value = dict(zip(fields, map(int, found.groups()), strict=True))
        try:
            return dt.datetime(
                value["YYYY"],
                value.get("MM", 1),
                value.get("DD", 1),
                value.get("HH", 0),
                value.get("mm", 0),
            )
        except ValueError as error:
            raise PartitionError(f"its time does not read: {error}") from None

    return parse
