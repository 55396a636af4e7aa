"""The HTTP/JSON transport, shaped like TensorFlow Serving's REST API.

Endpoints (``docs/serving.md`` has examples)::

    POST /v1/models/{model}:predict                  {"instances": [...]} or {"inputs": {...}}
    POST /v1/models/{model}/tables/{table}:lookup    {"keys": [...]}
    GET  /v1/models/{model}                          the served version's status
    GET  /healthz                                    200 when every model serves a version
    GET  /metrics                                    Prometheus text format

A prediction takes TF Serving's row format (``instances``: one object per row,
feature name -> value) or column format (``inputs``: feature name -> one value
per row) and answers in the same format (``predictions`` or ``outputs``), with
the ``model_version`` it was served from. A sparse feature's value for a row is
a key, a list of keys, or ``{"keys": [...], "weights": [...]}``; a key is a JSON
integer in [-2^63, 2^64 - 1] (negative ones are int64 keys, read as their
uint64 bit pattern, as the gRPC API does) or a string of digits, for clients
whose JSON numbers are doubles. A dense feature's value is a number (dim 1) or
a list of dim numbers. An output with one value per row gives a number per
row, a wider one a list.

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
* Request bodies are bounded (``max_body_bytes``, checked against
  Content-Length before reading and while reading) and must arrive within
  ``body_seconds`` (408: a client that stops mid-body does not hold its
  connection for ever). They must be UTF-8 JSON objects (NaN and Infinity
  are refused, as are unknown fields); the Content-Type is not checked, so
  ``curl -d`` works. Each value is checked
  for its type before it becomes an array, so a string where a number
  belongs, a float key, a bool, a nested list or a number outside float32
  is a 400 naming the field, row and feature. Batch sizes are checked
  (``Service.max_rows``, ``max_keys``: 413) before anything is converted.
* Where the work runs: parsing, the service call and encoding form one
  synchronous function per request. Predictions always run in a thread
  pool (``workers`` threads): the tower (TensorFlow) takes milliseconds
  and releases the GIL, so the event loop keeps answering other requests
  meanwhile. A lookup whose body is at most ``inline_bytes`` runs on the
  event loop itself: the engine answers a few keys in microseconds, and
  the hop to a pool thread and back costs more than that (parsing and
  converting 8 keys takes 7 us). Measured with
  ``benchmarks/serving_http_bench.py`` (8 keys a lookup, the client in
  another process, 2 shared cores): one client at a time, 0.52 ms a lookup
  inline vs 0.68 ms through the pool (p50; on a busier machine, medians of 3
  alternating runs, 0.70 vs 0.84 ms); 16 concurrent clients, 2,488 vs
  2,338 lookups/s (busier: 1,634 vs 1,657, the client process being the
  bottleneck); 16 lookup clients beside 4 predicting 256 rows, 1,148 vs
  1,019 lookups/s at the same 149 predictions/s (busier: 980 vs 897
  lookups/s, with 146 vs 174 predictions/s). So small lookups stay inline.
  Bigger ones go to the pool (parsing 100,000 keys takes 18 ms as numbers,
  85 ms as strings), so the loop is never held long.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import socket
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from wuliang.serving.errors import (
    InvalidArgument,
    NotFound,
    ServingError,
    TooLarge,
)
from wuliang.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from wuliang.serving.predict import FeatureInput
from wuliang.serving.service import Service

log = logging.getLogger("wuliang.serving")

MAX_BODY_BYTES = 16 << 20  # a request body, by default
INLINE_BYTES = 4096  # lookup bodies up to this size are answered on the event loop
WORKERS = 8  # threads of the pool that runs predictions and big lookups
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENDPOINTS = ("Predict", "Lookup", "Status", "Health", "Metrics")

_MODEL = r"{model:[^/:]+}"
_TABLE = r"{table:[^/:]+}"
_DIGITS = re.compile(r"-?[0-9]{1,20}", re.ASCII)
_INT64_MIN = -(1 << 63)
_UINT64_END = 1 << 64
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_NUMBER = frozenset((int, float))


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


# -- JSON in ------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number (NaN and Infinity are refused)")


def _describe(value: Any) -> str:
    """A JSON value's type and a short excerpt, for error messages."""
    kinds = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    text = json.dumps(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{kinds.get(type(value), type(value).__name__)} ({text})"


def _document(body: bytes, fields: Mapping[str, str]) -> dict[str, Any]:
    """The request body as a JSON object; ``fields``: the names it may hold."""
    if not body:
        raise InvalidArgument("the request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidArgument(
            f"the request body is not UTF-8 (byte {error.start}: {error.reason})"
        ) from None
    try:
        document = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidArgument("the request body's JSON nests too deeply") from None
    except ValueError as error:  # JSONDecodeError, NaN, an integer of 4,300+ digits
        raise InvalidArgument(f"the request body is not valid JSON: {error}") from None
    if type(document) is not dict:
        raise InvalidArgument(f"the request body must be a JSON object, got {_describe(document)}")
    unknown = sorted(set(document) - set(fields))
    if unknown:
        known = ", ".join(f"{name!r} ({why})" for name, why in fields.items())
        raise InvalidArgument(f"unknown field {unknown[0]!r} in the request; fields: {known}")
    return document


def _keys(values: list[Any], what: str, offsets: list[int] | None = None) -> np.ndarray:
    """JSON keys (integers or strings of digits) as uint64; ``offsets``
    (CSR, one entry per row and one more) lets errors name the row."""
    if set(map(type, values)) <= {int}:  # the common case, at C speed
        try:
            array = np.array(values, dtype=None) if values else np.zeros(0, np.uint64)
        except OverflowError:  # beyond uint64: the loop below names it
            array = None
        if array is not None and array.dtype == np.int64:
            return array.view(np.uint64)
        if array is not None and array.dtype == np.uint64:
            return array
    out = np.empty(len(values), np.uint64)
    for i, value in enumerate(values):
        kind = type(value)
        if kind is int:
            key = value
        elif kind is str and _DIGITS.fullmatch(value):
            key = int(value)
        else:
            raise InvalidArgument(
                f"{_where(what, i, offsets)}: a key must be an integer or a string of digits, "
                f"got {_describe(value)}"
            )
        if not _INT64_MIN <= key < _UINT64_END:
            raise InvalidArgument(
                f"{_where(what, i, offsets)}: key {key} is outside uint64 [0, 2^64 - 1] "
                "(negative keys are int64, down to -2^63)"
            )
        out[i] = key & (_UINT64_END - 1)
    return out


def _floats(
    values: list[Any], what: str, per_row: int = 1, offsets: list[int] | None = None
) -> np.ndarray:
    """JSON numbers as float32, each finite and within float32's range;
    ``per_row`` values make a row, or ``offsets`` (CSR) say which values a
    row has (errors name the row)."""
    if not set(map(type, values)) <= _NUMBER:
        i = next(i for i, v in enumerate(values) if type(v) not in _NUMBER)
        raise InvalidArgument(
            f"{what}, row {_row(i, per_row, offsets)}: expected a number, got "
            f"{_describe(values[i])}"
        )
    try:
        array = np.array(values, np.float64)
    except OverflowError:  # an integer beyond a double
        i = next(i for i, v in enumerate(values) if type(v) is int and abs(v) > _FLOAT32_MAX)
        raise InvalidArgument(
            f"{what}, row {_row(i, per_row, offsets)}: {values[i]} is outside float32's range"
        ) from None
    bad = np.flatnonzero(~(np.abs(array) <= _FLOAT32_MAX))  # inf (1e999) or beyond float32
    if len(bad):
        i = int(bad[0])
        raise InvalidArgument(
            f"{what}, row {_row(i, per_row, offsets)}: {values[i]} is not a finite float32"
        )
    return array.astype(np.float32)


def _row(index: int, per_row: int, offsets: list[int] | None) -> int:
    """The row of a value: ``per_row`` values a row, or as CSR ``offsets`` say."""
    if offsets is None:
        return index // per_row
    return int(np.searchsorted(offsets, index, side="right")) - 1


def _where(what: str, index: int, offsets: list[int] | None) -> str:
    if offsets is None:
        return f"{what}[{index}]"
    return f"{what}, row {_row(index, 1, offsets)}"


def _sparse(name: str, column: list[Any]) -> FeatureInput:
    """One sparse feature's per-row values as CSR keys (and weights)."""
    what = f"sparse feature {name!r}"
    keys: list[Any] = []
    offsets = [0]
    weights: list[Any] | None = None
    for row, value in enumerate(column):
        kind = type(value)
        if kind is list:
            keys.extend(value)
        elif kind is dict:
            unknown = sorted(set(value) - {"keys", "weights"})
            if unknown or "keys" not in value:
                raise InvalidArgument(
                    f"{what}, row {row}: an object must hold 'keys' and optionally 'weights', "
                    f"got {_describe(value)}"
                )
            row_keys = value["keys"]
            row_keys = row_keys if type(row_keys) is list else [row_keys]
            row_weights = value.get("weights")
            if row_weights is not None:
                if type(row_weights) is not list or len(row_weights) != len(row_keys):
                    raise InvalidArgument(
                        f"{what}, row {row}: 'weights' must be a list of {len(row_keys)} "
                        f"numbers (one per key), got {_describe(row_weights)}"
                    )
                if weights is None:
                    weights = [1.0] * len(keys)
                weights.extend(row_weights)
            keys.extend(row_keys)
        else:  # a key (_keys checks it)
            keys.append(value)
        if weights is not None and len(weights) < len(keys):  # unweighted: 1 each
            weights.extend([1.0] * (len(keys) - len(weights)))
        offsets.append(len(keys))
    values = _keys(keys, what, offsets)
    weight_array = None
    if weights is not None:
        weight_array = _floats(weights, f"{what} weights", offsets=offsets)
    return FeatureInput(values, np.array(offsets, np.int64), weight_array)


def _dense(name: str, column: list[Any], dim: int) -> FeatureInput:
    """One dense feature's per-row values as float32 [rows, dim]."""
    what = f"dense feature {name!r}"
    flat: list[Any] = []
    for row, value in enumerate(column):
        kind = type(value)
        if kind is list and len(value) == dim:
            flat.extend(value)
        elif (kind is int or kind is float) and dim == 1:
            flat.append(value)
        else:
            raise InvalidArgument(
                f"{what}, row {row}: expected {'a number or ' if dim == 1 else ''}a list of "
                f"{dim} number{'s' if dim > 1 else ''}, got {_describe(value)}"
            )
    return FeatureInput(_floats(flat, what, dim).reshape(len(column), dim))


def _columns(document: dict[str, Any], names: list[str], max_rows: int) -> tuple[dict, int, bool]:
    """The features of a prediction request, one list of per-row values each:
    (columns, rows, row format)."""
    if ("instances" in document) == ("inputs" in document):
        raise InvalidArgument(
            "a prediction needs exactly one of 'instances' (row format: one object per row) "
            "and 'inputs' (column format: feature name -> one value per row)"
        )
    known = f"features: {', '.join(names)}"
    if "instances" in document:
        instances = document["instances"]
        if type(instances) is not list:
            raise InvalidArgument(
                f"'instances' must be an array of rows, got {_describe(instances)}"
            )
        rows = len(instances)
        if rows > max_rows:
            raise TooLarge(f"{rows} rows in one request; at most {max_rows}")
        columns: dict[str, list[Any]] = {name: [] for name in names}
        for row, instance in enumerate(instances):
            if type(instance) is not dict:
                raise InvalidArgument(
                    f"instances[{row}] must be an object (feature name -> value), got "
                    f"{_describe(instance)}"
                )
            try:
                for name, column in columns.items():
                    column.append(instance[name])
            except KeyError as error:
                raise InvalidArgument(
                    f"instances[{row}] has no feature {error.args[0]!r} ({known})"
                ) from None
            if len(instance) != len(names):
                extra = sorted(set(instance) - set(names))[0]
                raise InvalidArgument(
                    f"instances[{row}]: the model has no feature {extra!r} ({known})"
                )
        row_format = True
    else:
        inputs = document["inputs"]
        if type(inputs) is not dict:
            raise InvalidArgument(
                f"'inputs' must be an object (feature name -> one value per row), got "
                f"{_describe(inputs)}"
            )
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise InvalidArgument(f"inputs: the model has no feature {unknown[0]!r} ({known})")
        missing = [name for name in names if name not in inputs]
        if missing:
            raise InvalidArgument(f"inputs: feature {missing[0]!r} is missing ({known})")
        columns = {}
        rows = -1
        for name in names:
            column = inputs[name]
            if type(column) is not list:
                raise InvalidArgument(
                    f"inputs[{name!r}] must be an array of one value per row, got "
                    f"{_describe(column)}"
                )
            if len(column) > max_rows:
                raise TooLarge(f"{len(column)} rows in one request; at most {max_rows}")
            if rows >= 0 and len(column) != rows:
                raise InvalidArgument(
                    f"inputs[{name!r}] has {len(column)} rows, inputs[{names[0]!r}] has {rows}"
                )
            rows = len(column)
            columns[name] = column
        row_format = False
    if rows == 0:
        raise InvalidArgument("the request has no rows")
    return columns, rows, row_format


# -- JSON out -----------------------------------------------------------------------


def _per_row(values: np.ndarray) -> np.ndarray:
    """An output's values, a number per row when it has one per row."""
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    return np.ascontiguousarray(values, np.float32)


def _json(payload: Any, status: int = 200) -> web.Response:
    """``payload`` as JSON, numpy arrays included: a float32 as the shortest
    decimal that reads back as the same float32 (orjson; the standard
    library's encoder takes 20 times as long for a lookup's 16,000 floats)."""
    return web.Response(
        body=orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
    )


def _error(status: int, message: str) -> web.Response:
    response = _json({"error": message}, status)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="wuliang"'
    return response


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
        max_body_bytes: int,
        inline_bytes: int,
        body_seconds: float = 30.0,
    ) -> None:
        self.service = service
        self.executor = executor
        self.max_body_bytes = max_body_bytes
        self.body_seconds = body_seconds
        self.inline_bytes = inline_bytes

    def application(self) -> web.Application:
        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self.middleware(request, handler)

        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[middleware])
        router = app.router
        router.add_post(f"/v1/models/{_MODEL}:predict", self.predict, name="Predict")
        router.add_post(f"/v1/models/{_MODEL}/tables/{_TABLE}:lookup", self.lookup, name="Lookup")
        router.add_get(f"/v1/models/{_MODEL}", self.status, name="Status")
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
        name = request.match_info.route.name
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
                        "GET /v1/models/{model}, GET /healthz, GET /metrics"
                    ) from None
                except web.HTTPMethodNotAllowed as error:
                    raise MethodNotAllowed(
                        f"{request.method} is not allowed on {request.path[:100]!r}; "
                        f"use {', '.join(sorted(error.allowed_methods))}"
                    ) from None
                except web.HTTPRequestEntityTooLarge:
                    raise self._too_large(None) from None
        except ServingError as error:
            response = _error(error.http_status, str(error))
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
            f"the request body{got} is larger than {self.max_body_bytes} bytes (max_body_bytes)"
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

    async def _run(self, inline: bool, work: Callable[..., Any], *args: Any) -> Any:
        if inline:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, work, *args)

    # -- endpoints ------------------------------------------------------------------

    async def predict(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return _json(await self._run(False, self._predict, request.match_info["model"], body))

    async def lookup(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model, table = request.match_info["model"], request.match_info["table"]
        inline = len(body) <= self.inline_bytes
        return _json(await self._run(inline, self._lookup, model, table, body))

    async def status(self, request: web.Request) -> web.StreamResponse:
        (model,) = self.service.status(request.match_info["model"])
        if model["version"]:
            state, code, message = "AVAILABLE", "OK", ""
        else:
            state, code = "LOADING", "UNAVAILABLE"
            message = f"no version loaded yet ({model['refused']} refused)"
        return _json(
            {
                "model_version_status": [
                    {
                        "version": str(model["version"]),
                        "state": state,
                        "status": {"error_code": code, "error_message": message},
                    }
                ]
            }
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

    def _predict(self, model: str, body: bytes) -> dict[str, Any]:
        store = self.service.store(model)
        description = store.served().model
        sparse = [f.name for f in description.sparse]
        dense = {f.name: f.dim for f in description.dense}
        signature = description.signature
        document = _document(
            body,
            {
                "instances": "row format",
                "inputs": "column format",
                "signature_name": f"optional, {signature!r}",
            },
        )
        if document.get("signature_name", signature) != signature:
            raise InvalidArgument(
                f"signature_name must be {signature!r}, got {_describe(document['signature_name'])}"
            )
        columns, rows, row_format = _columns(document, [*sparse, *dense], self.service.max_rows)
        features = {name: _sparse(name, columns[name]) for name in sparse}
        features.update({name: _dense(name, columns[name], dim) for name, dim in dense.items()})
        answer = self.service.predict(store.name, features, rows)
        outputs = {name: _per_row(values) for name, values in sorted(answer.outputs.items())}
        version = str(answer.version)
        if row_format:
            if len(outputs) == 1:
                (predictions,) = outputs.values()
            else:
                names = list(outputs)
                columns = zip(*outputs.values(), strict=True)
                predictions = [dict(zip(names, row, strict=True)) for row in columns]
            return {"predictions": predictions, "model_version": version}
        return {
            "outputs": next(iter(outputs.values())) if len(outputs) == 1 else outputs,
            "model_version": version,
        }

    def _lookup(self, model: str, table: str, body: bytes) -> dict[str, Any]:
        self.service.store(model)  # an unknown model before a bad body
        document = _document(body, {"keys": "an array of keys"})
        if "keys" not in document:
            raise InvalidArgument("a lookup needs 'keys': an array of keys")
        keys = document["keys"]
        if type(keys) is not list:
            raise InvalidArgument(f"'keys' must be an array of keys, got {_describe(keys)}")
        if len(keys) > self.service.max_keys:
            raise TooLarge(f"{len(keys)} keys in one lookup; at most {self.service.max_keys}")
        result = self.service.lookup(model, table, _keys(keys, "keys"))
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
        tls: serve HTTPS with this context (``ssl.create_default_context(
            ssl.Purpose.CLIENT_AUTH)`` with ``load_cert_chain``); None: HTTP.
        max_body_bytes: the largest request body (413 beyond).
        workers: threads running predictions and big lookups.
        inline_bytes: lookup bodies up to this many bytes are answered on
            the event loop (see the module docstring); 0: every lookup in
            the pool.
        body_seconds: how long a request body may take to arrive (408 after).
        grace: seconds ``stop()`` lets requests in flight finish.
    """

    def __init__(
        self,
        service: Service,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ssl.SSLContext | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        workers: int = WORKERS,
        inline_bytes: int = INLINE_BYTES,
        body_seconds: float = 30.0,
        grace: float = 1.0,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
        self.service = service
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        self.port: int = self._socket.getsockname()[1]
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="wuliang-http")
        api = _Api(service, self._executor, max_body_bytes, inline_bytes, body_seconds)
        self._runner = web.AppRunner(
            api.application(),
            access_log=None,
            logger=_ProtocolLog(logging.getLogger("aiohttp.server"), {}),
            shutdown_timeout=grace,
        )
        self._loop = asyncio.new_event_loop()
        self._tls = tls
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
            self._socket.close()
            raise
        self._stopped = False

    def _serve(self, started: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.SockSite(self._runner, self._socket, ssl_context=self._tls)
            self._loop.run_until_complete(site.start())
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
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._executor.shutdown(wait=True)
            self._socket.close()

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
