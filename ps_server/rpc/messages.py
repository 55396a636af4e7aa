"""Protocol-buffer messages built from a compiled ``.proto`` descriptor.

Each gRPC API of wuliang (serving, the parameter server) keeps its ``.proto``
as the contract for clients in any language, and Python builds the message
classes at import from the file's compiled ``FileDescriptorProto`` (kept as
base64 beside it; ``make protos`` regenerates it), in a private descriptor
pool: no generated code is checked in, and any protobuf runtime >= 4 works.
"""

from __future__ import annotations

import base64
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["decode_descriptor", "message_classes"]


def decode_descriptor(encoded: str) -> bytes:
    """The serialized ``FileDescriptorProto`` kept as base64."""
    return base64.b64decode(encoded)


def message_classes(descriptor: bytes) -> dict[str, Any]:
    """The message classes of a serialized ``FileDescriptorProto``, by name."""
    proto = descriptor_pb2.FileDescriptorProto.FromString(descriptor)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    file = pool.FindFileByName(proto.name)
    return {
        name: message_factory.GetMessageClass(file.message_types_by_name[name])
        for name in file.message_types_by_name
    }
