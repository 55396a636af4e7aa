"""A served model whose rows come from Redis (``wuliang serve --redis URL``).

``RedisModelStore`` gives the ``Service`` the same surface as ``ModelStore``
(lookups, the served version, its model description and tower, table
statistics, counters) over ``RedisStore``: rows from the version that
``wuliang publish`` made current, through a local hot cache, following each
announced version. The model description comes with the published version;
the tower (for predictions) is that version's SavedModel in the export
directory when the replica can read it (``exports``), else the replica
serves lookups only. Keys without a row read as zeros (found False).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wuliang.ps_server import LookupResult, UnknownTableError
from wuliang.ps_server.storage import ModelDescription, Version
from wuliang.serving.errors import NotFound
from wuliang.serving.redis_store import RedisStore
from wuliang.serving.store import ServedVersion, StoreCounters, load_tower

log = logging.getLogger("wuliang.serving")


class RedisModelStore:
    """One model served from Redis (see the module docstring).

    Args:
        redis_url: where ``wuliang publish`` wrote the model.
        name: the model's name (``publish`` 's ``model``).
        exports: the export directory, for the towers (None: lookups only).
        cache_rows: rows of the local hot cache per table.
        poll_secs: how often the pointer is checked besides announcements.
    """

    missing = "zeros"
    precision = "fp32"

    def __init__(
        self,
        redis_url: str,
        name: str,
        exports: Path | None = None,
        cache_rows: int = 100_000,
        poll_secs: float = 5.0,
    ) -> None:
        self.name = name
        self.exports = exports
        self.counters = StoreCounters()
        self.on_apply: list[Callable[[ServedVersion, float], None]] = []
        self.on_refuse: list[Callable[[int, str], None]] = []
        self.redis = RedisStore(redis_url, name, cache_rows, poll_s=poll_secs or 5.0)
        self._served: dict[int, ServedVersion] = {}
        self._lock = threading.Lock()

    def start(self) -> RedisModelStore:
        self.served()
        return self

    def close(self) -> None:
        self.redis.close()

    @property
    def version(self) -> int:
        return self.redis.version

    def served(self, number: int | None = None) -> ServedVersion:
        """The version's model description and tower (loaded on first use)."""
        number = self.version if number is None else number
        with self._lock:
            served = self._served.get(number)
            if served is None:
                meta = self.redis.metadata()
                if int(meta.get("version", number)) != number:  # switched meanwhile
                    meta = {"version": number, "step": 0, "model": None}
                tower = None
                if self.exports is not None and (self.exports / str(number)).is_dir():
                    tower = load_tower(Version(self.exports / str(number)))
                model = meta.get("model")
                served = ServedVersion(
                    number, int(meta.get("step", 0)),
                    ModelDescription() if model is None else ModelDescription.from_dict(model),
                    tower, self.exports / str(number) if self.exports else Path(),
                )  # fmt: skip
                self._served = {v: s for v, s in self._served.items() if v >= number - 1}
                self._served[number] = served
                self.counters.applied += 1
                for callback in self.on_apply:
                    callback(served, 0.0)
            return served

    def tables(self) -> dict[str, int]:
        return self.redis.tables()

    def table_stats(self) -> dict[str, dict[str, Any]]:
        meta = self.redis.metadata()
        return {
            name: {"rows": int(info.get("rows", 0)), "bytes": 0}
            for name, info in meta.get("tables", {}).items()
        }

    def lookup(self, table: str, keys: Any) -> LookupResult:
        try:
            return self.redis.lookup(table, keys)
        except UnknownTableError:
            known = ", ".join(sorted(self.tables())) or "none"
            raise NotFound(
                f"model {self.name!r} has no table {table!r} (tables: {known})"
            ) from None
