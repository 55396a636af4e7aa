"""The serving API, independent of transport: what gRPC and HTTP call.

``Service(stores)`` holds the served models (``ServedModel`` s by name:
``ModelStore``, ``RedisModelStore``) and answers ``lookup``, ``predict`` and
``status``, checking each request's token first. The limits of a request
(``max_keys`` a lookup, ``max_rows`` a prediction, ``max_request_bytes`` a
request's bytes) are defined and checked here (``check_keys``,
``check_rows``, ``check_request_bytes``); a transport calls a check early,
before parsing what it bounds. Errors are ``wuliang.serving.errors``
exceptions (each transport maps them to its status); anything else raised
while answering is a bug, reported as INTERNAL without stopping the server.

Versions: a request may name the version it wants (``version``, or a
``label``, as TensorFlow Serving's ``ModelSpec``); ``select`` resolves it to
the store serving that version and its snapshot (a ``VersionedModel``
serves several; any other store only its current one), NOT_FOUND naming
the versions served when it is not one of them.

Models: ``update_models`` adds, replaces and removes models while requests
go on (a reloaded model config): the map of models is replaced whole, and a
removed model is closed ``RETIRE_SECONDS`` later, so requests that took it
finish first. ``listeners`` are called after every version applied and
every change of models (the gRPC health service follows them).

One version per prediction: ``predict`` takes the served version's snapshot
once, decodes the request with that version's model description (a
transport hands over a decoder), looks every table up at that version and
runs its tower; if the store moved to another version meanwhile, it starts
again from the new snapshot (for up to ``SWITCH_SECONDS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from wuliang.ps_server import LookupResult
from wuliang.ps_server.rpc.auth import token_matches
from wuliang.serving.errors import (
    InvalidArgument,
    NotFound,
    Overloaded,
    ServingError,
    TooLarge,
    Unauthenticated,
    Unavailable,
    VersionMoved,
)
from wuliang.serving.metrics import Metrics
from wuliang.serving.model import ServedModel, ServedVersion
from wuliang.serving.predict import (
    Decoder,
    FeatureInput,
    PredictAnswer,
    check_model,
    predict,
    read_blocks,
)
from wuliang.serving.versioned import close_later

__all__ = ["MAX_KEYS", "MAX_REQUEST_BYTES", "MAX_ROWS", "SWITCH_SECONDS", "Service"]

MAX_KEYS = 100_000  # per lookup, by default
MAX_ROWS = 10_000  # per prediction, by default
MAX_REQUEST_BYTES = 16 << 20  # a request's body (HTTP) or message (gRPC), by default
SWITCH_SECONDS = 5.0  # how long a prediction follows versions that keep switching


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
            if isinstance(error, Overloaded):
                self.metrics.shed.labels(self.transport, self.endpoint).inc()
        self.metrics.observe(self.transport, self.endpoint, code, time.perf_counter() - self.start)


class Service:
    """The served models and their API (see the module docstring).

    Args:
        stores: the models (``ServedModel`` s); their names must differ.
        token: when set, every request must carry it.
        max_keys: keys one lookup may ask for.
        max_rows: rows one prediction may ask for.
        max_request_bytes: bytes of one request (an HTTP body, a gRPC message).
    """

    def __init__(
        self,
        stores: Sequence[ServedModel],
        token: str | None = None,
        max_keys: int = MAX_KEYS,
        max_rows: int = MAX_ROWS,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        for name, value in (
            ("max_keys", max_keys),
            ("max_rows", max_rows),
            ("max_request_bytes", max_request_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        by_name: dict[str, ServedModel] = {}
        for store in stores:
            if store.name in by_name:
                raise ValueError(f"two models are named {store.name!r}")
            by_name[store.name] = store
        if not by_name:
            raise ValueError("a service needs at least one model")
        self.stores: dict[str, ServedModel] = by_name  # replaced whole (update_models)
        self.token = token
        self.max_keys = max_keys
        self.max_rows = max_rows
        self.max_request_bytes = max_request_bytes
        self.metrics = Metrics(lambda: list(self.stores.values()))
        self.listeners: list[Callable[[], None]] = []
        for store in by_name.values():
            self._follow(store)
        self.started = time.time()

    def _follow(self, store: ServedModel) -> None:
        store.on_apply.append(self._applied(store.name))
        store.on_refuse.append(lambda number, why, name=store.name: self._refused(name))

    def _applied(self, name: str) -> Callable[[Any, float], None]:
        def observe(served: Any, seconds: float) -> None:
            self.metrics.applies.labels(name).inc()
            self.metrics.apply_seconds.labels(name).observe(seconds)
            self._tell()

        return observe

    def _tell(self) -> None:
        for listener in self.listeners:
            listener()

    def update_models(
        self, add: Sequence[ServedModel] = (), remove: Sequence[str] = ()
    ) -> list[ServedModel]:
        """Adds models (replacing those of the same name) and removes the
        named ones, in one step for requests; the models replaced or removed
        are closed ``RETIRE_SECONDS`` later, and returned. The service keeps
        at least one model (ValueError)."""
        stores = dict(self.stores)
        gone = [stores.pop(name) for name in remove if name in stores]
        for store in add:
            old = stores.get(store.name)
            if old is not None and old is not store:
                gone.append(old)
            stores[store.name] = store
        if not stores:
            raise ValueError("a service needs at least one model")
        for store in add:
            self._follow(store)
        self.stores = stores  # one assignment: a request sees the old map or the new
        for store in gone:
            close_later(store)
        self._tell()
        return gone

    def _refused(self, name: str) -> None:
        self.metrics.refusals.labels(name).inc()

    # -- requests ----------------------------------------------------------------

    def authorize(self, token: str | None) -> None:
        """Unauthenticated unless the request's token is the service's."""
        if not token_matches(token, self.token):
            raise Unauthenticated("a valid token is required (authorization: Bearer <token>)")

    def observed(self, transport: str, endpoint: str) -> _Observed:
        """A context that counts and times one request (by the status code of
        the error leaving it, OK when none); maps nothing."""
        return _Observed(self.metrics, transport, endpoint)

    def store(self, model: str) -> ServedModel:
        """The model named ``model`` (empty: the only one, when there is one)."""
        stores = self.stores
        if not model and len(stores) == 1:
            return next(iter(stores.values()))
        store = stores.get(model)
        if store is None:
            raise NotFound(
                f"Servable not found for request: Latest({model}): no model {model!r} "
                f"(models: {', '.join(sorted(stores))})"
            )
        return store

    def select(
        self, model: str, version: int | None = None, label: str | None = None
    ) -> tuple[ServedModel, ServedVersion]:
        """The store serving the version a request names (``version``, or
        ``label``; neither: the newest) and that version's snapshot."""
        store = self.store(model)
        chooser = getattr(store, "select", None)
        if chooser is not None:
            return chooser(version, label)
        served = store.served()
        if label is not None:
            raise InvalidArgument(
                f"Unrecognized servable version label: {label} (model {store.name!r} has no "
                "labels: they come with a model config, wuliang serve --model-config)"
            )
        if version is not None and version != served.number:
            raise NotFound(
                f"Servable not found for request: Specific({store.name}, {version}): model "
                f"{store.name!r} serves version {served.number}, not {version}"
            )
        return store, served

    # -- limits ------------------------------------------------------------------

    def check_keys(self, n: int) -> None:
        """TooLarge when one lookup asks for more than ``max_keys`` keys."""
        if n > self.max_keys:
            raise TooLarge(f"{n} keys in one lookup; at most {self.max_keys}")

    def check_rows(self, n: int) -> None:
        """TooLarge when one prediction has more than ``max_rows`` rows."""
        if n > self.max_rows:
            raise TooLarge(f"{n} rows in one request; at most {self.max_rows}")

    def check_request_bytes(self, n: int) -> None:
        """TooLarge when a request is larger than ``max_request_bytes``."""
        if n > self.max_request_bytes:
            raise TooLarge(
                f"the request ({n} bytes) is larger than {self.max_request_bytes} bytes "
                "(max_request_bytes)"
            )

    # -- the API -----------------------------------------------------------------

    def lookup(
        self,
        model: str,
        table: str,
        keys: np.ndarray,
        version: int | None = None,
        label: str | None = None,
    ) -> LookupResult:
        """The rows of a table's keys (uint64 or int64 [n]), the version they
        were read at named in the answer (the one asked for, when given)."""
        store = self.store(model)
        if not isinstance(keys, np.ndarray) or keys.ndim != 1:
            raise InvalidArgument("keys must be a 1-D array of uint64")
        if len(keys) > self.max_keys:
            self.check_keys(len(keys))
        if version is None and label is None and not self._sized(store, table):
            result = store.lookup(table, keys)
        else:  # a sized table's blocks are read at one version
            result = self._pinned_lookup(model, table, keys, version, label)
        self.metrics.count_keys(store.name, table, len(keys))
        return result

    @staticmethod
    def _sized(store: ServedModel, table: str) -> bool:
        """Whether the table is a sized one in the version served now."""
        try:
            return bool(_blocks_of(store.served(), table))
        except Unavailable:
            return False

    def _pinned_lookup(
        self, model: str, table: str, keys: np.ndarray, version: int | None, label: str | None
    ) -> LookupResult:
        deadline = time.monotonic() + SWITCH_SECONDS
        while True:
            slot, served = self.select(model, version, label)
            try:
                blocks = _blocks_of(served, table)
                return read_blocks(slot.lookup, table, blocks, keys, served)
            except VersionMoved:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)

    def predict(
        self,
        model: str,
        features: Mapping[str, FeatureInput] | Decoder,
        rows: int | None = None,
        version: int | None = None,
        label: str | None = None,
    ) -> PredictAnswer:
        """Scores of a batch, all at one version (see the module docstring).

        Args:
            model: the model's name ("": the only one).
            features: the features by name, or a decoder that reads them
                (and the row count) with the model description of the
                version that answers.
            rows: the batch's rows (with a mapping of features).
            version, label: the version to answer from (default: the newest).
        """
        self.store(model)
        decoded: tuple[Mapping[str, FeatureInput], int] | None = None
        described = None
        deadline = None
        while True:
            store, served = self.select(model, version, label)
            check_model(store, served)
            if decoded is None or served.model != described:
                if callable(features):
                    decoded = features(served.model)
                else:
                    if rows is None:
                        raise InvalidArgument("rows is required with features by name")
                    decoded = (features, rows)
                described = served.model
                if isinstance(decoded[1], int) and decoded[1] > 0:
                    self.check_rows(decoded[1])
            try:
                return predict(store, served, decoded[0], decoded[1])
            except VersionMoved:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + SWITCH_SECONDS
                elif now > deadline:
                    raise Unavailable(
                        f"model {store.name!r}: versions kept switching for {SWITCH_SECONDS:g} s "
                        "during a prediction; retry"
                    ) from None
                time.sleep(0.001)  # a version is switching in, table by table

    def status(self, model: str = "") -> list[dict[str, Any]]:
        """Per model: version, step, tables, settings and counters."""
        stores = [self.store(model)] if model else list(self.stores.values())
        out = []
        for store in stores:
            try:
                served = store.served()
            except Unavailable:
                served = None
            stats = store.table_stats() if served is not None else {}
            dims = store.tables() if served is not None else {}
            out.append(
                {
                    "name": store.name,
                    "version": 0 if served is None else served.number,
                    "step": 0 if served is None else served.step,
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
                    # non-empty: the version serves lookups only, and why
                    "lookups_only": served.no_tower if served and served.tower is None else "",
                    "versions": versions_status(store, served),
                }
            )
        return out

    def model_names(self) -> list[str]:
        return sorted(self.stores)

    def healthy(self) -> bool:
        """Every model serves a version."""
        return all(store.version for store in self.stores.values())

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def versions_status(store: ServedModel, served: ServedVersion | None) -> list[dict[str, Any]]:
    """Each version of a model with its state (TensorFlow Serving's
    ``ModelVersionStatus``): ``version``, ``state``, ``error`` and ``bytes``."""
    listed = getattr(store, "versions_status", None)
    if listed is not None:
        versions = listed()
        if versions:
            return versions
    if served is None:
        return [{"version": 0, "state": "LOADING", "error": "", "bytes": 0}]
    size = sum(int(s["bytes"]) for s in store.table_stats().values())
    return [{"version": served.number, "state": "AVAILABLE", "error": "", "bytes": size}]


def _blocks_of(served: ServedVersion, table: str) -> tuple[str, ...]:
    """A sized table's extension blocks in the version's model (else ())."""
    for f in served.model.sparse:
        if f.table == table and f.blocks:
            return f.blocks
    return ()
