"""A Redis copy of a model's embedding tables, for a fleet of serving replicas.

``publish`` puts one version of an export directory (``wuliang.export``)
into Redis; ``RedisStore`` is what each replica looks rows up through. The
command line is ``wuliang publish``.

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

Publishing version V (one publisher at a time: ``wl:M:lock``, waited for):

1. Its chain is applied to a scratch embedded engine (every file verified).
2. Its rows are written with pipelined ``MSET`` s of ``WRITE_BATCH`` rows;
   nothing points at them yet.
3. One Lua script, atomic like MULTI/EXEC, runs after the last row is
   acknowledged: it checks that the lock is still ours, writes ``V:meta``,
   sets ``current`` to V, stamps V in the index and ``PUBLISH`` es V on the
   channel. Readers therefore see V complete or not at all.
4. Retention: the ``retention`` versions most recently made current are kept
   (V first), and so is every version a live replica reports reading; the
   others lose their metadata key first, then their rows (``SCAN MATCH
   wl:M:* COUNT`` + ``UNLINK`` in batches), then their index entry.

Publishing the version already current writes nothing; a version still in
Redis (a rollback within retention) is made current again without
rewriting. Each metadata key records a fingerprint of the export's chain (its
manifests' sha256): a different export published under the same model name
and version number is refused instead of being mixed in.

Switch protocol (``RedisStore``): a replica subscribes to the channel before
it reads the pointer, so no announcement falls between. A background thread
re-reads the pointer when a message arrives, and every ``poll_s`` seconds in
case one was missed; a new pointer loads that version's metadata and swaps
the replica's state (version, tables, caches) in one assignment. The pointer,
not the message, is the truth, so out-of-order announcements and rollbacks
are followed alike. The thread also renews the replica's ``reader`` key,
which keeps publishers from deleting the version it reads.

A lookup takes the state once and reads everything from that version's
namespace: rows from its cache, and the misses with ``MGET`` s that each
start with the version's metadata key. ``MGET`` is atomic, and retention
deletes the metadata key before any row, so an ``MGET`` that returns the
metadata key returned complete rows; one that does not (the version was
retired while the lookup ran) makes the lookup switch to the pointer's
version and start again. Every answer's rows therefore come from the one
version it names.

Cache: per table and version, at most ``cache_rows`` rows in numpy arrays
by slot, a dict from key to slot, and CLOCK eviction done a window of slots
at a time (``_Cache``); keys Redis has no row for are cached too (zeros, not
found). Versions are immutable, so entries never go stale; a switch starts
new, empty caches. A warm lookup is one dict probe per key and numpy
gathers; the misses' distinct keys go to Redis (measured costs:
``docs/export.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import operator
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

try:
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "wuliang.serving.redis_store needs the redis package: pip install 'wuliang[serving]'"
    ) from error

from wuliang.ps_server import LookupResult, UnknownTableError, as_keys, parameter_server
from wuliang.ps_server.storage import chain, versions
from wuliang.serving.versions import apply_chain

__all__ = [
    "FORMAT",
    "PublishResult",
    "RedisStore",
    "RedisStoreError",
    "publish",
]

log = logging.getLogger(__name__)

FORMAT = "wuliang-redis/1"  # the metadata key's format field
WRITE_BATCH = 5_000  # rows per MSET
PIPELINE_ROWS = 50_000  # rows per pipelined round trip
READ_BATCH = 10_000  # keys per MGET (a larger lookup pipelines several)
DELETE_BATCH = 10_000  # keys per SCAN page and per UNLINK
LOCK_TTL_MS = 30_000  # the publisher's lock expires unless renewed (every round trip)
_RETRIES = 5  # attempts of a lookup whose version is retired under it
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")

# Atomic flip: meta, pointer, index, announcement; only while the lock is ours.
# KEYS: lock, meta, current, index. ARGV: token, meta JSON, version, score, channel.
_FLIP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[3])
redis.call('PUBLISH', ARGV[5], ARGV[3])
return 1
"""
# Renews (ARGV[2] ms) or releases (ARGV[2] == '0') the lock if it is ours.
_LOCK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then return redis.call('DEL', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""


class RedisStoreError(OSError):
    """Redis failed or holds something unexpected (unreachable, a refused
    command, a lost lock, a damaged row). An ``OSError``, so that the command
    line reports it as ``wuliang publish: error: ...``; the message names the
    Redis URL (without its password)."""


# -- names ------------------------------------------------------------------------


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


def _row_values(weights: np.ndarray) -> list[bytes]:
    """Each row of a float32 [n, dim] array as dim * 4 bytes, little-endian."""
    rows = np.ascontiguousarray(weights, "<f4")
    return rows.view(f"V{rows.shape[1] * 4}").reshape(-1).tolist()


def _connect(url: str, socket_timeout: float) -> redis.Redis:
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


# -- publishing ---------------------------------------------------------------------


@dataclass
class PublishResult:
    """What ``publish`` did; ``status()`` is its one-line summary."""

    model: str
    version: int
    url: str  # without its password
    step: int = 0
    written: bool = True  # rows written (False: they were in Redis already)
    made_current: bool = True  # False: it was current already, nothing changed
    previous: int | None = None  # the version current before
    rows: dict[str, int] = field(default_factory=dict)
    removed: list[int] = field(default_factory=list)  # versions deleted (retention)
    kept_for_readers: list[int] = field(default_factory=list)  # beyond retention
    seconds: float = 0.0

    def status(self) -> str:
        """One line for logs and cron mail."""
        head = f"publish {self.model} version {self.version}"
        if not self.made_current:
            return f"{head} is already current at {self.url}; nothing written"
        was = f"was {self.previous}" if self.previous is not None else "first version"
        if self.written:
            tables = ", ".join(f"{t} {n:,} rows" for t, n in self.rows.items())
            what = f"{tables} written at step {self.step}"
        else:
            what = "already in Redis, rows not rewritten"
        tail = ""
        if self.removed:
            tail += f"; removed versions {', '.join(map(str, self.removed))}"
        if self.kept_for_readers:
            kept = ", ".join(map(str, self.kept_for_readers))
            tail += f"; kept versions {kept} (replicas read them)"
        return f"{head}: {what}; now current ({was}){tail}; {self.seconds:.2f} s -> {self.url}"


def publish(
    export_dir: str | os.PathLike,
    redis_url: str,
    model: str | None = None,
    version: int | None = None,
    retention: int = 2,
    *,
    lock_wait_s: float = 60.0,
) -> PublishResult:
    """Publishes one version of an export directory to Redis and makes it
    current (see the module docstring for the keys and the protocol).

    Args:
        export_dir: an export directory (``wuliang export``).
        redis_url: ``redis://[:password@]host:port/db`` (or ``rediss://``,
            ``unix://``).
        model: the model's name in Redis keys; default: export_dir's name.
        version: the export version; default: the one ``LATEST`` names.
        retention: how many versions to keep, counting the new one (at least
            1); versions that live replicas read are kept besides.
        lock_wait_s: how long to wait for another publisher of the model.

    Returns:
        What was done (``PublishResult.status()``).

    Raises:
        FileNotFoundError: export_dir is missing or holds no version.
        ValueError: a bad model name, retention or version number; a version
            that export_dir lacks (or whose chain is incomplete or corrupt);
            a version already in Redis from another export.
        RedisStoreError: Redis is unreachable or fails (the message names the URL).
        TimeoutError: another publisher held the model's lock for lock_wait_s.
    """
    start = time.perf_counter()
    if isinstance(retention, bool) or not isinstance(retention, int) or retention < 1:
        raise ValueError(f"retention must be an integer >= 1, got {retention!r}")
    root = Path(export_dir)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise FileNotFoundError(f"export directory {root} {what}")
    if model is None:
        model = root.resolve().name
    check_model_name(model)
    if version is not None:
        numbers = [v for v, _ in versions(root)]
        if version not in numbers:
            have = ", ".join(map(str, numbers)) or "none"
            raise ValueError(f"{root} has no version {version} (versions: {have})")
    versions_ = chain(root, version)
    top = versions_[-1]
    number = top.number
    source = {
        "export_dir": str(root.resolve()),
        "chain": [v.number for v in versions_],
        "fingerprint": _fingerprint(v.path / "manifest.json" for v in versions_),
    }
    url = display_url(redis_url)
    result = PublishResult(model, number, url, step=top.step)
    client = _connect(redis_url, socket_timeout=60)
    keys = Keys(model)
    try:
        # Already current: nothing to do, not even taking the lock (a write).
        if _in_redis(client, keys, source, result, root) is None or result.made_current:
            with _Lock(client, keys, url, lock_wait_s) as lock:
                _publish(client, keys, lock, versions_, source, retention, result, root)
    except redis.RedisError as error:
        raise RedisStoreError(f"Redis at {url}: {error}") from error
    finally:
        client.close()
    result.seconds = time.perf_counter() - start
    return result


def _fingerprint(manifests: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for path in manifests:
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _publish(
    client: redis.Redis,
    keys: Keys,
    lock: _Lock,
    versions_: Sequence[Any],
    source: dict[str, Any],
    retention: int,
    result: PublishResult,
    root: Path,
) -> None:
    """The part of ``publish`` under the lock (fills result in)."""
    number = result.version
    meta = _in_redis(client, keys, source, result, root)
    if meta is not None:
        if not result.made_current:
            return
        result.written = False  # a version kept by retention: flip back to it
    else:
        if client.zscore(keys.index, str(number)) is not None:
            _delete(client, keys, [number])  # leftovers of a publish that died
        meta = _write_version(client, keys, lock, versions_, source, result)
    meta["published"] = time.time()
    try:
        lock.flip(number, json.dumps(meta, sort_keys=True), meta["published"])
    except BaseException:
        if result.written:
            _abandon(client, keys, lock, number)
        raise
    _retire(client, keys, number, retention, result)


def _abandon(client: redis.Redis, keys: Keys, lock: _Lock, number: int) -> None:
    """After a failed write of version number: removes its rows while the
    lock is still ours; else (another publisher may be writing the same
    version now) leaves them listed in the index for a later publish."""
    try:
        if lock.ours():
            _delete(client, keys, [number])
        else:
            client.zadd(keys.index, {str(number): 0}, nx=True)
    except redis.RedisError as error:  # listed in the index already: a later publish removes them
        log.warning("could not remove the rows of version %d at %s: %s", number, lock.url, error)


def _in_redis(
    client: redis.Redis, keys: Keys, source: dict[str, Any], result: PublishResult, root: Path
) -> dict[str, Any] | None:
    """The metadata of result's version if Redis holds it (result then says
    whether it is current); sets result.previous. ValueError if it came from
    another export."""
    number = result.version
    current = _int_or_none(client.get(keys.current))
    result.previous = current
    raw = client.get(keys.meta(number))
    if raw is None:
        return None
    meta = json.loads(raw)
    theirs = meta.get("source", {})
    if theirs.get("fingerprint") != source["fingerprint"]:
        raise ValueError(
            f"Redis at {result.url} already holds version {number} of model "
            f"{keys.model!r} from another export ({theirs.get('export_dir')}); publish "
            f"{root} under another model name"
        )
    result.rows = {t: int(info["rows"]) for t, info in meta["tables"].items()}
    result.step = int(meta.get("step", result.step))
    result.made_current = result.written = current != number
    return meta


def _write_version(
    client: redis.Redis,
    keys: Keys,
    lock: _Lock,
    versions_: Sequence[Any],
    source: dict[str, Any],
    result: PublishResult,
) -> dict[str, Any]:
    """Applies the chain to a scratch engine and writes every row of it;
    returns the version's metadata."""
    top = versions_[-1]
    number = result.version
    tables = {name: entry.dim for name, entry in top.tables.items()}
    with parameter_server("embedded", num_shards=2) as engine:
        apply_chain(engine, Path(top.path).parent, number)  # verifies every file
        client.zadd(keys.index, {str(number): 0})  # listed before any row exists
        try:
            _write_rows(client, keys, lock, engine, number, tables, result)
        except BaseException:
            _abandon(client, keys, lock, number)
            raise
    return {
        "format": FORMAT,
        "model_name": keys.model,
        "version": number,
        "parent": top.parent,
        "kind": top.kind,
        "step": top.step,
        "model": None if top.model is None else top.model.to_dict(),
        "tables": {t: {"dim": dim, "rows": result.rows[t]} for t, dim in tables.items()},
        "source": source,
    }


def _write_rows(
    client: redis.Redis,
    keys: Keys,
    lock: _Lock,
    engine: Any,
    number: int,
    tables: dict[str, int],
    result: PublishResult,
) -> None:
    """Every row of the engine's tables into version number's namespace:
    pipelined MSETs, the lock renewed at every round trip."""
    pipe = client.pipeline(transaction=False)
    pending = 0
    for table, dim in tables.items():
        prefix = keys.row_prefix(number, table)
        written = 0
        for chunk in engine.export(table):
            for begin in range(0, len(chunk.keys), WRITE_BATCH):
                end = min(begin + WRITE_BATCH, len(chunk.keys))
                names = row_keys(prefix, chunk.keys[begin:end])
                values = _row_values(chunk.weights[begin:end].reshape(-1, dim))
                args: list[bytes] = [b""] * (2 * len(names))
                args[0::2] = names
                args[1::2] = values
                pipe.execute_command("MSET", *args)
                pending += len(names)
                written += len(names)
                if pending >= PIPELINE_ROWS:
                    pipe.execute()
                    lock.renew()
                    pending = 0
        result.rows[table] = written
    if pending:
        pipe.execute()


def _retire(
    client: redis.Redis, keys: Keys, current: int, retention: int, result: PublishResult
) -> None:
    """Deletes the versions that retention and the live replicas let go."""
    index = {int(v): score for v, score in client.zrange(keys.index, 0, -1, withscores=True)}
    recent = sorted((v for v, s in index.items() if s > 0), key=lambda v: -index[v])
    keep = {current, *recent[:retention]}
    read = _versions_read(client, keys)
    doomed = sorted(v for v in index if v not in keep and v not in read)
    result.kept_for_readers = sorted(v for v in index if v not in keep and v in read)
    if doomed:
        _delete(client, keys, doomed)
    result.removed = doomed


def _versions_read(client: redis.Redis, keys: Keys) -> set[int]:
    """The versions that live replicas report reading (their reader keys)."""
    names = list(client.scan_iter(match=keys.reader("*"), count=DELETE_BATCH))
    if not names:
        return set()
    return {v for v in map(_int_or_none, client.mget(names)) if v is not None}


def _delete(client: redis.Redis, keys: Keys, numbers: Sequence[int]) -> None:
    """Deletes versions: their metadata keys first (lookups reading them then
    retry elsewhere), then their rows, then their index entries."""
    client.delete(*(keys.meta(v) for v in numbers))
    base = keys.base.encode()
    doomed = {str(v).encode() for v in numbers}
    batch: list[bytes] = []
    for name in client.scan_iter(match=keys.base + "*", count=DELETE_BATCH):
        head = name[len(base) :].split(b":", 1)
        if len(head) == 2 and head[0] in doomed:
            batch.append(name)
            if len(batch) >= DELETE_BATCH:
                client.unlink(*batch)
                batch = []
    if batch:
        client.unlink(*batch)
    client.zrem(keys.index, *(str(v) for v in numbers))


class _Lock:
    """The model's publisher lock: a token with an expiry, renewed while
    held; the flip checks it (a publisher that lost it writes no pointer)."""

    def __init__(self, client: redis.Redis, keys: Keys, url: str, wait_s: float) -> None:
        self.client = client
        self.keys = keys
        self.url = url
        self.wait_s = wait_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.script = client.register_script(_LOCK)
        self.flip_script = client.register_script(_FLIP)

    def __enter__(self) -> _Lock:
        deadline = time.monotonic() + self.wait_s
        pause = 0.05
        while not self.client.set(self.keys.lock, self.token, nx=True, px=LOCK_TTL_MS):
            if time.monotonic() >= deadline:
                holder = self.client.get(self.keys.lock)
                who = holder.decode(errors="replace") if holder else "?"
                raise TimeoutError(
                    f"another publisher of model {self.keys.model!r} ({who}) holds "
                    f"{self.keys.lock} at {self.url}; waited {self.wait_s:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
        return self

    def ours(self) -> bool:
        return self.client.get(self.keys.lock) == self.token.encode()

    def renew(self) -> None:
        if not self.script(keys=[self.keys.lock], args=[self.token, LOCK_TTL_MS]):
            raise self.lost()

    def flip(self, version: int, meta: str, score: float) -> None:
        """Writes the metadata key, the pointer, the index entry and the
        announcement in one atomic script."""
        keys = self.keys
        names = [keys.lock, keys.meta(version), keys.current, keys.index]
        done = self.flip_script(
            keys=names, args=[self.token, meta, str(version), score, keys.channel]
        )
        if not done:
            raise self.lost()

    def lost(self) -> RedisStoreError:
        return RedisStoreError(
            f"lost the publish lock {self.keys.lock} at {self.url} (held more than "
            f"{LOCK_TTL_MS / 1000:g} s without renewal); the pointer was not changed"
        )

    def __exit__(self, *exc: object) -> None:
        try:
            self.script(keys=[self.keys.lock], args=[self.token, 0])
        except redis.RedisError as error:  # it expires by itself
            log.warning("could not release %s at %s: %s", self.keys.lock, self.url, error)


def _int_or_none(value: bytes | None) -> int | None:
    return None if value is None else int(value)


# -- reading --------------------------------------------------------------------------


class _Cache:
    """One table's rows of one version, at most ``capacity`` of them, evicted
    by CLOCK (second chance).

    Rows live in numpy arrays by slot (``rows``, ``found``: a key Redis has
    no row for is cached too, as zeros not found); ``slot_of`` maps a key
    (int) to its slot. A read is one dict probe per key and numpy gathers; a
    hit sets the slot's reference bit. Inserting sweeps the hand over a
    window of slots at once: unreferenced slots are taken, referenced ones
    lose their bit (their second chance), as CLOCK does one slot at a time.
    One lock guards it all: a slot must not change between a read's probe
    and its gather.
    """

    def __init__(self, capacity: int, dim: int) -> None:
        self.capacity = capacity
        self.dim = dim
        self.slot_of: dict[int, int] = {}
        self.keys = np.zeros(capacity, np.uint64)
        self.rows = np.zeros((capacity, dim), np.float32)  # calloc: pages come as used
        self.found = np.zeros(capacity, bool)
        self.ref = np.zeros(capacity, bool)
        self.used = 0  # slots 0 .. used-1 hold a key
        self.used_before = 0  # ``used`` before the latest ``_victims``
        self.hand = 0
        self.lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows float32 [n, dim], found bool [n], positions of the keys not
        cached); the rows and found of those positions are left to fill."""
        n = len(keys)
        with self.lock:
            if not self.slot_of:
                self.misses += n
                return (
                    np.empty((n, self.dim), np.float32),
                    np.empty(n, bool),
                    np.arange(n, dtype=np.intp),
                )
            slots = np.fromiter(map(self.slot_of.get, keys.tolist(), repeat(-1)), np.intp, n)
            hit = slots >= 0
            missing = np.flatnonzero(~hit)
            if len(missing):
                self.ref[slots[hit]] = True
                slots[missing] = 0  # gathered, then overwritten by the caller
            else:
                self.ref[slots] = True
            rows = self.rows[slots]
            found = self.found[slots]
            self.hits += n - len(missing)
            self.misses += len(missing)
        return rows, found, missing

    def insert(self, keys: np.ndarray, rows: np.ndarray, found: np.ndarray) -> None:
        """Caches distinct keys' rows (beyond capacity: the last ones)."""
        if not self.capacity:
            return
        if len(keys) > self.capacity:
            keys, rows, found = (a[-self.capacity :] for a in (keys, rows, found))
        with self.lock:
            if not self.capacity:  # cleared meanwhile (a switch)
                return
            klist = keys.tolist()
            new = np.fromiter(
                map(operator.not_, map(self.slot_of.__contains__, klist)), bool, len(klist)
            )
            if not new.all():  # another lookup cached some meanwhile
                keys, rows, found = keys[new], rows[new], found[new]
                klist = keys.tolist()
            if not klist:
                return
            slots = self._victims(len(klist))
            slot_of = self.slot_of
            for old in self.keys[slots[slots < self.used_before]].tolist():
                del slot_of[old]
            slot_of.update(zip(klist, slots.tolist(), strict=True))
            self.keys[slots] = keys
            self.rows[slots] = rows
            self.found[slots] = found
            self.ref[slots] = False

    def _victims(self, m: int) -> np.ndarray:
        """m distinct slots to fill: free ones first, then CLOCK's choice.
        Sets ``used_before``: slots below it held a key before this call."""
        self.used_before = self.used
        taken: list[np.ndarray] = []
        free = min(self.capacity - self.used, m)
        if free:
            taken.append(np.arange(self.used, self.used + free, dtype=np.intp))
            self.used += free
            m -= free
        ref = self.ref
        span = max(4 * m, 1024)  # slots swept at once; doubles while few are free
        while m:  # at most two laps: the first clears every bit it passes
            end = min(self.hand + span, self.capacity)
            span *= 2
            window = ref[self.hand : end]
            zeros = np.flatnonzero(~window)
            if len(zeros) >= m:
                last = int(zeros[m - 1]) + 1
                chosen = self.hand + zeros[:m]
                window[:last] = False
                self.hand += last
            else:
                chosen = self.hand + zeros
                window[:] = False
                self.hand = end
            ref[chosen] = True  # not chosen twice in this call
            taken.append(chosen)
            m -= len(chosen)
            if self.hand >= self.capacity:
                self.hand = 0
        return np.concatenate(taken) if len(taken) > 1 else taken[0]

    def clear(self) -> None:
        """Empties it for good (its version is no longer read)."""
        with self.lock:
            self.capacity = self.used = 0
            self.slot_of = {}
            self.keys = np.zeros(0, np.uint64)
            self.rows = np.zeros((0, self.dim), np.float32)
            self.found = np.zeros(0, bool)
            self.ref = np.zeros(0, bool)


@dataclass(frozen=True)
class _Table:
    name: str
    dim: int
    prefix: bytes  # of its row keys in the version's namespace
    cache: _Cache


@dataclass(frozen=True)
class _State:
    """One version as a replica reads it; replaced whole at a switch."""

    version: int
    meta: dict[str, Any]
    meta_key: str
    tables: dict[str, _Table]


class RedisStore:
    """Lookups of a published model's rows, for one serving replica.

    Follows the model's current version (see the module docstring): a
    background thread switches on announcements and checks the pointer
    every ``poll_s`` seconds. Thread-safe; close it (or use ``with``).

    Args:
        redis_url: where ``publish`` wrote.
        model: the model's name (``publish`` 's ``model``).
        cache_rows: rows cached per table (0: no cache).
        poll_s: how often the pointer is checked besides announcements.
        version: pin this version instead of following the pointer (a
            canary, a comparison); it must be in Redis.

    Raises:
        RedisStoreError: Redis is unreachable, or the version is not in it.
        LookupError: the model has no published version.
    """

    def __init__(
        self,
        redis_url: str,
        model: str,
        cache_rows: int = 100_000,
        *,
        poll_s: float = 5.0,
        version: int | None = None,
    ) -> None:
        if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 0:
            raise ValueError(f"cache_rows must be an integer >= 0, got {cache_rows!r}")
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
        self.url = display_url(redis_url)
        self.keys = Keys(check_model_name(model))
        self.cache_rows = cache_rows
        self.poll_s = float(poll_s)
        self.pinned = version is not None
        self.reader_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.reader_ttl_ms = int(max(10.0, 3 * self.poll_s) * 1000)
        self.switches = 0
        self.retries = 0  # lookups restarted because their version was retired under them
        self.last_error: BaseException | None = None  # the follower thread's latest
        self._client = _connect(redis_url, socket_timeout=10)
        self._switch_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._heartbeats = True
        pubsub: redis.client.PubSub | None = None
        try:
            if not self.pinned:  # subscribed before the pointer is read: nothing missed
                pubsub = self._subscribe()
            if version is None:
                version = _int_or_none(self._client.get(self.keys.current))
                if version is None:
                    raise LookupError(
                        f"model {model!r} has no published version at {self.url} "
                        f"({self.keys.current} is not set)"
                    )
            self._state = self._load(version)
            self._heartbeat()
        except BaseException as error:
            if pubsub is not None:
                pubsub.close()
            self._client.close()
            if isinstance(error, redis.RedisError):
                raise RedisStoreError(f"Redis at {self.url}: {error}") from error
            raise
        self._thread = threading.Thread(
            target=self._follow, args=(pubsub,), name=f"wuliang-redis-{model}", daemon=True
        )
        self._thread.start()

    # -- reading ----------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version lookups read now."""
        return self._state.version

    def tables(self) -> dict[str, int]:
        """{table: dim} of the current version."""
        return {name: t.dim for name, t in self._state.tables.items()}

    def model_description(self) -> dict[str, Any] | None:
        """The current version's feature description (the manifest's ``model``)."""
        return self._state.meta.get("model")

    def metadata(self) -> dict[str, Any]:
        """The current version's metadata key (a copy)."""
        return json.loads(json.dumps(self._state.meta))

    def stats(self) -> dict[str, Any]:
        """Version, switches, retried lookups, and per table the cache's
        rows, hits and misses."""
        state = self._state
        return {
            "version": state.version,
            "switches": self.switches,
            "retries": self.retries,
            "tables": {
                name: {
                    "cached": len(t.cache.slot_of),
                    "hits": t.cache.hits,
                    "misses": t.cache.misses,
                }
                for name, t in state.tables.items()
            },
        }

    def lookup(self, table: str, keys: Any) -> LookupResult:
        """Rows of keys, all from one version: ``LookupResult(rows float32
        [n, dim], found bool [n], version)``; keys without a row read as
        zeros, not found.

        Raises:
            UnknownTableError: the version has no such table.
            RedisStoreError: Redis failed, or versions kept disappearing.
        """
        keys = as_keys(keys)
        if keys.dtype == np.int64:
            keys = keys.view(np.uint64)
        if self._closed:
            raise RuntimeError(f"the RedisStore of model {self.keys.model!r} is closed")
        for _ in range(_RETRIES):
            state = self._state
            t = state.tables.get(table)
            if t is None:
                known = ", ".join(state.tables) or "none"
                raise UnknownTableError(
                    f"version {state.version} of model {self.keys.model!r} has no table "
                    f"{table!r} (tables: {known})"
                )
            rows, found, missing = t.cache.read(keys)
            if len(missing):
                wanted, where = np.unique(keys[missing], return_inverse=True)
                fetched = self._mget(state, t, wanted)
                if fetched is None:  # the version was retired under us: follow the pointer
                    self.retries += 1
                    self._refresh()
                    continue
                rows[missing] = fetched[0][where]
                found[missing] = fetched[1][where]
                t.cache.insert(wanted, *fetched)
            return LookupResult(rows, found, state.version)
        raise RedisStoreError(
            f"model {self.keys.model!r}: versions kept disappearing at {self.url} during a lookup "
            f"({_RETRIES} attempts)"
        )

    def _mget(
        self, state: _State, t: _Table, keys: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, found) of keys read with MGETs, each led by the version's
        metadata key; None if the version is no longer in Redis."""
        names = row_keys(t.prefix, keys)
        try:
            if len(names) <= READ_BATCH:
                replies = [self._client.execute_command("MGET", state.meta_key, *names)]
            else:
                pipe = self._client.pipeline(transaction=False)
                for begin in range(0, len(names), READ_BATCH):
                    pipe.execute_command("MGET", state.meta_key, *names[begin : begin + READ_BATCH])
                replies = pipe.execute()
        except redis.RedisError as error:
            raise RedisStoreError(f"Redis at {self.url}: {error}") from error
        if any(reply[0] is None for reply in replies):
            return None
        values = replies[0][1:] if len(replies) == 1 else [v for r in replies for v in r[1:]]
        found = np.fromiter(map(operator.is_not, values, repeat(None)), bool, len(values))
        present = [v for v in values if v is not None]
        rows = np.zeros((len(values), t.dim), np.float32)
        if present:
            sizes = set(map(len, present))
            if sizes != {t.dim * 4}:
                raise RedisStoreError(
                    f"rows of table {t.name!r} in version {state.version} at {self.url} have "
                    f"{sorted(sizes)} bytes, expected {t.dim * 4} (dim {t.dim})"
                )
            rows[found] = np.frombuffer(b"".join(present), "<f4").reshape(len(present), t.dim)
        return rows, found

    # -- following ---------------------------------------------------------------

    def _load(self, version: int) -> _State:
        raw = self._client.get(self.keys.meta(version))
        if raw is None:
            raise RedisStoreError(
                f"version {version} of model {self.keys.model!r} is not in Redis at "
                f"{self.url} ({self.keys.meta(version)} is missing)"
            )
        meta = json.loads(raw)
        if meta.get("format") != FORMAT:
            raise RedisStoreError(
                f"{self.keys.meta(version)} at {self.url} has format {meta.get('format')!r}, "
                f"expected {FORMAT!r}"
            )
        tables = {
            name: _Table(
                name,
                int(info["dim"]),
                self.keys.row_prefix(version, name),
                _Cache(self.cache_rows, int(info["dim"])),
            )
            for name, info in meta["tables"].items()
        }
        return _State(version, meta, self.keys.meta(version), tables)

    def _refresh(self) -> bool:
        """Switches to the pointer's version if it is another; True if it did."""
        if self.pinned:
            return False
        with self._switch_lock:
            try:
                target = _int_or_none(self._client.get(self.keys.current))
                if target is None:
                    raise RedisStoreError(
                        f"{self.keys.current} at {self.url} is not set (the model was unpublished)"
                    )
                old = self._state
                if target == old.version:
                    return False
                self._state = self._load(target)
            except redis.RedisError as error:
                raise RedisStoreError(f"Redis at {self.url}: {error}") from error
            self.switches += 1
            for t in old.tables.values():
                t.cache.clear()
            log.info(
                "model %s: switched from version %d to %d", self.keys.model, old.version, target
            )
        self._heartbeat()
        return True

    def _heartbeat(self) -> None:
        """Tells publishers which version this replica reads (its reader key)."""
        if not self._heartbeats:
            return
        try:
            self._client.set(
                self.keys.reader(self.reader_id), self._state.version, px=self.reader_ttl_ms
            )
        except redis.ResponseError as error:  # e.g. a read-only ACL user
            self._heartbeats = False
            log.warning(
                "model %s: cannot write %s at %s (%s); publishers will not see which "
                "version this replica reads",
                self.keys.model,
                self.keys.reader(self.reader_id),
                self.url,
                error,
            )

    def _subscribe(self) -> redis.client.PubSub:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.keys.channel)
        return pubsub

    def _follow(self, pubsub: redis.client.PubSub | None) -> None:
        """The background thread: announcements, the periodic check of the
        pointer, the reader key. Errors are logged and kept in
        ``last_error``; it reconnects with a growing pause."""
        next_check = time.monotonic() + self.poll_s
        pause = 0.1
        while not self._stop.is_set():
            try:
                if pubsub is None and not self.pinned:  # after an error: subscribe, check
                    pubsub = self._subscribe()
                    next_check = 0.0
                wait = min(0.2, max(0.0, next_check - time.monotonic()))  # close() waits <= 0.2 s
                message = None
                if pubsub is None:
                    self._stop.wait(wait)
                else:
                    message = pubsub.get_message(timeout=wait)
                if message is not None or time.monotonic() >= next_check:
                    if not self._refresh():
                        self._heartbeat()
                    next_check = time.monotonic() + self.poll_s
                pause = 0.1
            except (redis.RedisError, RedisStoreError, ValueError) as error:
                self.last_error = error
                log.warning(
                    "model %s: following versions at %s: %s", self.keys.model, self.url, error
                )
                if pubsub is not None:
                    with contextlib.suppress(redis.RedisError):
                        pubsub.close()
                    pubsub = None
                self._stop.wait(pause)
                pause = min(pause * 2, 5.0)
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError):
                pubsub.close()

    def close(self) -> None:
        """Stops the follower thread, removes the reader key and closes the
        connections. Lookups after it raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._client.delete(self.keys.reader(self.reader_id))
        except redis.RedisError as error:  # it expires by itself
            log.warning(
                "could not remove %s at %s: %s", self.keys.reader(self.reader_id), self.url, error
            )
        for t in self._state.tables.values():
            t.cache.clear()
        self._client.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, {self.keys.model!r}, version={self.version})"
