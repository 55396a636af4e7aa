"""TensorFlow Serving's gRPC services over a ``Service``, on the port of
wuliang's own (``GrpcServer`` adds them):

* ``tensorflow.serving.PredictionService/Predict``: inputs as
  ``TensorProto`` s by feature name (``tensors``), the tower's outputs back
  by name, with the ``model_spec`` (name, version, signature) that answered;
  ``output_filter`` keeps the outputs it names;
* ``PredictionService/GetModelMetadata``: the ``serving_default``
  ``SignatureDef`` (``metadata_field: "signature_def"``);
* ``tensorflow.serving.ModelService/GetModelStatus``: each version's state;
* ``Classify``, ``Regress``, ``MultiInference`` and
  ``HandleReloadConfigRequest``: UNIMPLEMENTED, with a sentence saying
  what to call instead.

``model_spec.version`` or ``version_label`` picks the version (default: the
newest); an empty ``model_spec.name`` is the server's only model when it
has one. Tokens, limits, metrics and error handling are those of wuliang's
own service (``grpc.server``): errors are gRPC statuses with TensorFlow
Serving's codes and messages naming the bad input, and the server keeps
serving. Requests arrive as bytes and are parsed in the handler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from wuliang.ps_server.storage import ModelDescription
from wuliang.serving.errors import FailedPrecondition, InvalidArgument, ServingError, Unimplemented
from wuliang.serving.grpc.common import abort, on_pool, parse, token
from wuliang.serving.overload import take_shed
from wuliang.serving.service import Service
from wuliang.serving.tfs import answers, proto, tensors

__all__ = ["tfs_handlers"]

log = logging.getLogger("wuliang.serving")

_UNIMPLEMENTED = {
    "Classify": "Classify is not implemented by wuliang: call Predict (the tower's outputs "
    "are the scores)",
    "Regress": "Regress is not implemented by wuliang: call Predict (the tower's outputs are "
    "the values)",
    "MultiInference": "MultiInference is not implemented by wuliang: call Predict once per model",
    "HandleReloadConfigRequest": "HandleReloadConfigRequest is not implemented by wuliang: "
    "edit the model config file and send the server SIGHUP (or let "
    "--model-config-poll-secs find it)",
}


def _spec(spec: Any) -> tuple[str, int | None, str | None]:
    """A ``ModelSpec`` 's model name, version and label."""
    choice = spec.WhichOneof("version_choice")
    version = spec.version.value if choice == "version" else None
    label = spec.version_label if choice == "version_label" else None
    return spec.name, version, label


def _check_signature(name: str, description: ModelDescription) -> None:
    if name and name != description.signature:
        raise FailedPrecondition(
            f'Serving signature key "{name}" not found (signatures: {description.signature})'
        )


class _Methods:
    def __init__(self, service: Service) -> None:
        self.service = service

    def predict(self, request: Any) -> Any:
        name, version, label = _spec(request.model_spec)
        signature_name = request.model_spec.signature_name

        def decode(description: ModelDescription) -> Any:
            _check_signature(signature_name, description)
            return tensors.features(request.inputs, description)

        answer = self.service.predict(name, decode, version=version, label=label)
        outputs = answer.outputs
        if request.output_filter:
            unknown = sorted(set(request.output_filter) - set(outputs))
            if unknown:
                raise InvalidArgument(
                    f"output_filter: output {unknown[0]!r} is not in the signature (outputs: "
                    f"{', '.join(sorted(outputs))})"
                )
            outputs = {n: outputs[n] for n in request.output_filter}
        response = proto.PredictResponse()
        spec = response.model_spec
        spec.name = self.service.store(name).name
        spec.version.value = answer.version
        spec.signature_name = signature_name or "serving_default"
        for output, values in outputs.items():
            tensors.output_tensor(response.outputs[output], values)
        return response

    def metadata(self, request: Any) -> Any:
        fields = list(request.metadata_field)
        if not fields:
            raise InvalidArgument(
                "GetModelMetadataRequest must specify at least one metadata_field "
                f"({answers.METADATA_FIELD!r})"
            )
        for field in fields:
            if field != answers.METADATA_FIELD:
                raise InvalidArgument(
                    f"Metadata field {field} is not supported (fields: {answers.METADATA_FIELD})"
                )
        name, version, label = _spec(request.model_spec)
        found = answers.metadata(self.service, name, version, label)
        signature = found.signature
        definitions = proto.SignatureDefMap()
        definition = definitions.signature_def[signature.name]
        definition.method_name = "tensorflow/serving/predict"
        for target, specs, prefix in (
            (definition.inputs, signature.inputs, f"{signature.name}_"),
            (definition.outputs, signature.outputs, ""),
        ):
            for key, spec in specs.items():
                info = target[key]
                info.name = f"{prefix}{key}:0"
                info.dtype = proto.DataType.values_by_name[spec.dtype].number
                for size in spec.shape:
                    info.tensor_shape.dim.add(size=size)
        response = proto.GetModelMetadataResponse()
        response.model_spec.name = found.name
        response.model_spec.version.value = found.version
        packed = response.metadata[answers.METADATA_FIELD]
        packed.type_url = proto.SIGNATURE_DEF_MAP_URL
        packed.value = definitions.SerializeToString()
        return response

    def status(self, request: Any) -> Any:
        name, version, label = _spec(request.model_spec)
        if not name:
            raise InvalidArgument("GetModelStatusRequest: model_spec.name is required")
        response = proto.GetModelStatusResponse()
        for state in answers.model_status(self.service, name, version, label):
            entry = response.model_version_status.add()
            entry.version = state.version
            entry.state = proto.State.values_by_name[state.state].number
            entry.status.error_code = proto.ErrorCode.values_by_name[state.error_code].number
            entry.status.error_message = state.error_message
        return response


def tfs_handlers(
    service: Service, predict_pool: ThreadPoolExecutor | None = None
) -> list[grpc.GenericRpcHandler]:
    """TensorFlow Serving's two services over ``service`` (see the module
    docstring); predictions run on ``predict_pool`` when given."""
    methods = _Methods(service)

    def call(endpoint: str, message: Any, body: Callable[[Any], Any] | None) -> Any:
        metric = f"tfs.{endpoint}"

        def handle(request: bytes, context: grpc.ServicerContext) -> Any:
            try:
                with service.observed("grpc", metric):
                    shed = take_shed()
                    if shed is not None:
                        raise shed
                    if service.token is not None:
                        service.authorize(token(context))
                    if body is None:
                        raise Unimplemented(_UNIMPLEMENTED[endpoint])
                    return body(parse(message, request)).SerializeToString()
            except ServingError as error:
                abort(context, error)
            except Exception:
                log.exception("gRPC %s failed", metric)
                context.abort(grpc.StatusCode.INTERNAL, f"{endpoint} failed inside the server")

        return grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=None
        )

    predict = call("Predict", proto.PredictRequest, methods.predict)
    on_pool(predict.unary_unary, predict_pool)
    prediction = {
        "Predict": predict,
        "GetModelMetadata": call(
            "GetModelMetadata", proto.GetModelMetadataRequest, methods.metadata
        ),
        **{m: call(m, None, None) for m in ("Classify", "Regress", "MultiInference")},
    }
    model = {
        "GetModelStatus": call("GetModelStatus", proto.GetModelStatusRequest, methods.status),
        "HandleReloadConfigRequest": call("HandleReloadConfigRequest", None, None),
    }
    return [
        grpc.method_handlers_generic_handler(proto.PREDICTION_SERVICE, prediction),
        grpc.method_handlers_generic_handler(proto.MODEL_SERVICE, model),
    ]
