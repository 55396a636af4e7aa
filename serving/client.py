"""``wuliang.serving.Client``: the Python client of a serving process (gRPC).

::

    with Client("127.0.0.1:8500", timeout=1.0) as client:
        rows, found, version = client.lookup("item", np.array([7, 42], np.uint64))
        scores, version = client.predict(
            {"user_id": np.array([1, 2], np.uint64),          # one key per row
             "genres": (keys, offsets),                        # CSR: several keys per row
             "age": np.array([[0.3], [0.5]], np.float32)},     # dense
            rows=2,
        )

Every call has a deadline (``timeout`` seconds, per client or per call) and
raises ``ServingClientError`` (with the gRPC ``code`` name and the server's
message) instead of a raw ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from wuliang.ps_server import LookupResult
from wuliang.serving import proto


class ServingClientError(Exception):
    """A call that failed: ``code`` (gRPC status name) and the server's message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


FeatureValue = (
    np.ndarray | tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]
)


class Client:
    """A connection to one serving process.

    Args:
        address: ``host:port`` of its gRPC endpoint.
        token: sent as ``authorization: Bearer <token>`` when given.
        timeout: seconds each call may take (its deadline).
        tls_root: PEM of the CA to trust (TLS); None: plain TCP.
        model: the default model of calls ("": the server's only one).
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout: float = 5.0,
        tls_root: bytes | None = None,
        model: str = "",
    ) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        if tls_root is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_root)
            self.channel = grpc.secure_channel(address, credentials, options=options)
        self.timeout = timeout
        self.model = model
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
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
        try:
            return self._calls[method](
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self.metadata,
            )
        except grpc.RpcError as error:
            raise ServingClientError(error.code().name, error.details() or "") from None

    def lookup(
        self, table: str, keys: Any, model: str | None = None, timeout: float | None = None
    ) -> LookupResult:
        """(rows float32 [n, dim], found bool [n], version) of keys."""
        keys = np.ascontiguousarray(keys)
        if keys.dtype not in (np.uint64, np.int64):
            raise TypeError(f"keys must be uint64 or int64, got {keys.dtype}")
        request = proto.LookupRequest(
            model=self.model if model is None else model,
            table=table,
            keys=keys.astype("<u8", copy=False).tobytes(),
        )
        response = self._call("Lookup", request, timeout)
        rows = np.frombuffer(response.vectors, "<f4").reshape(len(keys), response.dim)
        found = np.frombuffer(response.found, np.uint8).astype(bool)
        return LookupResult(rows, found, response.version)

    def predict(
        self,
        features: Mapping[str, FeatureValue],
        rows: int,
        model: str | None = None,
        timeout: float | None = None,
    ) -> tuple[dict[str, np.ndarray], int]:
        """Scores of a batch: ({output name: float32 [rows] or [rows, k]}, version).

        A feature is a uint64/int64 array (one key per row), a tuple
        ``(keys, offsets[, weights])`` (several keys per row), or a float32
        array ``[rows, dim]`` (dense)."""
        request = proto.PredictRequest(model=self.model if model is None else model, rows=rows)
        for name, value in features.items():
            request.features.append(_feature(name, value))
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
            }
            for m in response.models
        ]

    def healthy(self, timeout: float | None = None) -> bool:
        """The standard gRPC health check: True when serving."""
        try:
            answer = self._health.Check(
                health_pb2.HealthCheckRequest(service=proto.SERVICE),
                timeout=self.timeout if timeout is None else timeout,
            )
        except grpc.RpcError as error:
            raise ServingClientError(error.code().name, error.details() or "") from None
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _feature(name: str, value: FeatureValue) -> Any:
    if isinstance(value, tuple):
        keys, offsets, *rest = value
        weights = rest[0] if rest else None
        return proto.Feature(
            name=name,
            values=_keys(name, keys),
            offsets=np.ascontiguousarray(offsets, "<i8").tobytes(),
            weights=b"" if weights is None else np.ascontiguousarray(weights, "<f4").tobytes(),
        )
    value = np.ascontiguousarray(value)
    if value.dtype in (np.uint64, np.int64):
        return proto.Feature(name=name, values=_keys(name, value))
    if value.dtype != np.float32:
        raise TypeError(
            f"feature {name!r}: keys must be uint64/int64 and dense values float32, got "
            f"{value.dtype}"
        )
    return proto.Feature(name=name, values=value.astype("<f4", copy=False).tobytes())


def _keys(name: str, keys: Any) -> bytes:
    keys = np.ascontiguousarray(keys)
    if keys.dtype not in (np.uint64, np.int64):
        raise TypeError(f"feature {name!r}: keys must be uint64 or int64, got {keys.dtype}")
    return keys.astype("<u8", copy=False).tobytes()
