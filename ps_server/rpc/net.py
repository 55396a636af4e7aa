"""Addresses and listening errors shared by the gRPC and HTTP servers."""

from __future__ import annotations

import errno
import os
import socket
from typing import overload

__all__ = ["grpc_address", "listen_error"]


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as grpcio takes it (an IPv6 host in brackets)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


@overload
def listen_error(
    host: str, port: int, server: str, cause: BaseException | None = None
) -> OSError: ...


@overload
def listen_error(
    host: str, port: int, server: str, cause: None = None, *, probe_only: bool
) -> OSError | None: ...


def listen_error(
    host: str,
    port: int,
    server: str,
    cause: BaseException | None = None,
    *,
    probe_only: bool = False,
) -> OSError | None:
    """An ``OSError`` saying that ``server`` (``"gRPC"``, ``"HTTP"``) cannot
    listen on host:port, and why: ``cause``, or the operating system's
    reason when binding a plain socket there fails too (the port is in use,
    the address is not this machine's …). ``probe_only``: None when a plain
    socket can bind there."""
    reason: OSError | None = cause if isinstance(cause, OSError) else None
    if reason is None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            socket.create_server((host.strip("[]"), port), family=family).close()
        except OSError as error:
            reason = error
        else:
            if probe_only:
                return None
    code = reason.errno if reason is not None and reason.errno else errno.EADDRNOTAVAIL
    why = os.strerror(code) if reason is not None and reason.errno else str(reason or "")
    if code == errno.EADDRINUSE:
        why = "the port is in use (another server listens there)"
    where = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    error = OSError(f"{server} cannot listen on {where}: {why or 'binding failed'}")
    error.errno = code  # str(error) stays the message alone
    return error
