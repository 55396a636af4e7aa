"""The online server over HTTP/JSON (TF Serving's REST shape): predictions in
row and column format equal the trainer's, lookups the engine's; status,
health before and after a version, metrics, tokens, TLS, and every kind of
bad request answered with a 4xx naming it while the server keeps serving."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from small_model import trained_export

from wuliang.ps_server.rpc.tls import ServerTls
from wuliang.serving.http.server import HttpServer
from wuliang.serving.predict import FeatureInput, PredictAnswer
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore

MAX_BODY = 1 << 20
MAX_ROWS = 1000
MAX_KEYS = 1000


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A session trained 5 steps and exported (version 1), its files, a batch."""
    trained = trained_export(tmp_path_factory.mktemp("serving-http"))
    yield trained
    trained["session"].context.close()


@pytest.fixture(scope="module")
def served(trained: dict[str, Any]) -> Iterator[tuple[Service, HttpServer]]:
    store = ModelStore(trained["exports"], "m", poll_secs=0).start()
    service = Service([store], max_rows=MAX_ROWS, max_keys=MAX_KEYS, max_request_bytes=MAX_BODY)
    server = HttpServer(service)
    yield service, server
    server.stop()
    service.close()


def call(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, Any, http.client.HTTPResponse]:
    """(status, the JSON answer or the raw bytes, the response)."""
    if tls is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=tls)
    if body is not None and not isinstance(body, bytes | str):
        body = json.dumps(body)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    if response.getheader("Content-Type", "").startswith("application/json"):
        return response.status, json.loads(data), response
    return response.status, data, response


def instances(batch: Any, keys_as: type = int) -> list[dict[str, Any]]:
    """The batch in row format: user a key, items a list of keys, x a number."""
    users = batch.sparse["user"].values
    items = batch.sparse["items"]
    x = batch.dense_feature("x")
    rows = []
    for i in range(batch.size):
        bag = items.values[items.offsets[i] : items.offsets[i + 1]]
        rows.append(
            {
                "user": keys_as(int(users[i])),
                "items": [keys_as(int(k)) for k in bag],
                "x": float(x[i, 0]),
            }
        )
    return rows


def columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {name: [row[name] for row in rows] for name in rows[0]}


def test_predictions_equal_the_trainer_in_both_formats(
    trained: dict[str, Any], served: tuple[Service, HttpServer]
) -> None:
    _, server = served
    session, batch = trained["session"], trained["batch"]
    expected = session.run(batch, "predictions", train=False).reshape(-1)
    rows = instances(batch)
    status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", {"instances": rows})
    assert status == 200, answer
    assert answer["model_version"] == "1"
    np.testing.assert_allclose(answer["predictions"], expected, rtol=1e-5, atol=1e-6)
    status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", {"inputs": columns(rows)})
    assert status == 200, answer
    assert answer["model_version"] == "1"
    np.testing.assert_allclose(answer["outputs"], expected, rtol=1e-5, atol=1e-6)
    # Keys as strings of digits, a lone key as a one-key list, a dense value
    # as a list of dim numbers, and signature_name: the same answer.
    rows = instances(batch, keys_as=str)
    for row in rows:
        row["user"] = [row["user"]]
        row["x"] = [row["x"]]
    body = {"instances": rows, "signature_name": "serving_default"}
    status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", body)
    assert status == 200, answer
    np.testing.assert_allclose(answer["predictions"], expected, rtol=1e-5, atol=1e-6)


def test_weighted_keys(trained: dict[str, Any], served: tuple[Service, HttpServer]) -> None:
    """{"keys", "weights"} rows pool as the service pools weighted CSR keys."""
    service, server = served
    rows = instances(trained["batch"])[:4]
    rows[0]["items"] = {"keys": [1, 2, 3], "weights": [0.5, 2.0, 1.0]}
    rows[2]["items"] = {"keys": [7], "weights": [3]}
    status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", {"instances": rows})
    assert status == 200, answer
    keys = [1, 2, 3, *rows[1]["items"], 7, *rows[3]["items"]]
    weights = [0.5, 2.0, 1.0, *[1.0] * len(rows[1]["items"]), 3.0, *[1.0] * len(rows[3]["items"])]
    offsets = np.cumsum([0, 3, len(rows[1]["items"]), 1, len(rows[3]["items"])])
    features = {
        "user": FeatureInput(np.array([r["user"] for r in rows], np.uint64)),
        "items": FeatureInput(
            np.array(keys, np.uint64), offsets.astype(np.int64), np.array(weights, np.float32)
        ),
        "x": FeatureInput(np.array([[r["x"]] for r in rows], np.float32)),
    }
    want = service.predict("m", features, 4).outputs["predictions"].reshape(-1)
    np.testing.assert_array_equal(np.float32(answer["predictions"]), want)  # float32 exact
    unweighted = {**features, "items": FeatureInput(features["items"].values, offsets)}
    other = service.predict("m", unweighted, 4).outputs["predictions"].reshape(-1)
    assert not np.array_equal(want, other)  # the weights mattered


def test_several_outputs_by_name(
    trained: dict[str, Any], served: tuple[Service, HttpServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-task model's outputs: row format, an object per row; column
    format, an object of lists (an output of k > 1 values a row: lists)."""
    service, server = served
    real = service.predict

    def two_tasks(model: str, features: Any, rows: int | None = None) -> PredictAnswer:
        answer = real(model, features, rows)
        scores = answer.outputs.pop("predictions").reshape(-1)
        answer.outputs["predictions_click"] = scores
        answer.outputs["predictions_topics"] = np.stack([scores, 1 - scores], axis=1)
        return answer

    monkeypatch.setattr(service, "predict", two_tasks)
    rows = instances(trained["batch"])[:5]
    expected = trained["session"].run(trained["batch"], "predictions", train=False).reshape(-1)[:5]
    status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", {"instances": rows})
    assert status == 200, answer
    assert [set(p) for p in answer["predictions"]] == [
        {"predictions_click", "predictions_topics"}
    ] * 5
    click = [p["predictions_click"] for p in answer["predictions"]]
    np.testing.assert_allclose(click, expected, rtol=1e-5, atol=1e-6)
    assert all(len(p["predictions_topics"]) == 2 for p in answer["predictions"])
    status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", {"inputs": columns(rows)})
    assert status == 200, answer
    assert set(answer["outputs"]) == {"predictions_click", "predictions_topics"}
    np.testing.assert_allclose(answer["outputs"]["predictions_click"], expected, rtol=1e-5)
    np.testing.assert_allclose(
        np.array(answer["outputs"]["predictions_topics"])[:, 1], 1 - expected, rtol=1e-5, atol=1e-6
    )


def test_lookups_equal_the_engine(
    trained: dict[str, Any], served: tuple[Service, HttpServer]
) -> None:
    _, server = served
    session = trained["session"]
    keys = np.array([*range(0, 300, 7), 10**12, 2**64 - 1], np.uint64)
    json_keys: list[Any] = [int(k) for k in keys]
    json_keys[1] = str(json_keys[1])  # a string of digits
    json_keys[-1] = -1  # an int64 key: the same bits as 2^64 - 1
    path = "/v1/models/m/tables/users:lookup"
    status, answer, _ = call(server.port, "POST", path, {"keys": json_keys})
    assert status == 200, answer
    assert answer["model_version"] == "1"
    want = session.context.ps.lookup("users", keys)
    np.testing.assert_array_equal(np.array(answer["vectors"], np.float32), want.rows)
    np.testing.assert_array_equal(answer["found"], want.found)
    assert answer["found"][-2:] == [False, False] and answer["vectors"][-1] == [0.0] * 8
    # Big lookups (answered in the pool, not on the event loop): the same rows.
    many = np.arange(MAX_KEYS, dtype=np.uint64)
    status, answer, _ = call(server.port, "POST", path, {"keys": many.tolist()})
    assert status == 200, answer
    np.testing.assert_array_equal(
        np.array(answer["vectors"], np.float32), session.context.ps.lookup("users", many).rows
    )
    status, answer, _ = call(server.port, "POST", path, {"keys": []})
    assert status == 200 and answer["vectors"] == [] and answer["found"] == []


def test_status_health_and_metrics(served: tuple[Service, HttpServer]) -> None:
    _, server = served
    status, answer, _ = call(server.port, "GET", "/v1/models/m")
    assert status == 200
    assert answer == {
        "model_version_status": [
            {
                "version": "1",
                "state": "AVAILABLE",
                "status": {"error_code": "OK", "error_message": ""},
            }
        ]
    }
    status, answer, _ = call(server.port, "GET", "/healthz")
    assert status == 200 and answer == {"status": "SERVING"}
    call(server.port, "POST", "/v1/models/m/tables/users:lookup", {"keys": [1]})
    call(server.port, "POST", "/v1/models/m/tables/nope:lookup", {"keys": [1]})
    status, text, response = call(server.port, "GET", "/metrics")
    assert status == 200
    assert response.getheader("Content-Type") == "text/plain; version=0.0.4; charset=utf-8"
    text = text.decode()
    for line in (
        'wuliang_requests_total{code="OK",endpoint="Lookup",transport="http"}',
        'wuliang_requests_total{code="NOT_FOUND",endpoint="Lookup",transport="http"}',
        'wuliang_requests_total{code="OK",endpoint="Status",transport="http"}',
        'wuliang_requests_total{code="OK",endpoint="Health",transport="http"}',
        'wuliang_request_seconds_count{endpoint="Lookup",transport="http"}',
        'wuliang_served_version{model="m"} 1.0',
        'wuliang_lookup_keys_total{model="m",table="users"}',
    ):
        assert line in text, line


def test_health_and_status_before_and_after_a_version(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    exports = tmp_path / "exports"
    exports.mkdir()
    store = ModelStore(exports, "m", poll_secs=0).start()
    service = Service([store])
    server = HttpServer(service)
    try:
        status, answer, _ = call(server.port, "GET", "/healthz")
        assert status == 503 and "no version loaded yet of m" in answer["error"]
        status, answer, _ = call(server.port, "GET", "/v1/models/m")
        assert status == 200
        (version,) = answer["model_version_status"]
        assert version["version"] == "0" and version["state"] == "LOADING"
        assert version["status"]["error_code"] == "UNAVAILABLE"
        body = {"instances": instances(trained["batch"])}
        status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", body)
        assert status == 503 and "no version loaded yet" in answer["error"]
        status, answer, _ = call(
            server.port, "POST", "/v1/models/m/tables/users:lookup", {"keys": [1]}
        )
        assert status == 503, answer
        shutil.copytree(trained["exports"] / "1", exports / "1")
        assert store.refresh() == [1]
        assert call(server.port, "GET", "/healthz")[0] == 200
        status, answer, _ = call(server.port, "GET", "/v1/models/m")
        assert answer["model_version_status"][0]["state"] == "AVAILABLE"
        status, answer, _ = call(server.port, "POST", "/v1/models/m:predict", body)
        assert status == 200 and answer["model_version"] == "1"
    finally:
        server.stop()
        service.close()
    server.stop()  # twice: nothing more
    assert not server._thread.is_alive()
    with pytest.raises(OSError):
        call(server.port, "GET", "/healthz")


def test_a_token_is_required_everywhere_but_healthz(trained: dict[str, Any]) -> None:
    service = Service([ModelStore(trained["exports"], "m", poll_secs=0).start()], token="s3cret")
    server = HttpServer(service)
    requests = [
        ("POST", "/v1/models/m:predict", {"instances": instances(trained["batch"])}),
        ("POST", "/v1/models/m/tables/users:lookup", {"keys": [1, 2]}),
        ("GET", "/v1/models/m", None),
        ("GET", "/metrics", None),
        ("GET", "/nowhere", None),
    ]
    try:
        for method, path, body in requests:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Basic czNjcmV0"},
                {"Authorization": "s3cret"},
            ):
                status, answer, response = call(server.port, method, path, body, headers)
                assert status == 401, (path, headers, answer)
                assert "token" in answer["error"]
                assert response.getheader("WWW-Authenticate", "").startswith("Bearer")
            good = {"Authorization": "Bearer s3cret"}
            status, _, _ = call(server.port, method, path, body, good)
            assert status == (404 if path == "/nowhere" else 200), path
            status, _, _ = call(server.port, method, path, body, {"authorization": "bearer s3cret"})
            assert status == (404 if path == "/nowhere" else 200), path
        assert call(server.port, "GET", "/healthz")[0] == 200
        _, text, _ = call(
            server.port, "GET", "/metrics", headers={"Authorization": "Bearer s3cret"}
        )
        assert b'code="UNAUTHENTICATED",endpoint="Metrics",transport="http"' in text
    finally:
        server.stop()
        service.close()


def test_tls(trained: dict[str, Any], tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = ServerTls.from_files(cert, key)
    service = Service([ModelStore(trained["exports"], "m", poll_secs=0).start()])
    server = HttpServer(service, tls=tls)
    try:
        client = ssl.create_default_context(cafile=str(cert))
        status, answer, _ = call(
            server.port, "POST", "/v1/models/m/tables/users:lookup", {"keys": [1]}, tls=client
        )
        assert status == 200 and answer["model_version"] == "1"
        with pytest.raises(ssl.SSLError):  # a client that does not trust it
            call(server.port, "GET", "/healthz", tls=ssl.create_default_context())
    finally:
        server.stop()
        service.close()


def test_a_port_in_use_fails_in_the_constructor(served: tuple[Service, HttpServer]) -> None:
    service, server = served
    with pytest.raises(OSError):
        HttpServer(service, port=server.port)


PREDICT = "/v1/models/m:predict"
LOOKUP = "/v1/models/m/tables/users:lookup"
ROW = {"user": 1, "items": [2, 3], "x": 0.5}


def bad_requests() -> list[tuple[str, str, Any, dict[str, str], int, str]]:
    """(method, path, body, headers, status, a part of the error message)."""

    def row(**change: Any) -> dict[str, Any]:
        return {"instances": [ROW, {**ROW, **change}]}

    return [
        ("POST", PREDICT, b'{"instances": [', {}, 400, "not valid JSON"),
        ("POST", PREDICT, b"", {}, 400, "body is empty"),
        ("POST", PREDICT, b"[1, 2]", {}, 400, "must be a JSON object, got an array"),
        ("POST", PREDICT, b"\xff\xfe{}", {}, 400, "not UTF-8"),
        ("POST", PREDICT, b'{"instances": [' * 50_000, {}, 400, "nests too deeply"),
        ("POST", PREDICT, b'{"instances": [{"user": 1, "items": [], "x": NaN}]}', {}, 400, "NaN"),
        ("POST", PREDICT, b'{"instances": [{"user": 1, "items": [], "x": 1e999}]}', {}, 400,
         "row 0: inf is not a finite float32"),
        ("POST", PREDICT, row(x=1e39), {}, 400, "dense feature 'x', row 1: 1e+39 is not a finite"),
        ("POST", PREDICT, row(x=10**400), {}, 400, "outside float32"),
        ("POST", PREDICT, row(x="0.5"), {}, 400, "dense feature 'x', row 1: expected a number"),
        ("POST", PREDICT, row(x=[[0.5]]), {}, 400, "dense feature 'x', row 1: expected a number"),
        ("POST", PREDICT, row(x=[0.5, 1.0]), {}, 400, "a list of 1 number, got an array"),
        ("POST", PREDICT, row(x=True), {}, 400, "dense feature 'x', row 1"),
        ("POST", PREDICT, row(x=None), {}, 400, "got null"),
        ("POST", PREDICT, row(user=1.5), {}, 400,
         "sparse feature 'user', row 1: a key must be an integer"),
        ("POST", PREDICT, row(user=True), {}, 400, "sparse feature 'user', row 1: a key must be"),
        ("POST", PREDICT, row(user=2**64), {}, 400, "key 18446744073709551616 is outside uint64"),
        ("POST", PREDICT, row(user=-(2**63) - 1), {}, 400, "outside uint64"),
        ("POST", PREDICT, row(user="12a"), {}, 400, "a key must be an integer or a string"),
        ("POST", PREDICT, row(items=[2, [3]]), {}, 400, "sparse feature 'items', row 1"),
        ("POST", PREDICT, row(items={"keys": [1], "weights": [1, 2]}), {}, 400,
         "'weights' must be a list of 1 numbers"),
        ("POST", PREDICT, row(items={"keys": [1], "weights": ["a"]}), {}, 400,
         "expected a number"),
        ("POST", PREDICT, row(items={"key": [1]}), {}, 400, "must hold 'keys'"),
        ("POST", PREDICT, row(zzz=1), {}, 400, "instances[1]: the model has no feature 'zzz'"),
        ("POST", PREDICT, {"instances": [ROW, {"user": 1, "x": 0.5}]}, {}, 400,
         "instances[1] has no feature 'items'"),
        ("POST", PREDICT, {"instances": [ROW, 3]}, {}, 400, "instances[1] must be an object"),
        ("POST", PREDICT, {"instances": {"user": 1}}, {}, 400, "must be an array of rows"),
        ("POST", PREDICT, {"instances": []}, {}, 400, "no rows"),
        ("POST", PREDICT, {"instances": [ROW], "inputs": {}}, {}, 400, "exactly one of"),
        ("POST", PREDICT, {}, {}, 400, "exactly one of"),
        ("POST", PREDICT, {"instance": [ROW]}, {}, 400, "unknown field 'instance'"),
        ("POST", PREDICT, {"instances": [ROW], "signature_name": "other"}, {}, 400,
         "signature_name must be 'serving_default'"),
        ("POST", PREDICT, {"inputs": {"user": [1, 2], "items": [[1]], "x": [0.1, 0.2]}}, {}, 400,
         "inputs['items'] has 1 rows, inputs['user'] has 2"),
        ("POST", PREDICT, {"inputs": {"user": [1], "items": [[1]]}}, {}, 400,
         "feature 'x' is missing"),
        ("POST", PREDICT, {"inputs": {"user": 1, "items": [[1]], "x": [1]}}, {}, 400,
         "inputs['user'] must be an array"),
        ("POST", PREDICT, {"inputs": [1]}, {}, 400, "'inputs' must be an object"),
        ("POST", PREDICT, {"instances": [ROW] * (MAX_ROWS + 1)}, {}, 413,
         f"{MAX_ROWS + 1} rows in one request; at most {MAX_ROWS}"),
        ("POST", PREDICT, b"{" + b" " * MAX_BODY + b"}", {}, 413, "larger than 1048576 bytes"),
        ("POST", "/v1/models/nope:predict", {"instances": [ROW]}, {}, 404, "no model 'nope'"),
        ("GET", PREDICT, None, {}, 405, "GET is not allowed"),
        ("POST", "/v1/models/m", b"{}", {}, 405, "POST is not allowed"),
        ("GET", "/v2/whatever", None, {}, 404, "no endpoint GET '/v2/whatever'"),
        ("POST", LOOKUP, {"keys": list(range(MAX_KEYS + 1))}, {}, 413,
         f"{MAX_KEYS + 1} keys in one lookup"),
        ("POST", LOOKUP, {"keys": 7}, {}, 400, "'keys' must be an array"),
        ("POST", LOOKUP, {"key": [7]}, {}, 400, "unknown field 'key'"),
        ("POST", LOOKUP, {}, {}, 400, "a lookup needs 'keys'"),
        ("POST", LOOKUP, {"keys": [1, 2, "x"]}, {}, 400, "keys[2]: a key must be an integer"),
        ("POST", LOOKUP, {"keys": [1, 2.0]}, {}, 400, "keys[1]: a key must be an integer"),
        ("POST", LOOKUP, {"keys": [1, 2**64]}, {}, 400, "keys[1]: key 18446744073709551616"),
        ("POST", LOOKUP, {"keys": [1, {}]}, {}, 400, "got an object"),
        ("POST", "/v1/models/m/tables/nope:lookup", {"keys": [1]}, {}, 404, "no table 'nope'"),
        ("POST", "/v1/models/x/tables/users:lookup", {"keys": [1]}, {}, 404, "no model 'x'"),
        ("GET", "/v1/models/x", None, {}, 404, "no model 'x'"),
    ]  # fmt: skip


def test_bad_requests_get_a_4xx_naming_the_input(
    trained: dict[str, Any], served: tuple[Service, HttpServer], caplog: pytest.LogCaptureFixture
) -> None:
    _, server = served
    for method, path, body, headers, want, message in bad_requests():
        status, answer, _ = call(server.port, method, path, body, headers)
        assert status == want, (path, body if not isinstance(body, bytes) else body[:50], answer)
        assert message in answer["error"], (message, answer)
    # An oversized body without Content-Length (chunked) is refused too.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b"[" + b"0," * 1000 for _ in range(1000))
    connection.request("POST", LOOKUP, chunks, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and b"larger than" in response.read()
    connection.close()
    # A body that does not decode as its Content-Encoding says: a 400 that
    # closes the connection (the client does not reuse it).
    status, answer, response = call(
        server.port, "POST", LOOKUP, b'{"keys": [1]}', {"Content-Encoding": "gzip"}
    )
    assert status == 400 and "cannot be read" in answer["error"], answer
    assert response.getheader("Connection") == "close"
    # A request line that is not HTTP: aiohttp's 400, and no ERROR logged.
    with caplog.at_level(logging.DEBUG, "aiohttp.server"):
        for garbage in (
            b"GARBAGE\r\n\r\n",
            b"GET / HTTP/9.9\r\n\r\n",
            b"POST /\x00 HTTP/1.1\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
                client.sendall(garbage)
                assert client.recv(65536).split(b" ")[1] == b"400", garbage
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Error handling request" in caplog.text  # at DEBUG
    # The server still answers, correctly.
    status, answer, _ = call(
        server.port, "POST", PREDICT, {"instances": instances(trained["batch"])}
    )
    assert status == 200
    expected = trained["session"].run(trained["batch"], "predictions", train=False).reshape(-1)
    np.testing.assert_allclose(answer["predictions"], expected, rtol=1e-5, atol=1e-6)


def test_a_body_that_stops_coming_is_a_408(trained: dict[str, Any]) -> None:
    service = Service([ModelStore(trained["exports"], "m", poll_secs=0, load_towers=False).start()])
    server = HttpServer(service, body_seconds=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
            client.sendall(
                f"POST {LOOKUP} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode()
                + b'{"keys": [1'
            )
            answer = client.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"did not arrive within 0.5 s" in answer
        assert call(server.port, "POST", LOOKUP, {"keys": [1]})[0] == 200
    finally:
        server.stop()
        service.close()


def test_an_unexpected_error_is_a_logged_500(
    served: tuple[Service, HttpServer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    service, server = served

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "lookup", broken)
    with caplog.at_level(logging.ERROR, "wuliang.serving"):
        for body in ({"keys": [1]}, {"keys": list(range(MAX_KEYS))}):  # on the loop, in the pool
            status, answer, _ = call(server.port, "POST", LOOKUP, body)
            assert status == 500 and answer == {"error": "Lookup failed inside the server"}
    assert "RuntimeError: a bug" in caplog.text
    monkeypatch.undo()
    assert call(server.port, "POST", LOOKUP, {"keys": [1]})[0] == 200
