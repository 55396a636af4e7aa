"""The serving API, independent of transport: what gRPC and HTTP call.

``Service(stores)`` holds the served models (``ModelStore`` s, by name) and
answers ``lookup``, ``predict`` and ``status``, checking each request's
token and size first. Errors are ``wuliang.serving.errors`` exceptions
(each transport maps them to its status); anything else raised while
answering is a bug, reported as INTERNAL without stopping the server.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from wuliang.ps_server import LookupResult
from wuliang.serving.errors import (
    InvalidArgument,
    NotFound,
    ServingError,
    TooLarge,
    Unauthenticated,
)
from wuliang.serving.metrics import Metrics
from wuliang.serving.predict import FeatureInput, PredictAnswer, predict

MAX_KEYS = 100_000  # per lookup, by default
MAX_ROWS = 10_000  # per prediction, by default


class _Observed:
    """``Service.observed``: a class, not a generator context (a third of
    the cost, on every request)."""

    __slots__ = ("endpoint", "metrics", "start", "transport")

    def __init__(self, metrics: Metrics, transport: str, endpoint: str) -> None:
        self.metrics = metrics
        self.transport = transport
        self.endpoint = endpoint

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if kind is None:
            code = "OK"
        else:
            code = error.code if isinstance(error, ServingError) else "INTERNAL"
        self.metrics.observe(self.transport, self.endpoint, code, time.perf_counter() - self.start)


class Service:
    """The served models and their API (see the module docstring).

    Args:
        stores: the models; their names must differ.
        token: when set, every request must carry it.
        max_keys: keys one lookup may ask for.
        max_rows: rows one prediction may ask for.
    """

    def __init__(
        self,
        stores: Sequence[Any],
        token: str | None = None,
        max_keys: int = MAX_KEYS,
        max_rows: int = MAX_ROWS,
    ) -> None:
        self.stores: dict[str, Any] = {}  # ModelStore or RedisModelStore, by name
        for store in stores:
            if store.name in self.stores:
                raise ValueError(f"two models are named {store.name!r}")
            self.stores[store.name] = store
        if not self.stores:
            raise ValueError("a service needs at least one model")
        self.token = token
        self.max_keys = max_keys
        self.max_rows = max_rows
        self.metrics = Metrics(lambda: list(self.stores.values()))
        for store in self.stores.values():
            store.on_apply.append(self._applied(store.name))
            store.on_refuse.append(lambda number, why, name=store.name: self._refused(name))
        self.started = time.time()

    def _applied(self, name: str) -> Callable[[Any, float], None]:
        def observe(served: Any, seconds: float) -> None:
            self.metrics.applies.labels(name).inc()
            self.metrics.apply_seconds.labels(name).observe(seconds)

        return observe

    def _refused(self, name: str) -> None:
        self.metrics.refusals.labels(name).inc()

    # -- requests ----------------------------------------------------------------

    def authorize(self, token: str | None) -> None:
        """Unauthenticated unless the request's token is the service's."""
        if self.token is None:
            return
        if token is None or not hmac.compare_digest(token.encode(), self.token.encode()):
            raise Unauthenticated("a valid token is required (authorization: Bearer <token>)")

    def observed(self, transport: str, endpoint: str) -> _Observed:
        """A context that counts and times one request (by the status code of
        the error leaving it, OK when none); maps nothing."""
        return _Observed(self.metrics, transport, endpoint)

    def store(self, model: str) -> Any:
        """The model named ``model`` (empty: the only one, when there is one)."""
        if not model and len(self.stores) == 1:
            return next(iter(self.stores.values()))
        store = self.stores.get(model)
        if store is None:
            raise NotFound(f"no model {model!r} (models: {', '.join(sorted(self.stores))})")
        return store

    def lookup(self, model: str, table: str, keys: np.ndarray) -> LookupResult:
        store = self.store(model)
        if not isinstance(keys, np.ndarray) or keys.ndim != 1:
            raise InvalidArgument("keys must be a 1-D array of uint64")
        if len(keys) > self.max_keys:
            raise TooLarge(f"{len(keys)} keys in one lookup; at most {self.max_keys}")
        result = store.lookup(table, keys)
        self.metrics.count_keys(store.name, table, len(keys))
        return result

    def predict(self, model: str, features: Mapping[str, FeatureInput], rows: int) -> PredictAnswer:
        return predict(self.store(model), features, rows, self.max_rows)

    def status(self, model: str = "") -> list[dict[str, Any]]:
        """Per model: version, step, tables, settings and counters."""
        stores = [self.store(model)] if model else list(self.stores.values())
        out = []
        for store in stores:
            stats = store.table_stats() if store.version else {}
            dims = store.tables() if store.version else {}
            step = store.served().step if store.version else 0
            out.append(
                {
                    "name": store.name,
                    "version": store.version,
                    "step": step,
                    "tables": [
                        {
                            "name": name,
                            "dim": dims.get(name, 0),
                            "rows": s["rows"],
                            "bytes": s["bytes"],
                        }
                        for name, s in sorted(stats.items())
                    ],
                    "missing_keys": store.missing,
                    "precision": store.precision,
                    "applied": store.counters.applied,
                    "refused": store.counters.refused,
                }
            )
        return out

    def healthy(self) -> bool:
        """Every model serves a version."""
        return all(store.version for store in self.stores.values())

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
