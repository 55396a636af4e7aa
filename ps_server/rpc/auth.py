"""Shared-token authentication of the gRPC and HTTP servers.

A server started with a token file (``--token-file F``: the token is the
file's content, surrounding whitespace dropped) answers only requests that
carry it: the gRPC metadata ``authorization: Bearer <token>``, the HTTP
header ``Authorization: Bearer <token>``. Tokens are compared in constant
time. A job's parameter servers and trainers may all take the file from
the environment instead (``WULIANG_PS_TOKEN_FILE``: one setting for every
pod of a cluster).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "PS_TOKEN_FILE_ENV",
    "bearer",
    "metadata_token",
    "ps_token_file",
    "read_token",
    "token_matches",
]

PS_TOKEN_FILE_ENV = "WULIANG_PS_TOKEN_FILE"


def ps_token_file(environ: Mapping[str, str] | None = None) -> str | None:
    """The parameter servers' token file named by the environment, or None."""
    return (os.environ if environ is None else environ).get(PS_TOKEN_FILE_ENV) or None


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
