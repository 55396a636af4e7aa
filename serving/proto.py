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

import base64
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "wuliang.serving.Serving"
METHODS = ("Lookup", "Predict", "Status")

_DESCRIPTOR = (
    "Ch13dWxpYW5nL3NlcnZpbmcvc2VydmluZy5wcm90bxIPd3VsaWFuZy5zZXJ2aW5nIk8KDUxvb2t1"
    "cFJlcXVlc3QSFAoFbW9kZWwYASABKAlSBW1vZGVsEhQKBXRhYmxlGAIgASgJUgV0YWJsZRISCgRr"
    "ZXlzGAMgASgMUgRrZXlzImwKDkxvb2t1cFJlc3BvbnNlEhgKB3ZlY3RvcnMYASABKAxSB3ZlY3Rv"
    "cnMSFAoFZm91bmQYAiABKAxSBWZvdW5kEhAKA2RpbRgDIAEoDVIDZGltEhgKB3ZlcnNpb24YBCAB"
    "KARSB3ZlcnNpb24iaQoHRmVhdHVyZRISCgRuYW1lGAEgASgJUgRuYW1lEhYKBnZhbHVlcxgCIAEo"
    "DFIGdmFsdWVzEhgKB29mZnNldHMYAyABKAxSB29mZnNldHMSGAoHd2VpZ2h0cxgEIAEoDFIHd2Vp"
    "Z2h0cyJwCg5QcmVkaWN0UmVxdWVzdBIUCgVtb2RlbBgBIAEoCVIFbW9kZWwSEgoEcm93cxgCIAEo"
    "DVIEcm93cxI0CghmZWF0dXJlcxgDIAMoCzIYLnd1bGlhbmcuc2VydmluZy5GZWF0dXJlUghmZWF0"
    "dXJlcyJGCgZPdXRwdXQSEgoEbmFtZRgBIAEoCVIEbmFtZRIWCgZ2YWx1ZXMYAiABKAxSBnZhbHVl"
    "cxIQCgNkaW0YAyABKA1SA2RpbSJeCg9QcmVkaWN0UmVzcG9uc2USMQoHb3V0cHV0cxgBIAMoCzIX"
    "Lnd1bGlhbmcuc2VydmluZy5PdXRwdXRSB291dHB1dHMSGAoHdmVyc2lvbhgCIAEoBFIHdmVyc2lv"
    "biIlCg1TdGF0dXNSZXF1ZXN0EhQKBW1vZGVsGAEgASgJUgVtb2RlbCJdCgtUYWJsZVN0YXR1cxIS"
    "CgRuYW1lGAEgASgJUgRuYW1lEhAKA2RpbRgCIAEoDVIDZGltEhIKBHJvd3MYAyABKARSBHJvd3MS"
    "FAoFYnl0ZXMYBCABKARSBWJ5dGVzIvoBCgtNb2RlbFN0YXR1cxISCgRuYW1lGAEgASgJUgRuYW1l"
    "EhgKB3ZlcnNpb24YAiABKARSB3ZlcnNpb24SEgoEc3RlcBgDIAEoBFIEc3RlcBI0CgZ0YWJsZXMY"
    "BCADKAsyHC53dWxpYW5nLnNlcnZpbmcuVGFibGVTdGF0dXNSBnRhYmxlcxIhCgxtaXNzaW5nX2tl"
    "eXMYBSABKAlSC21pc3NpbmdLZXlzEhwKCXByZWNpc2lvbhgGIAEoCVIJcHJlY2lzaW9uEhgKB2Fw"
    "cGxpZWQYByABKARSB2FwcGxpZWQSGAoHcmVmdXNlZBgIIAEoBFIHcmVmdXNlZCJGCg5TdGF0dXNS"
    "ZXNwb25zZRI0CgZtb2RlbHMYASADKAsyHC53dWxpYW5nLnNlcnZpbmcuTW9kZWxTdGF0dXNSBm1v"
    "ZGVsczLtAQoHU2VydmluZxJJCgZMb29rdXASHi53dWxpYW5nLnNlcnZpbmcuTG9va3VwUmVxdWVz"
    "dBofLnd1bGlhbmcuc2VydmluZy5Mb29rdXBSZXNwb25zZRJMCgdQcmVkaWN0Eh8ud3VsaWFuZy5z"
    "ZXJ2aW5nLlByZWRpY3RSZXF1ZXN0GiAud3VsaWFuZy5zZXJ2aW5nLlByZWRpY3RSZXNwb25zZRJJ"
    "CgZTdGF0dXMSHi53dWxpYW5nLnNlcnZpbmcuU3RhdHVzUmVxdWVzdBofLnd1bGlhbmcuc2Vydmlu"
    "Zy5TdGF0dXNSZXNwb25zZWIGcHJvdG8z"
)


def descriptor_bytes() -> bytes:
    """The serialized ``FileDescriptorProto`` of ``serving.proto``."""
    return base64.b64decode("".join(_DESCRIPTOR))


def _messages() -> dict[str, Any]:
    proto = descriptor_pb2.FileDescriptorProto.FromString(descriptor_bytes())
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    file = pool.FindFileByName(proto.name)
    return {
        name: message_factory.GetMessageClass(file.message_types_by_name[name])
        for name in file.message_types_by_name
    }


_M = _messages()
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
