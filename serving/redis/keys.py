"""The Redis key layout of published models, shared by the publisher
(``redis.publish``) and the replicas (``redis.replica``); no I/O here (that
is ``redis.nodes``). The design is explained in ``docs/export.md`` (Redis
store for a fleet); in short:

* **Generations of cells.** A full version starts a generation ``G`` (a
  counter). Each row lives in one *cell* per generation, a string holding
  the row's recent values, newest first, each labelled with the version
  that wrote it: an entry is that version (uint64 little-endian; with the
  top bit set it is a tombstone: the row was removed, its floats are zeros)
  and the row's ``dim`` float32 (``redis.cells``). A delta adds an
  entry to the cells of the rows it changed or removed, and nothing else.
  A replica reading version ``V`` takes each cell's newest entry labelled
  ``<= V``: a tombstone or no entry reads as not found. Versions are a
  chain within a generation (a delta is written only on top of the
  generation's newest version), so "newest ``<= V``" is exactly V's row.
* **Shards and hash tags.** A generation's rows are split into ``S``
  shards by a hash of the key; shard ``s`` has its own hash tag, chosen so
  that its cluster slot falls in the ``s``-th of ``S`` equal slot ranges
  (the shards spread evenly over a cluster whose nodes own equal ranges).
  All keys of a shard are in one slot, so one ``MGET`` reads any number of
  them; a lookup sends one ``MGET`` per shard it needs, pipelined per node.
  One Redis uses ``S = 1``.
* **Sentinels.** Version ``V`` has a sentinel key in every shard, written
  before ``V`` becomes current and deleted first when it retires. Every
  ``MGET`` of a lookup starts with its shard's sentinel: a reply that holds
  it holds cells in which ``V``'s entries are still present (they are
  trimmed only after every sentinel of ``V`` is gone).

Keys (``M`` the model; ``{M}`` its control tag, ``{T}`` a shard's tag)::

    wl:{M}:current            the version replicas read (a decimal string)
    wl:{M}:V:meta             JSON: format, version, parent, kind, step, model,
                              tables {name: {dim, rows}}, generation, shard tags,
                              chain (the generation's versions up to V), published,
                              source (export dir, chain, fingerprint)
    wl:{M}:index              sorted set of versions with keys in Redis; score:
                              when each was last made current (0: being written)
    wl:{M}:generation         hash: version -> its generation (set before any row)
    wl:{M}:generations        counter of generations
    wl:{M}:lock               the publisher's lock (token, expires unless renewed)
    wl:{M}:readers            sorted set of live replicas, "<version>:<id>" scored
                              by when each expires (ms, the server's clock)
    channel wl:{M}:versions   pub/sub: a version number when it becomes current
    wl:{T}:g<G>:<table>:<8 bytes>   a cell: the key's uint64 little-endian
    wl:{T}:v<V>               version V's sentinel in shard T
    wl:{T}:v<V>:touched:<table>     list of chunks: the keys of shard T that delta V
                              wrote or removed (uint64 little-endian), for retention
"""

from __future__ import annotations

import binascii
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

try:
    import redis
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "wuliang's Redis store needs the redis package: pip install 'wuliang[serving]'"
    ) from error

__all__ = [
    "FORMAT",
    "SLOTS",
    "TOMBSTONE",
    "Keys",
    "Layout",
    "RedisStoreError",
    "cell_dtype",
    "check_model_name",
    "display_url",
    "fingerprint",
    "int_or_none",
    "redis",
    "row_keys",
    "slot_of",
]

FORMAT = "wuliang-redis/2"  # the metadata key's format field
SLOTS = 16384  # Redis Cluster hash slots
TOMBSTONE = np.uint64(1 << 63)  # an entry's version with this bit: the row was removed
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_SPREAD = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing of keys onto shards


class RedisStoreError(OSError):
    """Redis failed or holds something unexpected (unreachable, a refused
    command, a lost lock, a damaged row). An ``OSError``, so that the command
    line reports it as ``wuliang publish: error: ...``; the message names the
    Redis URL (without its password) or the cluster node."""


def display_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (for messages)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    creds, hosts = parts.netloc.rsplit("@", 1)
    user, sep, _ = creds.partition(":")
    if not sep:
        return url
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def check_model_name(model: str) -> str:
    """The model name, if usable in keys (letters, digits, ``_ . -``)."""
    if not _MODEL_NAME.match(model):
        raise ValueError(
            f"model name {model!r} cannot be used in Redis keys: use letters, digits, "
            "'_', '.' and '-', starting with a letter or digit"
        )
    return model


def slot_of(name: bytes | str) -> int:
    """The cluster hash slot of a key name (of its ``{tag}`` if it has one)."""
    if isinstance(name, str):
        name = name.encode()
    start = name.find(b"{")
    if start > -1:
        end = name.find(b"}", start + 1)
        if end > start + 1:
            name = name[start + 1 : end]
    return binascii.crc_hqx(name, 0) % SLOTS


@dataclass(frozen=True)
class Keys:
    """The control keys of one model (see the module docstring)."""

    model: str

    @property
    def base(self) -> str:
        return f"wl:{{{self.model}}}:"

    @property
    def slot(self) -> int:
        """The hash slot of every control key."""
        return slot_of(self.base)

    @property
    def current(self) -> str:
        return f"{self.base}current"

    @property
    def index(self) -> str:
        return f"{self.base}index"

    @property
    def generation(self) -> str:
        return f"{self.base}generation"

    @property
    def generations(self) -> str:
        return f"{self.base}generations"

    @property
    def lock(self) -> str:
        return f"{self.base}lock"

    @property
    def readers(self) -> str:
        return f"{self.base}readers"

    @property
    def channel(self) -> str:
        return f"{self.base}versions"

    def meta(self, version: int) -> str:
        return f"{self.base}{version}:meta"


def shard_tags(model: str, shards: int) -> list[str]:
    """One hash tag per shard: tag ``s`` hashes into the ``s``-th of
    ``shards`` equal ranges of the cluster's slots."""
    tags = []
    for s in range(shards):
        low, high = s * SLOTS // shards, (s + 1) * SLOTS // shards
        j = 0
        while not low <= slot_of(f"{model}:{s}:{j}") < max(high, low + 1):
            j += 1
        tags.append(f"{model}:{s}:{j}")
    return tags


@dataclass(frozen=True)
class Layout:
    """Where one generation's rows are: its number and its shards' tags."""

    generation: int
    tags: tuple[str, ...]
    slots: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", np.array([slot_of(t) for t in self.tags], np.int64))

    @classmethod
    def new(cls, model: str, generation: int, shards: int) -> Layout:
        return cls(generation, tuple(shard_tags(model, shards)))

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Layout:
        return cls(int(meta["generation"]), tuple(meta["tags"]))

    @property
    def shards(self) -> int:
        return len(self.tags)

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        """Each key's shard (a fixed hash of the uint64 key)."""
        if self.shards == 1:
            return np.zeros(len(keys), np.int64)
        spread = (keys.astype(np.uint64) * _SPREAD) >> np.uint64(32)
        return (spread % np.uint64(self.shards)).astype(np.int64)

    def cell_prefix(self, shard: int, table: str) -> bytes:
        return f"wl:{{{self.tags[shard]}}}:g{self.generation}:{table}:".encode()

    def sentinel(self, shard: int, version: int) -> bytes:
        return f"wl:{{{self.tags[shard]}}}:v{version}".encode()

    def touched(self, shard: int, version: int, table: str) -> bytes:
        return f"wl:{{{self.tags[shard]}}}:v{version}:touched:{table}".encode()

    def cell_pattern(self, model: str) -> str:
        """SCAN MATCH pattern of every cell of the generation."""
        return f"wl:{{{model}:*}}:g{self.generation}:*"


def cell_dtype(dim: int) -> np.dtype:
    """One entry of a cell: the version that wrote it (TOMBSTONE bit: removed), the row."""
    return np.dtype([("version", "<u8"), ("row", "<f4", (dim,))])


def row_keys(prefix: bytes, keys: np.ndarray) -> list[bytes]:
    """``prefix`` + each key's 8 bytes little-endian, vectorised."""
    width = len(prefix)
    packed = np.empty(len(keys), dtype=[("prefix", f"V{width}"), ("key", "<u8")])
    packed["prefix"] = np.void(prefix)
    packed["key"] = keys
    return packed.view(f"V{width + 8}").tolist()


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
