"""The Redis key layout of published models, shared by the publisher
(``redis_publish``) and the replicas (``redis_replica``).

Key layout (``M`` the model name, ``V`` a version number, all under ``wl:M:``)::

    wl:M:current              the version replicas read (a decimal string): the pointer
    wl:M:V:meta               JSON: format, version, parent, kind, step, model (the
                              manifest's feature description), tables {name: {dim,
                              rows}}, published (unix time), source (export dir,
                              chain, fingerprint)
    wl:M:V:<table>:<8 bytes>  one row: dim float32 little-endian (dim * 4 bytes);
                              the key's uint64, 8 bytes little-endian (binary-safe)
    wl:M:index                sorted set of the versions that may have keys in
                              Redis; score: when each was last made current (0:
                              being written, never current)
    wl:M:lock                 the publisher's lock (token, expires unless renewed)
    wl:M:reader:<id>          one per live replica: the version it reads (expires)
    channel wl:M:versions     pub/sub: a version number when it becomes current

A version's namespace holds every row of the version (its chain applied: a
full version and its deltas), so a lookup never combines versions; it is
immutable once its metadata key exists.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np

try:
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "wuliang's Redis store needs the redis package: pip install 'wuliang[serving]'"
    ) from error

__all__ = [
    "FORMAT",
    "Keys",
    "RedisStoreError",
    "check_model_name",
    "connect",
    "display_url",
    "fingerprint",
    "int_or_none",
    "row_keys",
]

FORMAT = "wuliang-redis/1"  # the metadata key's format field
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


class RedisStoreError(OSError):
    """Redis failed or holds something unexpected (unreachable, a refused
    command, a lost lock, a damaged row). An ``OSError``, so that the command
    line reports it as ``wuliang publish: error: ...``; the message names the
    Redis URL (without its password)."""


def display_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def check_model_name(model: str) -> str:
    """The model name, if usable in keys (letters, digits, ``_ . -``)."""
    if not _MODEL_NAME.match(model):
        raise ValueError(
            f"model name {model!r} cannot be used in Redis keys: use letters, digits, "
            "'_', '.' and '-', starting with a letter or digit"
        )
    return model


@dataclass(frozen=True)
class Keys:
    """The Redis names of one model (see the module docstring)."""

    model: str

    @property
    def base(self) -> str:
        return f"wl:{self.model}:"

    @property
    def current(self) -> str:
        return f"{self.base}current"

    @property
    def index(self) -> str:
        return f"{self.base}index"

    @property
    def lock(self) -> str:
        return f"{self.base}lock"

    @property
    def channel(self) -> str:
        return f"{self.base}versions"

    def meta(self, version: int) -> str:
        return f"{self.base}{version}:meta"

    def row_prefix(self, version: int, table: str) -> bytes:
        return f"{self.base}{version}:{table}:".encode()

    def reader(self, reader_id: str) -> str:
        return f"{self.base}reader:{reader_id}"


def row_keys(prefix: bytes, keys: np.ndarray) -> list[bytes]:
    """``prefix`` + each key's 8 bytes little-endian, vectorised."""
    width = len(prefix)
    packed = np.empty(len(keys), dtype=[("prefix", f"V{width}"), ("key", "<u8")])
    packed["prefix"] = np.void(prefix)
    packed["key"] = keys
    return packed.view(f"V{width + 8}").tolist()


def connect(url: str, socket_timeout: float) -> redis.Redis:
    """A client of url, checked with PING; RedisStoreError naming url if not."""
    try:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=5,
            socket_timeout=socket_timeout,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        )
    except ValueError as error:  # a URL redis-py cannot parse
        raise ValueError(f"bad Redis URL {display_url(url)!r}: {error}") from None
    try:
        client.ping()
    except redis.RedisError as error:
        client.close()
        raise RedisStoreError(f"cannot reach Redis at {display_url(url)}: {error}") from None
    return client


def fingerprint(manifests: Iterable[Path]) -> str:
    """The sha256 of an export chain's manifests' sha256s (which export a
    published version came from)."""
    digest = hashlib.sha256()
    for path in manifests:
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def int_or_none(value: bytes | None) -> int | None:
    """A Redis reply of a decimal number, None for none."""
    return None if value is None else int(value)
