"""``wuliang.serving.Client``: the Python client of a serving process (gRPC).

::

    with Client("127.0.0.1:8500", timeout=1.0) as client:
        rows, found, version = client.lookup("item", [7, 42])
        scores, version = client.predict(
            {"user_id": [1, 2],                          # one key per row
             "genres": ([3, 4, 3], [0, 2, 3]),           # CSR: keys and row offsets
             "tags": [["comedy", "dark"], []],           # raw strings, a list per row
             "age": np.array([[0.3], [0.5]], np.float32)},  # dense
        )

A sparse feature's value is one key per row (a list or an integer array),
a list per row (of keys, or of raw strings), or a tuple ``(values, offsets[,
weights])`` (CSR); a key is an integer in [-2^63, 2^64 - 1] (negative: an
int64 key, read as its uint64 bits). Strings are sent as strings
(``Feature.string_values``): the server hashes them when the feature was
trained on hashed strings, and otherwise takes each string of digits for the
key it spells, as the HTTP/JSON API does. A dense feature's value is float:
a float array ``[rows]`` or ``[rows, dim]``, or a list of Python floats (a
list of integers is taken for keys). What the client cannot send (a nested
list of irregular depth, booleans, integers mixed with strings in one
feature) raises ``TypeError`` or ``ValueError`` naming the feature.

Every call has a deadline (``timeout`` seconds, per client or per call) and
raises ``ServingClientError`` (with the gRPC ``code`` name and the server's
message) instead of a raw ``grpc.RpcError``; ``healthy()`` answers False
instead when the server is unreachable or not serving.

A call the server shed under overload (RESOURCE_EXHAUSTED carrying
``grpc-retry-pushback-ms``, ``wuliang.serving.overload``) is sent again, up
to ``retries`` times, after a pause: the server's pushback (at least
``RETRY_BASE_SECONDS``) doubled at each try, at most ``RETRY_MAX_SECONDS``,
times a random factor in [0.5, 1.5) (jitter: clients shed together do not
come back together), and never past the call's deadline. Any other error,
a request too large included, is raised at once.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from wuliang.ps_server import LookupResult
from wuliang.ps_server.rpc.auth import bearer
from wuliang.serving.errors import InvalidArgument
from wuliang.serving.features import parse_keys
from wuliang.serving.grpc import proto
from wuliang.serving.grpc.common import PUSHBACK_KEY

__all__ = ["RETRY_BASE_SECONDS", "RETRY_MAX_SECONDS", "Client", "ServingClientError"]

RETRY_BASE_SECONDS = 0.01  # the least pause before sending a shed call again
RETRY_MAX_SECONDS = 1.0  # the longest


class ServingClientError(Exception):
    """A call that failed: ``code`` (gRPC status name) and the server's message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Client:
    """A connection to one serving process.

    Args:
        address: ``host:port`` of its gRPC endpoint.
        token: sent as ``authorization: Bearer <token>`` when given.
        timeout: seconds each call may take (its deadline).
        tls_root: the CA certificate to trust (PEM bytes, or the path of a
            PEM file) for a server speaking TLS; None: plain TCP.
        model: the default model of calls ("": the server's only one).
        retries: times a call the server shed is sent again (0: never).
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 5.0,
        tls_root: bytes | str | os.PathLike | None = None,
        model: str = "",
        retries: int = 3,
    ) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        options = [("grpc.max_receive_message_length", 256 << 20)]
        if tls_root is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            root = tls_root if isinstance(tls_root, bytes) else Path(tls_root).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            self.channel = grpc.secure_channel(address, credentials, options=options)
        self.timeout = timeout
        self.model = model
        self.retries = retries
        self._random = random.Random()
        self.metadata = bearer(token) if token else ()
        self._calls = {
            method: self.channel.unary_unary(
                proto.method_path(method),
                request_serializer=proto.REQUESTS[method].SerializeToString,
                response_deserializer=proto.RESPONSES[method].FromString,
            )
            for method in proto.METHODS
        }
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            try:
                return self._calls[method](
                    request,
                    timeout=max(deadline - time.monotonic(), 0.0),
                    metadata=self.metadata,
                )
            except grpc.RpcError as error:
                pause = self._pause(error, attempt)
                if pause is None or time.monotonic() + pause >= deadline:
                    raise ServingClientError(error.code().name, error.details() or "") from None
            time.sleep(pause)
            attempt += 1

    def _pause(self, error: grpc.RpcError, attempt: int) -> float | None:
        """Seconds to wait before sending a shed call again; None: raise."""
        if attempt >= self.retries or error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None
        trailers = getattr(error, "trailing_metadata", lambda: None)() or ()
        pushback = next((value for key, value in trailers if key == PUSHBACK_KEY), None)
        if pushback is None:  # not shed: a request too large, ...
            return None
        try:
            wait_ms = int(pushback)
        except ValueError:
            wait_ms = 0
        if wait_ms < 0:  # gRPC's pushback for "do not retry"
            return None
        base = max(wait_ms / 1e3, RETRY_BASE_SECONDS)
        pause = min(base * 2**attempt, RETRY_MAX_SECONDS)
        return pause * self._random.uniform(0.5, 1.5)

    def lookup(
        self, table: str, keys: Any, model: str | None = None, timeout: float | None = None
    ) -> LookupResult:
        """(rows float32 [n, dim], found bool [n], version) of keys: an
        integer array, or a list of integers and strings of digits."""
        data, n = _lookup_keys(keys)
        request = proto.LookupRequest(
            model=self.model if model is None else model, table=table, keys=data
        )
        response = self._call("Lookup", request, timeout)
        rows = np.frombuffer(response.vectors, "<f4").reshape(n, response.dim)
        found = np.frombuffer(response.found, np.uint8).astype(bool)
        if len(found) != n:  # proto3 leaves an empty field out
            found = np.zeros(n, bool)
        return LookupResult(rows, found, response.version)

    def predict(
        self,
        features: Mapping[str, Any],
        rows: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> tuple[dict[str, np.ndarray], int]:
        """Scores of a batch: ({output name: float32 [rows] or [rows, k]}, version).

        Args:
            features: each feature's values (see the module docstring).
            rows: the batch's rows (default: read from the first feature).
        """
        messages = [_feature(name, value) for name, value in features.items()]
        if rows is None:
            rows = _rows_of(features)
        request = proto.PredictRequest(
            model=self.model if model is None else model, rows=rows, features=messages
        )
        response = self._call("Predict", request, timeout)
        outputs = {}
        for output in response.outputs:
            values = np.frombuffer(output.values, "<f4")
            outputs[output.name] = values if output.dim == 1 else values.reshape(-1, output.dim)
        return outputs, response.version

    def status(self, model: str | None = None, timeout: float | None = None) -> list[dict]:
        """Per model: version, step, tables, settings and counters."""
        response = self._call(
            "Status", proto.StatusRequest(model=self.model if model is None else model), timeout
        )
        return [
            {
                "name": m.name,
                "version": m.version,
                "step": m.step,
                "tables": [
                    {"name": t.name, "dim": t.dim, "rows": t.rows, "bytes": t.bytes}
                    for t in m.tables
                ],
                "missing_keys": m.missing_keys,
                "precision": m.precision,
                "applied": m.applied,
                "refused": m.refused,
                "lookups_only": m.lookups_only,
            }
            for m in response.models
        ]

    def healthy(self, timeout: float | None = None) -> bool:
        """The standard gRPC health check: True when the server serves every
        model; False when it does not yet, or cannot be reached in time."""
        try:
            answer = self._health.Check(
                health_pb2.HealthCheckRequest(service=proto.SERVICE),
                timeout=self.timeout if timeout is None else timeout,
                metadata=self.metadata,
            )
        except grpc.RpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- values to messages ------------------------------------------------------------


def _lookup_keys(keys: Any) -> tuple[bytes, int]:
    """A lookup's keys as uint64 little-endian bytes, and their number:
    integers and strings of digits, read as the HTTP/JSON API reads them."""
    if isinstance(keys, np.ndarray) and keys.ndim == 1 and keys.dtype.kind in "iu":
        values = _int_keys("keys", keys)
    else:
        if isinstance(keys, np.ndarray):
            if keys.ndim != 1 or keys.dtype.kind not in "USO":
                raise TypeError(
                    f"keys must be a 1-D array of integers or strings, got {keys.dtype} "
                    f"{list(keys.shape)}"
                )
            keys = keys.tolist()
        if not isinstance(keys, Sequence) or isinstance(keys, str | bytes):
            raise TypeError(f"keys must be a list or array, got {type(keys).__name__}")
        items = [k.item() if isinstance(k, np.generic) else k for k in keys]
        try:
            values = parse_keys(items, "keys")
        except InvalidArgument as error:
            raise ValueError(str(error)) from None
    return values.astype("<u8", copy=False).tobytes(), len(values)


def _feature(name: str, value: Any) -> Any:
    """One feature as a ``proto.Feature`` (see the module docstring)."""
    what = f"feature {name!r}"
    if isinstance(value, tuple):
        if len(value) not in (2, 3):
            raise TypeError(f"{what}: a tuple must be (values, offsets[, weights])")
        values, offsets, *rest = value
        kind, flat = _flat_values(what, values)
        if kind == "floats":
            raise TypeError(f"{what}: CSR values must be keys or strings, got {flat.dtype}")
        weights = rest[0] if rest else None
        return _sparse(name, kind, flat, _ints(f"{what} offsets", offsets), weights)
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return proto.Feature(name=name, values=np.ascontiguousarray(value, "<f4").tobytes())
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return _sparse(name, "keys", _int_keys(what, value), None, None)
    if isinstance(value, np.ndarray) and value.ndim > 1:
        raise TypeError(
            f"{what}: a {value.ndim}-D {value.dtype} array; send one key per row (1-D), "
            "a list of keys per row, or (keys, offsets) for several keys per row"
        )
    rows = value.tolist() if isinstance(value, np.ndarray) else value
    if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
        raise TypeError(
            f"{what}: expected a list or array of values (one per row), got {type(value).__name__}"
        )
    nested = [isinstance(row, list | tuple | np.ndarray) for row in rows]
    if not any(nested):  # one value per row
        kind, flat = _flat_values(what, rows)
        if kind == "floats":
            return proto.Feature(name=name, values=flat.astype("<f4").tobytes())
        return _sparse(name, kind, flat, None, None)
    if not all(nested) and _has_float(rows):
        raise TypeError(f"{what}: rows mix numbers and lists")
    if _has_float(rows):  # dense rows of dim values
        try:
            dense = np.asarray(rows, np.float32)
        except (ValueError, TypeError):
            raise TypeError(f"{what}: dense rows must each hold as many floats") from None
        if dense.ndim != 2:
            raise TypeError(f"{what}: dense values nest too deeply")
        return proto.Feature(name=name, values=dense.astype("<f4").tobytes())
    flat_rows: list[Any] = []
    offsets = [0]
    for i, row in enumerate(rows):  # a key or string, or a list of them, per row
        items = row.tolist() if isinstance(row, np.ndarray) else row
        if isinstance(items, list | tuple):
            if any(isinstance(x, list | tuple | np.ndarray) for x in items):
                raise TypeError(f"{what}, row {i}: keys nest too deeply (a list per row at most)")
            flat_rows.extend(items)
        else:
            flat_rows.append(items)
        offsets.append(len(flat_rows))
    kind, flat = _flat_values(what, flat_rows)
    return _sparse(name, kind, flat, np.array(offsets, "<i8"), None)


def _sparse(name: str, kind: str, values: Any, offsets: Any, weights: Any) -> Any:
    feature = proto.Feature(name=name)
    if kind == "strings":
        encoded = [s.encode() for s in values]
        bounds = np.zeros(len(encoded) + 1, "<i8")
        np.cumsum([len(b) for b in encoded], out=bounds[1:])
        feature.string_values = b"".join(encoded)
        feature.string_offsets = bounds.tobytes()
    else:
        feature.values = values.astype("<u8", copy=False).tobytes()
    if offsets is not None:
        feature.offsets = np.ascontiguousarray(offsets, "<i8").tobytes()
    if weights is not None:
        weights = np.asarray(weights)
        if weights.dtype.kind not in "fiu" or weights.ndim != 1:
            raise TypeError(f"feature {name!r} weights: expected a 1-D float array")
        feature.weights = np.ascontiguousarray(weights, "<f4").tobytes()
    return feature


def _flat_values(what: str, values: Any) -> tuple[str, Any]:
    """("keys", uint64 array), ("strings", list of str) or ("floats", float
    array) of a flat list or 1-D array; TypeError or ValueError naming
    ``what`` for anything else."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise TypeError(f"{what}: expected a 1-D array, got {values.ndim}-D")
        if values.dtype.kind in "iu":
            return "keys", _int_keys(what, values)
        if values.dtype.kind == "f":
            return "floats", values
        if values.dtype.kind not in "USO":
            raise TypeError(f"{what}: keys must be integers or strings, got {values.dtype}")
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        raise TypeError(f"{what}: expected a list or array, got {type(values).__name__}")
    items = [v.item() if isinstance(v, np.generic) else v for v in values]
    kinds = set(map(type, items))
    if not items or kinds == {int}:
        try:
            return "keys", parse_keys(items, what)
        except InvalidArgument as error:
            raise ValueError(str(error)) from None
    if kinds <= {str, bytes}:
        return "strings", [v.decode() if isinstance(v, bytes) else v for v in items]
    if kinds <= {int, float}:
        return "floats", np.asarray(items, np.float64)
    if kinds & {str, bytes} and int in kinds:
        raise TypeError(f"{what}: mixes integer keys and strings; send one kind per feature")
    bad = next(v for v in items if type(v) not in (int, float, str, bytes))
    raise TypeError(
        f"{what}: expected integer keys, strings or floats, got {type(bad).__name__} ({bad!r})"
    )


def _int_keys(what: str, values: np.ndarray) -> np.ndarray:
    if values.dtype == np.uint64:
        return values
    if values.dtype == np.int64:
        return values.view(np.uint64)
    if values.dtype.kind == "u":
        return values.astype(np.uint64)
    return values.astype(np.int64).view(np.uint64)


def _ints(what: str, values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(f"{what}: expected a 1-D integer array, got {array.dtype} {array.shape}")
    return array.astype(np.int64)


def _has_float(rows: Sequence[Any]) -> bool:
    for row in rows:
        items = row.tolist() if isinstance(row, np.ndarray) else row
        for x in items if isinstance(items, list | tuple) else (items,):
            if isinstance(x, float | np.floating):
                return True
    return False


def _rows_of(features: Mapping[str, Any]) -> int:
    """The batch's rows, read from its first feature."""
    if not features:
        raise ValueError("a prediction needs at least one feature (or rows=)")
    value = next(iter(features.values()))
    if isinstance(value, tuple):
        return len(value[1]) - 1
    return len(value)
