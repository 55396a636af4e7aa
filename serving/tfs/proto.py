"""TensorFlow Serving's messages, built at import from the compiled
descriptors of the ``.proto`` files beside this module.

Those files are written for wuliang with the field names and numbers of
TensorFlow Serving's and TensorFlow's own messages (``ModelSpec``,
``PredictRequest``, ``TensorProto`` …), so the bytes a TensorFlow Serving
client sends read the same; ``tests/test_tfs_grpc.py`` checks every field
against the ``tensorflow-serving-api`` package. The messages live in a private
descriptor pool: TensorFlow registers its own ``tensorflow.TensorProto`` in
protobuf's default pool, and the two never meet. After editing a ``.proto``,
``make protos`` regenerates the descriptors below.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

from wuliang.ps_server.rpc.messages import decode_descriptor

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"
SIGNATURE_DEF_MAP_URL = "type.googleapis.com/tensorflow.serving.SignatureDefMap"

_DESCRIPTORS = {
    "error_codes": (
        "CiV3dWxpYW5nL3NlcnZpbmcvdGZzL2Vycm9yX2NvZGVzLnByb3RvEhB0ZW5zb3JmbG93LmVycm9y"
        "KrcCCgRDb2RlEgYKAk9LEAASDQoJQ0FOQ0VMTEVEEAESCwoHVU5LTk9XThACEhQKEElOVkFMSURf"
        "QVJHVU1FTlQQAxIVChFERUFETElORV9FWENFRURFRBAEEg0KCU5PVF9GT1VORBAFEhIKDkFMUkVB"
        "RFlfRVhJU1RTEAYSFQoRUEVSTUlTU0lPTl9ERU5JRUQQBxITCg9VTkFVVEhFTlRJQ0FURUQQEBIW"
        "ChJSRVNPVVJDRV9FWEhBVVNURUQQCBIXChNGQUlMRURfUFJFQ09ORElUSU9OEAkSCwoHQUJPUlRF"
        "RBAKEhAKDE9VVF9PRl9SQU5HRRALEhEKDVVOSU1QTEVNRU5URUQQDBIMCghJTlRFUk5BTBANEg8K"
        "C1VOQVZBSUxBQkxFEA4SDQoJREFUQV9MT1NTEA9iBnByb3RvMw=="
    ),
    "tensorflow": (
        "CiR3dWxpYW5nL3NlcnZpbmcvdGZzL3RlbnNvcmZsb3cucHJvdG8SCnRlbnNvcmZsb3cimAEKEFRl"
        "bnNvclNoYXBlUHJvdG8SMgoDZGltGAIgAygLMiAudGVuc29yZmxvdy5UZW5zb3JTaGFwZVByb3Rv"
        "LkRpbVIDZGltEiEKDHVua25vd25fcmFuaxgDIAEoCFILdW5rbm93blJhbmsaLQoDRGltEhIKBHNp"
        "emUYASABKANSBHNpemUSEgoEbmFtZRgCIAEoCVIEbmFtZSK7BAoLVGVuc29yUHJvdG8SKgoFZHR5"
        "cGUYASABKA4yFC50ZW5zb3JmbG93LkRhdGFUeXBlUgVkdHlwZRI/Cgx0ZW5zb3Jfc2hhcGUYAiAB"
        "KAsyHC50ZW5zb3JmbG93LlRlbnNvclNoYXBlUHJvdG9SC3RlbnNvclNoYXBlEiUKDnZlcnNpb25f"
        "bnVtYmVyGAMgASgFUg12ZXJzaW9uTnVtYmVyEiUKDnRlbnNvcl9jb250ZW50GAQgASgMUg10ZW5z"
        "b3JDb250ZW50Eh0KCGhhbGZfdmFsGA0gAygFQgIQAVIHaGFsZlZhbBIfCglmbG9hdF92YWwYBSAD"
        "KAJCAhABUghmbG9hdFZhbBIhCgpkb3VibGVfdmFsGAYgAygBQgIQAVIJZG91YmxlVmFsEhsKB2lu"
        "dF92YWwYByADKAVCAhABUgZpbnRWYWwSHQoKc3RyaW5nX3ZhbBgIIAMoDFIJc3RyaW5nVmFsEiUK"
        "DHNjb21wbGV4X3ZhbBgJIAMoAkICEAFSC3Njb21wbGV4VmFsEh8KCWludDY0X3ZhbBgKIAMoA0IC"
        "EAFSCGludDY0VmFsEh0KCGJvb2xfdmFsGAsgAygIQgIQAVIHYm9vbFZhbBIlCgxkY29tcGxleF92"
        "YWwYDCADKAFCAhABUgtkY29tcGxleFZhbBIhCgp1aW50MzJfdmFsGBAgAygNQgIQAVIJdWludDMy"
        "VmFsEiEKCnVpbnQ2NF92YWwYESADKARCAhABUgl1aW50NjRWYWwimwEKClRlbnNvckluZm8SFAoE"
        "bmFtZRgBIAEoCUgAUgRuYW1lEioKBWR0eXBlGAIgASgOMhQudGVuc29yZmxvdy5EYXRhVHlwZVIF"
        "ZHR5cGUSPwoMdGVuc29yX3NoYXBlGAMgASgLMhwudGVuc29yZmxvdy5UZW5zb3JTaGFwZVByb3Rv"
        "Ugt0ZW5zb3JTaGFwZUIKCghlbmNvZGluZyLvAwoMU2lnbmF0dXJlRGVmEjwKBmlucHV0cxgBIAMo"
        "CzIkLnRlbnNvcmZsb3cuU2lnbmF0dXJlRGVmLklucHV0c0VudHJ5UgZpbnB1dHMSPwoHb3V0cHV0"
        "cxgCIAMoCzIlLnRlbnNvcmZsb3cuU2lnbmF0dXJlRGVmLk91dHB1dHNFbnRyeVIHb3V0cHV0cxIf"
        "CgttZXRob2RfbmFtZRgDIAEoCVIKbWV0aG9kTmFtZRJCCghkZWZhdWx0cxgEIAMoCzImLnRlbnNv"
        "cmZsb3cuU2lnbmF0dXJlRGVmLkRlZmF1bHRzRW50cnlSCGRlZmF1bHRzGlEKC0lucHV0c0VudHJ5"
        "EhAKA2tleRgBIAEoCVIDa2V5EiwKBXZhbHVlGAIgASgLMhYudGVuc29yZmxvdy5UZW5zb3JJbmZv"
        "UgV2YWx1ZToCOAEaUgoMT3V0cHV0c0VudHJ5EhAKA2tleRgBIAEoCVIDa2V5EiwKBXZhbHVlGAIg"
        "ASgLMhYudGVuc29yZmxvdy5UZW5zb3JJbmZvUgV2YWx1ZToCOAEaVAoNRGVmYXVsdHNFbnRyeRIQ"
        "CgNrZXkYASABKAlSA2tleRItCgV2YWx1ZRgCIAEoCzIXLnRlbnNvcmZsb3cuVGVuc29yUHJvdG9S"
        "BXZhbHVlOgI4ASr0AgoIRGF0YVR5cGUSDgoKRFRfSU5WQUxJRBAAEgwKCERUX0ZMT0FUEAESDQoJ"
        "RFRfRE9VQkxFEAISDAoIRFRfSU5UMzIQAxIMCghEVF9VSU5UOBAEEgwKCERUX0lOVDE2EAUSCwoH"
        "RFRfSU5UOBAGEg0KCURUX1NUUklORxAHEhAKDERUX0NPTVBMRVg2NBAIEgwKCERUX0lOVDY0EAkS"
        "CwoHRFRfQk9PTBAKEgwKCERUX1FJTlQ4EAsSDQoJRFRfUVVJTlQ4EAwSDQoJRFRfUUlOVDMyEA0S"
        "DwoLRFRfQkZMT0FUMTYQDhINCglEVF9RSU5UMTYQDxIOCgpEVF9RVUlOVDE2EBASDQoJRFRfVUlO"
        "VDE2EBESEQoNRFRfQ09NUExFWDEyOBASEgsKB0RUX0hBTEYQExIPCgtEVF9SRVNPVVJDRRAUEg4K"
        "CkRUX1ZBUklBTlQQFRINCglEVF9VSU5UMzIQFhINCglEVF9VSU5UNjQQF2IGcHJvdG8z"
    ),
    "apis": (
        "Ch53dWxpYW5nL3NlcnZpbmcvdGZzL2FwaXMucHJvdG8SEnRlbnNvcmZsb3cuc2VydmluZxoZZ29v"
        "Z2xlL3Byb3RvYnVmL2FueS5wcm90bxoeZ29vZ2xlL3Byb3RvYnVmL3dyYXBwZXJzLnByb3RvGiV3"
        "dWxpYW5nL3NlcnZpbmcvdGZzL2Vycm9yX2NvZGVzLnByb3RvGiR3dWxpYW5nL3NlcnZpbmcvdGZz"
        "L3RlbnNvcmZsb3cucHJvdG8iuAEKCU1vZGVsU3BlYxISCgRuYW1lGAEgASgJUgRuYW1lEjcKB3Zl"
        "cnNpb24YAiABKAsyGy5nb29nbGUucHJvdG9idWYuSW50NjRWYWx1ZUgAUgd2ZXJzaW9uEiUKDXZl"
        "cnNpb25fbGFiZWwYBCABKAlIAFIMdmVyc2lvbkxhYmVsEiUKDnNpZ25hdHVyZV9uYW1lGAMgASgJ"
        "Ug1zaWduYXR1cmVOYW1lQhAKDnZlcnNpb25fY2hvaWNlIo8CCg5QcmVkaWN0UmVxdWVzdBI8Cgpt"
        "b2RlbF9zcGVjGAEgASgLMh0udGVuc29yZmxvdy5zZXJ2aW5nLk1vZGVsU3BlY1IJbW9kZWxTcGVj"
        "EkYKBmlucHV0cxgCIAMoCzIuLnRlbnNvcmZsb3cuc2VydmluZy5QcmVkaWN0UmVxdWVzdC5JbnB1"
        "dHNFbnRyeVIGaW5wdXRzEiMKDW91dHB1dF9maWx0ZXIYAyADKAlSDG91dHB1dEZpbHRlchpSCgtJ"
        "bnB1dHNFbnRyeRIQCgNrZXkYASABKAlSA2tleRItCgV2YWx1ZRgCIAEoCzIXLnRlbnNvcmZsb3cu"
        "VGVuc29yUHJvdG9SBXZhbHVlOgI4ASLwAQoPUHJlZGljdFJlc3BvbnNlEjwKCm1vZGVsX3NwZWMY"
        "AiABKAsyHS50ZW5zb3JmbG93LnNlcnZpbmcuTW9kZWxTcGVjUgltb2RlbFNwZWMSSgoHb3V0cHV0"
        "cxgBIAMoCzIwLnRlbnNvcmZsb3cuc2VydmluZy5QcmVkaWN0UmVzcG9uc2UuT3V0cHV0c0VudHJ5"
        "UgdvdXRwdXRzGlMKDE91dHB1dHNFbnRyeRIQCgNrZXkYASABKAlSA2tleRItCgV2YWx1ZRgCIAEo"
        "CzIXLnRlbnNvcmZsb3cuVGVuc29yUHJvdG9SBXZhbHVlOgI4ASLIAQoPU2lnbmF0dXJlRGVmTWFw"
        "EloKDXNpZ25hdHVyZV9kZWYYASADKAsyNS50ZW5zb3JmbG93LnNlcnZpbmcuU2lnbmF0dXJlRGVm"
        "TWFwLlNpZ25hdHVyZURlZkVudHJ5UgxzaWduYXR1cmVEZWYaWQoRU2lnbmF0dXJlRGVmRW50cnkS"
        "EAoDa2V5GAEgASgJUgNrZXkSLgoFdmFsdWUYAiABKAsyGC50ZW5zb3JmbG93LlNpZ25hdHVyZURl"
        "ZlIFdmFsdWU6AjgBIn4KF0dldE1vZGVsTWV0YWRhdGFSZXF1ZXN0EjwKCm1vZGVsX3NwZWMYASAB"
        "KAsyHS50ZW5zb3JmbG93LnNlcnZpbmcuTW9kZWxTcGVjUgltb2RlbFNwZWMSJQoObWV0YWRhdGFf"
        "ZmllbGQYAiADKAlSDW1ldGFkYXRhRmllbGQigwIKGEdldE1vZGVsTWV0YWRhdGFSZXNwb25zZRI8"
        "Cgptb2RlbF9zcGVjGAEgASgLMh0udGVuc29yZmxvdy5zZXJ2aW5nLk1vZGVsU3BlY1IJbW9kZWxT"
        "cGVjElYKCG1ldGFkYXRhGAIgAygLMjoudGVuc29yZmxvdy5zZXJ2aW5nLkdldE1vZGVsTWV0YWRh"
        "dGFSZXNwb25zZS5NZXRhZGF0YUVudHJ5UghtZXRhZGF0YRpRCg1NZXRhZGF0YUVudHJ5EhAKA2tl"
        "eRgBIAEoCVIDa2V5EioKBXZhbHVlGAIgASgLMhQuZ29vZ2xlLnByb3RvYnVmLkFueVIFdmFsdWU6"
        "AjgBImsKC1N0YXR1c1Byb3RvEjYKCmVycm9yX2NvZGUYASABKA4yFi50ZW5zb3JmbG93LmVycm9y"
        "LkNvZGVSCmVycm9yX2NvZGUSJAoNZXJyb3JfbWVzc2FnZRgCIAEoCVINZXJyb3JfbWVzc2FnZSJV"
        "ChVHZXRNb2RlbFN0YXR1c1JlcXVlc3QSPAoKbW9kZWxfc3BlYxgBIAEoCzIdLnRlbnNvcmZsb3cu"
        "c2VydmluZy5Nb2RlbFNwZWNSCW1vZGVsU3BlYyKAAgoSTW9kZWxWZXJzaW9uU3RhdHVzEhgKB3Zl"
        "cnNpb24YASABKANSB3ZlcnNpb24SQgoFc3RhdGUYAiABKA4yLC50ZW5zb3JmbG93LnNlcnZpbmcu"
        "TW9kZWxWZXJzaW9uU3RhdHVzLlN0YXRlUgVzdGF0ZRI3CgZzdGF0dXMYAyABKAsyHy50ZW5zb3Jm"
        "bG93LnNlcnZpbmcuU3RhdHVzUHJvdG9SBnN0YXR1cyJTCgVTdGF0ZRILCgdVTktOT1dOEAASCQoF"
        "U1RBUlQQChILCgdMT0FESU5HEBQSDQoJQVZBSUxBQkxFEB4SDQoJVU5MT0FESU5HECgSBwoDRU5E"
        "EDIidAoWR2V0TW9kZWxTdGF0dXNSZXNwb25zZRJaChRtb2RlbF92ZXJzaW9uX3N0YXR1cxgBIAMo"
        "CzImLnRlbnNvcmZsb3cuc2VydmluZy5Nb2RlbFZlcnNpb25TdGF0dXNSFG1vZGVsX3ZlcnNpb25f"
        "c3RhdHVzYgZwcm90bzM="
    ),
    "config": (
        "CiB3dWxpYW5nL3NlcnZpbmcvdGZzL2NvbmZpZy5wcm90bxISdGVuc29yZmxvdy5zZXJ2aW5nIvED"
        "CiFGaWxlU3lzdGVtU3RvcmFnZVBhdGhTb3VyY2VDb25maWcaywMKFVNlcnZhYmxlVmVyc2lvblBv"
        "bGljeRJsCgZsYXRlc3QYZCABKAsyUi50ZW5zb3JmbG93LnNlcnZpbmcuRmlsZVN5c3RlbVN0b3Jh"
        "Z2VQYXRoU291cmNlQ29uZmlnLlNlcnZhYmxlVmVyc2lvblBvbGljeS5MYXRlc3RIAFIGbGF0ZXN0"
        "EmMKA2FsbBhlIAEoCzJPLnRlbnNvcmZsb3cuc2VydmluZy5GaWxlU3lzdGVtU3RvcmFnZVBhdGhT"
        "b3VyY2VDb25maWcuU2VydmFibGVWZXJzaW9uUG9saWN5LkFsbEgAUgNhbGwScgoIc3BlY2lmaWMY"
        "ZiABKAsyVC50ZW5zb3JmbG93LnNlcnZpbmcuRmlsZVN5c3RlbVN0b3JhZ2VQYXRoU291cmNlQ29u"
        "ZmlnLlNlcnZhYmxlVmVyc2lvblBvbGljeS5TcGVjaWZpY0gAUghzcGVjaWZpYxorCgZMYXRlc3QS"
        "IQoMbnVtX3ZlcnNpb25zGAEgASgNUgtudW1WZXJzaW9ucxoFCgNBbGwaJgoIU3BlY2lmaWMSGgoI"
        "dmVyc2lvbnMYASADKANSCHZlcnNpb25zQg8KDXBvbGljeV9jaG9pY2UigQMKC01vZGVsQ29uZmln"
        "EhIKBG5hbWUYASABKAlSBG5hbWUSGwoJYmFzZV9wYXRoGAIgASgJUghiYXNlUGF0aBIlCg5tb2Rl"
        "bF9wbGF0Zm9ybRgEIAEoCVINbW9kZWxQbGF0Zm9ybRJ9ChRtb2RlbF92ZXJzaW9uX3BvbGljeRgH"
        "IAEoCzJLLnRlbnNvcmZsb3cuc2VydmluZy5GaWxlU3lzdGVtU3RvcmFnZVBhdGhTb3VyY2VDb25m"
        "aWcuU2VydmFibGVWZXJzaW9uUG9saWN5UhJtb2RlbFZlcnNpb25Qb2xpY3kSWQoOdmVyc2lvbl9s"
        "YWJlbHMYCCADKAsyMi50ZW5zb3JmbG93LnNlcnZpbmcuTW9kZWxDb25maWcuVmVyc2lvbkxhYmVs"
        "c0VudHJ5Ug12ZXJzaW9uTGFiZWxzGkAKElZlcnNpb25MYWJlbHNFbnRyeRIQCgNrZXkYASABKAlS"
        "A2tleRIUCgV2YWx1ZRgCIAEoA1IFdmFsdWU6AjgBIkoKD01vZGVsQ29uZmlnTGlzdBI3CgZjb25m"
        "aWcYASADKAsyHy50ZW5zb3JmbG93LnNlcnZpbmcuTW9kZWxDb25maWdSBmNvbmZpZyJwChFNb2Rl"
        "bFNlcnZlckNvbmZpZxJRChFtb2RlbF9jb25maWdfbGlzdBgBIAEoCzIjLnRlbnNvcmZsb3cuc2Vy"
        "dmluZy5Nb2RlbENvbmZpZ0xpc3RIAFIPbW9kZWxDb25maWdMaXN0QggKBmNvbmZpZ2IGcHJvdG8z"
    ),
}


def descriptors() -> dict[str, bytes]:
    """The serialized ``FileDescriptorProto`` of each ``.proto``, by file stem."""
    return {stem: decode_descriptor("".join(parts)) for stem, parts in _DESCRIPTORS.items()}


def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for module in (any_pb2, wrappers_pb2):  # the files the API imports
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb))
    for data in descriptors().values():
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(data))
    return pool


POOL = _pool()


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(name))


TensorProto = _message("tensorflow.TensorProto")
TensorShapeProto = _message("tensorflow.TensorShapeProto")
TensorInfo = _message("tensorflow.TensorInfo")
SignatureDef = _message("tensorflow.SignatureDef")
ModelSpec = _message("tensorflow.serving.ModelSpec")
PredictRequest = _message("tensorflow.serving.PredictRequest")
PredictResponse = _message("tensorflow.serving.PredictResponse")
SignatureDefMap = _message("tensorflow.serving.SignatureDefMap")
GetModelMetadataRequest = _message("tensorflow.serving.GetModelMetadataRequest")
GetModelMetadataResponse = _message("tensorflow.serving.GetModelMetadataResponse")
StatusProto = _message("tensorflow.serving.StatusProto")
GetModelStatusRequest = _message("tensorflow.serving.GetModelStatusRequest")
ModelVersionStatus = _message("tensorflow.serving.ModelVersionStatus")
GetModelStatusResponse = _message("tensorflow.serving.GetModelStatusResponse")
ModelServerConfig = _message("tensorflow.serving.ModelServerConfig")
ModelConfig = _message("tensorflow.serving.ModelConfig")

DataType = POOL.FindEnumTypeByName("tensorflow.DataType")
ErrorCode = POOL.FindEnumTypeByName("tensorflow.error.Code")
State = POOL.FindEnumTypeByName("tensorflow.serving.ModelVersionStatus.State")
