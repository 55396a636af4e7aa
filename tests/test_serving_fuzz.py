"""10,000 random and mutated requests to each serving endpoint (gRPC Lookup,
Predict, Status; HTTP predict, lookup, model status); the server answers each
with a proper error or the correct answer, still answers valid requests
correctly afterwards, and its memory does not grow without bound.

Design:

* The server runs in a process of its own (``tests/serving_process.py``:
  gRPC and HTTP over one export), so its RSS (``/proc/<pid>/status``) is its
  own, and a crash shows as a dead process.
* A seeded generator per endpoint draws from a pool of valid requests: 30%
  are sent as they are, the rest mutated. gRPC: field mutations (keys of 7
  bytes, random offsets, huge or zero ``rows``, features dropped, doubled,
  renamed, NaN weights …) and byte mutations of the serialized message
  (truncated, flipped, inserted and deleted bytes, random bytes, invalid
  UTF-8 in a string field, a length prefix of 4 GB, another method's
  message), sent as raw bytes through a generic channel call. HTTP: JSON
  mutations (a random node replaced by random JSON, NaN, 1e999, 2^64, a
  float key, a nested list; keys deleted or added; lists shortened), byte
  mutations of the body (truncated, garbled, invalid UTF-8, UTF-16, deep
  nesting, random bytes, empty), oversized bodies and batches, wrong content
  types and encodings, wrong methods, unknown models, tables and paths, and
  raw mutated request heads on a socket.
* Each answer is checked against an oracle: the same serving code in this
  process over the same export (``_Handlers`` for gRPC, ``_Api`` for HTTP),
  which gives the expected answer or error (code and message) for the bytes
  sent; what the transport decides alone (405, 413 of the body, 404 of an
  unknown path) is expected by the generator. An answer must equal the
  oracle's: the same error (gRPC code and details, HTTP status and
  ``{"error": message}``) or the same result; a deadline (10 s a request)
  or a connection reset is a failure.
* Requests go 8 to 16 at a time (gRPC futures, asyncio tasks for HTTP),
  more than the server's pools answer at once, so some are shed
  (``wuliang.serving.overload``): a shed answer is a correct one when it is
  well formed (RESOURCE_EXHAUSTED "overloaded: ..." with a retry pushback;
  503 with ``Retry-After`` and ``retry_after_ms``), and at most
  ``MAX_SHED_SHARE`` of an endpoint's answers may be shed, so that the rest
  still check the parsing.
* Afterwards the valid pool is sent again over both transports and checked
  against the trainer's engine, and a batch's predictions against the
  trainer's (1e-5); the metrics must show no INTERNAL, the log no ERROR
  (malformed requests are aiohttp's DEBUG lines), and the process must
  exit cleanly.
* Memory: RSS after a warm-up of 1,000 requests per endpoint, and after the
  10,000 per endpoint; the growth must stay under ``RSS_GROWTH_MB``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import yarl
from small_model import batch_features, trained_export

from wuliang.serving.errors import ServingError
from wuliang.serving.grpc import proto
from wuliang.serving.grpc.common import PUSHBACK_KEY, details, parse
from wuliang.serving.grpc.server import _Handlers
from wuliang.serving.http.server import _Api, _json
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore

SEED = 20240611
PER_ENDPOINT = int(os.environ.get("WULIANG_FUZZ_REQUESTS", 10_000))  # fewer while debugging
WARMUP = PER_ENDPOINT // 10
VALID_SHARE = 0.3
MAX_ROWS = 256
MAX_KEYS = 2048
MAX_BODY = 256 << 10
TIMEOUT = 10.0
GRPC_IN_FLIGHT = 8
MAX_SHED_SHARE = 0.5
HTTP_IN_FLIGHT = 16
RSS_GROWTH_MB = 40
SCRIPT = Path(__file__).with_name("serving_process.py")
NAMES = ["m", "", "users", "items", "x", "user", "nope", "M", "m ", "é", "模型", "a" * 300, "\x00"]
JSON_TYPE = "application/json"


# -- the served export and the oracle -------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A session trained 5 steps and exported (version 1), its files, a batch."""
    trained = trained_export(tmp_path_factory.mktemp("serving-fuzz"))
    yield trained
    trained["session"].context.close()


@pytest.fixture(scope="module")
def server(trained: dict[str, Any]) -> Iterator[dict[str, Any]]:
    log = trained["root"] / "server.log"
    command = [sys.executable, str(SCRIPT), str(trained["exports"]), "--max-rows", str(MAX_ROWS)]
    command += ["--max-keys", str(MAX_KEYS), "--max-body-bytes", str(MAX_BODY)]
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
        )
    try:
        line = process.stdout.readline()
        assert line, f"the serving process did not start: {log.read_text()[-3000:]}"
        ports = json.loads(line)
        yield {**ports, "process": process, "log": log}
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


@pytest.fixture(scope="module")
def oracle(trained: dict[str, Any]) -> Iterator[Service]:
    store = ModelStore(trained["exports"], "m", poll_secs=0).start()
    service = Service([store], max_rows=MAX_ROWS, max_keys=MAX_KEYS, max_request_bytes=MAX_BODY)
    yield service
    service.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- the valid pools ------------------------------------------------------------------


def random_keys(rng: np.random.Generator, n: int, trained_up_to: int) -> np.ndarray:
    keys = rng.integers(0, trained_up_to, n).astype(np.uint64)
    wild = rng.random(n) < 0.1
    keys[wild] = rng.integers(0, 2**64 - 1, int(wild.sum()), dtype=np.uint64, endpoint=True)
    return keys


def lookup_pool(rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """(table, keys)."""
    pool = []
    for _ in range(48):
        table = str(rng.choice(["users", "items"]))
        pool.append((table, random_keys(rng, int(rng.integers(0, 64)), 600)))
    return pool


def predict_pool(rng: np.random.Generator) -> list[dict[str, Any]]:
    """rows, user keys, items (a list of keys per row), weights or None, x."""
    pool = []
    for i in range(32):
        rows = int(rng.integers(1, 48))
        items = [random_keys(rng, int(rng.integers(0, 5)), 600) for _ in range(rows)]
        weights = None
        if i % 3 == 0:
            weights = [rng.uniform(0.1, 3.0, len(bag)).astype(np.float32) for bag in items]
        pool.append(
            {
                "rows": rows,
                "user": random_keys(rng, rows, 400),
                "items": items,
                "weights": weights,
                "x": rng.normal(size=rows).astype(np.float32),
            }
        )
    return pool


# -- gRPC ---------------------------------------------------------------------------


def grpc_lookup(table: str, keys: np.ndarray, model: str = "m") -> Any:
    return proto.LookupRequest(model=model, table=table, keys=keys.astype("<u8").tobytes())


def grpc_predict(request: dict[str, Any]) -> Any:
    items = request["items"]
    offsets = np.cumsum([0, *map(len, items)]).astype("<i8")
    weights = b""
    if request["weights"] is not None:
        weights = np.concatenate(request["weights"]).astype("<f4").tobytes()
    features = [
        proto.Feature(name="user", values=request["user"].astype("<u8").tobytes()),
        proto.Feature(
            name="items",
            values=np.concatenate(items).astype("<u8").tobytes(),
            offsets=offsets.tobytes(),
            weights=weights,
        ),
        proto.Feature(name="x", values=request["x"].astype("<f4").tobytes()),
    ]
    return proto.PredictRequest(model="m", rows=request["rows"], features=features)


def mutate_lookup(message: Any, rnd: random.Random) -> str:
    kind = rnd.choice(
        ["odd_bytes", "random_bytes", "too_many", "empty", "table", "model", "extreme"]
    )
    if kind == "odd_bytes":
        message.keys = message.keys[: -rnd.randint(1, 7)] if message.keys else b"\x01\x02\x03"
    elif kind == "random_bytes":
        message.keys = rnd.randbytes(rnd.randint(0, 200))
    elif kind == "too_many":
        message.keys = np.arange(MAX_KEYS + rnd.randint(1, 50), dtype="<u8").tobytes()
    elif kind == "empty":
        message.keys = b""
    elif kind == "table":
        message.table = rnd.choice(NAMES)
    elif kind == "model":
        message.model = rnd.choice(NAMES)
    else:
        message.keys = np.array([0, 2**64 - 1, 2**63, 1], "<u8").tobytes()
    return f"lookup_{kind}"


def mutate_predict(message: Any, rnd: random.Random) -> str:
    kind = rnd.choice(
        ["rows", "drop", "double", "rename", "extra", "values", "offsets", "weights",
         "dense", "model"]
    )  # fmt: skip
    features = message.features
    feature = features[rnd.randrange(len(features))]
    if kind == "rows":
        message.rows = rnd.choice([0, 1, message.rows + 1, message.rows - 1, 2**32 - 1,
                                   rnd.randint(0, 2**32 - 1), MAX_ROWS + 1])  # fmt: skip
    elif kind == "drop":
        del features[rnd.randrange(len(features))]
    elif kind == "double":
        features.append(feature)
    elif kind == "rename":
        feature.name = rnd.choice(NAMES)
    elif kind == "extra":
        features.append(proto.Feature(name=rnd.choice(NAMES), values=rnd.randbytes(16)))
    elif kind == "values":
        choice = rnd.randrange(3)
        if choice == 0:
            feature.values = feature.values[: -rnd.randint(1, 7)]
        elif choice == 1:
            feature.values += rnd.randbytes(rnd.choice([1, 4, 8, 16]))
        else:
            feature.values = rnd.randbytes(rnd.randint(0, 64))
    elif kind == "offsets":
        n = message.rows + 1
        feature.offsets = rnd.choice(
            [
                np.array([rnd.randint(-(2**63), 2**63 - 1) for _ in range(n)], "<i8").tobytes(),
                np.arange(n, dtype="<i8")[::-1].tobytes(),
                (np.arange(n, dtype="<i8") - 5).tobytes(),
                np.arange(n + rnd.choice([-1, 1, 5]), dtype="<i8").tobytes(),
                rnd.randbytes(rnd.randint(1, 30)),
            ]
        )
    elif kind == "weights":
        n = max(len(feature.values) // 8, 1)
        weights = np.full(n + rnd.choice([0, 0, -1, 1]), 1.0, "<f4")
        weights[rnd.randrange(len(weights))] = rnd.choice([np.nan, np.inf, -1.0, 0.0, 1e38])
        feature.weights = weights.tobytes()
    elif kind == "dense":
        x = np.frombuffer(features[-1].values, "<f4").copy()
        if len(x) and rnd.random() < 0.5:
            x[rnd.randrange(len(x))] = rnd.choice([np.nan, np.inf, -np.inf, 3e38])
            features[-1].values = x.tobytes()
        else:
            features[-1].values = np.zeros(len(x) + rnd.choice([-1, 1, 3]), "<f4").tobytes()
    else:
        message.model = rnd.choice(NAMES)
    return f"predict_{kind}"


def mutate_status(message: Any, rnd: random.Random) -> str:
    message.model = rnd.choice([*NAMES, "m" * 10_000, "".join(chr(rnd.randint(32, 0x2FFF)))])
    return "status_model"


BYTE_EDITS = ("truncate", "flip", "insert")


def edit_bytes(kind: str, data: bytes, rnd: random.Random) -> bytes:
    """``data`` cut short, with a few bits flipped, or with random bytes inserted."""
    if kind == "truncate":
        return data[: rnd.randint(0, max(len(data) - 1, 0))]
    if kind == "flip":
        out = bytearray(data or b"\x00")
        for _ in range(rnd.randint(1, 4)):
            out[rnd.randrange(len(out))] ^= rnd.randint(1, 255)
        return bytes(out)
    at = rnd.randint(0, len(data))
    return data[:at] + rnd.randbytes(rnd.randint(1, 16)) + data[at:]


def garble(data: bytes, rnd: random.Random, others: list[bytes]) -> tuple[str, bytes]:
    """A byte-level mutation of a serialized message."""
    kind = rnd.choice(
        ["truncate", "flip", "insert", "delete", "append", "random", "utf8", "length", "other"]
    )
    if kind in BYTE_EDITS:
        return kind, edit_bytes(kind, data, rnd)
    if kind == "delete":
        at = rnd.randint(0, len(data))
        return kind, data[:at] + data[at + rnd.randint(1, 16) :]
    if kind == "append":
        return kind, data + rnd.randbytes(rnd.randint(1, 64))
    if kind == "random":
        return kind, rnd.randbytes(rnd.randint(0, 300))
    if kind == "utf8":  # field 1 (model, a string) with invalid UTF-8
        return kind, b"\x0a\x03\xff\xfe\xc3" + data
    if kind == "length":  # field 3 claims 4 GB
        return kind, data + b"\x1a\xff\xff\xff\xff\x0f" + rnd.randbytes(8)
    return kind, rnd.choice(others)


def grpc_stream(
    method: str, pool: list[Any], rnd: random.Random, count: int, others: list[bytes]
) -> Iterator[tuple[str, bytes]]:
    mutate = {"Lookup": mutate_lookup, "Predict": mutate_predict, "Status": mutate_status}
    for _ in range(count):
        base = pool[rnd.randrange(len(pool))]
        draw = rnd.random()
        if draw < VALID_SHARE:
            yield "valid", base.SerializeToString()
        elif draw < 0.65:
            message = type(base)()
            message.CopyFrom(base)
            name = mutate[method](message, rnd)
            yield name, message.SerializeToString()
        else:
            name, data = garble(base.SerializeToString(), rnd, others)
            yield f"bytes_{name}", data


class GrpcOracle:
    def __init__(self, service: Service) -> None:
        handlers = _Handlers(service)
        self.bodies = {
            "Lookup": handlers.lookup,
            "Predict": handlers.predict,
            "Status": handlers.status,
        }

    def __call__(self, method: str, payload: bytes) -> tuple[str, Any]:
        """("OK", the response message) or (the error code, its message)."""
        try:
            answer = self.bodies[method](parse(proto.REQUESTS[method], payload))
            if isinstance(answer, bytes):  # Lookup answers its wire bytes
                answer = proto.RESPONSES[method].FromString(answer)
            return "OK", answer
        except ServingError as error:
            return error.code, details(error)
        except Exception as error:
            return "ORACLE_FAILED", repr(error)


def same_grpc_response(method: str, got: Any, want: Any) -> bool:
    if method != "Predict":
        return bool(got == want)
    if got.version != want.version or len(got.outputs) != len(want.outputs):
        return False
    for a, b in zip(got.outputs, want.outputs, strict=True):
        if a.name != b.name or a.dim != b.dim or len(a.values) != len(b.values):
            return False
        x, y = np.frombuffer(a.values, "<f4"), np.frombuffer(b.values, "<f4")
        if not np.allclose(x, y, rtol=1e-5, atol=1e-6):
            return False
    return True


def run_grpc(
    address: str,
    method: str,
    stream: Iterator[tuple[str, bytes]],
    oracle: GrpcOracle,
    counts: collections.Counter,
    failures: list[str],
) -> None:
    with grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        call = channel.unary_unary(proto.method_path(method))  # bytes in, bytes out
        in_flight: collections.deque = collections.deque()

        def check(name: str, payload: bytes, future: Any) -> None:
            try:
                data = future.result()
                got: tuple[str, Any] = ("OK", proto.RESPONSES[method].FromString(data))
            except grpc.RpcError as error:
                got = (error.code().name, error.details())
                if got[0] == "RESOURCE_EXHAUSTED" and got[1].startswith("overloaded: "):
                    pushback = dict(error.trailing_metadata() or ()).get(PUSHBACK_KEY, "")
                    counts[f"grpc {method} shed"] += 1
                    if not pushback.isdigit():
                        failures.append(f"gRPC {method} {name}: shed without a pushback")
                    return
            want = oracle(method, payload)
            counts[f"grpc {method} {got[0]}"] += 1
            if got[0] != want[0] or (
                not same_grpc_response(method, got[1], want[1])
                if got[0] == "OK"
                else got[1] != want[1]
            ):
                failures.append(f"gRPC {method} {name} {payload[:60]!r}: got {got}, want {want}")

        for name, payload in stream:
            in_flight.append((name, payload, call.future(payload, timeout=TIMEOUT)))
            if len(in_flight) >= GRPC_IN_FLIGHT:
                check(*in_flight.popleft())
        while in_flight:
            check(*in_flight.popleft())


def raw_garbage(port: int, rnd: random.Random, count: int, http: bool) -> None:
    """Bytes that are not the protocol at all, straight on a port: the server
    answers (HTTP: 400) or closes the connection, and goes on serving."""
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as connection:
            garbage = rnd.randbytes(rnd.randint(1, 2000))
            connection.sendall(garbage + b"\r\n\r\n" if http else garbage)
            with contextlib.suppress(ConnectionResetError):  # closing on garbage is fine here
                connection.recv(65536)


# -- HTTP ---------------------------------------------------------------------------


def http_instances(request: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    """The pool request as JSON: row or column format, keys as numbers or strings."""
    as_str = rnd.random() < 0.3
    key = str if as_str else int
    rows = []
    for i in range(request["rows"]):
        bag = [key(int(k)) for k in request["items"][i]]
        items: Any = bag
        if request["weights"] is not None:
            items = {"keys": bag, "weights": request["weights"][i].tolist()}
        rows.append({"user": key(int(request["user"][i])), "items": items,
                     "x": float(request["x"][i])})  # fmt: skip
    if rnd.random() < 0.5:
        return {"instances": rows}
    return {"inputs": {name: [row[name] for row in rows] for name in ("user", "items", "x")}}


def random_json(rnd: random.Random, depth: int = 0) -> Any:
    kind = rnd.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rnd.choice([None, True, False])
    if kind == 1:
        return rnd.choice([0, -1, 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 10**400])
    if kind == 2:
        return rnd.choice([0.5, -1e-300, 1e39, 3.4e38, float("nan"), float("inf"), -0.0])
    if kind == 3:
        return rnd.choice(["", "12", "-5", "1e3", "0x1f", "\ud800", "é", "12" * 30, " 1"])
    if kind in (4, 5, 6):
        return rnd.randint(-5, 700)
    if kind in (7, 8):
        return [random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    return {rnd.choice(NAMES): random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 3))}


def nodes(value: Any) -> list[tuple[Any, Any]]:
    """(container, key or index) of every node below value."""
    out = []
    stack = [value]
    while stack:
        container = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, child in items:
            out.append((container, key))
            if isinstance(child, dict | list):
                stack.append(child)
    return out


def mutate_json(document: Any, rnd: random.Random) -> tuple[str, Any]:
    document = copy.deepcopy(document)
    places = nodes(document)
    if not places:
        return "json_random", random_json(rnd)
    container, key = rnd.choice(places)
    kind = rnd.choice(["replace", "replace", "delete", "add", "wrap", "shorten"])
    if kind == "replace":
        container[key] = random_json(rnd)
    elif kind == "delete":
        del container[key]
    elif kind == "add":
        if isinstance(container, dict):
            container[rnd.choice([*NAMES, "keys", "weights", "inputs", "instances"])] = 1
        else:
            container.insert(key, random_json(rnd))
    elif kind == "wrap":
        container[key] = [container[key]]
    else:
        value = container[key]
        if isinstance(value, list) and value:
            del value[rnd.randrange(len(value))]
        else:
            container[key] = {}
    return f"json_{kind}", document


def garble_body(data: bytes, rnd: random.Random) -> tuple[str, bytes]:
    kind = rnd.choice(
        ["truncate", "flip", "insert", "utf8", "utf16", "bom", "nest", "random", "empty"]
    )
    if kind in BYTE_EDITS:
        return kind, edit_bytes(kind, data, rnd)
    if kind == "utf8":
        at = rnd.randint(0, len(data))
        bad = rnd.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"])
        return kind, data[:at] + bad + data[at:]
    if kind == "utf16":
        return kind, data.decode().encode("utf-16")
    if kind == "bom":
        return kind, b"\xef\xbb\xbf" + data
    if kind == "nest":
        depth = rnd.choice([100, 5000, 100_000])
        return kind, b'{"instances": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "random":
        return kind, rnd.randbytes(rnd.randint(1, 300))
    return kind, b""


HttpCase = tuple[str, str, str, dict[str, str], bytes | None, tuple]
# (mutation, method, path, headers, body, expect): expect ("oracle", endpoint,
# model, table) or ("status", HTTP status)


def quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def http_stream(
    endpoint: str, pool: list[Any], rnd: random.Random, count: int
) -> Iterator[HttpCase]:
    for _ in range(count):
        base = pool[rnd.randrange(len(pool))]
        model, table = "m", "users"
        if endpoint == "Predict":
            document: Any = http_instances(base, rnd)
        elif endpoint == "Lookup":
            table = base[0]
            document = {"keys": [int(k) if rnd.random() < 0.8 else str(k) for k in base[1]]}
        else:
            document = None
        headers = {"Content-Type": JSON_TYPE}
        method = "GET" if endpoint == "Status" else "POST"
        expect: tuple = ("oracle", endpoint)
        draw = rnd.random()
        name = "valid"
        if draw < VALID_SHARE:
            pass
        elif draw < 0.55 and document is not None:
            name, document = mutate_json(document, rnd)
        elif draw < 0.75 and document is not None:
            name, body = garble_body(json.dumps(document).encode(), rnd)
            document = body
            name = f"bytes_{name}"
        else:
            name = rnd.choice(
                ["content_type", "encoding", "method", "model", "table", "path", "big_body",
                 "big_batch", "query", "raw"]
            )  # fmt: skip
            if name == "content_type":
                headers["Content-Type"] = rnd.choice(
                    ["text/plain", "application/x-www-form-urlencoded", "application/xml",
                     "multipart/form-data; boundary=zz", "application/json; charset=latin-1",
                     "image/png", "*/*"]
                )  # fmt: skip
            elif name == "encoding":
                headers["Content-Encoding"] = rnd.choice(["gzip", "deflate", "br", "zstd"])
                # A body that is not what its encoding says: 400 where it is
                # read; the status endpoint does not read it (but aiohttp
                # refuses encodings it cannot decode, br and zstd, at once).
                expect = ("encoding", {400} if endpoint != "Status" else {200, 400})
            elif name == "method":
                method = rnd.choice(
                    ["PUT", "DELETE", "PATCH", "GET" if method == "POST" else "POST"]
                )
                expect = ("status", 405)
            elif name == "model":
                model = rnd.choice([n for n in NAMES if n and "\x00" not in n])
            elif name == "table":
                table = rnd.choice([n for n in NAMES if n and "\x00" not in n])
            elif name == "path":
                yield name, method, rnd.choice(
                    ["/v1/models/", "/v1/models/m/", "/v1/models/m:predictx", "/v2/models/m",
                     "/v1/models/m/versions/", "/v1/models/m/tables/:lookup", "/", "/v1",
                     "/v1/models/m/tables/users:lookups", "/" + quote(rnd.randbytes(8).hex())]
                ), headers, json.dumps(document).encode(), ("status", 404)  # fmt: skip
                continue
            elif name == "big_body":
                document = b'{"keys": [' + b" " * (MAX_BODY + rnd.randint(1, 4096)) + b"]}"
                if endpoint != "Status":  # which does not read a body
                    expect = ("status", 413)
            elif name == "big_batch":
                if endpoint == "Predict":
                    document = {"instances": [{"user": 1, "items": [2], "x": 0.5}] * (MAX_ROWS + 1)}
                elif endpoint == "Lookup":
                    document = {"keys": list(range(MAX_KEYS + 1))}
            elif name == "raw":
                expect = ("raw",)
        path = {
            "Predict": f"/v1/models/{quote(model)}:predict",
            "Lookup": f"/v1/models/{quote(model)}/tables/{quote(table)}:lookup",
            "Status": f"/v1/models/{quote(model)}",
        }[endpoint]
        if name == "query":  # ignored
            path += "?version=2&x=%ff&y"
        if expect[0] == "oracle":
            expect = ("oracle", endpoint, model, table)
        if isinstance(document, bytes) or document is None:
            body = document
        else:
            body = json.dumps(document).encode()
        if endpoint == "Status" and name not in ("big_body", "encoding") and rnd.random() < 0.5:
            body = None
        yield name, method, path, headers, body, expect


class HttpOracle:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.api = _Api(service, None, 0)  # type: ignore[arg-type]

    def __call__(
        self, endpoint: str, model: str, table: str, body: bytes | None
    ) -> tuple[int, Any]:
        """(HTTP status, the JSON answer)."""
        try:
            if endpoint == "Predict":  # through the server's JSON encoder (arrays)
                return 200, json.loads(_json(self.api._predict(model, body or b"")).body)
            if endpoint == "Lookup":
                return 200, json.loads(_json(self.api._lookup(model, table, body or b"")).body)
            (status,) = self.service.status(model)
            ok = {"error_code": "OK", "error_message": ""}
            version = {"version": str(status["version"]), "state": "AVAILABLE", "status": ok}
            return 200, {"model_version_status": [version]}
        except ServingError as error:
            return error.http_status, {"error": str(error)}
        except Exception as error:
            return 999, {"oracle failed": repr(error)}


def same_json(got: Any, want: Any) -> bool:
    if isinstance(want, dict) and ("predictions" in want or "outputs" in want):
        if not isinstance(got, dict) or got.get("model_version") != want["model_version"]:
            return False
        key = "predictions" if "predictions" in want else "outputs"
        a, b = got.get(key), want[key]
        if isinstance(b, dict):
            return (
                isinstance(a, dict)
                and a.keys() == b.keys()
                and all(np.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in b)
            )
        return isinstance(a, list) and len(a) == len(b) and np.allclose(a, b, rtol=1e-5, atol=1e-6)
    return bool(got == want)


async def raw_http(port: int, case: HttpCase, rnd: random.Random) -> tuple[int, bytes]:
    """The request as bytes with a mutated head, on a socket of its own;
    (status, body) of the answer."""
    _, method, path, _, body, _ = case
    body = body or b""
    line = f"{method} {path} HTTP/1.1".encode()
    mutated = rnd.choice(
        [line.replace(b"HTTP/1.1", rnd.choice([b"HTTP/9.9", b"HTTX/1.1", b"HTTP/1", b""])),
         line.replace(b" ", b"  ", 1), line.replace(b"/", b"\\", 1),
         line + rnd.choice([b"\x00", b"\xff", b" extra"]),
         line.replace(method.encode(), rnd.choice([b"P\x00ST", b"", b"FOO", b"get"])),
         line.replace(path.encode(), path.encode() + b"\xff\xfe"),
         line.replace(path.encode(), b"/" + b"a" * 20_000)]
    )  # fmt: skip
    extra = rnd.choice(
        [b"", b"X-Junk: \x01\x02\r\n", b"Bad Header\r\n", b"X-Long: " + b"a" * 20_000 + b"\r\n",
         b": empty\r\n", b"Host: second\r\n", b"Content-Length: -5\r\n",
         b"Content-Length: 99999999999999999999\r\n", b"Transfer-Encoding: zip\r\n"]
    )  # fmt: skip
    head = mutated + b"\r\nHost: fuzz\r\n" + extra + b"Connection: close\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n".encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), TIMEOUT)  # until the server closes
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    parts = status_line.split(b" ")
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise AssertionError(f"not an HTTP answer: {answer[:200]!r}")
    return int(parts[1]), rest.partition(b"\r\n\r\n")[2]


async def run_http(
    port: int,
    endpoint: str,
    stream: Iterator[HttpCase],
    oracle: HttpOracle,
    rnd: random.Random,
    counts: collections.Counter,
    failures: list[str],
) -> None:
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    base = f"http://127.0.0.1:{port}"

    async def one(session: aiohttp.ClientSession, case: HttpCase) -> None:
        name, method, path, headers, body, expect = case
        try:
            if expect[0] == "raw":
                status, _ = await raw_http(port, case, rnd)
                counts[f"http {endpoint} raw {status}"] += 1
                if status >= 500:
                    failures.append(f"HTTP {endpoint} raw {path!r}: answered {status}")
                return
            url = yarl.URL(base + path, encoded=True)
            async with session.request(
                method, url, data=body, headers=headers, skip_auto_headers=["Content-Type"]
            ) as response:
                data = await response.read()
                status = response.status
                content_type = response.content_type
                retry_after = response.headers.get("Retry-After")
        except Exception as error:  # a reset, a deadline …
            failures.append(f"HTTP {endpoint} {name} {method} {path!r}: {error!r}")
            return
        where = f"HTTP {endpoint} {name} {method} {path!r} {(body or b'')[:80]!r}"
        if status == 503 and retry_after is not None:  # shed
            counts[f"http {endpoint} shed"] += 1
            answer = json.loads(data)
            if not retry_after.isdigit() or not answer["error"].startswith("overloaded: "):
                failures.append(f"{where}: shed as {retry_after!r} {answer}")
            return
        counts[f"http {endpoint} {status}"] += 1
        if expect[0] == "encoding":
            if status not in expect[1]:
                failures.append(f"{where} {headers}: got {status} {data[:200]!r}")
            return
        if content_type != JSON_TYPE:
            failures.append(f"{where}: {status} {content_type} {data[:200]!r}")
            return
        got = json.loads(data)
        if expect[0] == "status":
            if status != expect[1] or not isinstance(got.get("error"), str):
                failures.append(f"{where}: got {status} {got}, want {expect[1]}")
            return
        want_status, want = oracle(*expect[1:], body)
        if status != want_status or not same_json(got, want):
            failures.append(f"{where}: got {status} {str(got)[:300]}, want {want_status} "
                            f"{str(want)[:300]}")  # fmt: skip

    connector = aiohttp.TCPConnector(limit=HTTP_IN_FLIGHT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            for case in stream:  # shared: each case goes to one worker
                await one(session, case)

        await asyncio.gather(*(worker() for _ in range(HTTP_IN_FLIGHT)))


# -- the test -----------------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_random_and_mutated_requests(
    trained: dict[str, Any], server: dict[str, Any], oracle: Service
) -> None:
    session, batch = trained["session"], trained["batch"]
    rng = np.random.default_rng(SEED)
    lookups, predicts = lookup_pool(rng), predict_pool(rng)
    grpc_pools = {
        "Lookup": [grpc_lookup(t, k, rnd_model) for (t, k), rnd_model in
                   zip(lookups, ["m", ""] * len(lookups), strict=False)],
        "Predict": [grpc_predict(p) for p in predicts],
        "Status": [proto.StatusRequest(model="m"), proto.StatusRequest(model="")],
    }  # fmt: skip
    others = [m.SerializeToString() for pool in grpc_pools.values() for m in pool[:4]]
    http_pools = {"Predict": predicts, "Lookup": lookups, "Status": [None]}
    grpc_oracle, http_oracle = GrpcOracle(oracle), HttpOracle(oracle)
    address = f"127.0.0.1:{server['grpc']}"
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []

    def phase(count: int, seed: int) -> None:
        for i, method in enumerate(("Lookup", "Predict", "Status")):
            rnd = random.Random(seed + i)
            stream = grpc_stream(method, grpc_pools[method], rnd, count, others)
            run_grpc(address, method, stream, grpc_oracle, counts, failures)
        for i, endpoint in enumerate(("Predict", "Lookup", "Status")):
            rnd = random.Random(seed + 10 + i)
            stream = http_stream(endpoint, http_pools[endpoint], rnd, count)
            asyncio.run(
                run_http(server["http"], endpoint, stream, http_oracle, rnd, counts, failures)
            )
        raw_garbage(server["grpc"], random.Random(seed + 20), count // 100, http=False)
        raw_garbage(server["http"], random.Random(seed + 21), count // 100, http=True)

    start = time.perf_counter()
    phase(WARMUP, SEED)
    rss_warm = rss_mb(server["pid"])
    warm_seconds = time.perf_counter() - start
    phase(PER_ENDPOINT, SEED + 100)
    rss_end = rss_mb(server["pid"])
    seconds = time.perf_counter() - start
    summary = (
        f"{sum(counts.values())} requests in {seconds:.0f} s (warm-up {warm_seconds:.0f} s); "
        f"RSS {rss_warm:.0f} MB after the warm-up, {rss_end:.0f} MB after all; "
        f"answers: {dict(sorted(counts.items()))}"
    )
    print(summary)
    examples = "\n".join(failure[:600] for failure in failures[:20])
    assert not failures, f"{len(failures)} wrong answers, e.g.:\n{examples}"
    assert server["process"].poll() is None, "the serving process died"
    assert rss_end - rss_warm < RSS_GROWTH_MB, summary
    every = {k.rsplit(" ", 1)[0] for k in counts}
    for endpoint in ("grpc Lookup", "grpc Predict", "grpc Status", "http Predict",
                     "http Lookup", "http Status"):  # fmt: skip
        answered = sum(n for k, n in counts.items() if k.startswith(endpoint + " "))
        assert answered >= PER_ENDPOINT
        assert counts[f"{endpoint} shed"] <= MAX_SHED_SHARE * answered, summary
        assert endpoint in every

    # Valid requests still answer correctly: lookups equal the trainer's
    # engine, a batch's predictions the trainer's.
    from wuliang.serving.client import Client

    with Client(address, timeout=TIMEOUT) as client:
        for table, keys in lookups:
            want = session.context.ps.lookup(table, keys)
            got = client.lookup(table, keys)
            np.testing.assert_array_equal(got.rows, want.rows)
            np.testing.assert_array_equal(got.found, want.found)
        features = batch_features(batch)
        items = batch.sparse["items"]
        outputs, version = client.predict(features, rows=batch.size)
        expected = session.run(batch, "predictions", train=False).reshape(-1)
        np.testing.assert_allclose(outputs["predictions"], expected, rtol=1e-5, atol=1e-6)
        assert version == 1 and client.status()[0]["version"] == 1

    async def http_checks() -> str:
        base = f"http://127.0.0.1:{server['http']}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http:
            for table, keys in lookups:
                url = f"{base}/v1/models/m/tables/{table}:lookup"
                async with http.post(url, json={"keys": keys.tolist()}) as response:
                    answer = await response.json()
                want = session.context.ps.lookup(table, keys)
                assert answer["found"] == want.found.tolist()
                np.testing.assert_array_equal(
                    np.array(answer["vectors"], np.float32).reshape(want.rows.shape), want.rows
                )
            rows = [
                {"user": int(features["user"][i]),
                 "items": items.values[items.offsets[i]: items.offsets[i + 1]].tolist(),
                 "x": float(features["x"][i, 0])}
                for i in range(batch.size)
            ]  # fmt: skip
            async with http.post(
                f"{base}/v1/models/m:predict", json={"instances": rows}
            ) as response:
                answer = await response.json()
            np.testing.assert_allclose(answer["predictions"], expected, rtol=1e-5, atol=1e-6)
            async with http.get(f"{base}/metrics") as response:
                return await response.text()

    metrics = asyncio.run(http_checks())
    assert 'code="INTERNAL"' not in metrics
    assert 'wuliang_served_version{model="m"} 1.0' in metrics
    # The process ends cleanly, and logged no error of its own.
    process = server["process"]
    process.stdin.close()
    assert process.wait(timeout=60) == 0
    log = server["log"].read_text(errors="replace")
    errors = [line for line in log.splitlines() if line.startswith(("ERROR:", "CRITICAL:"))]
    assert not errors, errors[:10]
