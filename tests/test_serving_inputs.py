"""What clients send: raw strings of features trained on string columns, keys
as digit strings, empty and nested lists, over gRPC (the Python client) and
HTTP/JSON, which must read them alike; the Python client's health check; and
the client example of docs/serving.md, run against a server with a token and
TLS.

The model is trained here on Parquet columns of strings (``ParquetReader``
hashes them and reports ``hashed_features``; the session records
``hash_field`` in the exported model description): ``user`` (integer ids),
``items`` (lists of integer ids), ``city`` (a string), ``tags`` (lists of
strings, sharing ``city`` 's table), ``age`` (dense).
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from repo_data import REPO

import wuliang as wl
from wuliang.ps_server.storage import Version
from wuliang.reader import ParquetReader, hash_strings
from wuliang.serving import Client, GrpcServer, HttpServer, ModelStore, ServerTls, Service
from wuliang.serving.client import ServingClientError
from wuliang.serving.grpc import proto

FEATURES = ["user", "items", "city", "tags", "age"]
CITIES = ["paris", "lyon", "oslo", "köln", "12", "7", "new york"]
TAGS = ["a", "b", "comedy", "dark", "42", "x y", "日本"]
ROWS = 64


def write_data(path: Path) -> None:
    rng = np.random.default_rng(3)
    n = 640
    cities = np.array(CITIES)[rng.integers(0, len(CITIES), n)].tolist()
    table = pa.table(
        {
            "user": rng.integers(0, 50, n),
            "items": [rng.integers(0, 80, rng.integers(0, 4)).tolist() for _ in range(n)],
            "city": pa.array(cities, pa.string()),
            "tags": pa.array(
                [
                    [TAGS[j] for j in rng.integers(0, len(TAGS), rng.integers(0, 4))]
                    for _ in range(n)
                ],
                pa.list_(pa.string()),
            ),
            "age": rng.normal(size=n).astype(np.float32),
            "label": rng.integers(0, 2, n).astype(np.float32),
        }
    )
    pq.write_table(table, path, row_group_size=128)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A session trained on string columns and exported; a batch of its data
    as the reader hashed it, and the same rows raw."""
    root = tmp_path_factory.mktemp("serving-inputs")
    data = root / "data.parquet"
    write_data(data)
    keras.utils.set_random_seed(4)
    users, items, words = (wl.EmbeddingTable(n, 4) for n in ("users", "items", "words"))
    features = [
        wl.SparseFeature("user", users),
        wl.SparseFeature("items", items, combiner="mean"),
        wl.SparseFeature("city", words),
        wl.SparseFeature("tags", words, combiner="mean"),
        wl.DenseFeature("age"),
    ]
    tower = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    session = wl.Session(tower, features, wl.Context(num_shards=2))
    reader = ParquetReader(str(data), ROWS, FEATURES, label="label")
    assert reader.hashed_features == {"city": "city", "tags": "tags"}
    session.train(reader, steps=6)
    exports = root / "exports"
    session.export(exports)
    batch = next(iter(ParquetReader(str(data), ROWS, FEATURES, label="label")))
    raw = pq.read_table(data, columns=FEATURES).slice(0, ROWS).to_pylist()
    yield {"session": session, "exports": exports, "batch": batch, "raw": raw, "root": root}
    session.context.close()


@pytest.fixture(scope="module")
def served(trained: dict[str, Any]) -> Iterator[dict[str, Any]]:
    service = Service([ModelStore(trained["exports"], "m", poll_secs=0).start()])
    grpc_server, http_server = GrpcServer(service), HttpServer(service)
    client = Client(f"127.0.0.1:{grpc_server.port}", timeout=30)
    yield {"service": service, "client": client, "http": http_server.port, "grpc": grpc_server}
    client.close()
    http_server.stop()
    grpc_server.stop()
    service.close()


def rest(port: int, path: str, body: Any) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", path, json.dumps(body))
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def columns(raw: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The raw rows as client features: lists per feature, dense as floats."""
    out = {name: [row[name] for row in raw] for name in FEATURES}
    out["age"] = [float(a) for a in out["age"]]
    return out


def test_the_export_records_which_features_hash_strings(trained: dict[str, Any]) -> None:
    model = Version(trained["exports"] / "1").model
    assert model is not None
    assert {f.name: f.hash_field for f in model.sparse} == {
        "user": None,
        "items": None,
        "city": "city",
        "tags": "tags",
    }


def test_raw_strings_predict_as_the_hashed_keys_and_the_trainer(
    trained: dict[str, Any], served: dict[str, Any]
) -> None:
    client, raw, batch = served["client"], trained["raw"], trained["batch"]
    expected = trained["session"].run(batch, "predictions", train=False).reshape(-1)
    features = columns(raw)
    from_strings, version = client.predict(features)
    assert version == 1
    np.testing.assert_allclose(from_strings["predictions"], expected, rtol=1e-5, atol=1e-6)
    # The same rows with the keys hashed by the client: the same scores, bit for bit.
    tags = batch.sparse["tags"]
    hashed = {
        **features,
        "city": np.asarray(hash_strings(features["city"], "city"), np.uint64),
        "tags": (
            np.asarray(hash_strings([t for row in features["tags"] for t in row], "tags")),
            tags.offsets,
        ),
    }
    np.testing.assert_array_equal(hashed["city"], batch.sparse["city"].values.view(np.uint64))
    from_keys, _ = client.predict(hashed)
    np.testing.assert_array_equal(from_keys["predictions"], from_strings["predictions"])
    # HTTP/JSON: raw strings in row and column format, and the keys as integers.
    status, answer = rest(served["http"], "/v1/models/m:predict", {"instances": raw})
    assert status == 200, answer
    np.testing.assert_array_equal(np.float32(answer["predictions"]), from_strings["predictions"])
    status, answer = rest(served["http"], "/v1/models/m:predict", {"inputs": features})
    assert status == 200, answer
    np.testing.assert_array_equal(np.float32(answer["outputs"]), from_strings["predictions"])
    as_ints = {**features, "city": [int(k) for k in hashed["city"]]}
    as_ints["tags"] = [
        [int(k) for k in hashed["tags"][0][tags.offsets[i] : tags.offsets[i + 1]]]
        for i in range(batch.size)
    ]
    status, answer = rest(served["http"], "/v1/models/m:predict", {"inputs": as_ints})
    assert status == 200, answer
    np.testing.assert_array_equal(np.float32(answer["outputs"]), from_strings["predictions"])


def test_strings_are_checked(served: dict[str, Any]) -> None:
    client, port = served["client"], served["http"]
    row = {"user": 1, "items": [2], "city": "paris", "tags": [], "age": 0.5}
    status, answer = rest(port, "/v1/models/m:predict", {"instances": [{**row, "user": "abc"}]})
    assert status == 400
    assert answer["error"] == (
        "sparse feature 'user', row 0: a key must be an integer or a string of digits (feature "
        "'user' takes integer ids: it was not trained on hashed strings), got a string (\"abc\")"
    )
    with pytest.raises(ServingClientError) as error:
        client.predict({**{k: [v] for k, v in row.items()}, "user": ["abc"]})
    assert error.value.code == "INVALID_ARGUMENT"
    assert error.value.message == answer["error"].replace("'user', row 0", "'user' strings[0]")

    def raw_predict(**feature: Any) -> ServingClientError:
        features = [
            proto.Feature(name="user", values=np.array([1], "<u8").tobytes()),
            proto.Feature(name="items", values=np.array([2], "<u8").tobytes()),
            proto.Feature(name="tags", offsets=np.array([0, 0], "<i8").tobytes()),
            proto.Feature(name="age", values=np.array([0.5], "<f4").tobytes()),
            proto.Feature(name="city", **feature),
        ]
        request = proto.PredictRequest(model="m", rows=1, features=features)
        with pytest.raises(ServingClientError) as error:
            client._call("Predict", request, None)
        assert error.value.code == "INVALID_ARGUMENT"
        return error.value

    bounds = np.array([0, 5], "<i8").tobytes()
    assert (
        "not both"
        in raw_predict(
            values=np.array([1], "<u8").tobytes(), string_values=b"paris", string_offsets=bounds
        ).message
    )
    assert (
        "string_offsets must rise from 0 to the 5 bytes"
        in raw_predict(
            string_values=b"paris", string_offsets=np.array([0, 9], "<i8").tobytes()
        ).message
    )
    assert (
        "string 0 is not UTF-8"
        in raw_predict(string_values=b"\xff\xfe\xfd\xfc\xfb", string_offsets=bounds).message
    )
    assert "string_values come without string_offsets" in raw_predict(string_values=b"x").message
    lone = {"instances": [{**row, "city": "\ud800"}]}  # JSON allows a lone surrogate
    status, answer = rest(port, "/v1/models/m:predict", lone)
    assert status == 400 and "sparse feature 'city'" in answer["error"]
    assert "is not valid Unicode" in answer["error"]
    status, answer = rest(port, "/v1/models/m:predict", {"instances": [{**row, "age": "old"}]})
    assert status == 400 and "dense feature 'age', row 0: expected a number" in answer["error"]


# -- the Python client and HTTP/JSON read the same inputs alike ------------------------

LOOKUPS = [  # (what, keys): both answer the same rows, or both refuse
    ("no keys", []),
    ("integers", [7, 42, 10**12]),
    ("strings of digits", ["7", "42"]),
    ("digits and integers", [7, "42", "-1"]),
    ("a negative key is int64", [-1, 2**64 - 1]),
    ("uint64 bounds", [0, 2**63, 2**64 - 1]),
    ("not digits", ["7", "abc"]),
    ("a float", [1.5]),
    ("a nested list", [[1, 2]]),
    ("beyond uint64", [2**64]),
    ("a boolean", [True]),
    ("null", [None]),
]
ROW = {"user": [1, 2], "items": [[3], [4, 5]], "city": ["oslo", "lyon"], "tags": [[], ["a"]]}
PREDICTIONS = [  # (what, features without age): both answer the same scores, or both refuse
    ("keys and raw strings", ROW),
    ("user as strings of digits", {**ROW, "user": ["1", "2"]}),
    ("user as lists of one key", {**ROW, "user": [[1], [2]]}),
    ("empty key lists", {**ROW, "items": [[], []], "tags": [[], []]}),
    ("a key or a list per row", {**ROW, "items": [3, [4, 5]]}),
    ("a digit string of a hashed feature is hashed", {**ROW, "city": ["12", "7"]}),
    ("a lone string per row of a list feature", {**ROW, "tags": ["comedy", ["a", "b"]]}),
    ("a negative key", {**ROW, "user": [-1, 2]}),
    ("not digits for integer ids", {**ROW, "user": ["abc", "2"]}),
    ("nesting too deep", {**ROW, "items": [[3, [4]], [5]]}),
    ("a float key", {**ROW, "user": [1.5, 2.0]}),
    ("a boolean key", {**ROW, "user": [True, False]}),
    ("rows of different lengths", {**ROW, "user": [1, 2, 3]}),
]


def over_http(port: int, path: str, body: Any) -> Any:
    status, answer = rest(port, path, body)
    return ("error", status) if status != 200 else answer


def test_the_client_and_http_agree_on_lookups(served: dict[str, Any]) -> None:
    client, port = served["client"], served["http"]
    for what, keys in LOOKUPS:
        web = over_http(port, "/v1/models/m/tables/items:lookup", {"keys": keys})
        try:
            got = client.lookup("items", keys)
        except (TypeError, ValueError) as error:
            assert web == ("error", 400), (what, web)
            assert "keys" in str(error) and type(error).__module__ == "builtins", what
            continue
        assert web != ("error", 400), (what, "HTTP refused what the client sent")
        assert got.rows.shape == (len(keys), 4), what
        np.testing.assert_array_equal(got.rows, np.float32(web["vectors"]).reshape(-1, 4), what)
        assert got.found.tolist() == web["found"], what


def test_the_client_and_http_agree_on_predictions(served: dict[str, Any]) -> None:
    client, port = served["client"], served["http"]
    answers = {}
    for what, features in PREDICTIONS:
        features = {**features, "age": [0.25] * len(features["user"])}
        web = over_http(port, "/v1/models/m:predict", {"inputs": features})
        try:
            outputs, _ = client.predict(features)
        except (TypeError, ValueError) as error:
            assert web == ("error", 400), (what, web)
            assert re.search(r"feature '\w+'", str(error)), (what, error)
            continue
        except ServingClientError as error:
            assert web == ("error", 400) and error.code == "INVALID_ARGUMENT", (what, web, error)
            continue
        assert web != ("error", 400), (what, "HTTP refused what the client sent")
        np.testing.assert_array_equal(np.float32(web["outputs"]), outputs["predictions"], what)
        answers[what] = outputs["predictions"]
    base = answers["keys and raw strings"]
    for same in ("user as strings of digits", "user as lists of one key"):
        np.testing.assert_array_equal(answers[same], base)
    assert not np.array_equal(answers["a digit string of a hashed feature is hashed"], base)
    assert len(answers) == 8, sorted(answers)


def test_what_only_http_takes(served: dict[str, Any]) -> None:
    """Integers beside strings in one feature (keys already hashed beside raw
    strings): HTTP takes them, the client asks for one kind per feature."""
    client, port = served["client"], served["http"]
    features = {**ROW, "city": [12, "lyon"], "age": [0.25, 0.25]}
    assert "outputs" in over_http(port, "/v1/models/m:predict", {"inputs": features})
    with pytest.raises(TypeError, match="feature 'city': mixes integer keys and strings"):
        client.predict(features)


def test_healthy_is_false_when_unreachable_or_not_serving(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with Client(f"127.0.0.1:{port}", timeout=0.5) as client:
        assert client.healthy() is False
    (tmp_path / "exports").mkdir()
    service = Service([ModelStore(tmp_path / "exports", "m", poll_secs=0).start()])
    server = GrpcServer(service)
    try:
        with Client(f"127.0.0.1:{server.port}", timeout=5) as client:
            assert client.healthy() is False  # no version yet
            with pytest.raises(ServingClientError) as error:
                client.lookup("items", [1])
            assert error.value.code == "UNAVAILABLE"
    finally:
        server.stop()
        service.close()


# -- the client example of docs/serving.md ---------------------------------------------


def doc_example() -> str:
    text = (REPO / "docs" / "serving.md").read_text()
    match = re.search(
        r"<!-- the Python client example[^>]*-->\s*```python\n(.*?)```", text, flags=re.S
    )
    assert match, "docs/serving.md lost its Python client example"
    return match[1]


def test_the_docs_client_example_runs(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    shutil.copy(cert, tmp_path / "ca.pem")
    store = ModelStore(trained["exports"], "ranker", poll_secs=0).start()
    service = Service([store], token="s3cret")
    server = GrpcServer(service, "127.0.0.1", 0, tls=ServerTls.from_files(cert, key))
    code = doc_example().replace('"localhost:8500"', f'"127.0.0.1:{server.port}"')
    code = code.replace('"ca.pem"', repr(str(tmp_path / "ca.pem")))
    try:
        exec(compile(code, "docs/serving.md", "exec"), {})
    finally:
        server.stop()
        service.close()
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[:2] == ["True", "(3, 4) [True, True, False] 1"], printed
    assert lines[-1].startswith("NOT_FOUND model 'ranker' has no table 'nope'"), printed


def test_raw_strings_through_tensorflow_serving_s_api(
    trained: dict[str, Any], served: dict[str, Any]
) -> None:
    """A TensorFlow Serving client sends the string features as DT_STRING
    tensors (lists padded with empty strings) and the ids as int64 (lists
    padded with -1): the trainer's scores; the metadata says which is which."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import (
        get_model_metadata_pb2,
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    raw = trained["raw"]
    expected = trained["session"].run(trained["batch"], "predictions", train=False).reshape(-1)

    def padded(rows: list[list[Any]], pad: Any, dtype: Any) -> Any:
        width = max(1, max(len(r) for r in rows))
        return np.array([[*r, *[pad] * (width - len(r))] for r in rows], dtype)

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "m"
    inputs = {
        "user": np.array([r["user"] for r in raw], np.int64),
        "items": padded([r["items"] for r in raw], -1, np.int64),
        "city": np.array([r["city"].encode() for r in raw], object),
        "tags": padded([[t.encode() for t in r["tags"]] for r in raw], b"", object),
        "age": np.array([[r["age"]] for r in raw], np.float32),
    }
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    with grpc.insecure_channel(f"127.0.0.1:{served['grpc'].port}") as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(request, 30)
        got = tf.make_ndarray(response.outputs["predictions"]).reshape(-1)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
        meta = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        meta.model_spec.name = "m"
        signatures = get_model_metadata_pb2.SignatureDefMap()
        stub.GetModelMetadata(meta, 30).metadata["signature_def"].Unpack(signatures)
        kinds = {
            name: tf.dtypes.as_dtype(info.dtype).name
            for name, info in signatures.signature_def["serving_default"].inputs.items()
        }
        assert kinds == {
            "user": "int64", "items": "int64", "city": "string", "tags": "string", "age": "float32"
        }  # fmt: skip
        request.inputs["user"].CopyFrom(tf.make_tensor_proto(np.array([b"x1"] * len(raw))))
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(request, 30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "feature 'user' takes integer ids" in info.value.details()
