"""Shared-token authentication of the gRPC and HTTP servers.

A server started with a token file (``--token-file F``: the token is the
file's content, surrounding whitespace dropped) answers only requests that
carry it: the gRPC metadata ``authorization: Bearer <token>``, the HTTP
header ``Authorization: Bearer <token>``. Tokens are compared in constant
time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

__all__ = ["bearer", "metadata_token", "read_token", "token_matches"]


def read_token(path: str | Path) -> str:
    """The token in a file; OSError naming an unreadable file, ValueError an empty one."""
    path = Path(path)
    try:
        token = path.read_text().strip()
    except OSError as error:
        raise OSError(f"token file {path} cannot be read: {error.strerror or error}") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def token_matches(given: str | None, expected: str | None) -> bool:
    """Whether a request's token is the server's (any, when it has none)."""
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries a token."""
    return (("authorization", f"Bearer {token}"),)


def metadata_token(metadata: Iterable[tuple[str, str]]) -> str | None:
    """The token of a gRPC call's ``authorization: Bearer <token>`` metadata."""
    for key, value in metadata:
        if key == "authorization":
            return value.removeprefix("Bearer ").strip()
    return None
