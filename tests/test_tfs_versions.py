"""Versions kept by a policy (TensorFlow Serving's latest / specific / all)
and labels, over both APIs; several models from a model config file,
re-read on SIGHUP while clients predict; TensorFlow Serving's documented
REST examples replayed."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
import tensorflow as tf
from serve_cli import running
from small_model import make_session, reader, write_data
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

import wuliang as wl
from wuliang.reader import ParquetReader
from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.http.server import HttpServer
from wuliang.serving.service import Service
from wuliang.serving.tfs.config import parse_model_config
from wuliang.serving.versioned import VersionedModel, VersionPolicy


def tfs_request(batch: Any, model: str, version: int | None = None, label: str = "") -> Any:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    if version is not None:
        request.model_spec.version.value = version
    if label:
        request.model_spec.version_label = label
    items = batch.sparse["items"]
    lengths = np.diff(items.offsets)
    padded = np.full((batch.size, max(1, int(lengths.max()))), -1, np.int64)
    for row in range(batch.size):
        padded[row, : lengths[row]] = items.values[items.offsets[row] : items.offsets[row + 1]]
    request.inputs["user"].CopyFrom(tf.make_tensor_proto(batch.sparse["user"].values))
    request.inputs["items"].CopyFrom(tf.make_tensor_proto(padded))
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(batch.dense_feature("x")))
    return request


def predicted(stub: Any, request: Any) -> tuple[np.ndarray, int]:
    response = stub.Predict(request, 30)
    return tf.make_ndarray(response.outputs["predictions"]).reshape(-1), (
        response.model_spec.version.value
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("versions")
    files = write_data(root)
    session = make_session()
    session.train(reader(files, 0), steps=3)
    yield {"session": session, "files": files, "root": root}
    session.context.close()


def test_latest_two_keeps_a_pinned_version_while_deltas_apply(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    session, files = trained["session"], trained["files"]
    exports = tmp_path / "exports"
    batch = next(iter(reader(files, 0)))
    session.export(exports, kind="full")
    scores = {1: session.run(batch, "predictions", train=False).reshape(-1)}
    model = VersionedModel(
        exports, "m", policy=VersionPolicy("latest", 2), labels={"stable": 1}, poll_secs=0
    ).start()
    service = Service([model])
    grpc_server, http = GrpcServer(service), HttpServer(service)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    base = f"http://127.0.0.1:{http.port}/v1/models/m"
    try:
        assert model.served_versions() == [1]
        for version in (2, 3):  # deltas
            session.train(reader(files, 0), steps=1)
            assert session.export(exports).version == version
            scores[version] = session.run(batch, "predictions", train=False).reshape(-1)
            if version == 2:
                assert model.refresh() == [1, 2]
                slots = {slot.version: slot for slot in model._slots}
                # both versions at once, by number, by label and by default
                for asked, label, want in ((1, "", 1), (None, "stable", 1), (None, "", 2)):
                    got, number = predicted(stub, tfs_request(batch, "m", asked, label))
                    assert number == want
                    np.testing.assert_allclose(got, scores[want], rtol=0, atol=1e-6)
                status = requests.get(base, timeout=30).json()
                assert [s["version"] for s in status["model_version_status"]] == ["1", "2"]
                metrics = requests.get(f"http://127.0.0.1:{http.port}/metrics", timeout=30).text
                for number in (1, 2):  # each version's own engine
                    assert f'wuliang_version_bytes{{model="m",version="{number}"}}' in metrics
                answer = requests.post(
                    f"{base}/labels/stable:predict",
                    json={"inputs": {"user": [1], "items": [[2, 3]], "x": [0.5]}},
                    timeout=30,
                ).json()
                assert answer["model_version"] == "1"
        assert model.refresh() == [2, 3]
        # version 1's slot rolled forward to 3 (deltas applied), no new engine
        assert {slot.version: slot for slot in model._slots} == {2: slots[2], 3: slots[1]}
        got, number = predicted(stub, tfs_request(batch, "m", 2))
        np.testing.assert_allclose(got, scores[2], rtol=0, atol=1e-6)
        got, number = predicted(stub, tfs_request(batch, "m"))
        assert number == 3
        np.testing.assert_allclose(got, scores[3], rtol=0, atol=1e-6)
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(tfs_request(batch, "m", 1), 30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == (
            "Servable not found for request: Specific(m, 1): model 'm' serves versions 2, 3, not 1"
        )
        gone = requests.post(
            f"{base}/labels/stable:predict", json={"instances": [{"user": 1}]}, timeout=30
        )
        assert gone.status_code == 404 and "(label 'stable')" in gone.json()["error"]
        meta = requests.get(f"{base}/versions/2/metadata", timeout=30).json()
        assert meta["model_spec"] == {"name": "m", "signature_name": "", "version": "2"}
        inputs = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]
        assert inputs["x"]["dtype"] == "DT_FLOAT" and inputs["user"]["dtype"] == "DT_INT64"
        # a corrupt delta is refused; the policy keeps what it had
        session.train(reader(files, 0), steps=1)
        result = session.export(exports)
        part = next((result.path / "tables" / "users").glob("part-*.arrow"))
        part.write_bytes(part.read_bytes()[:-10] + b"0123456789")
        assert model.refresh() == [2, 3] and model.counters.refused == 1
        # a new policy: version 2 only
        model.reconfigure(VersionPolicy("specific", versions=(2,)), {"stable": 2})
        assert model.served_versions() == [2]
        assert predicted(stub, tfs_request(batch, "m", label="stable"))[1] == 2
        with pytest.raises(ValueError, match="never serves"):
            model.reconfigure(VersionPolicy("specific", versions=(2,)), {"canary": 3})
        bad = requests.get(f"{base}/versions/x1", timeout=30)
        assert bad.status_code == 400 and "must be a number" in bad.json()["error"]
    finally:
        channel.close()
        http.stop()
        grpc_server.stop()
        service.close()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("model_config_list {}", "names no model"),
        ("model_config_list { config { base_path: 'x' } }", "config 1: name is required"),
        ("model_config_list { config { name: 'a' } }", "base_path is required"),
        (
            "model_config_list { config { name: 'a' base_path: 'x' logging_config {} } }",
            'has no field named "logging_config"',
        ),
        (
            "model_config_list { config { name: 'a' base_path: 'x' model_platform: 'onnx' } }",
            "model_platform 'onnx' is not served here",
        ),
        (
            "model_config_list { config { name: 'a' base_path: 'x' "
            "model_version_policy { specific { } } } }",
            "specific needs at least one version",
        ),
        (
            "model_config_list { config { name: 'a' base_path: 'x' "
            "model_version_policy { specific { versions: 3 } } "
            "version_labels { key: 'stable' value: 4 } } }",
            "label 'stable' names version 4, which the policy (specific [3]) never serves",
        ),
        (
            "model_config_list { config { name: 'a' base_path: 'x' } "
            "config { name: 'a' base_path: 'y' } }",
            "two models are named 'a'",
        ),
    ],
)
def test_a_bad_model_config_names_the_problem(text: str, error: str) -> None:
    with pytest.raises(ValueError, match="model config cfg") as info:
        parse_model_config(text, "cfg")
    assert error in str(info.value)


def test_a_model_config_parses_as_tensorflow_serving_writes_it() -> None:
    (a, b) = parse_model_config(
        """
        model_config_list: {
          config: {
            name: "a", base_path: "s3://bucket/a", model_platform: "tensorflow",
            model_version_policy: { latest: { num_versions: 2 } }
            version_labels { key: "stable" value: 3 }
          }
          config { name: "b" base_path: "/models/b" model_version_policy { all {} } }
        }
        """
    )
    assert (a.name, a.base_path, str(a.policy), a.labels) == (
        "a",
        "s3://bucket/a",
        "latest 2",
        {"stable": 3},
    )
    assert (b.name, str(b.policy), b.labels) == ("b", "all", {})


def write_config(path: Path, models: dict[str, Path]) -> None:
    path.write_text(
        "model_config_list {\n"
        + "".join(
            f'  config {{ name: "{name}" base_path: "{folder}" model_platform: "tensorflow" }}\n'
            for name, folder in models.items()
        )
        + "}\n"
    )


def test_serve_a_model_config_and_follow_it_on_sighup(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    """Two models from one file; SIGHUP adds a third and removes one while a
    client predicts the first without a failed request."""
    session, files = trained["session"], trained["files"]
    folders = {name: tmp_path / name for name in ("a", "b", "c")}
    session.export(folders["a"], kind="full")
    shutil.copytree(folders["a"], folders["b"])
    shutil.copytree(folders["a"], folders["c"])
    batch = next(iter(reader(files, 0)))
    want = session.run(batch, "predictions", train=False).reshape(-1)
    config = tmp_path / "models.config"
    write_config(config, {"a": folders["a"], "b": folders["b"]})
    with running(tmp_path, "--model-config", str(config)) as server:
        assert server.banner.startswith(
            f"serving models 'a' version 1, 'b' version 1 from {config}: grpc 127.0.0.1:"
        )
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc}")
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for name in ("a", "b"):
            got, _ = predicted(stub, tfs_request(batch, name))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        failures: list[str] = []
        done = threading.Event()
        calls = [0]

        def predict_a() -> None:
            while not done.is_set():
                try:
                    predicted(stub, tfs_request(batch, "a"))
                    calls[0] += 1
                except grpc.RpcError as error:
                    failures.append(f"{error.code()}: {error.details()}")

        client = threading.Thread(target=predict_a)
        client.start()
        try:
            write_config(config, {"a": folders["a"], "c": folders["c"]})
            server.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 60
            while server.rest("GET", "/v1/models/b")[0] != 404:
                assert time.monotonic() < deadline, server.log_text()[-3000:]
                time.sleep(0.2)
            got, _ = predicted(stub, tfs_request(batch, "c"))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
            # a broken file changes nothing
            config.write_text("model_config_list { config { name: 'a' } }")
            server.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while "base_path is required" not in server.log_text():
                assert time.monotonic() < deadline, server.log_text()[-3000:]
                time.sleep(0.2)
            assert server.rest("GET", "/v1/models/c")[0] == 200
        finally:
            done.set()
            client.join()
            channel.close()
        assert failures == [] and calls[0] > 0
        log = server.log_text()
        assert "added or replaced: c; removed: b" in log


def test_tensorflow_serving_s_documented_rest_examples(tmp_path: Path) -> None:
    """The requests of TensorFlow Serving's REST API page, replayed against a
    model with one dense input ``x``: status, predict with ``instances`` and
    ``inputs`` (bare values: the model has one input), metadata, an unknown
    model's 404 and ``:regress`` (501 here)."""
    data = tmp_path / "d.parquet"
    x = np.random.default_rng(0).normal(size=256).astype(np.float32)
    pq.write_table(pa.table({"x": x, "label": (x > 0).astype(np.float32)}), data)
    keras.utils.set_random_seed(1)
    session = wl.Session(
        keras.Sequential([keras.layers.Dense(1)]), [wl.DenseFeature("x")], wl.Context()
    )
    try:
        session.train(ParquetReader(str(data), 64, ["x"], label="label"), steps=2)
        exports = tmp_path / "half_plus_three"
        session.export(exports)
        three = tmp_path / "three.parquet"
        rows = {"x": np.float32([1, 2, 5]), "label": np.float32([0, 0, 0])}
        pq.write_table(pa.table(rows), three)
        (batch,) = ParquetReader(str(three), 3, ["x"], label="label")
        want = session.run(batch, "predictions", train=False).reshape(-1)
    except BaseException:
        session.context.close()
        raise
    service = Service([VersionedModel(exports, poll_secs=0).start()])
    http = HttpServer(service)
    url = f"http://127.0.0.1:{http.port}/v1/models"
    try:
        status = requests.get(f"{url}/half_plus_three", timeout=30).json()
        assert status == {
            "model_version_status": [
                {"version": "1", "state": "AVAILABLE",
                 "status": {"error_code": "OK", "error_message": ""}}
            ]
        }  # fmt: skip
        rows_answer = requests.post(
            f"{url}/half_plus_three:predict", data='{"instances": [1.0,2.0,5.0]}', timeout=30
        ).json()
        columns = requests.post(
            f"{url}/half_plus_three:predict", json={"inputs": [1.0, 2.0, 5.0]}, timeout=30
        ).json()
        assert len(rows_answer["predictions"]) == 3
        assert columns["outputs"] == rows_answer["predictions"]
        np.testing.assert_allclose(rows_answer["predictions"], want, rtol=0, atol=1e-6)
        meta = requests.get(f"{url}/half_plus_three/metadata", timeout=30).json()
        signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
        assert signature["inputs"]["x"]["tensor_shape"]["dim"] == [
            {"size": "-1", "name": ""},
            {"size": "1", "name": ""},
        ]
        assert signature["method_name"] == "tensorflow/serving/predict"
        missing = requests.post(f"{url}/half:predict", data='{"instances": [1.0,5.0]}', timeout=30)
        assert missing.status_code == 404
        assert missing.json()["error"].startswith("Servable not found for request: Latest(half)")
        regress = requests.post(
            f"{url}/half_plus_three:regress",
            json={"signature_name": "tensorflow/serving/regress", "examples": [{"x": 1.0}]},
            timeout=30,
        )
        assert regress.status_code == 501 and ":predict" in regress.json()["error"]
    finally:
        http.stop()
        service.close()
        session.context.close()
