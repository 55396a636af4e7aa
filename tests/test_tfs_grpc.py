"""TensorFlow Serving's gRPC API on wuliang's port, called through the
unmodified ``tensorflow-serving-api`` stubs: predictions equal the trainer's,
metadata describes the features and outputs, status lists the version, and
errors carry TensorFlow Serving's codes with messages naming the input."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tensorflow as tf
from repo_data import REPO
from small_model import trained_export
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from tensorflow_serving.config import model_server_config_pb2

from wuliang.serving.grpc.server import GrpcServer
from wuliang.serving.service import Service
from wuliang.serving.store import ModelStore
from wuliang.serving.tfs import proto


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    trained = trained_export(tmp_path_factory.mktemp("tfs"))
    yield trained
    trained["session"].context.close()


@pytest.fixture(scope="module")
def server(trained: dict[str, Any]) -> Iterator[dict[str, Any]]:
    service = Service([ModelStore(trained["exports"], "m", poll_secs=0).start()], token="tok")
    grpc_server = GrpcServer(service)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    yield {
        "predict": prediction_service_pb2_grpc.PredictionServiceStub(channel),
        "models": model_service_pb2_grpc.ModelServiceStub(channel),
        "channel": channel,
    }
    channel.close()
    grpc_server.stop()
    service.close()


AUTH = (("authorization", "Bearer tok"),)


def padded(batch: Any, name: str) -> np.ndarray:
    """A list feature as TF Serving clients send it: [batch, n], -1 padded."""
    csr = batch.sparse[name]
    lengths = np.diff(csr.offsets)
    out = np.full((len(lengths), max(1, int(lengths.max()))), -1, np.int64)
    for row, (start, end) in enumerate(zip(csr.offsets[:-1], csr.offsets[1:], strict=True)):
        out[row, : end - start] = csr.values[start:end]
    return out


def request_of(batch: Any, model: str = "m", **spec: Any) -> Any:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    request.inputs["user"].CopyFrom(
        tf.make_tensor_proto(batch.sparse["user"].values.astype(np.int64))
    )
    request.inputs["items"].CopyFrom(tf.make_tensor_proto(padded(batch, "items")))
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(batch.dense_feature("x").reshape(-1, 1)))
    return request


def test_the_messages_have_tensorflow_serving_s_fields() -> None:
    """Every field of wuliang's .proto files has the name, number, type and
    label of the field in TensorFlow Serving's (and TensorFlow's) own."""
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2
    from tensorflow.core.protobuf import meta_graph_pb2
    from tensorflow_serving.apis import status_pb2
    from tensorflow_serving.config import file_system_storage_path_source_pb2 as source_pb2

    policy = source_pb2.FileSystemStoragePathSourceConfig.ServableVersionPolicy

    theirs = {
        m.DESCRIPTOR.full_name: m.DESCRIPTOR
        for m in (
            tensor_pb2.TensorProto,
            tensor_shape_pb2.TensorShapeProto,
            tensor_shape_pb2.TensorShapeProto.Dim,
            status_pb2.StatusProto,
            policy,
            policy.Latest,
            policy.Specific,
            meta_graph_pb2.TensorInfo,
            meta_graph_pb2.SignatureDef,
            model_pb2.ModelSpec,
            predict_pb2.PredictRequest,
            predict_pb2.PredictResponse,
            get_model_metadata_pb2.SignatureDefMap,
            get_model_metadata_pb2.GetModelMetadataRequest,
            get_model_metadata_pb2.GetModelMetadataResponse,
            get_model_status_pb2.GetModelStatusRequest,
            get_model_status_pb2.ModelVersionStatus,
            get_model_status_pb2.GetModelStatusResponse,
            model_server_config_pb2.ModelServerConfig,
            model_server_config_pb2.ModelConfigList,
            model_server_config_pb2.ModelConfig,
        )
    }
    checked = 0
    for name, descriptor in theirs.items():
        mine = proto.POOL.FindMessageTypeByName(name)
        for field in mine.fields:
            other = descriptor.fields_by_name[field.name]
            assert (field.number, field.type) == (other.number, other.type), (name, field.name)
            assert field.is_repeated == other.is_repeated, (name, field.name)
            if field.message_type is not None:
                assert field.message_type.full_name == other.message_type.full_name
            checked += 1
    for enum in ("tensorflow.DataType", "tensorflow.serving.ModelVersionStatus.State"):
        mine_enum = proto.POOL.FindEnumTypeByName(enum)
        from google.protobuf import descriptor_pool

        other_enum = descriptor_pool.Default().FindEnumTypeByName(enum)
        for value in mine_enum.values:
            assert other_enum.values_by_name[value.name].number == value.number
    assert checked == 59


def test_the_descriptors_are_the_proto_files_compiled() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from regen_proto import compiled_tfs_descriptors
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert compiled_tfs_descriptors() == proto.descriptors(), "a .proto changed: make protos"


def test_predict_through_the_stub_equals_the_trainer(
    trained: dict[str, Any], server: dict[str, Any]
) -> None:
    session, batch = trained["session"], trained["batch"]
    expected = session.run(batch, "predictions", train=False)
    response = server["predict"].Predict(request_of(batch), 30, metadata=AUTH)
    got = tf.make_ndarray(response.outputs["predictions"])
    np.testing.assert_allclose(got.reshape(-1), expected.reshape(-1), rtol=0, atol=1e-6)
    assert response.model_spec.name == "m" and response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"
    # version 1 asked for by number; typed fields instead of tensor_content;
    # a 1-D dense feature of dim 1
    request = request_of(batch, version=1, signature_name="serving_default")
    users = batch.sparse["user"].values.astype(np.int64)
    request.inputs["user"].Clear()
    request.inputs["user"].dtype = tf.int64.as_datatype_enum
    request.inputs["user"].tensor_shape.dim.add(size=len(users))
    request.inputs["user"].int64_val.extend(users.tolist())
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(batch.dense_feature("x").reshape(-1)))
    again = server["predict"].Predict(request, 30, metadata=AUTH)
    np.testing.assert_array_equal(tf.make_ndarray(again.outputs["predictions"]), got)
    # output_filter
    request.output_filter.append("predictions")
    assert list(server["predict"].Predict(request, 30, metadata=AUTH).outputs) == ["predictions"]


def test_metadata_describes_the_features_and_outputs(server: dict[str, Any]) -> None:
    request = get_model_metadata_pb2.GetModelMetadataRequest()
    request.model_spec.name = "m"
    request.metadata_field.append("signature_def")
    response = server["predict"].GetModelMetadata(request, 30, metadata=AUTH)
    assert response.model_spec.name == "m" and response.model_spec.version.value == 1
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signatures)
    signature = signatures.signature_def["serving_default"]
    assert signature.method_name == "tensorflow/serving/predict"
    shapes = {
        name: (tf.dtypes.as_dtype(info.dtype).name, [d.size for d in info.tensor_shape.dim])
        for name, info in signature.inputs.items()
    }
    assert shapes == {
        "user": ("int64", [-1, -1]),
        "items": ("int64", [-1, -1]),
        "x": ("float32", [-1, 1]),
    }
    (output,) = signature.outputs.values()
    assert tf.dtypes.as_dtype(output.dtype) == tf.float32
    assert output.tensor_shape.dim[0].size == -1


def test_model_status_lists_the_served_version(server: dict[str, Any]) -> None:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "m"
    response = server["models"].GetModelStatus(request, 30, metadata=AUTH)
    (status,) = response.model_version_status
    assert status.version == 1
    assert status.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
    assert status.status.error_code == 0 and status.status.error_message == ""
    request.model_spec.version.value = 9
    with pytest.raises(grpc.RpcError) as info:
        server["models"].GetModelStatus(request, 30, metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "Could not find version 9 of model m"


def _error(call: Any, *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30, metadata=kwargs.pop("metadata", AUTH), **kwargs)
    return info.value.code(), info.value.details()


def test_errors_carry_tensorflow_serving_s_codes(
    trained: dict[str, Any], server: dict[str, Any]
) -> None:
    batch = trained["batch"]
    predict = server["predict"].Predict
    code, message = _error(predict, request_of(batch, "nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert message.startswith("Servable not found for request") and "'nope'" in message
    code, message = _error(predict, request_of(batch, version=7))
    assert code == grpc.StatusCode.NOT_FOUND
    assert message == (
        "Servable not found for request: Specific(m, 7): model 'm' serves version 1, not 7"
    )
    code, message = _error(predict, request_of(batch, version_label="canary"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("Unrecognized servable version label: canary")
    code, message = _error(predict, request_of(batch, signature_name="other"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and '"other" not found' in message
    missing = request_of(batch)
    del missing.inputs["x"]
    assert _error(predict, missing) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "input 'x' is missing (inputs: user, items, x; the metadata, GetModelMetadata, "
        "describes each)",
    )
    wrong = request_of(batch)
    wrong.inputs["user"].CopyFrom(tf.make_tensor_proto(np.ones(batch.size, np.float32)))
    code, message = _error(predict, wrong)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "got DT_FLOAT" in message
    rows = request_of(batch)
    rows.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((3, 1), np.float32)))
    code, message = _error(predict, rows)
    assert message == f"input 'x' has 3 rows (first dimension), input 'user' has {batch.size}"
    assert _error(predict, request_of(batch), metadata=())[0] == grpc.StatusCode.UNAUTHENTICATED
    for method in ("Classify", "Regress", "MultiInference"):
        call = server["channel"].unary_unary(f"/tensorflow.serving.PredictionService/{method}")
        code, message = _error(call, b"")
        assert code == grpc.StatusCode.UNIMPLEMENTED and "call Predict" in message
    metadata = get_model_metadata_pb2.GetModelMetadataRequest()
    metadata.model_spec.name = "m"
    code, message = _error(server["predict"].GetModelMetadata, metadata)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "metadata_field" in message
    garbled = server["channel"].unary_unary("/tensorflow.serving.PredictionService/Predict")
    code, message = _error(garbled, b"\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "PredictRequest" in message
    # and the server still answers
    assert server["predict"].Predict(request_of(batch), 30, metadata=AUTH).outputs
