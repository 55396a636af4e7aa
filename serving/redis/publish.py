"""``wuliang publish``: one version of an export directory put into Redis (one
Redis or a Redis Cluster: ``redis.nodes``) for a fleet of serving replicas
(``redis.replica``); the key layout and the cells are in ``redis.keys`` and
``redis.cells``.

Publishing version V (one publisher at a time: ``wl:{M}:lock``, waited for):

1. Versions that a dead publisher left half written are removed first.
2. **A delta on top of Redis.** When V is a delta and Redis holds, with
   the same export fingerprint, a version A of V's chain that is the
   newest version of its generation, only what the deltas after A hold is
   written: V's entries are added to the cells of the rows they changed or
   removed (read, rewritten and trimmed: ``redis.cells.rewrite``), after
   the list of those keys (``touched``, for retention) and before V's
   sentinels. Nothing a replica reads at another version changes.
3. **Otherwise a full copy**: V's chain is applied to a scratch engine
   (every file verified) and every row is written as a one-entry cell of a
   new generation, with pipelined ``MSET`` s per shard (one pipelined round
   trip per node), then V's sentinels.
4. One Lua script on the control slot, atomic like MULTI/EXEC, runs after
   the last write is acknowledged: it checks that the lock is still ours,
   writes ``V:meta``, sets ``current`` to V, stamps V in the index and
   ``PUBLISH`` es V. Readers see V complete or not at all.
5. Retention: the ``retention`` versions most recently made current are kept
   (V first), and so is every version a live replica reports reading
   (``wl:{M}:readers``); the others lose their metadata key and sentinels
   first, then what only they needed: a generation no kept version belongs
   to is deleted (``SCAN MATCH`` on every node + ``UNLINK``), and in a kept
   generation the cells a retired delta touched are trimmed. Redis
   therefore holds about one copy per live generation plus the entries of
   the retained deltas.

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
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wuliang.ps_server import parameter_server
from wuliang.ps_server.storage import Version, chain, versions
from wuliang.serving.redis.cells import rewrite
from wuliang.serving.redis.keys import (
    FORMAT,
    TOMBSTONE,
    Keys,
    Layout,
    RedisStoreError,
    cell_dtype,
    check_model_name,
    display_url,
    fingerprint,
    int_or_none,
    redis,
    row_keys,
    slot_of,
)
from wuliang.serving.redis.nodes import Command, Deployment, connect_deployment, pack
from wuliang.serving.versions import apply_chain

__all__ = ["PublishResult", "default_shards", "live_readers", "publish"]

log = logging.getLogger("wuliang.serving")

WRITE_BATCH = 5_000  # rows per MSET
PIPELINE_ROWS = 50_000  # rows per pipelined round trip (per batch of commands)
DELTA_BATCH = 20_000  # rows read and rewritten per round of a delta
DELETE_BATCH = 10_000  # keys per SCAN page and per UNLINK
TOUCHED_CHUNK = 1 << 20  # keys per element of a touched list
LOCK_TTL_MS = 30_000  # the publisher's lock expires unless renewed (every round trip)
SHARDS_PER_NODE = 8  # a cluster's default shards per master (one Redis: 1 shard)


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
# The live readers: drops those expired (the server's clock), returns the rest.
_READERS = """
local t = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t[1] * 1000 + math.floor(t[2] / 1000))
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


@dataclass
class PublishResult:
    """What ``publish`` did; ``status()`` is its one-line summary."""

    model: str
    version: int
    url: str  # without its password
    _: KW_ONLY
    step: int = 0
    kind: str = "full"  # how it was written: "full" (a copy) or "delta" (on top of `base`)
    base: int | None = None  # the version a delta was written on
    written: bool = True  # rows written (False: they were in Redis already)
    made_current: bool = True  # False: it was current already, nothing changed
    previous: int | None = None  # the version current before
    rows: dict[str, int] = field(default_factory=dict)  # rows written (a full copy: all)
    removed_rows: dict[str, int] = field(default_factory=dict)  # a delta's removed rows
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
            gone = sum(self.removed_rows.values())
            if self.kind == "delta":
                what = f"delta on {self.base}: {tables}"
                what += f" and {gone:,} removed" if gone else ""
                what += f" written at step {self.step}"
            else:
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


def default_shards(deployment: Deployment) -> int:
    """Shards of a new generation: 1 on one Redis, ``SHARDS_PER_NODE`` per master."""
    return 1 if not deployment.cluster else SHARDS_PER_NODE * len(deployment.masters())


def publish(
    export_dir: str | os.PathLike,
    redis_url: str,
    model: str | None = None,
    version: int | None = None,
    retention: int = 2,
    *,
    lock_wait_s: float = 60.0,
    shards: int | None = None,
    full: bool = False,
) -> PublishResult:
    """Publishes one version of an export directory to Redis and makes it
    current (see the module docstring for the protocol).

    Args:
        export_dir: an export directory (``wuliang export``).
        redis_url: ``redis://[:password@]host:port/db`` (or ``rediss://``,
            ``unix://``), or a cluster: ``redis+cluster://h1:p1,h2:p2``.
        model: the model's name in Redis keys; default: export_dir's name.
        version: the export version; default: the one ``LATEST`` names.
        retention: how many versions to keep, counting the new one (at least
            1); versions that live replicas read are kept besides.
        lock_wait_s: how long to wait for another publisher of the model.
        shards: hash-tagged shards of a new generation (a full copy);
            default ``default_shards``.
        full: write a full copy even when the version could be written as a
            delta on top of Redis.

    Returns:
        What was done (``PublishResult.status()``).

    Raises:
        FileNotFoundError: export_dir is missing or holds no version.
        ValueError: a bad model name, retention, shards or version number; a
            version that export_dir lacks (or whose chain is incomplete or
            corrupt); a version already in Redis from another export.
        RedisStoreError: Redis is unreachable or fails (the message names the
            URL, or the cluster node).
        TimeoutError: another publisher held the model's lock for lock_wait_s.
    """
    start = time.perf_counter()
    if isinstance(retention, bool) or not isinstance(retention, int) or retention < 1:
        raise ValueError(f"retention must be an integer >= 1, got {retention!r}")
    if shards is not None and (
        isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 4096
    ):
        raise ValueError(f"shards must be an integer from 1 to 4096, got {shards!r}")
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
    source = _source(root, versions_)
    url = display_url(redis_url)
    result = PublishResult(model, top.number, url, step=top.step)
    deployment = connect_deployment(redis_url, socket_timeout=60)
    job = _Publisher(deployment, Keys(model), result, root)
    try:
        # Already current: nothing to do, not even taking the lock (a write).
        if job.in_redis(source) is None or result.made_current:
            with _Lock(deployment, job.keys, url, lock_wait_s) as lock:
                job.lock = lock
                job.run(versions_, source, retention, shards, full)
    except redis.RedisError as error:
        raise RedisStoreError(f"Redis at {url}: {error}") from error
    finally:
        deployment.close()
    result.seconds = time.perf_counter() - start
    return result


def _source(root: Path, versions_: Sequence[Version]) -> dict[str, Any]:
    return {
        "export_dir": str(root.resolve()),
        "chain": [v.number for v in versions_],
        "fingerprint": fingerprint(v.path / "manifest.json" for v in versions_),
    }


def live_readers(deployment: Deployment, keys: Keys) -> dict[str, int]:
    """{replica id: the version it reads} of the live replicas."""
    members = deployment.command(keys.slot, "EVAL", _READERS, 1, keys.readers)
    readers = {}
    for member in members:
        number, _, reader = member.decode().partition(":")
        readers[reader] = int(number)
    return readers


class _Publisher:
    """One publish of one model (fills ``result`` in)."""

    def __init__(self, deployment: Deployment, keys: Keys, result: PublishResult, root: Path):
        self.d = deployment
        self.keys = keys
        self.result = result
        self.root = root
        self.lock: _Lock | None = None

    def cmd(self, *args: Any) -> Any:
        """A command on the control slot."""
        return self.d.command(self.keys.slot, *args)

    def in_redis(self, source: dict[str, Any]) -> dict[str, Any] | None:
        """The metadata of result's version if Redis holds it (result then says
        whether it is current); sets result.previous. ValueError if it came from
        another export."""
        result = self.result
        number = result.version
        result.previous = int_or_none(self.cmd("GET", self.keys.current))
        meta = self.meta(number)
        if meta is None:
            return None
        theirs = meta.get("source", {})
        if theirs.get("fingerprint") != source["fingerprint"]:
            raise ValueError(
                f"Redis at {result.url} already holds version {number} of model "
                f"{self.keys.model!r} from another export ({theirs.get('export_dir')}); "
                f"publish {self.root} under another model name"
            )
        result.rows = {t: int(info["rows"]) for t, info in meta["tables"].items()}
        result.step = int(meta.get("step", result.step))
        result.kind = str(meta.get("written", "full"))
        result.made_current = result.written = result.previous != number
        return meta

    def meta(self, number: int) -> dict[str, Any] | None:
        raw = self.cmd("GET", self.keys.meta(number))
        if raw is None:
            return None
        meta = json.loads(raw)
        if meta.get("format") != FORMAT:
            raise RedisStoreError(
                f"{self.keys.meta(number)} at {self.result.url} has format "
                f"{meta.get('format')!r}, expected {FORMAT!r}: it was published by another "
                "wuliang; delete the model's keys (wl:{model}:*) and publish again"
            )
        return meta

    def index(self) -> dict[int, float]:
        pairs = self.cmd("ZRANGE", self.keys.index, 0, -1, "WITHSCORES")
        return {int(pairs[i]): float(pairs[i + 1]) for i in range(0, len(pairs), 2)}

    def layouts(self) -> dict[int, Layout]:
        """The layout of every version in the index (from ``wl:{M}:generation``)."""
        raw = self.cmd("HGETALL", self.keys.generation)
        out = {}
        for i in range(0, len(raw), 2):
            generation, _, shards = raw[i + 1].decode().partition(":")
            out[int(raw[i])] = Layout.new(self.keys.model, int(generation), int(shards))
        return out

    # -- the publish ------------------------------------------------------------------

    def run(
        self,
        versions_: Sequence[Version],
        source: dict[str, Any],
        retention: int,
        shards: int | None,
        full: bool,
    ) -> None:
        result = self.result
        number = result.version
        self.clean_dead(keep=None)
        meta = self.in_redis(source)
        if meta is not None:
            if not result.made_current:
                return
            result.written = False  # a version kept by retention: flip back to it
        else:
            base = None if full else self.base_of(versions_)
            try:
                if base is not None:
                    meta = self.write_delta(versions_, base, source)
                else:
                    meta = self.write_full(versions_, source, shards)
            except BaseException:
                self.abandon(number)
                raise
        meta["published"] = time.time()
        assert self.lock is not None
        try:
            self.lock.flip(number, json.dumps(meta, sort_keys=True), meta["published"])
        except BaseException:
            if result.written:
                self.abandon(number)
            raise
        self.retire(number, retention)

    def base_of(self, versions_: Sequence[Version]) -> dict[str, Any] | None:
        """The metadata of the version of the chain to write a delta on: in
        Redis from this export, the newest of its generation; None: none."""
        if versions_[-1].kind != "delta":
            return None
        layouts = self.layouts()
        for i in range(len(versions_) - 2, -1, -1):
            number = versions_[i].number
            if number not in layouts:
                continue
            meta = self.meta(number)
            if meta is None:
                continue
            mine = _source(self.root, versions_[: i + 1])["fingerprint"]
            if meta.get("source", {}).get("fingerprint") != mine:
                return None
            generation = layouts[number].generation
            newest = max(v for v, lay in layouts.items() if lay.generation == generation)
            return meta if newest == number else None
        return None

    def start_version(self, number: int, layout: Layout) -> None:
        """Lists the version (index score 0, its generation) before any of its keys."""
        slot, place = self.keys.slot, f"{layout.generation}:{layout.shards}"
        self.d.run([Command(slot, ("ZADD", self.keys.index, 0, str(number))),
                    Command(slot, ("HSET", self.keys.generation, str(number), place))])  # fmt: skip

    def write_full(
        self, versions_: Sequence[Version], source: dict[str, Any], shards: int | None
    ) -> dict[str, Any]:
        """A new generation holding every row of the chain applied."""
        result = self.result
        top = versions_[-1]
        number = result.version
        generation = int(self.cmd("INCR", self.keys.generations))
        layout = Layout.new(self.keys.model, generation, shards or default_shards(self.d))
        tables = {name: entry.dim for name, entry in top.tables.items()}
        with parameter_server("embedded", num_shards=2) as engine:
            apply_chain(engine, Path(top.path).parent, number)  # verifies every file
            self.start_version(number, layout)
            for table, dim in tables.items():
                written = 0
                batch: list[Command] = []
                pending = 0
                dtype = cell_dtype(dim)
                for chunk in engine.export(table):
                    keys = np.asarray(chunk.keys, np.uint64)
                    cells = np.empty(len(keys), dtype)
                    cells["version"] = number
                    cells["row"] = chunk.weights.reshape(-1, dim)
                    for command in self.msets(layout, table, keys, cells):
                        batch.append(command)
                    pending += len(keys)
                    written += len(keys)
                    if pending >= PIPELINE_ROWS:
                        self.send(batch)
                        batch, pending = [], 0
                self.send(batch)
                result.rows[table] = written
        self.send([Command(int(s), ("SET", layout.sentinel(i, number), b"1"))
                   for i, s in enumerate(layout.slots)])  # fmt: skip
        return self.meta_of(top, source, layout, [number], dict(result.rows), "full")

    def msets(
        self, layout: Layout, table: str, keys: np.ndarray, cells: np.ndarray
    ) -> Iterator[Command]:
        """MSETs of one-entry cells, per shard, WRITE_BATCH at a time."""
        shard = layout.shard_of(keys)
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(layout.shards + 1))
        raw = cells.view(np.uint8).reshape(len(cells), -1)
        for s in range(layout.shards):
            mine = order[bounds[s] : bounds[s + 1]]
            prefix = layout.cell_prefix(s, table)
            for begin in range(0, len(mine), WRITE_BATCH):
                part = mine[begin : begin + WRITE_BATCH]
                names = row_keys(prefix, keys[part])
                yield Command(int(layout.slots[s]), packed=pack(b"MSET", [], names, raw[part]))

    def send(self, commands: list[Command]) -> list[Any]:
        """A batch of commands, with the lock's renewal in the same round
        (RedisStoreError if the lock was lost)."""
        if not commands:
            return []
        assert self.lock is not None
        *replies, renewed = self.d.run([*commands, self.lock.renewal()])
        self.lock.check(renewed)
        return replies

    def meta_of(
        self,
        top: Version,
        source: dict[str, Any],
        layout: Layout,
        chain_: list[int],
        rows: dict[str, int],
        written: str,
    ) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model_name": self.keys.model,
            "version": self.result.version,
            "parent": top.parent,
            "kind": top.kind,
            "written": written,
            "step": top.step,
            "model": None if top.model is None else top.model.to_dict(),
            "tables": {t: {"dim": top.tables[t].dim, "rows": n} for t, n in rows.items()},
            "generation": layout.generation,
            "tags": list(layout.tags),
            "chain": chain_,
            "source": source,
        }

    def write_delta(
        self, versions_: Sequence[Version], base: dict[str, Any], source: dict[str, Any]
    ) -> dict[str, Any]:
        """The rows the deltas after ``base`` changed or removed, as entries
        of ``result.version`` added to ``base`` 's generation."""
        result = self.result
        number = result.version
        top = versions_[-1]
        layout = Layout.of(base)
        after = [v for v in versions_ if v.number > int(base["version"])]
        for v in after:
            v.verify()
        dims = {t: int(info["dim"]) for t, info in base["tables"].items()}
        for v in after:
            for t, entry in v.tables.items():
                if dims.setdefault(t, entry.dim) != entry.dim:
                    raise ValueError(
                        f"{v.path}: table {t!r} has dim {entry.dim}, version {base['version']} "
                        f"in Redis has {dims[t]}; publish it with full=True"
                    )
        layouts = self.layouts()
        live = np.array(
            sorted({v for v, lay in layouts.items() if lay.generation == layout.generation}
                   | {number}), np.uint64,
        )  # fmt: skip
        self.start_version(number, layout)
        rows = {t: int(info["rows"]) for t, info in base["tables"].items()}
        for table, dim in dims.items():
            keys, cells = _changes(after, table, number, dim)
            if not len(keys):
                continue
            lead = self.touched_lists(layout, number, table, keys)  # before any cell
            for begin in range(0, len(keys), DELTA_BATCH):
                part = slice(begin, begin + DELTA_BATCH)
                before, now = self.rewrite(
                    layout, table, dim, keys[part], live, cells[part], lead=lead
                )
                lead = []
                rows[table] = rows.get(table, 0) + int(now.sum()) - int(before.sum())
            tomb = (cells["version"] & TOMBSTONE) != 0
            result.rows[table] = int((~tomb).sum())
            result.removed_rows[table] = int(tomb.sum())
        self.send([Command(int(s), ("SET", layout.sentinel(i, number), b"1"))
                   for i, s in enumerate(layout.slots)])  # fmt: skip
        result.kind, result.base = "delta", int(base["version"])
        chain_ = [*base.get("chain", [base["version"]]), number]
        return self.meta_of(top, source, layout, chain_, rows, "delta")

    def touched_lists(
        self, layout: Layout, number: int, table: str, keys: np.ndarray
    ) -> list[Command]:
        """The writes of the lists of the keys a delta changes, per shard."""
        shard = layout.shard_of(keys)
        commands = []
        for s in np.unique(shard):
            mine = np.ascontiguousarray(keys[shard == s], "<u8")
            name = layout.touched(int(s), number, table)
            for begin in range(0, len(mine), TOUCHED_CHUNK):
                chunk = mine[begin : begin + TOUCHED_CHUNK].tobytes()
                commands.append(Command(int(layout.slots[s]), ("RPUSH", name, chunk)))
        return commands

    def read_touched(self, layout: Layout, number: int, table: str) -> np.ndarray:
        commands = [
            Command(int(slot), ("LRANGE", layout.touched(s, number, table), 0, -1))
            for s, slot in enumerate(layout.slots)
        ]
        chunks = [c for reply in self.d.run(commands) for c in reply]
        if not chunks:
            return np.zeros(0, np.uint64)
        return np.frombuffer(b"".join(chunks), "<u8").astype(np.uint64)

    def rewrite(
        self,
        layout: Layout,
        table: str,
        dim: int,
        keys: np.ndarray,
        live: np.ndarray,
        cells: np.ndarray | None = None,
        drop: int | None = None,
        lead: Sequence[Command] = (),
    ) -> tuple[np.ndarray, np.ndarray]:
        """Reads the cells of keys, rewrites them (``redis.cells.rewrite``)
        and writes them back (one round trip per node each way; ``lead``:
        writes sent ahead of the reads, in their round)."""
        shard = layout.shard_of(keys)
        order = np.argsort(shard, kind="stable")
        keys = keys[order]
        cells = None if cells is None else cells[order]
        shard = shard[order]
        bounds = np.searchsorted(shard, np.arange(layout.shards + 1))
        names: list[bytes] = []
        reads = []
        for s in range(layout.shards):
            if bounds[s] == bounds[s + 1]:
                continue
            mine = row_keys(layout.cell_prefix(s, table), keys[bounds[s] : bounds[s + 1]])
            names += mine
            reads.append(Command(int(layout.slots[s]), packed=pack(b"MGET", [], mine)))
        values = [v for reply in self.send([*lead, *reads])[len(lead) :] for v in reply]
        what = f"table {table!r} of model {self.keys.model!r} at {self.result.url}"
        out = rewrite(values, dim, live, cells, drop, what)
        writes = []
        name_array = np.array(names, dtype=object)
        for s in range(layout.shards):
            lo, hi = int(bounds[s]), int(bounds[s + 1])
            if lo == hi:
                continue
            slot = int(layout.slots[s])
            mine = lo + np.flatnonzero(out.changed[lo:hi])
            for group, raw in out.by_count(mine):
                group_names = name_array[group].tolist()
                for begin in range(0, len(group), WRITE_BATCH):
                    part = slice(begin, begin + WRITE_BATCH)
                    packed = pack(b"MSET", [], group_names[part], raw[part])
                    writes.append(Command(slot, packed=packed))
            dels = name_array[mine[out.counts[mine] == 0]].tolist()
            for begin in range(0, len(dels), WRITE_BATCH):
                writes.append(Command(slot, ("UNLINK", *dels[begin : begin + WRITE_BATCH])))
        self.send(writes)
        return out.before, out.after

    # -- removing versions ---------------------------------------------------------------

    def clean_dead(self, keep: int | None) -> None:
        """Removes versions a dead publisher left half written (index score
        0, no metadata)."""
        for number, score in self.index().items():
            if score == 0 and number != keep and self.cmd("EXISTS", self.keys.meta(number)) == 0:
                log.info("model %s: removing version %d, left half written by a publisher "
                         "that died", self.keys.model, number)  # fmt: skip
                self.delete([number])
                self.result.removed.append(number)

    def abandon(self, number: int) -> None:
        """After a failed write of version number: removes its keys while the
        lock is still ours; else (another publisher may be writing the same
        version now) leaves them listed in the index for a later publish."""
        assert self.lock is not None
        try:
            if self.lock.ours():
                self.delete([number])
            else:
                self.cmd("ZADD", self.keys.index, "NX", 0, str(number))
        except (redis.RedisError, RedisStoreError) as error:  # listed: a later publish removes them
            log.warning(
                "could not remove the keys of version %d at %s: %s", number, self.result.url, error
            )

    def retire(self, current: int, retention: int) -> None:
        """Deletes the versions that retention and the live replicas let go."""
        result = self.result
        index = self.index()
        recent = sorted((v for v, s in index.items() if s > 0), key=lambda v: -index[v])
        keep = {current, *recent[:retention]}
        read = set(live_readers(self.d, self.keys).values())
        doomed = sorted(v for v in index if v not in keep and v not in read)
        result.kept_for_readers = sorted(v for v in index if v not in keep and v in read)
        if doomed:
            self.delete(doomed)
        result.removed = sorted({*result.removed, *doomed})

    def delete(self, numbers: Sequence[int]) -> None:
        """Deletes versions: their metadata keys and sentinels first (lookups
        reading them then retry elsewhere), then what only they needed (their
        generation, or their entries of cells), then their index entries."""
        layouts = self.layouts()
        metas = {v: self.meta(v) for v in numbers}
        self.cmd("DEL", *(self.keys.meta(v) for v in numbers))
        sentinels = [
            Command(int(slot), ("DEL", layouts[v].sentinel(s, v)))
            for v in numbers
            if v in layouts
            for s, slot in enumerate(layouts[v].slots)
        ]
        self.send(sentinels)
        doomed = set(numbers)
        generations = {layouts[v].generation for v in numbers if v in layouts}
        for generation in sorted(generations):
            members = {v: lay for v, lay in layouts.items() if lay.generation == generation}
            layout = next(iter(members.values()))
            remaining = sorted(v for v in members if v not in doomed)
            gone = sorted(v for v in members if v in doomed)
            if not remaining:
                self.delete_generation(layout)
            else:
                self.trim(layout, gone, remaining, metas)
            self.send([Command(int(slot), ("DEL", layout.touched(s, v, t)))
                       for v in gone for t in self.tables_of(v, metas, layout)
                       for s, slot in enumerate(layout.slots)])  # fmt: skip
        self.cmd("ZREM", self.keys.index, *(str(v) for v in numbers))
        self.cmd("HDEL", self.keys.generation, *(str(v) for v in numbers))

    def tables_of(
        self, number: int, metas: dict[int, dict[str, Any] | None], layout: Layout
    ) -> list[str]:
        """The tables a version may have touched lists of (its metadata's, or
        for a version that died unpublished, any the generation has)."""
        meta = metas.get(number)
        if meta is not None:
            return list(meta["tables"])
        names: set[str] = set()
        for m in metas.values():
            if m is not None:
                names |= set(m["tables"])
        for v in self.index():
            other = self.meta(v)
            if other is not None and int(other["generation"]) == layout.generation:
                names |= set(other["tables"])
        return sorted(names)

    def trim(
        self,
        layout: Layout,
        gone: list[int],
        remaining: list[int],
        metas: dict[int, dict[str, Any] | None],
    ) -> None:
        """In a kept generation, the cells the retired versions' entries are
        in, rewritten for the versions that remain (a dead version's own
        entries dropped)."""
        live = np.array(remaining, np.uint64)
        keep_meta = self.meta(remaining[-1])
        tables = (
            {} if keep_meta is None else {t: int(i["dim"]) for t, i in keep_meta["tables"].items()}
        )
        for m in metas.values():
            if m is not None:
                tables.update({t: int(i["dim"]) for t, i in m["tables"].items()})
        for v in gone:
            published = metas.get(v) is not None
            if published and metas[v].get("written") == "full":  # type: ignore[union-attr]
                sources = [r for r in remaining if r > v]  # its entries the later deltas hid
            else:
                sources = [v]
            for table, dim in tables.items():
                lists = [self.read_touched(layout, s, table) for s in sources]
                keys = np.unique(np.concatenate([np.zeros(0, np.uint64), *lists]))
                for begin in range(0, len(keys), DELTA_BATCH):
                    part = keys[begin : begin + DELTA_BATCH]
                    self.rewrite(layout, table, dim, part, live, drop=None if published else v)

    def delete_generation(self, layout: Layout) -> None:
        """Every cell of a generation (SCAN on every master, UNLINK per slot)."""
        pattern = layout.cell_pattern(self.keys.model)
        for node in self.d.masters():
            client = self.d.client(node)
            batch: dict[int, list[bytes]] = {}
            count = 0
            for name in client.scan_iter(match=pattern, count=DELETE_BATCH):
                batch.setdefault(slot_of(name), []).append(name)
                count += 1
                if count >= DELETE_BATCH:
                    self._unlink(batch)
                    batch, count = {}, 0
            self._unlink(batch)

    def _unlink(self, batch: dict[int, list[bytes]]) -> None:
        self.send([Command(slot, ("UNLINK", *names)) for slot, names in batch.items()])


def _changes(
    after: Sequence[Version], table: str, number: int, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """The keys the deltas change or remove in table (sorted, distinct) and
    their new entries labelled ``number`` (the last delta's word wins)."""
    keys: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    gone: list[np.ndarray] = []
    for v in after:
        if table not in v.tables:
            continue
        for chunk in v.read_rows(table):
            keys.append(np.asarray(chunk.keys, np.uint64))
            rows.append(np.asarray(chunk.weights, np.float32).reshape(-1, dim))
            gone.append(np.zeros(len(chunk.keys), bool))
        removed = np.asarray(v.removed_keys(table), np.uint64)
        keys.append(removed)
        rows.append(np.zeros((len(removed), dim), np.float32))
        gone.append(np.ones(len(removed), bool))
    if not keys:
        return np.zeros(0, np.uint64), np.zeros(0, cell_dtype(dim))
    all_keys = np.concatenate(keys)
    reverse = all_keys[::-1]
    distinct, last = np.unique(reverse, return_index=True)  # last occurrence wins
    pick = len(all_keys) - 1 - last
    cells = np.zeros(len(distinct), cell_dtype(dim))
    tomb = np.concatenate(gone)[pick]
    cells["version"] = np.where(tomb, np.uint64(number) | TOMBSTONE, np.uint64(number))
    cells["row"] = np.concatenate(rows)[pick]
    cells["row"][tomb] = 0
    return distinct, cells


class _Lock:
    """The model's publisher lock: a token with an expiry, renewed while
    held; the flip checks it (a publisher that lost it writes no pointer)."""

    def __init__(self, deployment: Deployment, keys: Keys, url: str, wait_s: float) -> None:
        self.d = deployment
        self.keys = keys
        self.url = url
        self.wait_s = wait_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def cmd(self, *args: Any) -> Any:
        return self.d.command(self.keys.slot, *args)

    def __enter__(self) -> _Lock:
        deadline = time.monotonic() + self.wait_s
        pause = 0.05
        while not self.cmd("SET", self.keys.lock, self.token, "NX", "PX", LOCK_TTL_MS):
            if time.monotonic() >= deadline:
                holder = self.cmd("GET", self.keys.lock)
                who = holder.decode(errors="replace") if holder else "?"
                raise TimeoutError(
                    f"another publisher of model {self.keys.model!r} ({who}) holds "
                    f"{self.keys.lock} at {self.url}; waited {self.wait_s:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
        return self

    def ours(self) -> bool:
        return self.cmd("GET", self.keys.lock) == self.token.encode()

    def renewal(self) -> Command:
        """The command that renews the lock (``check`` its reply)."""
        return Command(self.keys.slot, ("EVAL", _LOCK, 1, self.keys.lock, self.token, LOCK_TTL_MS))

    def check(self, renewed: Any) -> None:
        if not renewed:
            raise self.lost()

    def flip(self, version: int, meta: str, score: float) -> None:
        """Writes the metadata key, the pointer, the index entry and the
        announcement in one atomic script."""
        keys = self.keys
        names = [keys.lock, keys.meta(version), keys.current, keys.index]
        args = [self.token, meta, str(version), score, keys.channel]
        if not self.cmd("EVAL", _FLIP, len(names), *names, *args):
            raise self.lost()

    def lost(self) -> RedisStoreError:
        return RedisStoreError(
            f"lost the publish lock {self.keys.lock} at {self.url} (held more than "
            f"{LOCK_TTL_MS / 1000:g} s without renewal); the pointer was not changed"
        )

    def __exit__(self, *exc: object) -> None:
        try:
            self.cmd("EVAL", _LOCK, 1, self.keys.lock, self.token, 0)
        except (redis.RedisError, RedisStoreError) as error:  # it expires by itself
            log.warning("could not release %s at %s: %s", self.keys.lock, self.url, error)
