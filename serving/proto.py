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
    "Ch13dWxpYW5nL3NlcnZpbmcvc2VydmluZy5wcm90bxIPd3VsaWFuZy5zZXJ2aW5nIk8KDUxvb2t1"
    "cFJlcXVlc3QSFAoFbW9kZWwYASABKAlSBW1vZGVsEhQKBXRhYmxlGAIgASgJUgV0YWJsZRISCgRr"
    "ZXlzGAMgASgMUgRrZXlzImwKDkxvb2t1cFJlc3BvbnNlEhgKB3ZlY3RvcnMYASABKAxSB3ZlY3Rv"
    "cnMSFAoFZm91bmQYAiABKAxSBWZvdW5kEhAKA2RpbRgDIAEoDVIDZGltEhgKB3ZlcnNpb24YBCAB"
    "KARSB3ZlcnNpb24itQEKB0ZlYXR1cmUSEgoEbmFtZRgBIAEoCVIEbmFtZRIWCgZ2YWx1ZXMYAiAB"
    "KAxSBnZhbHVlcxIYCgdvZmZzZXRzGAMgASgMUgdvZmZzZXRzEhgKB3dlaWdodHMYBCABKAxSB3dl"
    "aWdodHMSIwoNc3RyaW5nX3ZhbHVlcxgFIAEoDFIMc3RyaW5nVmFsdWVzEiUKDnN0cmluZ19vZmZz"
    "ZXRzGAYgASgMUg1zdHJpbmdPZmZzZXRzInAKDlByZWRpY3RSZXF1ZXN0EhQKBW1vZGVsGAEgASgJ"
    "UgVtb2RlbBISCgRyb3dzGAIgASgNUgRyb3dzEjQKCGZlYXR1cmVzGAMgAygLMhgud3VsaWFuZy5z"
    "ZXJ2aW5nLkZlYXR1cmVSCGZlYXR1cmVzIkYKBk91dHB1dBISCgRuYW1lGAEgASgJUgRuYW1lEhYK"
    "BnZhbHVlcxgCIAEoDFIGdmFsdWVzEhAKA2RpbRgDIAEoDVIDZGltIl4KD1ByZWRpY3RSZXNwb25z"
    "ZRIxCgdvdXRwdXRzGAEgAygLMhcud3VsaWFuZy5zZXJ2aW5nLk91dHB1dFIHb3V0cHV0cxIYCgd2"
    "ZXJzaW9uGAIgASgEUgd2ZXJzaW9uIiUKDVN0YXR1c1JlcXVlc3QSFAoFbW9kZWwYASABKAlSBW1v"
    "ZGVsIl0KC1RhYmxlU3RhdHVzEhIKBG5hbWUYASABKAlSBG5hbWUSEAoDZGltGAIgASgNUgNkaW0S"
    "EgoEcm93cxgDIAEoBFIEcm93cxIUCgVieXRlcxgEIAEoBFIFYnl0ZXMinQIKC01vZGVsU3RhdHVz"
    "EhIKBG5hbWUYASABKAlSBG5hbWUSGAoHdmVyc2lvbhgCIAEoBFIHdmVyc2lvbhISCgRzdGVwGAMg"
    "ASgEUgRzdGVwEjQKBnRhYmxlcxgEIAMoCzIcLnd1bGlhbmcuc2VydmluZy5UYWJsZVN0YXR1c1IG"
    "dGFibGVzEiEKDG1pc3Npbmdfa2V5cxgFIAEoCVILbWlzc2luZ0tleXMSHAoJcHJlY2lzaW9uGAYg"
    "ASgJUglwcmVjaXNpb24SGAoHYXBwbGllZBgHIAEoBFIHYXBwbGllZBIYCgdyZWZ1c2VkGAggASgE"
    "UgdyZWZ1c2VkEiEKDGxvb2t1cHNfb25seRgJIAEoCVILbG9va3Vwc09ubHkiRgoOU3RhdHVzUmVz"
    "cG9uc2USNAoGbW9kZWxzGAEgAygLMhwud3VsaWFuZy5zZXJ2aW5nLk1vZGVsU3RhdHVzUgZtb2Rl"
    "bHMy7QEKB1NlcnZpbmcSSQoGTG9va3VwEh4ud3VsaWFuZy5zZXJ2aW5nLkxvb2t1cFJlcXVlc3Qa"
    "Hy53dWxpYW5nLnNlcnZpbmcuTG9va3VwUmVzcG9uc2USTAoHUHJlZGljdBIfLnd1bGlhbmcuc2Vy"
    "dmluZy5QcmVkaWN0UmVxdWVzdBogLnd1bGlhbmcuc2VydmluZy5QcmVkaWN0UmVzcG9uc2USSQoG"
    "U3RhdHVzEh4ud3VsaWFuZy5zZXJ2aW5nLlN0YXR1c1JlcXVlc3QaHy53dWxpYW5nLnNlcnZpbmcu"
    "U3RhdHVzUmVzcG9uc2ViBnByb3RvMw=="
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
