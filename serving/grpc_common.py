"""What both gRPC services of a serving process share (wuliang's own,
``grpc_server``, and TensorFlow Serving's, ``tfs.grpc``): the request's
token, parsing request bytes inside the handler (so bytes that are not the
message are INVALID_ARGUMENT, not grpcio's INTERNAL), and an error's
message cut to fit a status."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from wuliang.ps_server.rpc.auth import metadata_token
from wuliang.serving.errors import InvalidArgument, ServingError

__all__ = ["MAX_DETAILS_BYTES", "details", "parse", "token"]

MAX_DETAILS_BYTES = 2000  # of an error's message (see details())


def token(context: grpc.ServicerContext) -> str | None:
    return metadata_token(context.invocation_metadata())


def details(error: ServingError) -> str:
    """The error's message as a status' details: cut to ``MAX_DETAILS_BYTES``
    of UTF-8, so that a message quoting a huge input (a model name of 10,000
    characters) still fits the trailers' 8 KiB (percent-encoded, a byte may
    take 3); a longer one would reach the client as RESOURCE_EXHAUSTED."""
    message = str(error)
    data = message.encode()
    if len(data) <= MAX_DETAILS_BYTES:
        return message
    return data[: MAX_DETAILS_BYTES - 3].decode(errors="ignore") + "..."


def parse(message: Any, data: bytes) -> Any:
    """The request message of ``data``; INVALID_ARGUMENT (not grpcio's
    INTERNAL) when the bytes are not one."""
    try:
        return message.FromString(data)
    except DecodeError as error:
        raise InvalidArgument(
            f"the request is not a valid {message.DESCRIPTOR.name} ({len(data)} bytes): {error}"
        ) from None
