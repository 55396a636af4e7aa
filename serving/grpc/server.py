"""The gRPC transport: ``wuliang.serving.Serving`` (``serving.proto``),
TensorFlow Serving's ``PredictionService`` and ``ModelService``
(``wuliang.serving.tfs.grpc``) and the standard health service
(``grpc.health.v1.Health``), on one port.

Arrays arrive and leave as raw little-endian bytes (``serving.proto``); a
sparse feature's raw strings as concatenated UTF-8 and their offsets
(``string_values``, ``string_offsets``). The transport only turns messages
into arrays and back: a prediction hands the ``Service`` a decoder that
reads the request's features with the model description of the version
that answers it (``features``). A request's token, when the service has
one, is the ``authorization`` metadata ``Bearer <token>``. Every error is a
gRPC status (``errors.ServingError.code``) with a message naming the bad
input; an unexpected exception is logged and answered INTERNAL, and the
server keeps serving. Requests arrive as bytes and are parsed inside the
handler, so bytes that are not the request message (truncated, garbled) are
INVALID_ARGUMENT and counted in the metrics, where grpcio's own deserializer
would answer INTERNAL and log a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from wuliang.ps_server.rpc.net import grpc_address, listen_error
from wuliang.ps_server.rpc.tls import ServerTls
from wuliang.ps_server.storage import ModelDescription
from wuliang.serving.errors import InvalidArgument, ServingError
from wuliang.serving.features import string_keys_of_bytes
from wuliang.serving.grpc import proto
from wuliang.serving.grpc.common import abort, on_pool, parse, token
from wuliang.serving.overload import Shedding, SheddingPool, take_shed
from wuliang.serving.predict import PREDICT_THREADS, FeatureInput
from wuliang.serving.service import Service
from wuliang.serving.tfs.grpc import tfs_handlers

__all__ = ["GrpcServer", "features", "serving_handler"]

log = logging.getLogger("wuliang.serving")
CONTROL_THREADS = 2  # threads answering status, metadata and health (never shed)
MAX_SEND_BYTES = 256 << 20  # an answer (a lookup of 100,000 keys of dim 128 is 51 MB)


def _array(data: bytes, dtype: str, what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise InvalidArgument(
            f"{what}: {len(data)} bytes is not a whole number of {size}-byte values"
        )
    return np.frombuffer(data, dtype)


class _Handlers:
    def __init__(self, service: Service) -> None:
        self.service = service

    def call(
        self, endpoint: str, body: Callable[[Any], Any]
    ) -> Callable[[bytes, grpc.ServicerContext], Any]:
        message = proto.REQUESTS[endpoint]

        def handle(request: bytes, context: grpc.ServicerContext) -> Any:
            try:
                with self.service.observed("grpc", endpoint):
                    shed = take_shed()
                    if shed is not None:
                        raise shed
                    if self.service.token is not None:
                        self.service.authorize(token(context))
                    return body(parse(message, request))
            except ServingError as error:
                abort(context, error)
            except Exception:
                log.exception("gRPC %s failed", endpoint)
                context.abort(grpc.StatusCode.INTERNAL, f"{endpoint} failed inside the server")

        return handle

    def lookup(self, request: Any) -> bytes:
        keys = _array(request.keys, "<u8", "keys")
        result = self.service.lookup(request.model, request.table, keys)
        return proto.lookup_response(result.rows, result.found, result.version)

    def predict(self, request: Any) -> Any:
        answer = self.service.predict(
            request.model, lambda description: features(request, description)
        )
        outputs = [
            proto.Output(
                name=name,
                values=values.astype("<f4", copy=False).tobytes(),
                dim=1 if values.ndim == 1 else values.shape[1],
            )
            for name, values in sorted(answer.outputs.items())
        ]
        return proto.PredictResponse(outputs=outputs, version=answer.version)

    def status(self, request: Any) -> Any:
        models = [
            proto.ModelStatus(
                name=m["name"],
                version=m["version"],
                step=m["step"],
                tables=[proto.TableStatus(**t) for t in m["tables"]],
                missing_keys=m["missing_keys"],
                precision=m["precision"],
                applied=m["applied"],
                refused=m["refused"],
                lookups_only=m["lookups_only"],
            )
            for m in self.service.status(request.model)
        ]
        return proto.StatusResponse(models=models)


def features(request: Any, description: ModelDescription) -> tuple[dict[str, FeatureInput], int]:
    """A ``PredictRequest`` 's features as arrays, read with the model
    description of the version that answers it (which features are sparse,
    which hash raw strings); and its row count."""
    sparse = description.sparse_by_name
    out: dict[str, FeatureInput] = {}
    for f in request.features:
        name = f.name
        if name in out:
            raise InvalidArgument(f"feature {name!r} is given twice")
        strings = bool(f.string_values or f.string_offsets)
        spec = sparse.get(name)
        if spec is None:
            if strings and name in description.dense_by_name:
                raise InvalidArgument(f"dense feature {name!r} takes float32 values, not strings")
            out[name] = FeatureInput(_array(f.values, "<f4", f"feature {name!r}"))
            continue
        if strings:
            if f.values:
                raise InvalidArgument(
                    f"sparse feature {name!r}: send keys (values) or strings (string_values), "
                    "not both"
                )
            bounds = _array(f.string_offsets, "<i8", f"feature {name!r} string_offsets")
            keys = string_keys_of_bytes(
                f.string_values, bounds, spec, f"sparse feature {name!r} strings"
            )
        else:
            keys = _array(f.values, "<u8", f"feature {name!r} keys")
        out[name] = FeatureInput(
            keys,
            _array(f.offsets, "<i8", f"feature {name!r} offsets") if f.offsets else None,
            _array(f.weights, "<f4", f"feature {name!r} weights") if f.weights else None,
        )
    return out, int(request.rows)


def serving_handler(
    service: Service,
    lookup_pool: ThreadPoolExecutor | None = None,
    predict_pool: ThreadPoolExecutor | None = None,
) -> grpc.GenericRpcHandler:
    """The ``wuliang.serving.Serving`` methods over ``service``; lookups and
    predictions run on ``lookup_pool`` and ``predict_pool`` when given (else
    on the server's pool, as status does)."""
    handlers = _Handlers(service)
    bodies = {"Lookup": handlers.lookup, "Predict": handlers.predict, "Status": handlers.status}
    calls = {method: handlers.call(method, body) for method, body in bodies.items()}
    on_pool(calls["Lookup"], lookup_pool)
    on_pool(calls["Predict"], predict_pool)
    return grpc.method_handlers_generic_handler(
        proto.SERVICE,
        {
            method: grpc.unary_unary_rpc_method_handler(
                calls[method],
                request_deserializer=None,  # bytes: parsed by the handler (grpc.common.parse)
                # Lookup answers wire bytes (proto.lookup_response)
                response_serializer=None
                if method == "Lookup"
                else proto.RESPONSES[method].SerializeToString,
            )
            for method, body in bodies.items()
        },
    )


class GrpcServer:
    """A started gRPC server (``port``: the bound port); ``stop()`` ends it.

    Lookups run on a pool of ``lookup_threads`` threads, predictions (both
    APIs') on one of ``predict_threads``; a slow prediction never holds
    lookups up. Each of the two is a ``SheddingPool``: a call that would
    wait too long is answered RESOURCE_EXHAUSTED at once (``shedding``,
    ``wuliang.serving.overload``). Status, metadata and health run on a pool
    of their own (``CONTROL_THREADS``), never shed. Lookups default to 2
    threads: a lookup is mostly Python work under the GIL (grpcio's and the
    handler's; the engine releases it), so two threads overlap the released
    part of one with the Python of another, and more only contend for the
    GIL. Four clients on 2 cores (docs/performance.md): lookups/s 2,390 with
    2 threads, 2,260 with 1, 2,000 with 4, 1,960 on one shared pool of 16.
    Predictions default to ``PREDICT_THREADS`` (``wuliang.serving.predict``:
    TensorFlow spreads one prediction over the cores itself).

    Messages larger than the service's ``max_request_bytes`` are refused
    (RESOURCE_EXHAUSTED). The port is bound exclusively (no
    ``SO_REUSEPORT``): a port another server holds fails here.

    Args:
        service: what the calls answer from.
        host: the address to listen on.
        port: the port (0: a free one).
        tls: serve TLS with this certificate and key (``ServerTls``); None: plain.
        lookup_threads: threads answering lookups.
        predict_threads: threads answering predictions.
        shedding: the bounds of both pools' queues (default: ``Shedding()``).

    Raises:
        OSError: the port cannot be bound (the message names it and why).
    """

    def __init__(
        self,
        service: Service,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ServerTls | None = None,
        lookup_threads: int = 2,
        predict_threads: int = PREDICT_THREADS,
        shedding: Shedding | None = None,
    ) -> None:
        for name, value in (
            ("lookup_threads", lookup_threads),
            ("predict_threads", predict_threads),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        options = [
            ("grpc.max_receive_message_length", service.max_request_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.so_reuseport", 0),
        ]
        self.service = service
        self.tls = tls
        shedding = Shedding() if shedding is None else shedding
        self.lookup_queue = shedding.queue("grpc Lookup", lookup_threads)
        self.predict_queue = shedding.queue("grpc Predict", predict_threads)
        self.lookup_pool = SheddingPool(self.lookup_queue, "wuliang-lookup")
        self.predict_pool = SheddingPool(self.predict_queue, "wuliang-predict")
        self.pool = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="wuliang-grpc")
        self.pools = (self.lookup_pool, self.predict_pool, self.pool)
        service.metrics.queues.extend((self.lookup_queue, self.predict_queue))
        self.server = grpc.server(self.pool, options=options)
        self.server.add_generic_rpc_handlers(
            (serving_handler(service, self.lookup_pool, self.predict_pool),)
        )
        self.server.add_generic_rpc_handlers(tfs_handlers(service, self.predict_pool))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = grpc_address(host, port)
        if port:  # a port that cannot be bound: said here, not in grpcio's log
            probe = listen_error(host, port, "gRPC", probe_only=True)
            if probe is not None:
                self._end_pools(wait=False)
                raise probe
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, tls.grpc_credentials())
        except RuntimeError:  # grpcio: "Failed to bind to address ..."
            self.port = 0
        if self.port == 0:
            self._end_pools(wait=False)
            raise listen_error(host, port, "gRPC")
        service.listeners.append(self.update_health)  # versions applied, models changed
        self.update_health()
        self.server.start()

    def update_health(self) -> None:
        """SERVING once every model serves a version, else NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.service.healthy()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", proto.SERVICE, "tensorflow.serving.PredictionService"):
            self.health.set(name, status)

    def _end_pools(self, wait: bool) -> None:
        if not wait:
            self.server.stop(None)
        for pool in self.pools:
            pool.shutdown(wait=wait)
        for queue in (self.lookup_queue, self.predict_queue):
            if queue in self.service.metrics.queues:
                self.service.metrics.queues.remove(queue)

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()
        self._end_pools(wait=True)
