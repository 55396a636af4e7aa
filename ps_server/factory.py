"""One factory maps a parameter-server address to its implementation.

``parameter_server(address)`` is how a ``Context`` (and serving) gets its
parameter server:

* ``"embedded"``: the C++ engine in this process (``Engine``);
* a list of ``"host:port"`` (or one string of them separated by commas):
  remote servers, ``wuliang ps`` processes (``RemoteServer``, loaded on
  first use: it needs grpcio, the ``remote`` extra);
* more kinds (a GPU-cached front) register with ``register_backend``.

A backend is a function ``(address, num_shards) -> ParameterServer``. An
address that no registered backend takes is a ``ValueError`` listing the
forms there are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from wuliang.ps_server.engine import Engine
from wuliang.ps_server.interface import ParameterServer

Backend = Callable[[Any, "int | None"], ParameterServer]

_BACKENDS: dict[str, Backend] = {}
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})")
FORMS = {
    "embedded": '"embedded" (the engine in this process)',
    "remote": '["host:port", ...] or "host:port,host:port" (remote parameter servers)',
}


def register_backend(kind: str, backend: Backend) -> None:
    """Makes ``parameter_server`` build ``kind`` 's servers with ``backend``."""
    _BACKENDS[kind] = backend


def default_shards() -> int:
    """Shards of an embedded engine by default: one per CPU, at most 16."""
    return max(1, min(os.cpu_count() or 1, 16))


def parameter_server(
    address: str | Sequence[str] = "embedded", num_shards: int | None = None
) -> ParameterServer:
    """The parameter server at ``address`` (see the module docstring).

    Args:
        address: ``"embedded"`` or a list of ``"host:port"``.
        num_shards: shard threads of an embedded engine (default: one per
            CPU, at most 16).
    """
    kind = address_kind(address)
    if kind == "remote" and isinstance(address, str):
        address = [a.strip() for a in address.split(",")]
    backend = _BACKENDS.get(kind)
    if backend is None:
        available = ", ".join(FORMS.get(k, repr(k)) for k in _BACKENDS)
        raise ValueError(
            f"ps={address!r}: {kind} parameter servers are not available in this version "
            f"of wuliang; available: {available}"
        )
    return backend(address, num_shards)


def address_kind(address: object) -> str:
    """``"embedded"`` or ``"remote"``; ValueError naming a bad address."""
    if address == "embedded":
        return "embedded"
    if isinstance(address, str) and ":" in address:
        address = [a.strip() for a in address.split(",")]
    if isinstance(address, list | tuple) and address:
        bad = [a for a in address if not isinstance(a, str) or not _valid_host_port(a)]
        if not bad:
            return "remote"
        raise ValueError(
            f"ps={address!r}: {bad[0]!r} is not a host:port (port 1-65535); "
            f"valid forms: {', '.join(FORMS.values())}"
        )
    raise ValueError(
        f"ps={address!r} is not a parameter-server address; valid forms: "
        + ", ".join(FORMS.values())
    )


def _valid_host_port(text: str) -> bool:
    match = _HOST_PORT.fullmatch(text)
    return match is not None and 1 <= int(match["port"]) <= 65535


def _embedded(address: Any, num_shards: int | None) -> ParameterServer:
    return Engine(num_shards if num_shards is not None else default_shards())


def _remote(address: Any, num_shards: int | None) -> ParameterServer:
    if num_shards is not None:
        raise ValueError(
            "num_shards is for an embedded engine: remote servers have the shard threads "
            "they were started with (wuliang ps --threads)"
        )
    try:
        from wuliang.ps_server.remote.client import RemoteServer
    except ImportError as error:  # grpcio is an extra
        raise ImportError(
            f"remote parameter servers need grpcio ({error}): pip install 'wuliang[remote]'"
        ) from error
    from wuliang.ps_server.rpc.auth import ps_token_file, read_token

    token_file = ps_token_file()
    return RemoteServer(list(address), token=read_token(token_file) if token_file else None)


register_backend("embedded", _embedded)
register_backend("remote", _remote)
