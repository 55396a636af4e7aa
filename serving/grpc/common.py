"""What both gRPC services of a serving process share (wuliang's own,
``grpc.server``, and TensorFlow Serving's, ``tfs.grpc``): the request's
token, the pool a handler runs on, parsing request bytes inside the
handler (so bytes that are not the message are INVALID_ARGUMENT, not
grpcio's INTERNAL), and an error as a status (its message cut to fit; a
shed request's retry pushback)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from wuliang.ps_server.rpc.auth import metadata_token
from wuliang.serving.errors import InvalidArgument, Overloaded, ServingError

__all__ = ["MAX_DETAILS_BYTES", "PUSHBACK_KEY", "abort", "details", "on_pool", "parse", "token"]

MAX_DETAILS_BYTES = 2000  # of an error's message (see details())
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's retry pushback: when to retry a shed call


def abort(context: grpc.ServicerContext, error: ServingError) -> None:
    """Ends the call with ``error`` 's status; a shed request (``Overloaded``)
    also carries ``grpc-retry-pushback-ms``."""
    if isinstance(error, Overloaded):
        context.set_trailing_metadata(((PUSHBACK_KEY, str(error.retry_ms)),))
    context.abort(getattr(grpc.StatusCode, error.code), details(error))


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


def on_pool(handler: Any, pool: ThreadPoolExecutor | None) -> None:
    """Runs ``handler`` on ``pool`` instead of the server's: grpcio runs a
    handler carrying this attribute there (grpc._server.
    _select_thread_pool_for_behavior); a grpcio without it runs every call
    on the server's pool, slower and never shed."""
    if pool is not None:
        handler.experimental_thread_pool = pool
