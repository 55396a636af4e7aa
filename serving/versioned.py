"""``VersionedModel``: one model served at several versions at once, as a
version policy says (TensorFlow Serving's ``latest``, ``specific``, ``all``),
with labels naming versions (``stable``, ``canary``).

A ``ModelStore`` serves one version of an export directory and moves it
forward as new versions land. A ``VersionedModel`` keeps a ``ModelStore``
(a *slot*, its own embedded engine) per version it serves:

* **Which versions**: ``VersionPolicy.wanted`` of the versions in the
  directory that are not refused: the newest N (``latest``, N = 1 by
  default), the ones listed that exist (``specific``), or every one
  (``all``). Every ``poll_secs`` (and on ``refresh()``) the slots are
  brought to the wanted set.
* **Rolling, not reloading**: a wanted version not served yet is loaded
  into the slot of a version that is leaving, preferring one it rests on
  (only the deltas between are applied, as a single ``ModelStore`` does);
  a new slot (a new engine) is made only when no version leaves. So
  ``latest 1`` is a single store moving forward in place, and ``latest 2``
  keeps the previous version served, pinned clients and all, while the
  newest deltas apply. A slot rolls in place, each table switched
  atomically: a request pinned to the leaving version either reads it
  whole or, once the slot moved on, is NOT_FOUND.
* **Refusals** are shared by the slots (one set): a refused version, and
  the deltas resting on it, are never wanted again, and the policy's
  next choice is loaded instead.
* **Labels** map names to version numbers; a request by label reads the
  labelled version when it is served (NOT_FOUND naming the served versions
  otherwise, INVALID_ARGUMENT for an unknown label, as TensorFlow Serving).
* **Memory**: every served version is a whole engine; ``versions_status``
  reports each one's bytes. A version no longer served stops taking
  requests at once and is closed ``RETIRE_SECONDS`` later, so requests
  that took it before finish on it.

``select(version, label)`` returns the slot and its snapshot for a
request; the ``ServedModel`` protocol's other methods (``served``,
``lookup``, ``tables`` …) answer for the newest served version.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wuliang.ps_server import LookupResult
from wuliang.ps_server.storage import RemotePath, chain, location, versions
from wuliang.serving.errors import InvalidArgument, NotFound, Unavailable, VersionMoved
from wuliang.serving.model import ServedVersion, StoreCounters
from wuliang.serving.store import ModelStore

__all__ = ["RETIRE_SECONDS", "VersionPolicy", "VersionedModel", "close_later"]

log = logging.getLogger("wuliang.serving")
KINDS = ("latest", "specific", "all")
RETIRE_SECONDS = 10.0  # a version (or model) no longer served is closed this much later


def close_later(closable: Any, seconds: float = RETIRE_SECONDS) -> None:
    """Closes a store ``seconds`` from now, on a timer thread: requests that
    took it before it stopped being served finish on it first."""
    timer = threading.Timer(seconds, closable.close)
    timer.daemon = True
    timer.start()


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model are served (TensorFlow Serving's
    ``model_version_policy``)."""

    kind: str = "latest"
    num_versions: int = 1  # latest
    versions: tuple[int, ...] = ()  # specific

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a version policy is one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "latest" and self.num_versions < 1:
            raise ValueError(f"latest needs num_versions >= 1, got {self.num_versions}")
        if self.kind == "specific":
            if not self.versions:
                raise ValueError("specific needs at least one version")
            bad = [v for v in self.versions if v < 1]
            if bad:
                raise ValueError(f"specific: versions are numbers >= 1, got {bad[0]}")

    def wanted(self, available: Sequence[int]) -> list[int]:
        """The versions to serve among ``available``, ascending."""
        ordered = sorted(set(available))
        if self.kind == "latest":
            return ordered[-self.num_versions :]
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered

    def __str__(self) -> str:
        if self.kind == "latest":
            return f"latest {self.num_versions}"
        if self.kind == "specific":
            return f"specific {list(self.versions)}"
        return "all"


@dataclass
class _Refusals:
    numbers: set[int] = field(default_factory=set)  # shared by the slots
    why: dict[int, str] = field(default_factory=dict)


class VersionedModel:
    """The versions of one export directory that a policy wants, each in a
    ``ModelStore`` of its own (see the module docstring).

    Args:
        export_dir: the trainer's export directory (a folder, or a URI).
        name: the model's name in requests (default: the directory's name).
        policy: which versions to serve (default: the newest).
        labels: label -> version number.
        poll_secs: how often to look for new versions (0: only on ``refresh()``).
        store_options: for each slot's ``ModelStore`` (``missing``,
            ``precision``, ``num_shards``, ``load_towers``, ``gpu_cache_rows``).
    """

    def __init__(
        self,
        export_dir: str | Path | RemotePath,
        name: str | None = None,
        *,
        policy: VersionPolicy | None = None,
        labels: Mapping[str, int] | None = None,
        poll_secs: float = 10.0,
        **store_options: Any,
    ) -> None:
        if poll_secs < 0:
            raise ValueError(f"poll_secs must be >= 0, got {poll_secs!r}")
        self.export_dir = location(export_dir)
        self.name = name or self.export_dir.resolve().name
        self.source = str(self.export_dir)
        self.policy = policy or VersionPolicy()
        self.labels: dict[str, int] = dict(labels or {})
        self.poll_secs = poll_secs
        self.store_options = store_options
        self.missing = store_options.get("missing", "zeros")
        self.precision = store_options.get("precision", "fp32")
        self.counters = StoreCounters()
        self.on_apply: list[Callable[[ServedVersion, float], None]] = []
        self.on_refuse: list[Callable[[int, str], None]] = []
        self._refusals = _Refusals()
        self._slots: list[ModelStore] = []  # replaced whole, never changed in place
        self._lock = threading.Lock()  # one refresh at a time
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.check_labels()
        self._new_slot().close()  # options checked now, not at the first version

    # -- slots ---------------------------------------------------------------------

    def _new_slot(self) -> ModelStore:
        slot = ModelStore(
            self.export_dir,
            self.name,
            poll_secs=0,
            refused=self._refusals.numbers,
            **self.store_options,
        )
        slot.on_apply.append(self._applied)
        slot.on_refuse.append(self._refused)
        return slot

    def _applied(self, served: ServedVersion, took: float) -> None:
        self.counters.applied += 1
        self.counters.apply_seconds = [*self.counters.apply_seconds[-99:], took]
        for callback in self.on_apply:
            callback(served, took)

    def _refused(self, number: int, why: str) -> None:
        self.counters.refused += 1
        self._refusals.why[number] = why
        for callback in self.on_refuse:
            callback(number, why)

    def check_labels(self) -> None:
        """ValueError for a label that can never name a served version."""
        for label, number in self.labels.items():
            if not label or number < 1:
                raise ValueError(
                    f"model {self.name!r}: label {label!r} -> {number}: a label is a non-empty "
                    "name of a version number >= 1"
                )
            if self.policy.kind == "specific" and number not in self.policy.versions:
                raise ValueError(
                    f"model {self.name!r}: label {label!r} names version {number}, which the "
                    f"policy ({self.policy}) never serves"
                )

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> VersionedModel:
        """Loads the versions the policy wants and starts following the directory."""
        self.refresh()
        if self.poll_secs > 0 and self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name=f"wuliang-watch-{self.name}", daemon=True
            )
            self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_secs):
            try:
                self.refresh()
            except Exception:  # never let the watcher die; the next poll retries
                log.exception("model %s: refreshing from %s failed", self.name, self.export_dir)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        with self._lock:
            slots, self._slots = self._slots, []
        for slot in slots:
            slot.close()

    def reconfigure(self, policy: VersionPolicy, labels: Mapping[str, int]) -> None:
        """A new policy and labels (a reloaded model config), applied now."""
        old = self.policy, self.labels
        self.policy, self.labels = policy, dict(labels)
        try:
            self.check_labels()
        except ValueError:
            self.policy, self.labels = old
            raise
        self.refresh()

    def refresh(self) -> list[int]:
        """Brings the served versions to what the policy wants; returns them."""
        with self._lock:
            self._settle()
            return self.served_versions()

    def _settle(self) -> None:
        slots = list(self._slots)
        wanted: list[int] = []
        for _ in range(8):  # a refusal changes what is wanted: again, until none
            refused = len(self._refusals.numbers)
            on_disk = [n for n, _ in versions(self.export_dir)]
            wanted = self.policy.wanted([n for n in on_disk if n not in self._refusals.numbers])
            served = {slot.version for slot in slots}
            leaving = [slot for slot in slots if slot.version not in wanted]
            for target in sorted(set(wanted) - served, reverse=True):  # the newest first
                slot = self._slot_for(target, leaving)
                if slot is None:
                    slot = self._new_slot()
                    slots.append(slot)
                else:
                    leaving.remove(slot)
                slot.load(target)  # False: refused (counted, remembered, logged)
                self._slots = sorted(slots, key=lambda s: s.version)  # served once loaded
            if len(self._refusals.numbers) == refused:
                break
        kept: dict[int, ModelStore] = {}
        for slot in slots:  # two slots never serve one version
            if slot.version in wanted and slot.version not in kept:
                kept[slot.version] = slot
        self._slots = [kept[v] for v in sorted(kept)]
        for slot in slots:
            if kept.get(slot.version) is not slot:
                if slot.version:
                    log.info("model %s: version %d unloaded", self.name, slot.version)
                close_later(slot)

    def _slot_for(self, target: int, leaving: list[ModelStore]) -> ModelStore | None:
        """The leaving slot to load ``target`` into: one at a version it
        rests on (the newest such), else any, else None."""
        if not leaving:
            return None
        try:
            base = {v.number for v in chain(self.export_dir, target)}
        except (OSError, ValueError):
            base = set()
        resting = [slot for slot in leaving if slot.version in base and slot.version < target]
        if resting:
            return max(resting, key=lambda s: s.version)
        return leaving[0]

    # -- what is served ------------------------------------------------------------

    @property
    def version(self) -> int:
        """The newest version served (0: none yet)."""
        slots = self._slots
        return max((slot.version for slot in slots), default=0)

    def served_versions(self) -> list[int]:
        return sorted(v for v in (slot.version for slot in self._slots) if v)

    def _newest(self) -> ModelStore:
        slots = self._slots
        if not slots:
            raise Unavailable(f"model {self.name!r} has no version loaded yet")
        return max(slots, key=lambda s: s.version)

    def served(self) -> ServedVersion:
        return self._newest().served()

    def select(
        self, version: int | None = None, label: str | None = None
    ) -> tuple[ModelStore, ServedVersion]:
        """The slot and snapshot a request for ``version`` (or ``label``;
        neither: the newest) reads."""
        if label is not None:
            labels = self.labels
            if label not in labels:
                known = ", ".join(f"{k} -> {v}" for k, v in sorted(labels.items())) or "none"
                raise InvalidArgument(
                    f"Unrecognized servable version label: {label} (model {self.name!r} "
                    f"labels: {known})"
                )
            version = labels[label]
        if version is None:
            slot = self._newest()
            return slot, slot.served()
        for slot in self._slots:
            current = slot._current
            if current is not None and current.number == version:
                return slot, current
        if not self._slots:
            raise Unavailable(f"model {self.name!r} has no version loaded yet")
        named = f" (label {label!r})" if label is not None else ""
        raise NotFound(
            f"Servable not found for request: Specific({self.name}, {version}): model "
            f"{self.name!r} serves version{'s' if len(self._slots) > 1 else ''} "
            f"{', '.join(map(str, self.served_versions()))}, not {version}{named}"
        )

    def lookup(self, table: str, keys: Any, at: ServedVersion | None = None) -> LookupResult:
        if at is None:
            return self._newest().lookup(table, keys)
        for slot in self._slots:
            if slot._current is at:
                return slot.lookup(table, keys, at)
        raise VersionMoved(f"model {self.name!r}: version {at.number} is no longer served")

    def tables(self) -> dict[str, int]:
        slots = self._slots
        return self._newest().tables() if slots else {}

    def table_stats(self) -> dict[str, dict[str, Any]]:
        slots = self._slots
        return self._newest().table_stats() if slots else {}

    def versions_status(self) -> list[dict[str, Any]]:
        """Per version served, refused or awaited: ``version``, ``state``
        (TensorFlow Serving's: AVAILABLE, LOADING, END), ``error`` (why a
        version was refused) and ``bytes`` (of its engine's tables)."""
        out = {}
        for slot in self._slots:
            if slot.version:
                stats = slot.table_stats()
                out[slot.version] = {
                    "version": slot.version,
                    "state": "AVAILABLE",
                    "error": "",
                    "bytes": sum(int(s["bytes"]) for s in stats.values()),
                }
        if self.policy.kind == "specific":
            for number in self.policy.versions:
                if number not in out:
                    why = self._refusals.why.get(number)
                    out[number] = {
                        "version": number,
                        "state": "LOADING" if why is None else "END",
                        "error": why or "",
                        "bytes": 0,
                    }
        return [out[n] for n in sorted(out)]

    def __enter__(self) -> VersionedModel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
