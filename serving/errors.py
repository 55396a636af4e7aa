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


class Unavailable(ServingError):
    code = "UNAVAILABLE"
    http_status = 503
