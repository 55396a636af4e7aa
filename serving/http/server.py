"""The HTTP/JSON transport, shaped like TensorFlow Serving's REST API.

Endpoints (``docs/serving.md`` has examples)::

    POST /v1/models/{model}[V]:predict               {"instances": [...]} or {"inputs": {...}}
    POST /v1/models/{model}[V]/tables/{table}:lookup {"keys": [...]}
    GET  /v1/models/{model}[V]                       the status of each version
    GET  /v1/models/{model}[V]/metadata              the serving_default signature
    POST /v1/models/{model}[V]:classify | :regress   501: not implemented (use :predict)
    GET  /healthz                                    200 when every model serves a version
    GET  /metrics                                    Prometheus text format

where ``[V]`` is nothing (the newest version), ``/versions/{number}`` or
``/labels/{label}``, as in TensorFlow Serving's REST API. Status and
metadata are TensorFlow Serving's JSON of ``GetModelStatusResponse`` and
``GetModelMetadataResponse`` (``wuliang.serving.tfs.answers``).

A prediction takes TF Serving's row format (``instances``: one object per row,
feature name -> value) or column format (``inputs``: feature name -> one value
per row) and answers in the same format (``predictions`` or ``outputs``), with
the ``model_version`` it was served from. A sparse feature's value for a row is
a key, a list of keys, or ``{"keys": [...], "weights": [...]}``; a key is a JSON
integer in [-2^63, 2^64 - 1] (negative ones are int64 keys, read as their
uint64 bit pattern, as the gRPC API does) or a string: the raw value of a
feature trained on hashed strings (hashed as training hashed it), else a
string of digits, for clients whose JSON numbers are doubles. A dense
feature's value is a number (dim 1) or a list of dim numbers. An output with
one value per row gives a number per row, a wider one a list. The JSON is
read and written by ``http.codec``; this module is the server.

Design:

* One aiohttp application on its own event loop in a background thread
  (``HttpServer``), bound to a socket made in the constructor (so a port in
  use fails there, and ``port`` is known at once); ``stop()`` closes it,
  letting requests in flight finish for up to ``grace`` seconds.
* Every request passes one middleware: it times and counts the request
  (``Service.observed("http", endpoint)``; routes outside the API count as
  ``Unknown``, so random paths never make new metric labels), checks the
  token (``Authorization: Bearer <token>``, every endpoint but ``/healthz``)
  and turns every error into ``{"error": message}`` with its status
  (``ServingError.http_status``; aiohttp's own 404, 405 and 413 become
  ``NotFound``, ``MethodNotAllowed`` and ``TooLarge``); anything else is
  logged and answered 500, and the server goes on. Requests too malformed
  to reach the middleware (a garbled request line) get aiohttp's plain-text
  400, logged at DEBUG only (``_ProtocolLog``).
* Request bodies are bounded (the service's ``max_request_bytes``, checked
  against Content-Length before reading and while reading) and must arrive within
  ``body_seconds`` (408: a client that stops mid-body does not hold its
  connection for ever). They must be UTF-8 JSON objects (NaN and Infinity
  are refused, as are unknown fields); the Content-Type is not checked, so
  ``curl -d`` works. Each value is checked
  for its type before it becomes an array, so a string where a number
  belongs, a float key, a bool, a nested list or a number outside float32
  is a 400 naming the field, row and feature. Batch sizes are checked
  (``Service.check_rows``, ``check_keys``: 413) before anything is converted.
  A prediction's body is decoded with the model description of the version
  that answers it (``Service.predict`` takes the decoder).
* Where the work runs: parsing, the service call and encoding form one
  synchronous function per request. Predictions always run in a thread pool
  (``workers`` threads, ``PREDICT_THREADS`` as gRPC's): the tower (TensorFlow) takes
  milliseconds and releases the GIL, so the event loop keeps answering other
  requests meanwhile. TensorFlow spreads one prediction over the cores itself,
  so more threads add no throughput and only stretch each prediction: 100-row
  predictions over REST (``benchmarks/overload_bench.py``'s model, 2 cores)
  answered 409/s from 1 caller at 2.4 ms each and 394/s from 8, and under an
  overload at twice that rate the admitted ones took 11 ms (p50) with 2
  threads against 100 ms with 8 (and 8 ms with 1). A lookup whose body is at most
  ``inline_bytes`` runs on the event loop itself: the engine answers a few
  keys in microseconds, and the hop to a pool thread and back costs more than
  that (parsing and converting 8 keys takes 7 us). Measured with
  ``benchmarks/serving_http_bench.py`` (8 keys a lookup, the client in another
  process, 2 shared cores): one client at a time, 0.52 ms a lookup inline vs
  0.68 ms through the pool (p50; on a busier machine, medians of 3 alternating
  runs, 0.70 vs 0.84 ms); 16 concurrent clients, 2,488 vs 2,338 lookups/s
  (busier: 1,634 vs 1,657, the client process being the bottleneck); 16 lookup
  clients beside 4 predicting 256 rows, 1,148 vs 1,019 lookups/s at the same
  149 predictions/s (busier: 980 vs 897 lookups/s, with 146 vs 174
  predictions/s). So lookups stay inline up to 16 KB (about 1,500 keys, ~1.5
  ms of the loop): under overload an answer computed on a pool thread waited
  7-23 ms (p50-p99) for the loop to get the GIL back from the pool's threads,
  and the server spent 510 µs an answer against 370 inline
  (``benchmarks/overload_bench.py``, 1000-key lookups). Bigger ones go to a
  pool of their own (``lookup_workers`` threads: parsing 100,000 keys takes 18
  ms as numbers, 85 ms as strings, and a lookup's answer is encoded there
  too), so the loop is never held long; it is Python under the GIL, so two
  threads, as for gRPC's lookups.
* Overload, and only overload, is shed (``wuliang.serving.overload``):
  once its body is read, a lookup or prediction is answered 503 with
  ``Retry-After`` at once when the event loop's queue (``LoopQueue``: the
  requests handled before it in the loop's pass, and its wait) or then its
  pool's (``ApiQueue``) is full, or overloaded and would keep it waiting
  longer than ``max_queue_ms``. Health, metrics, status and metadata are
  never shed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from wuliang.ps_server.rpc.net import listen_error
from wuliang.ps_server.rpc.tls import ServerTls
from wuliang.serving.errors import (
    InvalidArgument,
    NotFound,
    ServingError,
    TooLarge,
    Unimplemented,
)
from wuliang.serving.http.codec import PredictRequest, lookup_keys
from wuliang.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from wuliang.serving.overload import Shedding
from wuliang.serving.predict import PREDICT_THREADS
from wuliang.serving.service import Service
from wuliang.serving.tfs import answers

log = logging.getLogger("wuliang.serving")

INLINE_BYTES = 16384  # lookup bodies up to this size are answered on the event loop
LOOKUP_WORKERS = 2  # threads of the pool that runs big lookups
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENDPOINTS = ("Predict", "Lookup", "Status", "Metadata", "Unimplemented", "Health", "Metrics")

_MODEL = r"{model:[^/:]+}"
_TABLE = r"{table:[^/:]+}"
# a version in the path: none (the newest), by number or by label -> route name suffix
_VERSIONS = {"": "", "/versions/{version:[^/:]+}": ":version", "/labels/{label:[^/:]+}": ":label"}


class MethodNotAllowed(ServingError):
    """A known path asked with another method (GET for a prediction …)."""

    code = "UNIMPLEMENTED"
    http_status = 405


class BodyError(ServingError):
    """The request body could not be read: its answer closes the connection."""


class BodyTimeout(BodyError):
    """The request body came too slowly (``body_seconds``)."""

    code = "DEADLINE_EXCEEDED"
    http_status = 408


class ClientClosed(BodyError):
    """The client closed the connection before its request body ended."""

    code = "CANCELLED"
    http_status = 400


class UnreadableBody(BodyError):
    """A body aiohttp cannot decode (a Content-Encoding it is not in …)."""

    code = "INVALID_ARGUMENT"
    http_status = 400


# -- JSON out -----------------------------------------------------------------------


def _json(payload: Any, status: int = 200) -> web.Response:
    """``payload`` as JSON, numpy arrays included: a float32 as the shortest
    decimal that reads back as the same float32 (orjson; the standard
    library's encoder takes 20 times as long for a lookup's 16,000 floats)."""
    return web.Response(
        body=orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
    )


def _encoded(work: Callable[..., Any], *args: Any) -> web.Response:
    """``work(*args)`` 's answer as JSON, encoded where the work ran (a
    lookup of 1,000 keys of dim 16 is 160 KB of JSON: in the pool, not on
    the event loop)."""
    return _json(work(*args))


def _error(status: int, message: str, retry_ms: int | None = None) -> web.Response:
    """``{"error": message}``; a shed request's also says when to retry
    (``retry_after_ms``, and ``Retry-After`` in whole seconds, at least 1)."""
    if retry_ms is None:
        response = _json({"error": message}, status)
    else:
        response = _json({"error": message, "retry_after_ms": retry_ms}, status)
        response.headers["Retry-After"] = str(max(1, math.ceil(retry_ms / 1e3)))
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="wuliang"'
    return response


def _target(request: web.Request) -> tuple[str, int | None, str | None]:
    """The model, version and label a request's path names."""
    info = request.match_info
    text = info.get("version")
    version = None
    if text is not None:
        if not text.isascii() or not text.isdigit() or len(text) > 18:
            raise InvalidArgument(
                f"the version in the path must be a number, got {text[:40]!r} "
                "(/v1/models/{model}/versions/{number}, or /labels/{label})"
            )
        version = int(text)
    return info["model"], version, info.get("label")


def _pinned(version: int | None, label: str | None) -> dict[str, Any]:
    """The version arguments of a service call, none for the newest version."""
    return {} if version is None and label is None else {"version": version, "label": label}


def _token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


# -- the server ---------------------------------------------------------------------


class _ProtocolLog(logging.LoggerAdapter):
    """aiohttp's server log (``aiohttp.server``), where a malformed request
    (a bad request line or header, a body that does not decode) is one
    DEBUG line instead of an ERROR with a traceback: it is the client's
    fault, already answered 400, and a flood of them must not flood the log.
    Anything else is logged as aiohttp logs it."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, HttpProcessingError | RequestPayloadError):
            reason = str(error).replace("\n", " ")[:300]
            self.logger.debug(f"{msg}: %s", *args, reason)
        else:
            self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


class _Api:
    """The endpoints over one service (see the module docstring)."""

    def __init__(
        self,
        service: Service,
        executor: ThreadPoolExecutor,
        inline_bytes: int,
        body_seconds: float = 30.0,
        shedding: Shedding | None = None,
        workers: int = PREDICT_THREADS,
        lookup_executor: ThreadPoolExecutor | None = None,
        lookup_workers: int = LOOKUP_WORKERS,
    ) -> None:
        shedding = Shedding() if shedding is None else shedding
        self.service = service
        self.max_body_bytes = service.max_request_bytes
        self.body_seconds = body_seconds
        self.inline_bytes = inline_bytes
        self.pools = {"predict": (executor, shedding.queue("http Predict", workers))}
        self.pools["lookup"] = (
            self.pools["predict"]
            if lookup_executor is None
            else (lookup_executor, shedding.queue("http Lookup", lookup_workers))
        )
        self.loop_queue = shedding.loop("http loop")
        self.lag = self.loop_queue.lag
        self.clock = self.loop_queue.clock
        self.queues = [self.loop_queue, *{id(q): q for _, q in self.pools.values()}.values()]

    def application(self) -> web.Application:
        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self.middleware(request, handler)

        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[middleware])
        router = app.router
        for path, suffix in _VERSIONS.items():
            base = f"/v1/models/{_MODEL}{path}"
            router.add_post(f"{base}:predict", self.predict, name=f"Predict{suffix}")
            router.add_post(f"{base}/tables/{_TABLE}:lookup", self.lookup, name=f"Lookup{suffix}")
            router.add_get(base, self.status, name=f"Status{suffix}")
            router.add_get(f"{base}/metadata", self.metadata, name=f"Metadata{suffix}")
            router.add_post(
                f"{base}:{{verb:classify|regress}}",
                self.unimplemented,
                name=f"Unimplemented{suffix}",
            )
        router.add_get("/healthz", self.health, name="Health")
        router.add_get("/metrics", self.metrics, name="Metrics")
        return app

    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await self._answer(request, handler)
        if request.body_exists and not request.content.is_eof():
            # A body left unread (an error before reading it, a GET with a
            # body): aiohttp drains it after the answer and, if it does not
            # decode (a gzip body that is not gzip), drops the connection;
            # "Connection: close" keeps clients from reusing it meanwhile.
            response.force_close()
        return response

    async def _answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        name = (request.match_info.route.name or "").split(":")[0]
        endpoint = name if name in ENDPOINTS else "Unknown"
        try:
            with self.service.observed("http", endpoint):
                if endpoint != "Health":
                    self.service.authorize(_token(request))
                try:
                    return await handler(request)
                except web.HTTPNotFound:
                    raise NotFound(
                        f"no endpoint {request.method} {request.path[:100]!r}; endpoints: "
                        "POST /v1/models/{model}:predict, "
                        "POST /v1/models/{model}/tables/{table}:lookup, "
                        "GET /v1/models/{model}, GET /v1/models/{model}/metadata "
                        "(each with /versions/{version} or /labels/{label} after the model), "
                        "GET /healthz, GET /metrics"
                    ) from None
                except web.HTTPMethodNotAllowed as error:
                    raise MethodNotAllowed(
                        f"{request.method} is not allowed on {request.path[:100]!r}; "
                        f"use {', '.join(sorted(error.allowed_methods))}"
                    ) from None
                except web.HTTPRequestEntityTooLarge:
                    raise self._too_large(None) from None
        except ServingError as error:
            response = _error(error.http_status, str(error), getattr(error, "retry_ms", None))
            if isinstance(error, BodyError):  # the rest of the body cannot be trusted
                response.force_close()
            return response
        except web.HTTPException as error:  # aiohttp's own (a bad request line …)
            return _error(error.status, error.text or error.reason)
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path[:100])
            return _error(500, f"{endpoint} failed inside the server")

    def _too_large(self, size: int | None) -> TooLarge:
        got = "" if size is None else f" ({size} bytes)"
        return TooLarge(
            f"the request body{got} is larger than {self.max_body_bytes} bytes (max_request_bytes)"
        )

    async def _body(self, request: web.Request) -> bytes:
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            raise self._too_large(size)
        try:
            return await asyncio.wait_for(request.read(), self.body_seconds)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
            raise BodyTimeout(
                f"the request body did not arrive within {self.body_seconds:g} s (body_seconds)"
            ) from None
        except ConnectionError:  # the client went away mid-body: no one reads the answer
            raise ClientClosed("the connection closed before the request body ended") from None
        except RequestPayloadError as error:  # a gzip body that is not gzip …
            reason = getattr(error.__cause__, "message", None) or str(error).split("\n")[-1]
            raise UnreadableBody(f"the request body cannot be read: {reason.strip()}") from None

    async def _run(self, where: str, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` on the loop (``where`` "inline") or in the
        "lookup" or "predict" pool, once admitted."""
        wait = self.loop_queue.admit()
        if where == "inline":
            return work(*args)
        executor, queue = self.pools[where]
        arrived = queue.admit(wait)
        ran = False

        def timed() -> Any:
            nonlocal ran
            ran = True
            start = time.perf_counter()
            stale = queue.stale(arrived)  # an overloaded queue sheds (and ends) what waited
            if stale is not None:
                raise stale
            try:
                return work(*args)
            finally:  # here, not on the loop: the loop may take its time to resume
                queue.done(time.perf_counter() - start)

        try:
            return await asyncio.get_running_loop().run_in_executor(executor, timed)
        finally:
            if not ran:
                queue.done(None)

    # -- endpoints ------------------------------------------------------------------

    async def predict(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model, version, label = _target(request)
        return await self._run("predict", _encoded, self._predict, model, body, version, label)

    async def lookup(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model, version, label = _target(request)
        table = request.match_info["table"]
        where = "inline" if len(body) <= self.inline_bytes else "lookup"
        work = (self._lookup, model, table, body, version, label)
        return await self._run(where, _encoded, *work)

    async def status(self, request: web.Request) -> web.StreamResponse:
        states = answers.model_status(self.service, *_target(request))
        return _json({"model_version_status": [state.json() for state in states]})

    async def metadata(self, request: web.Request) -> web.StreamResponse:
        return _json(answers.metadata(self.service, *_target(request)).json())

    async def unimplemented(self, request: web.Request) -> web.StreamResponse:
        verb = request.match_info["verb"]
        raise Unimplemented(
            f":{verb} is not implemented by wuliang: use :predict (the tower's outputs are "
            f"the {'scores' if verb == 'classify' else 'values'})"
        )

    async def health(self, request: web.Request) -> web.StreamResponse:
        if self.service.healthy():
            return _json({"status": "SERVING"})
        waiting = sorted(name for name, store in self.service.stores.items() if not store.version)
        return _error(503, f"not serving: no version loaded yet of {', '.join(waiting)}")

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=self.service.metrics.text(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    # -- the work, on the loop or in the pool ---------------------------------------

    def _predict(
        self, model: str, body: bytes, version: int | None = None, label: str | None = None
    ) -> dict[str, Any]:
        request = PredictRequest(body, self.service.check_rows)
        answer = self.service.predict(model, request.decode, **_pinned(version, label))
        return request.answer(answer.outputs, answer.version)

    def _lookup(
        self,
        model: str,
        table: str,
        body: bytes,
        version: int | None = None,
        label: str | None = None,
    ) -> dict[str, Any]:
        self.service.store(model)  # an unknown model before a bad body
        keys = lookup_keys(body, self.service.check_keys)
        result = self.service.lookup(model, table, keys, **_pinned(version, label))
        return {
            "vectors": np.ascontiguousarray(result.rows, np.float32),
            "found": np.ascontiguousarray(result.found, np.bool_),
            "model_version": str(result.version),
        }


class HttpServer:
    """A started HTTP server (``port``: the bound port); ``stop()`` ends it.

    Args:
        service: what the endpoints answer from.
        host: the address to listen on.
        port: the port (0: a free one).
        tls: serve HTTPS with this certificate and key (``ServerTls``); None: HTTP.
        workers: threads running predictions (see the module docstring).
        lookup_workers: threads running big lookups (JSON parsing and
            encoding: Python under the GIL, where more threads only share
            it, as gRPC's lookup pool).
        inline_bytes: lookup bodies up to this many bytes are answered on
            the event loop (see the module docstring); 0: every lookup in
            the pool.
        body_seconds: how long a request body may take to arrive (408 after).
        grace: seconds ``stop()`` lets requests in flight finish.
        shedding: the bounds of the loop's lag and the pools' queues
            (default: ``Shedding()``).
    """

    def __init__(
        self,
        service: Service,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ServerTls | None = None,
        workers: int = PREDICT_THREADS,
        inline_bytes: int = INLINE_BYTES,
        body_seconds: float = 30.0,
        grace: float = 1.0,
        shedding: Shedding | None = None,
        lookup_workers: int = LOOKUP_WORKERS,
    ) -> None:
        self.service = service
        self.tls = tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, port), family=family)
        except OSError as error:
            raise listen_error(host, port, "HTTP", error) from None
        self.port: int = self._socket.getsockname()[1]
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="wuliang-http")
        self._lookup_executor = ThreadPoolExecutor(
            lookup_workers, thread_name_prefix="wuliang-http-lookup"
        )
        api = _Api(
            service,
            self._executor,
            inline_bytes,
            body_seconds,
            shedding,
            workers,
            self._lookup_executor,
            lookup_workers,
        )
        self._api = api
        service.metrics.queues.extend(api.queues)
        service.metrics.loop_lags.append(api.lag)
        self._runner = web.AppRunner(
            api.application(),
            access_log=None,
            logger=_ProtocolLog(logging.getLogger("aiohttp.server"), {}),
            shutdown_timeout=grace,
        )
        self._loop = asyncio.SelectorEventLoop(api.clock)
        self._ssl = None if tls is None else tls.ssl_context()
        self._grace = grace
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve, args=(started,), name=f"wuliang-http-{self.port}", daemon=True
        )
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join()
            self._executor.shutdown()
            self._lookup_executor.shutdown()
            self._socket.close()
            for queue in api.queues:
                service.metrics.queues.remove(queue)
            service.metrics.loop_lags.remove(api.lag)
            raise
        self._stopped = False

    def _serve(self, started: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.SockSite(self._runner, self._socket, ssl_context=self._ssl)
            self._loop.run_until_complete(site.start())
            self._api.lag.start(self._loop)
        except BaseException as error:
            self._loop.close()
            started.set_exception(error)
            return
        started.set_result(None)
        try:
            self._loop.run_forever()
            # Connections the cleanup closed may leave their handler tasks
            # pending: end them before the loop goes.
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        finally:
            self._loop.close()

    def stop(self) -> None:
        """Stops listening, lets requests in flight finish (``grace`` seconds
        at most), then ends the loop's thread and the pool."""
        if self._stopped:
            return
        self._stopped = True
        cleanup = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            cleanup.result(timeout=self._grace + 10)
        finally:
            self._loop.call_soon_threadsafe(self._api.lag.stop)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._executor.shutdown(wait=True)
            self._lookup_executor.shutdown(wait=True)
            self._socket.close()
            metrics = self.service.metrics
            for queue in self._api.queues:
                if queue in metrics.queues:
                    metrics.queues.remove(queue)
            if self._api.lag in metrics.loop_lags:
                metrics.loop_lags.remove(self._api.lag)

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
