"""The messages of ``serving.proto``, built at import from its descriptor.

``serving.proto`` (beside this module) is the contract for clients in any
language. Python needs its messages only: they are built here from the
file's compiled descriptor (``FileDescriptorProto``, base64 below) in a
private descriptor pool, so no generated code is checked in and any
protobuf runtime >= 4 works. ``tests/test_serving_proto.py`` compiles
``serving.proto`` with ``grpc_tools.protoc`` and checks it equals this
descriptor; after editing the .proto, regenerate with ``make protos``.

The gRPC methods (``/wuliang.serving.Serving/Lookup`` …) are served and
called through grpcio's generic handlers with these messages' own
serializers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wuliang.ps_server.rpc.messages import decode_descriptor, message_classes

SERVICE = "wuliang.serving.Serving"
METHODS = ("Lookup", "Predict", "Status")

_DESCRIPTOR = (
    "CiJ3dWxpYW5nL3NlcnZpbmcvZ3JwYy9zZXJ2aW5nLnByb3RvEg93dWxpYW5nLnNlcnZpbmciTwoN"
    "TG9va3VwUmVxdWVzdBIUCgVtb2RlbBgBIAEoCVIFbW9kZWwSFAoFdGFibGUYAiABKAlSBXRhYmxl"
    "EhIKBGtleXMYAyABKAxSBGtleXMibAoOTG9va3VwUmVzcG9uc2USGAoHdmVjdG9ycxgBIAEoDFIH"
    "dmVjdG9ycxIUCgVmb3VuZBgCIAEoDFIFZm91bmQSEAoDZGltGAMgASgNUgNkaW0SGAoHdmVyc2lv"
    "bhgEIAEoBFIHdmVyc2lvbiK1AQoHRmVhdHVyZRISCgRuYW1lGAEgASgJUgRuYW1lEhYKBnZhbHVl"
    "cxgCIAEoDFIGdmFsdWVzEhgKB29mZnNldHMYAyABKAxSB29mZnNldHMSGAoHd2VpZ2h0cxgEIAEo"
    "DFIHd2VpZ2h0cxIjCg1zdHJpbmdfdmFsdWVzGAUgASgMUgxzdHJpbmdWYWx1ZXMSJQoOc3RyaW5n"
    "X29mZnNldHMYBiABKAxSDXN0cmluZ09mZnNldHMicAoOUHJlZGljdFJlcXVlc3QSFAoFbW9kZWwY"
    "ASABKAlSBW1vZGVsEhIKBHJvd3MYAiABKA1SBHJvd3MSNAoIZmVhdHVyZXMYAyADKAsyGC53dWxp"
    "YW5nLnNlcnZpbmcuRmVhdHVyZVIIZmVhdHVyZXMiRgoGT3V0cHV0EhIKBG5hbWUYASABKAlSBG5h"
    "bWUSFgoGdmFsdWVzGAIgASgMUgZ2YWx1ZXMSEAoDZGltGAMgASgNUgNkaW0iXgoPUHJlZGljdFJl"
    "c3BvbnNlEjEKB291dHB1dHMYASADKAsyFy53dWxpYW5nLnNlcnZpbmcuT3V0cHV0UgdvdXRwdXRz"
    "EhgKB3ZlcnNpb24YAiABKARSB3ZlcnNpb24iJQoNU3RhdHVzUmVxdWVzdBIUCgVtb2RlbBgBIAEo"
    "CVIFbW9kZWwiXQoLVGFibGVTdGF0dXMSEgoEbmFtZRgBIAEoCVIEbmFtZRIQCgNkaW0YAiABKA1S"
    "A2RpbRISCgRyb3dzGAMgASgEUgRyb3dzEhQKBWJ5dGVzGAQgASgEUgVieXRlcyKdAgoLTW9kZWxT"
    "dGF0dXMSEgoEbmFtZRgBIAEoCVIEbmFtZRIYCgd2ZXJzaW9uGAIgASgEUgd2ZXJzaW9uEhIKBHN0"
    "ZXAYAyABKARSBHN0ZXASNAoGdGFibGVzGAQgAygLMhwud3VsaWFuZy5zZXJ2aW5nLlRhYmxlU3Rh"
    "dHVzUgZ0YWJsZXMSIQoMbWlzc2luZ19rZXlzGAUgASgJUgttaXNzaW5nS2V5cxIcCglwcmVjaXNp"
    "b24YBiABKAlSCXByZWNpc2lvbhIYCgdhcHBsaWVkGAcgASgEUgdhcHBsaWVkEhgKB3JlZnVzZWQY"
    "CCABKARSB3JlZnVzZWQSIQoMbG9va3Vwc19vbmx5GAkgASgJUgtsb29rdXBzT25seSJGCg5TdGF0"
    "dXNSZXNwb25zZRI0CgZtb2RlbHMYASADKAsyHC53dWxpYW5nLnNlcnZpbmcuTW9kZWxTdGF0dXNS"
    "Bm1vZGVsczLtAQoHU2VydmluZxJJCgZMb29rdXASHi53dWxpYW5nLnNlcnZpbmcuTG9va3VwUmVx"
    "dWVzdBofLnd1bGlhbmcuc2VydmluZy5Mb29rdXBSZXNwb25zZRJMCgdQcmVkaWN0Eh8ud3VsaWFu"
    "Zy5zZXJ2aW5nLlByZWRpY3RSZXF1ZXN0GiAud3VsaWFuZy5zZXJ2aW5nLlByZWRpY3RSZXNwb25z"
    "ZRJJCgZTdGF0dXMSHi53dWxpYW5nLnNlcnZpbmcuU3RhdHVzUmVxdWVzdBofLnd1bGlhbmcuc2Vy"
    "dmluZy5TdGF0dXNSZXNwb25zZWIGcHJvdG8z"
)


def descriptor_bytes() -> bytes:
    """The serialized ``FileDescriptorProto`` of ``serving.proto``."""
    return decode_descriptor("".join(_DESCRIPTOR))


_M = message_classes(descriptor_bytes())
LookupRequest = _M["LookupRequest"]
LookupResponse = _M["LookupResponse"]
Feature = _M["Feature"]
PredictRequest = _M["PredictRequest"]
Output = _M["Output"]
PredictResponse = _M["PredictResponse"]
StatusRequest = _M["StatusRequest"]
TableStatus = _M["TableStatus"]
ModelStatus = _M["ModelStatus"]
StatusResponse = _M["StatusResponse"]

REQUESTS = {"Lookup": LookupRequest, "Predict": PredictRequest, "Status": StatusRequest}


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def lookup_response(rows: Any, found: Any, version: int) -> bytes:
    """The wire bytes of ``LookupResponse(vectors=rows, found=found, dim=...,
    version=version)``, as its ``SerializeToString`` writes them, built in one
    copy of the rows (not three: array to bytes, into the message, out of it).

    ``rows``: float32 [n, dim]; ``found``: bool or uint8 [n]."""
    n, dim = rows.shape
    vectors = np.ascontiguousarray(rows, "<f4").view(np.uint8).reshape(-1)  # no copy if so
    flags = np.ascontiguousarray(found).view(np.uint8)
    parts: list[Any] = []
    if n * dim:  # proto3 leaves fields at their default out
        parts += [b"\x0a", _varint(len(vectors)), vectors]
    if n:
        parts += [b"\x12", _varint(n), flags]
    if dim:
        parts += [b"\x18", _varint(dim)]
    if version:
        parts += [b"\x20", _varint(version)]
    return b"".join(parts)


RESPONSES = {"Lookup": LookupResponse, "Predict": PredictResponse, "Status": StatusResponse}


def method_path(method: str) -> str:
    """The gRPC path of a method: ``/wuliang.serving.Serving/<method>``."""
    return f"/{SERVICE}/{method}"
