"""One factory maps a parameter-server address to its implementation.

``parameter_server(address)`` is how a ``Context`` (and serving) gets its
parameter server:

* ``"embedded"``: the C++ engine in this process (``Engine``);
* a list of ``"host:port"`` (or one string of them separated by commas):
  remote servers, ``wuliang ps`` processes (``RemoteServer``, loaded on
  first use: it needs grpcio, the ``remote`` extra): the token from
  ``WULIANG_PS_TOKEN_FILE``, and a server that stays unreachable longer
  than ``WULIANG_PS_RETRY_SECONDS`` (default 60) fails the call naming it,
  which ends a training job with that error instead of a hang;
* ``"<address>?gpu_cache_rows=N"``: a GPU hot cache of N rows per table
  (``CachedServer``, ``wuliang.ps_server.cache``) in front of the server at
  ``<address>`` (either form above, as one string); more options after
  ``&``: ``policy=stats|lru``, ``half_life=<batches>``,
  ``xp=auto|numpy|cupy``, ``sync_steps=k`` (shared rows, merged every k
  training pulls: a job of several trainers); e.g.
  ``"embedded?gpu_cache_rows=1000000"``,
  ``"h1:7001,h2:7002?gpu_cache_rows=1000000&policy=lru"``;
* ``"<address>?host_cache_rows=N"``: the same cache with its rows in this
  process's memory (numpy): a host cache in front of remote servers, which
  serves a trainer's hot rows without a round trip;
* ``"embedded?disk_dir=D&memory_gb=G"``: the engine with its disk tier
  (``Engine(disk_dir=, memory_bytes=)``, docs/disk_tier.md): rows beyond
  G GiB of RAM live in row files under D; the cache's options may follow
  (``"embedded?disk_dir=/ssd&memory_gb=4&gpu_cache_rows=100000"``);
* more kinds register with ``register_backend``.

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
    "cached": '"<address>?gpu_cache_rows=N" (a GPU hot cache in front of either)',
}
CACHE_OPTIONS = ("gpu_cache_rows", "host_cache_rows", "policy", "half_life", "xp", "sync_steps")
ENGINE_OPTIONS = ("disk_dir", "memory_gb")  # an embedded engine's, after "?"


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
        address: ``"embedded"``, a list of ``"host:port"``, or either
            followed by ``?gpu_cache_rows=N`` (a GPU hot cache in front).
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
    """``"embedded"``, ``"remote"`` or ``"cached"``; ValueError naming a
    bad address."""
    if address == "embedded":
        return "embedded"
    if isinstance(address, str) and "?" in address:
        base, engine, cache = _split_options(address)
        if engine and base != "embedded":
            raise ValueError(
                f"ps={address!r}: {', '.join(engine)} are an embedded engine's options "
                "(remote servers take wuliang ps --disk-dir / --memory-gb)"
            )
        if not cache:
            return "embedded"
        address_kind(cache_address(address)[0])
        return "cached"
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


def _split_options(address: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """(the address before "?", its engine options, its cache options);
    ValueError naming an unknown one."""
    base, _, query = address.partition("?")
    engine: dict[str, str] = {}
    cache: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        name, sep, value = item.partition("=")
        if sep and name in ENGINE_OPTIONS:
            engine[name] = value
        elif sep and name in CACHE_OPTIONS:
            cache[name] = value
        else:
            known = ", ".join(f"{o}=..." for o in ENGINE_OPTIONS + CACHE_OPTIONS)
            raise ValueError(f"ps={address!r}: {item!r} is not an option (options: {known})")
    return base, engine, cache


def engine_options(address: str) -> dict[str, Any]:
    """``Engine``'s keyword arguments from ``"embedded?disk_dir=D&memory_gb=G"``
    (``disk_dir``, ``memory_bytes``); ValueError naming a bad value."""
    _, engine, _ = _split_options(address)
    options: dict[str, Any] = {}
    if "memory_gb" in engine:
        try:
            gb = float(engine["memory_gb"])
        except ValueError:
            gb = -1.0
        if not 0 < gb < float("inf"):
            raise ValueError(f"ps={address!r}: memory_gb must be a number > 0, got "
                             f"{engine['memory_gb']!r}")  # fmt: skip
        options["memory_bytes"] = int(gb * (1 << 30))
    if "disk_dir" in engine:
        if not engine["disk_dir"]:
            raise ValueError(f"ps={address!r}: disk_dir is empty")
        options["disk_dir"] = engine["disk_dir"]
    elif options:
        raise ValueError(f"ps={address!r}: memory_gb is the disk tier's budget: it needs disk_dir")
    return options


def cache_address(address: str) -> tuple[str, dict[str, Any]]:
    """``"<address>?gpu_cache_rows=N&..."`` split into the inner address
    (with its engine options, if any) and ``CachedServer``'s keyword
    arguments (``rows``, ``policy``, ...); ValueError naming a bad option."""
    base, engine, cache = _split_options(address)
    inner = base + ("?" + "&".join(f"{k}={v}" for k, v in engine.items()) if engine else "")
    if "gpu_cache_rows" in cache and "host_cache_rows" in cache:
        raise ValueError(f"ps={address!r}: give gpu_cache_rows or host_cache_rows, not both")
    if "host_cache_rows" in cache and cache.setdefault("xp", "numpy") != "numpy":
        raise ValueError(f"ps={address!r}: a host cache's rows are numpy arrays (xp=numpy)")
    options: dict[str, Any] = {}
    for name, value in cache.items():
        try:
            if name in ("gpu_cache_rows", "host_cache_rows"):
                options["rows"] = int(value)
            elif name == "sync_steps":
                options["sync_steps"] = int(value)
            elif name == "half_life":
                options["half_life"] = float(value)
            else:
                options[name] = value
        except ValueError:
            raise ValueError(f"ps={address!r}: {name} must be a number, got {value!r}") from None
    if "rows" not in options:
        raise ValueError(
            f"ps={address!r}: a cached address needs gpu_cache_rows=N or host_cache_rows=N"
        )
    return inner, options


def _valid_host_port(text: str) -> bool:
    match = _HOST_PORT.fullmatch(text)
    return match is not None and 1 <= int(match["port"]) <= 65535


def _embedded(address: Any, num_shards: int | None) -> ParameterServer:
    options = engine_options(address) if isinstance(address, str) and "?" in address else {}
    return Engine(num_shards if num_shards is not None else default_shards(), **options)


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
    return RemoteServer(
        list(address),
        token=read_token(token_file) if token_file else None,
        retry_seconds=_seconds_from_env(RETRY_ENV, 60.0),
    )


RETRY_ENV = "WULIANG_PS_RETRY_SECONDS"  # how long a server may stay away (default 60)


def _seconds_from_env(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0, got {text!r}")
    return value


def _cached(address: Any, num_shards: int | None) -> ParameterServer:
    from wuliang.ps_server.cache import CachedServer

    inner_address, options = cache_address(address)
    inner = parameter_server(inner_address, num_shards)
    try:
        return CachedServer(inner, **options)
    except BaseException:
        inner.close()
        raise


register_backend("embedded", _embedded)
register_backend("remote", _remote)
register_backend("cached", _cached)
