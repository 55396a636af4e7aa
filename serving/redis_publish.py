"""``wuliang publish``: one version of an export directory put into Redis for a
fleet of serving replicas (``redis_replica``); the keys are in ``redis_keys``.

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
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wuliang.ps_server import parameter_server
from wuliang.ps_server.storage import chain, versions
from wuliang.serving.redis_keys import (
    FORMAT,
    Keys,
    RedisStoreError,
    check_model_name,
    connect,
    display_url,
    fingerprint,
    int_or_none,
    redis,
    row_keys,
)
from wuliang.serving.versions import apply_chain

__all__ = ["PublishResult", "publish"]

log = logging.getLogger("wuliang.serving")

WRITE_BATCH = 5_000  # rows per MSET
PIPELINE_ROWS = 50_000  # rows per pipelined round trip
DELETE_BATCH = 10_000  # keys per SCAN page and per UNLINK
LOCK_TTL_MS = 30_000  # the publisher's lock expires unless renewed (every round trip)


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


def _row_values(weights: np.ndarray) -> list[bytes]:
    """Each row of a float32 [n, dim] array as dim * 4 bytes, little-endian."""
    rows = np.ascontiguousarray(weights, "<f4")
    return rows.view(f"V{rows.shape[1] * 4}").reshape(-1).tolist()


@dataclass
class PublishResult:
    """What ``publish`` did; ``status()`` is its one-line summary."""

    model: str
    version: int
    url: str  # without its password
    _: KW_ONLY
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
        "fingerprint": fingerprint(v.path / "manifest.json" for v in versions_),
    }
    url = display_url(redis_url)
    result = PublishResult(model, number, url, step=top.step)
    client = connect(redis_url, socket_timeout=60)
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
    current = int_or_none(client.get(keys.current))
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
    return {v for v in map(int_or_none, client.mget(names)) if v is not None}


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
