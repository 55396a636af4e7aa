"""Addresses and listening errors shared by the gRPC and HTTP servers."""

from __future__ import annotations

import errno
import os
import socket

__all__ = ["grpc_address", "listen_error"]


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as grpcio takes it (an IPv6 host in brackets)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def listen_error(host: str, port: int, server: str, cause: BaseException | None = None) -> OSError:
    """An ``OSError`` saying that ``server`` (``"gRPC"``, ``"HTTP"``) cannot
    listen on host:port, and why: the operating system's reason when binding
    a plain socket there fails too (the port is in use, the address is not
    this machine's …)."""
    reason: OSError | None = cause if isinstance(cause, OSError) else None
    if reason is None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            socket.create_server((host.strip("[]"), port), family=family).close()
        except OSError as error:
            reason = error
    code = reason.errno if reason is not None and reason.errno else errno.EADDRNOTAVAIL
    why = os.strerror(code) if reason is not None and reason.errno else str(reason or "")
    if code == errno.EADDRINUSE:
        why = "the port is in use (another server listens there)"
    where = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    error = OSError(f"{server} cannot listen on {where}: {why or 'binding failed'}")
    error.errno = code  # str(error) stays the message alone
    return error
