"""Errors a serving request can end with; each transport maps them to its
status (gRPC status code, HTTP status). Messages name the bad input."""

from __future__ import annotations


class ServingError(Exception):
    """A request that cannot be answered; ``code`` is the gRPC status name."""

    code = "INTERNAL"
    http_status = 500

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.code


class InvalidArgument(ServingError):
    code = "INVALID_ARGUMENT"
    http_status = 400


class NotFound(ServingError):
    code = "NOT_FOUND"
    http_status = 404


class Unauthenticated(ServingError):
    code = "UNAUTHENTICATED"
    http_status = 401


class TooLarge(ServingError):
    code = "RESOURCE_EXHAUSTED"
    http_status = 413


class FailedPrecondition(ServingError):
    """The model cannot answer this kind of request (a replica serving
    lookups only has no tower to predict with); HTTP 400, as TensorFlow
    Serving maps FAILED_PRECONDITION."""

    code = "FAILED_PRECONDITION"
    http_status = 400


class Unavailable(ServingError):
    """No version is served yet (or the Redis behind a replica is unreachable)."""

    code = "UNAVAILABLE"
    http_status = 503


class VersionMoved(Unavailable):
    """A lookup at a version the store no longer reads: the caller resolves
    the served version again (``Service.predict`` does). Reaches a client
    only when versions kept switching for ``SWITCH_SECONDS``."""


class Unimplemented(ServingError):
    """A method wuliang does not implement (TensorFlow Serving's Classify,
    Regress, MultiInference); HTTP 501."""

    code = "UNIMPLEMENTED"
    http_status = 501


class Overloaded(ServingError):
    """Shed: the API's queue is full, or the request would wait longer than
    allowed (``wuliang.serving.overload``). RESOURCE_EXHAUSTED over gRPC
    with ``grpc-retry-pushback-ms``, HTTP 503 with ``Retry-After``; a client
    retries it after ``retry_ms`` milliseconds or so."""

    code = "RESOURCE_EXHAUSTED"
    http_status = 503

    def __init__(self, message: str, retry_ms: int) -> None:
        super().__init__(message)
        self.retry_ms = retry_ms
