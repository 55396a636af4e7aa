"""The model store: one export directory served from an embedded engine.

``ModelStore(export_dir)`` loads the newest valid version (a full export and
its chain of deltas: ``wuliang.serving.versions``) into a parameter server,
then follows the directory: ``refresh()`` (called every ``poll_secs`` by a
watcher thread) applies each new version while lookups go on.

* Atomic: each table switches wholly from one version to the next
  (``ParameterServer.apply_update``), and every lookup reports the version
  its rows were read at. A version's SavedModel is loaded before its tables
  switch, so a prediction always finds the tower of the version its rows
  belong to (the store keeps the towers of the current and the previous
  version).
* Refusal: a version whose manifest or checksums fail (or whose SavedModel
  does not load) is refused: logged, counted (``refused``), remembered, and
  the previous version keeps serving; so is every later delta resting on it,
  until a new full version arrives.
* Restart: the newest version whose whole chain verifies is served; corrupt
  newer ones are skipped (and counted).
* Keys without a row read as zeros (``missing="zeros"``, found False) or as
  the training table's initial vector (``missing="initial"``: the manifest
  keeps each table's initializer and seed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wuliang.ps_server import LookupResult, ParameterServer, UnknownTableError, parameter_server
from wuliang.ps_server.interface import MISSING
from wuliang.ps_server.storage import (
    SERVING,
    CorruptVersionError,
    ModelDescription,
    Version,
    chain,
    versions,
)
from wuliang.serving.errors import NotFound, Unavailable
from wuliang.serving.versions import apply

log = logging.getLogger("wuliang.serving")
PRECISIONS = ("fp32", "fp16", "int8")


@dataclass
class ServedVersion:
    """What a version brings beside its rows: the tower and the model's shape."""

    number: int
    step: int
    model: ModelDescription  # the manifest's (features, tables); empty when none
    tower: Tower | None  # None when towers are not loaded
    path: Path


@dataclass
class StoreCounters:
    applied: int = 0
    refused: int = 0
    apply_seconds: list[float] = field(default_factory=list)  # of the last applies


class ModelStore:
    """One served model: an export directory applied to a parameter server.

    Args:
        export_dir: the trainer's export directory.
        name: the model's name in requests (default: the directory's name).
        missing: ``"zeros"`` or ``"initial"`` (see the module docstring).
        precision: how the served vectors are stored (``"fp32"``, ``"fp16"``,
            ``"int8"``: smaller, slightly lossy).
        poll_secs: how often the watcher looks for new versions (0: never;
            call ``refresh()``).
        num_shards: shard threads of the engine.
        load_towers: load each version's SavedModel (for predictions).
    """

    def __init__(
        self,
        export_dir: str | Path,
        name: str | None = None,
        *,
        missing: str = "zeros",
        precision: str = "fp32",
        poll_secs: float = 10.0,
        num_shards: int = 2,
        load_towers: bool = True,
    ) -> None:
        if missing not in MISSING:
            raise ValueError(f"missing must be one of {', '.join(MISSING)}, got {missing!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if poll_secs < 0:
            raise ValueError(f"poll_secs must be >= 0, got {poll_secs!r}")
        self.export_dir = Path(export_dir)
        self.name = name or self.export_dir.resolve().name
        self.missing = missing
        self.precision = precision
        self.poll_secs = poll_secs
        self.load_towers = load_towers
        self.ps: ParameterServer = parameter_server("embedded", num_shards)
        self.counters = StoreCounters()
        self._served: dict[int, ServedVersion] = {}  # current and previous
        self._chain: list[int] = []  # the versions applied, base first
        self._refused: set[int] = set()
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
        return self._chain[-1] if self._chain else 0

    def served(self, number: int | None = None) -> ServedVersion:
        """A version still held (default: the current one)."""
        number = self.version if number is None else number
        served = self._served.get(number)
        if served is None:
            if not self._chain:
                raise Unavailable(f"model {self.name!r} has no version loaded yet")
            raise Unavailable(f"model {self.name!r}: version {number} is no longer held")
        return served

    def tables(self) -> dict[str, int]:
        """The served tables and their dims."""
        return {name: self.ps.spec(name).dim for name in self.ps.tables()}

    def table_stats(self) -> dict[str, dict[str, Any]]:
        """Rows, bytes and counters of each served table."""
        return self.ps.stats()

    def lookup(self, table: str, keys: Any) -> LookupResult:
        """The rows of keys, which were found, and the version they were read at."""
        if not self._chain:
            raise Unavailable(f"model {self.name!r} has no version loaded yet")
        try:
            return self.ps.lookup(table, keys, missing=self.missing)  # it checks the keys
        except UnknownTableError:
            known = ", ".join(sorted(self.ps.tables())) or "none"
            raise NotFound(
                f"model {self.name!r} has no table {table!r} (tables: {known})"
            ) from None

    # -- following the directory ---------------------------------------------------

    def refresh(self) -> list[int]:
        """Applies the versions newer than the served one; returns them."""
        with self._lock:
            on_disk = [n for n, _ in versions(self.export_dir)]
            if not self._chain:
                return self._load_newest(on_disk)
            applied = []
            for target in (n for n in on_disk if n > self.version and n not in self._refused):
                if not self._apply_through(target):
                    break
                applied.append(target)
            return applied

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

    def _apply_through(self, target: int) -> bool:
        """Applies what leads from the served version to ``target``."""
        try:
            path = chain(self.export_dir, target)
        except (CorruptVersionError, OSError, ValueError) as error:
            self._refuse(target, error)
            return False
        numbers = [v.number for v in path]
        if any(n in self._refused for n in numbers):
            self._refuse(target, f"it rests on refused version {min(self._refused & set(numbers))}")
            return False
        if self.version in numbers:  # deltas on top of what is served
            path = path[numbers.index(self.version) + 1 :]
        return self._apply_chain(path)

    def _apply_chain(self, path: list[Version]) -> bool:
        for version in path:
            number = version.number
            previous = self.version
            start = time.perf_counter()
            try:
                version.verify()
                served = ServedVersion(
                    number,
                    version.step,
                    version.model or ModelDescription(),
                    self._load_tower(version),
                    version.path,
                )
                # Held before any table switches: an answer whose rows are of
                # the new version finds its tower, and one still on the
                # previous version (tables switch one by one) finds that one.
                self._served = {
                    **{n: v for n, v in self._served.items() if n == previous},
                    number: served,
                }
                apply(self.ps, version, precision=self.precision)
                if version.kind == "full":  # tables the new base no longer has
                    for gone in set(self.ps.tables()) - set(version.tables):
                        self.ps.drop_table(gone)
            except (CorruptVersionError, OSError, ValueError) as error:
                self._served.pop(number, None)
                self._refuse(number, error)
                return False
            took = time.perf_counter() - start
            if version.kind == "full":
                self._chain = [number]
            else:
                self._chain.append(number)
            self.counters.applied += 1
            self.counters.apply_seconds = [*self.counters.apply_seconds[-99:], took]
            log.info("model %s: version %d applied (%s) in %.3f s", self.name, number,
                     version.kind, took)  # fmt: skip
            for callback in self.on_apply:
                callback(served, took)
        return True

    def _load_tower(self, version: Version) -> Any:
        return load_tower(version) if self.load_towers else None

    def _refuse(self, number: int, error: object) -> None:
        if number in self._refused:
            return
        self._refused.add(number)
        self.counters.refused += 1
        log.error("model %s: version %d refused: %s", self.name, number, error)
        for callback in self.on_refuse:
            callback(number, str(error))


class Tower:
    """A version's loaded SavedModel and its ``serve`` function.

    ``serve`` is the concrete function of the export's signature, taken once
    at load: calling it skips the argument matching that calling the
    restored ``tf.function`` repeats on every request (about half the
    tower's time at batch 100)."""

    def __init__(self, module: Any) -> None:
        self.module = module  # kept: the function's variables belong to it
        self.serve = module.serve.get_concrete_function()

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs (float32 arrays by name) of one batch of inputs."""
        import tensorflow as tf

        result = self.serve({name: tf.constant(value) for name, value in inputs.items()})
        return {name: np.asarray(value.numpy(), np.float32) for name, value in result.items()}


def load_tower(version: Version) -> Tower:
    """A version's SavedModel (its tower), its files checked first."""
    import tensorflow as tf

    try:
        module = tf.saved_model.load(str(version.checked(f"{SERVING}/saved_model.pb").parent))
        return Tower(module)
    except (OSError, ValueError, TypeError, AttributeError, tf.errors.OpError) as error:
        raise ValueError(f"the SavedModel of {version.path} does not load: {error}") from None
