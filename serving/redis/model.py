"""``RedisModelStore``: a served model whose rows come from Redis
(``wuliang serve --redis URL``), a ``ServedModel`` (``model.py``).

Its rows are those of the version ``wuliang publish`` made current, read
through ``RedisStore`` (``redis.replica``: a local hot cache, following each
announced version). The model description comes with the published version;
the tower (for predictions) is that version's SavedModel in the export
directory when the replica can read it (``exports``), loaded before the
replica switches to the version (a SavedModel that does not load refuses
the version; the previous one keeps serving). Without a readable export the
replica serves lookups only, and a prediction is answered
FAILED_PRECONDITION saying why. The replica may start before the model's
first publish: it serves nothing (UNAVAILABLE) until a version is announced.
Keys without a row read as zeros (found False); vectors are fp32.

A request's snapshot (``served()``) carries the replica's state of its
version, so its lookups read that version's namespace even if the replica
switches meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from wuliang.ps_server import LookupResult, UnknownTableError
from wuliang.ps_server.storage import CorruptVersionError, ModelDescription, Version, chain
from wuliang.serving.errors import NotFound, Unavailable, VersionMoved
from wuliang.serving.model import ServedVersion, StoreCounters, load_tower
from wuliang.serving.redis.keys import RedisStoreError, fingerprint
from wuliang.serving.redis.replica import NoVersionError, RedisStore, ReplicaState, VersionRetired

__all__ = ["RedisModelStore"]


class RedisModelStore:
    """One model served from Redis (see the module docstring).

    Args:
        redis_url: where ``wuliang publish`` wrote the model.
        name: the model's name (``publish`` 's ``model``).
        exports: the export directory, for the towers (None: lookups only).
        cache_rows: rows of the local hot cache per table.
        poll_secs: how often the pointer is checked besides announcements
            (0: every 5 s).
        load_towers: load each version's SavedModel from ``exports``.
    """

    missing = "zeros"
    precision = "fp32"

    def __init__(
        self,
        redis_url: str,
        name: str,
        exports: str | Path | None = None,
        cache_rows: int = 100_000,
        poll_secs: float = 5.0,
        load_towers: bool = True,
    ) -> None:
        self.redis_url = redis_url
        self.name = name
        self.exports = None if exports is None else Path(exports)
        self.cache_rows = cache_rows
        self.poll_secs = poll_secs or 5.0
        self.load_towers = load_towers
        self.counters = StoreCounters()
        self.on_apply: list[Callable[[ServedVersion, float], None]] = []
        self.on_refuse: list[Callable[[int, str], None]] = []
        self.redis: RedisStore | None = None
        self.source = redis_url

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> RedisModelStore:
        """Connects, loads the current version (if there is one) and follows."""
        if self.redis is None:
            self.redis = RedisStore(
                self.redis_url,
                self.name,
                self.cache_rows,
                poll_s=self.poll_secs,
                prepare=self._prepare,
                on_switch=self._switched,
                on_refuse=self._refused,
            )
            self.source = self.redis.url  # without its password
        return self

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()

    def __enter__(self) -> RedisModelStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what is served ------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version served now (0: none yet)."""
        return 0 if self.redis is None else self.redis.version

    def served(self) -> ServedVersion:
        """A snapshot of the version served now (its model description and tower)."""
        state = None if self.redis is None else self.redis.state
        if state is None:
            raise Unavailable(f"model {self.name!r} has no version loaded yet")
        return state.prepared

    def tables(self) -> dict[str, int]:
        return {} if self.redis is None else self.redis.tables()

    def table_stats(self) -> dict[str, dict[str, Any]]:
        state = None if self.redis is None else self.redis.state
        if state is None:
            return {}
        return {
            name: {"rows": int(info.get("rows", 0)), "bytes": 0}
            for name, info in state.meta.get("tables", {}).items()
        }

    def lookup(self, table: str, keys: Any, at: ServedVersion | None = None) -> LookupResult:
        """The rows of keys, which were found, and the version they were read
        at; with ``at``, that version's rows or ``VersionMoved``."""
        redis = self.redis
        if redis is None:
            raise Unavailable(f"model {self.name!r} has no version loaded yet")
        try:
            return redis.lookup(table, keys, None if at is None else at.handle)
        except UnknownTableError:
            known = ", ".join(sorted(self.tables())) or "none"
            raise NotFound(
                f"model {self.name!r} has no table {table!r} (tables: {known})"
            ) from None
        except VersionRetired as error:
            raise VersionMoved(str(error)) from None
        except NoVersionError:
            raise Unavailable(f"model {self.name!r} has no version loaded yet") from None
        except RedisStoreError as error:
            raise Unavailable(f"model {self.name!r}: {error}") from None

    # -- following (RedisStore's callbacks, on its thread) ---------------------------

    def _prepare(self, state: ReplicaState) -> ServedVersion:
        """The snapshot of a version about to be served: its description and,
        when the export directory has the same version, its tower."""
        meta = state.meta
        model = meta.get("model")
        description = ModelDescription() if model is None else ModelDescription.from_dict(model)
        tower, why, path = None, "", None
        if not self.load_towers:
            why = "its towers are not loaded (load_towers=False)"
        elif self.exports is None:
            why = "the replica has no export directory for its towers (serve --exports)"
        else:
            path = self.exports / str(state.version)
            why = self._no_tower(path, state.version, meta.get("source", {}))
            if not why:
                tower = load_tower(Version(path))  # ValueError refuses the version
        return ServedVersion(
            state.version,
            int(meta.get("step", 0)),
            description,
            tower,
            str(meta.get("kind", "full")),
            path,
            no_tower=why,
            handle=state,
        )

    def _no_tower(self, path: Path, number: int, source: dict[str, Any]) -> str:
        """Why the export directory cannot give version number's tower ("": it can)."""
        if not (path / "manifest.json").is_file():
            return f"the export directory has no version {number} ({path} is missing)"
        try:
            versions = chain(path.parent, number)
            mine = fingerprint(v.path / "manifest.json" for v in versions)
        except (CorruptVersionError, OSError, ValueError) as error:
            return f"version {number} of the export directory cannot be read: {error}"
        if source.get("fingerprint") not in (None, mine):
            return (
                f"version {number} of {path.parent} is not the export that was published "
                f"(from {source.get('export_dir')})"
            )
        return ""

    def _switched(self, state: ReplicaState, seconds: float) -> None:
        self.counters.applied += 1
        self.counters.apply_seconds = [*self.counters.apply_seconds[-99:], seconds]
        for callback in self.on_apply:
            callback(state.prepared, seconds)

    def _refused(self, number: int, why: str) -> None:
        self.counters.refused += 1
        for callback in self.on_refuse:
            callback(number, why)
