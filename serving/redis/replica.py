"""``RedisStore``: what a serving replica looks a published model's rows up
through (``wuliang publish``, ``redis.publish``, writes them; the keys are in
``redis.keys``).

Switch protocol: a replica subscribes to the model's channel before it reads
the pointer, so no announcement falls between. A background thread re-reads
the pointer when a message arrives, and every ``poll_s`` seconds in case one
was missed; a new pointer loads that version's metadata (and whatever the
owner prepares for it: ``prepare``, e.g. the tower), reads the keys its
caches hold at the new version into the new caches (``_warm``: the hot rows
stay cached across versions, and a publish does not send every replica's
misses to Redis at once), and swaps the replica's state (version, tables,
caches) in one assignment. The pointer, not the
message, is the truth, so out-of-order announcements and rollbacks are
followed alike. A version whose preparation fails is refused: the replica
keeps its version until another is published. The thread also renews the
replica's entry in the model's ``readers`` set (it expires unless
renewed), which keeps publishers from deleting the version it reads. A
replica may start before the model's first publish: it has no version (0)
until one is announced.

A lookup takes a state once (the current one, or the one it is given: a
request's snapshot) and reads everything at that version: rows from its
cache (``redis.cache``), and the misses from their cells, one ``MGET`` per
shard that holds any of them (in a cluster, one pipelined round trip per
node: ``redis.nodes``), each ``MGET`` led by the version's sentinel in that
shard. ``MGET`` is atomic, and retention deletes a version's sentinels
before it trims any cell, so an ``MGET`` that returns the sentinel returned
cells that still hold the version's entries; one that does not (the
version was retired while the lookup ran) makes a lookup of the current
state switch to the pointer's version and start again, and a lookup of a
given state raise ``VersionRetired``. Every answer's rows therefore come
from the one version it names (``redis.cells.decode``: each cell's newest
entry at or below it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from wuliang.ps_server import LookupResult, UnknownTableError, as_keys
from wuliang.serving.redis.cache import RowCache
from wuliang.serving.redis.cells import decode
from wuliang.serving.redis.keys import (
    FORMAT,
    Keys,
    Layout,
    RedisStoreError,
    check_model_name,
    display_url,
    int_or_none,
    redis,
    row_keys,
)
from wuliang.serving.redis.nodes import Command, connect_deployment, pack

__all__ = ["NoVersionError", "RedisStore", "ReplicaState", "VersionRetired"]

log = logging.getLogger("wuliang.serving")

READ_BATCH = 10_000  # keys per MGET (a larger lookup pipelines several)
WARM_BATCH = 50_000  # keys of a cache warmed per pipelined read at a switch
_RETRIES = 5  # attempts of a lookup whose version is retired under it

# Renews a replica's entry in the readers set (ARGV: member, ttl ms, the
# member it replaces or ''), expiring by the server's clock.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if ARGV[3] ~= '' and ARGV[3] ~= ARGV[1] then redis.call('ZREM', KEYS[1], ARGV[3]) end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""


class NoVersionError(LookupError):
    """The model has no published version (yet)."""


class VersionRetired(RedisStoreError):
    """A lookup pinned to a version (a request's snapshot) that retention
    removed from Redis meanwhile."""


@dataclass(frozen=True)
class _Table:
    name: str
    dim: int
    prefixes: list[bytes]  # of its cells, per shard
    cache: RowCache


class ReplicaState:
    """One version as a replica reads it; replaced whole at a switch.

    ``prepared`` is what the store's ``prepare`` made of it (None without one)."""

    __slots__ = ("layout", "meta", "prepared", "sentinels", "tables", "version")

    def __init__(
        self, version: int, meta: dict[str, Any], layout: Layout, tables: dict[str, _Table]
    ) -> None:
        self.version = version
        self.meta = meta
        self.layout = layout
        self.sentinels = [layout.sentinel(s, version) for s in range(layout.shards)]
        self.tables = tables
        self.prepared: Any = None


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
        prepare: called with each version's ``ReplicaState`` before the
            replica switches to it (its result becomes ``state.prepared``);
            an error from it (``ValueError``, ``OSError``: the version is bad)
            refuses the version.
        on_switch: called with (the new state, seconds it took) after each
            switch, the first version's included.
        on_refuse: called with (version, why) for each refused version.

    Raises:
        RedisStoreError: Redis is unreachable, or the pinned version (or the
            one the pointer names) is not in it.
    """

    def __init__(
        self,
        redis_url: str,
        model: str,
        cache_rows: int = 100_000,
        *,
        poll_s: float = 5.0,
        version: int | None = None,
        prepare: Callable[[ReplicaState], Any] | None = None,
        on_switch: Callable[[ReplicaState, float], None] | None = None,
        on_refuse: Callable[[int, str], None] | None = None,
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
        self.prepare = prepare
        self.on_switch = on_switch
        self.on_refuse = on_refuse
        self.reader_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.reader_ttl_ms = int(max(10.0, 3 * self.poll_s) * 1000)
        self.switches = 0
        self.retries = 0  # lookups restarted because their version was retired under them
        self.warmed = 0  # rows read into the caches at the last switch
        self.refused: set[int] = set()
        self.last_error: BaseException | None = None  # the follower thread's latest
        self._nodes = connect_deployment(redis_url, socket_timeout=10)
        self._member = ""  # this replica's entry in the readers set
        self._switch_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._heartbeats = True
        self._state: ReplicaState | None = None
        pubsub: redis.client.PubSub | None = None
        try:
            if not self.pinned:  # subscribed before the pointer is read: nothing missed
                pubsub = self._subscribe()
            if version is None:
                version = int_or_none(self._get(self.keys.current))
            if version is None:
                log.warning(
                    "model %s has no published version at %s yet (%s is not set); waiting "
                    "for wuliang publish",
                    self.keys.model,
                    self.url,
                    self.keys.current,
                )
            else:
                with self._switch_lock:
                    if not self._switch(version) and self.pinned:
                        raise RedisStoreError(
                            f"version {version} of model {model!r} was refused at {self.url}"
                        )
            self._heartbeat()
        except BaseException as error:
            if pubsub is not None:
                pubsub.close()
            self._nodes.close()
            if isinstance(error, redis.RedisError):
                raise RedisStoreError(f"Redis at {self.url}: {error}") from error
            raise
        self._thread = threading.Thread(
            target=self._follow, args=(pubsub,), name=f"wuliang-redis-{model}", daemon=True
        )
        self._thread.start()

    # -- reading ----------------------------------------------------------------

    @property
    def state(self) -> ReplicaState | None:
        """The version lookups read now (None: nothing published yet)."""
        return self._state

    @property
    def version(self) -> int:
        """The version lookups read now (0: none yet)."""
        state = self._state
        return 0 if state is None else state.version

    def tables(self) -> dict[str, int]:
        """{table: dim} of the current version."""
        state = self._state
        return {} if state is None else {name: t.dim for name, t in state.tables.items()}

    def model_description(self) -> dict[str, Any] | None:
        """The current version's feature description (the manifest's ``model``)."""
        state = self._state
        return None if state is None else state.meta.get("model")

    def metadata(self) -> dict[str, Any]:
        """The current version's metadata key (a copy; empty before the first)."""
        state = self._state
        return {} if state is None else json.loads(json.dumps(state.meta))

    def stats(self) -> dict[str, Any]:
        """Version, switches, retried lookups, rows read into the caches at
        the last switch, and per table the cache's rows, hits and misses."""
        state = self._state
        return {
            "version": 0 if state is None else state.version,
            "switches": self.switches,
            "retries": self.retries,
            "warmed": self.warmed,
            "tables": {
                name: {
                    "cached": len(t.cache.slot_of),
                    "hits": t.cache.hits,
                    "misses": t.cache.misses,
                }
                for name, t in (state.tables.items() if state is not None else ())
            },
        }

    def lookup(self, table: str, keys: Any, state: ReplicaState | None = None) -> LookupResult:
        """Rows of keys, all from one version: ``LookupResult(rows float32
        [n, dim], found bool [n], version)``; keys without a row read as
        zeros, not found. ``state``: read that version (a request's
        snapshot) instead of the current one.

        Raises:
            NoVersionError: nothing is published yet.
            UnknownTableError: the version has no such table.
            VersionRetired: ``state`` 's version is no longer in Redis.
            RedisStoreError: Redis failed, or versions kept disappearing.
        """
        keys = as_keys(keys)
        if keys.dtype == np.int64:
            keys = keys.view(np.uint64)
        if self._closed:
            raise RuntimeError(f"the RedisStore of model {self.keys.model!r} is closed")
        pinned = state is not None
        for _ in range(_RETRIES):
            if not pinned:
                state = self._state
                if state is None:
                    raise NoVersionError(
                        f"model {self.keys.model!r} has no published version at {self.url} yet"
                    )
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
                fetched = self._read(state, t, wanted)
                if fetched is None:  # the version was retired under us
                    if pinned:
                        raise VersionRetired(
                            f"version {state.version} of model {self.keys.model!r} is no "
                            f"longer in Redis at {self.url}"
                        )
                    self.retries += 1
                    self._refresh()  # follow the pointer
                    continue
                rows[missing] = fetched[0][where]
                found[missing] = fetched[1][where]
                t.cache.insert(wanted, *fetched)
            return LookupResult(rows, found, state.version)
        raise RedisStoreError(
            f"model {self.keys.model!r}: versions kept disappearing at {self.url} during a lookup "
            f"({_RETRIES} attempts)"
        )

    def _read(
        self, state: ReplicaState, t: _Table, keys: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, found) of distinct keys, read from their cells with one MGET
        per shard (per READ_BATCH keys), each led by the shard's sentinel;
        None if the version is no longer in Redis."""
        layout = state.layout
        shard = layout.shard_of(keys)
        if layout.shards > 1:
            order = np.argsort(shard, kind="stable")
            bounds = np.searchsorted(shard[order], np.arange(layout.shards + 1))
        else:
            order = None
            bounds = np.array([0, len(keys)])
        ordered = keys if order is None else keys[order]
        commands = []
        for s in np.flatnonzero(np.diff(bounds)).tolist():
            names = row_keys(t.prefixes[s], ordered[bounds[s] : bounds[s + 1]])
            head = [state.sentinels[s]]
            slot = int(layout.slots[s])
            for begin in range(0, len(names), READ_BATCH):
                packed = pack(b"MGET", head, names[begin : begin + READ_BATCH])
                commands.append(Command(slot, packed=packed))
        replies = self._nodes.run(commands)
        if any(reply[0] is None for reply in replies):
            return None
        values = replies[0][1:] if len(replies) == 1 else [v for r in replies for v in r[1:]]
        what = f"table {t.name!r} of version {state.version} at {self.url}"
        try:
            rows, found = decode(values, t.dim, state.version, what)
        except ValueError as error:
            raise RedisStoreError(str(error)) from None
        if order is not None:
            back = np.empty_like(order)
            back[order] = np.arange(len(order))
            rows, found = rows[back], found[back]
        return rows, found

    # -- following ---------------------------------------------------------------

    def _get(self, name: str) -> Any:
        """GET of a control key."""
        return self._nodes.command(self.keys.slot, "GET", name)

    def _load(self, version: int) -> ReplicaState:
        raw = self._get(self.keys.meta(version))
        if raw is None:
            raise RedisStoreError(
                f"version {version} of model {self.keys.model!r} is not in Redis at "
                f"{self.url} ({self.keys.meta(version)} is missing)"
            )
        meta = json.loads(raw)
        if meta.get("format") != FORMAT:
            raise RedisStoreError(
                f"{self.keys.meta(version)} at {self.url} has format {meta.get('format')!r}, "
                f"expected {FORMAT!r} (published by another wuliang: publish it again)"
            )
        layout = Layout.of(meta)
        tables = {
            name: _Table(
                name,
                int(info["dim"]),
                [layout.cell_prefix(s, name) for s in range(layout.shards)],
                RowCache(self.cache_rows, int(info["dim"])),
            )
            for name, info in meta["tables"].items()
        }
        return ReplicaState(version, meta, layout, tables)

    def _switch(self, target: int) -> bool:
        """Loads and prepares version target and makes it the current one
        (under ``_switch_lock``); False if it was refused."""
        start = time.perf_counter()
        state = self._load(target)
        if self.prepare is not None:
            try:
                state.prepared = self.prepare(state)
            except Exception as error:  # CorruptVersionError is a ValueError
                self.refused.add(target)
                expected = isinstance(error, ValueError | OSError)
                log.error(
                    "model %s: version %d refused: %s",
                    self.keys.model,
                    target,
                    error,
                    exc_info=None if expected else error,  # an unexpected one: its traceback
                )
                if self.on_refuse is not None:
                    self.on_refuse(target, str(error))
                return False
        old = self._state
        warmed = 0 if old is None else self._warm(old, state)
        self._state = state
        self.warmed = warmed
        seconds = time.perf_counter() - start
        if old is not None:
            self.switches += 1
            for t in old.tables.values():
                t.cache.clear()
        log.info(
            "model %s: version %d (%s) applied from Redis in %.3f s%s",
            self.keys.model,
            target,
            state.meta.get("kind", "full"),
            seconds,
            f" (was {old.version}; {warmed} cached rows read again)" if old is not None else "",
        )
        if self.on_switch is not None:
            self.on_switch(state, seconds)
        return True

    def _warm(self, old: ReplicaState, new: ReplicaState) -> int:
        """Reads the rows the old version's caches hold, at the new version,
        into its caches, before the switch; the number of rows read. So a
        replica's hot rows stay cached across versions instead of all
        missing at once after each publish (every replica of a fleet at the
        same moment, at Redis). A Redis error ends the warming, not the
        switch: the rest are read as lookups miss them."""
        warmed = 0
        for name, t in new.tables.items():
            before = old.tables.get(name)
            if before is None or before.dim != t.dim or not t.cache.capacity:
                continue
            with before.cache.lock:
                hot = np.fromiter(before.cache.slot_of, np.uint64, len(before.cache.slot_of))
            hot = hot[: t.cache.capacity]
            for begin in range(0, len(hot), WARM_BATCH):
                keys = hot[begin : begin + WARM_BATCH]
                try:
                    fetched = self._read(new, t, keys)
                except (RedisStoreError, redis.RedisError) as error:
                    log.warning(
                        "model %s: warming the cache of version %d stopped: %s",
                        self.keys.model,
                        new.version,
                        error,
                    )
                    return warmed
                if fetched is None:  # retired before it was current
                    return warmed
                t.cache.insert(keys, *fetched)
                warmed += len(keys)
        return warmed

    def _refresh(self) -> bool:
        """Switches to the pointer's version if it is another; True if it did."""
        if self.pinned:
            return False
        with self._switch_lock:
            try:
                target = int_or_none(self._get(self.keys.current))
                if target is None:
                    if self._state is None:
                        return False  # not published yet
                    raise RedisStoreError(
                        f"{self.keys.current} at {self.url} is not set (the model was unpublished)"
                    )
                if target == self.version or target in self.refused:
                    return False
                if not self._switch(target):
                    return False
            except redis.RedisError as error:
                raise RedisStoreError(f"Redis at {self.url}: {error}") from error
        self._heartbeat()
        return True

    def _heartbeat(self) -> None:
        """Tells publishers which version this replica reads (its entry in
        the readers set)."""
        state = self._state
        if not self._heartbeats or state is None:
            return
        member = f"{state.version}:{self.reader_id}"
        try:
            self._nodes.command(
                self.keys.slot, "EVAL", _HEARTBEAT, 1, self.keys.readers,
                member, self.reader_ttl_ms, self._member,
            )  # fmt: skip
            self._member = member
        except RedisStoreError as error:
            if "refused" not in str(error):  # unreachable: the follower retries
                raise
            self._heartbeats = False  # e.g. a read-only ACL user
            log.warning(
                "model %s: cannot write %s at %s (%s); publishers will not see which "
                "version this replica reads",
                self.keys.model,
                self.keys.readers,
                self.url,
                error,
            )

    def _subscribe(self) -> redis.client.PubSub:
        pubsub = self._nodes.client_of_slot(self.keys.slot).pubsub(ignore_subscribe_messages=True)
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
            except Exception as error:  # the thread never dies; it tries again
                self.last_error = error
                expected = isinstance(error, redis.RedisError | RedisStoreError | ValueError)
                log.warning(
                    "model %s: following versions at %s: %s",
                    self.keys.model,
                    self.url,
                    error,
                    exc_info=None if expected else error,
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
            if self._member:
                self._nodes.command(self.keys.slot, "ZREM", self.keys.readers, self._member)
        except (redis.RedisError, RedisStoreError) as error:  # it expires by itself
            log.warning("could not remove %s from %s at %s: %s", self._member,
                        self.keys.readers, self.url, error)  # fmt: skip
        if self._state is not None:
            for t in self._state.tables.values():
                t.cache.clear()
        self._nodes.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, {self.keys.model!r}, version={self.version})"
