"""Where a published model lives: one Redis, or a Redis Cluster, behind one
small interface (``Deployment``) that the publisher and the replicas share.

URLs::

    redis://[[user]:password@]host:port[/db]        one Redis (also rediss://, unix://)
    redis+cluster://[[user]:password@]h1:p1,h2:p2   a Redis Cluster (rediss+cluster:// for TLS)
    redis://h1:p1?cluster=true                      the same, in the query form

A cluster URL names any of its nodes (more than one, in case one is down);
the others are found with ``CLUSTER SLOTS``.

``Deployment.run(commands)`` runs a batch of commands, each bound to a hash
slot, as one pipelined round trip per node: every node's commands are
written before any reply is read, so the nodes work in parallel. Replies
come back in the batch's order. In a cluster it follows the cluster's own
redirections: ``MOVED`` refreshes the slot map (``CLUSTER SLOTS``) and
resends, ``ASK`` (a slot being migrated) resends to the node named, after
``ASKING``, without changing the map; ``TRYAGAIN`` and ``CLUSTERDOWN`` are
retried after a short pause. A multi-key command that still gets
``TRYAGAIN`` (its slot is half migrated: some of its keys are on each side,
which lasts until the migration ends) is split into single-key commands,
which ``ASK`` follows; a split ``MGET`` reads its first key last, after the
others (a lookup's sentinel: see ``redis.replica``). A node that cannot be reached (after the map
is refreshed once, in case a replica took over) raises ``RedisStoreError``
naming that node.

Why not redis-py's ``RedisCluster``: a lookup's batch is a few ``MGET`` s
per node whose arguments are packed with numpy (``pack``: every row key has
the same length), and redis-py's cluster pipeline packs and routes each
command in Python, one at a time, which costs more than the ``MGET`` itself
at these sizes; its MOVED/ASK handling also resends failed commands one by
one. The protocol needed is small (the slot map, three redirections), so it
is spoken here on top of redis-py's connections and its hiredis parser.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from wuliang.serving.redis.keys import SLOTS, RedisStoreError, display_url, redis, slot_of

__all__ = ["Command", "Deployment", "connect_deployment", "pack", "slot_of"]

_REDIRECTS = 6  # rounds of redirections / retries of one batch
_PAUSE_S = 0.05  # before resending after TRYAGAIN / CLUSTERDOWN / a refresh


@dataclass(frozen=True)
class Command:
    """One command of a batch: its hash slot and either its packed bytes
    (``pack``) or its arguments (packed by redis-py)."""

    slot: int
    args: tuple[Any, ...] = ()
    packed: bytes | None = None

    def name(self) -> str:
        if self.args:
            first = self.args[0]
            return first.decode() if isinstance(first, bytes) else str(first)
        assert self.packed is not None
        return self.packed.split(b"\r\n", 3)[2].decode(errors="replace")


def pack(command: bytes, head: Sequence[bytes], names: list[bytes], values: Any = None) -> bytes:
    """The RESP bytes of ``command *head, name_0, [value_0,] name_1, ...``
    with numpy: every name has the same length, and so has every value
    (``values``: a [n, width] uint8 array, or None)."""
    n = len(names)
    count = 1 + len(head) + n * (1 if values is None else 2)
    out = [f"*{count}\r\n${len(command)}\r\n".encode(), command, b"\r\n"]
    out += [b"$%d\r\n%s\r\n" % (len(h), h) for h in head]
    if n:
        width = len(names[0])
        fields = [("nh", f"V{len(str(width)) + 3}"), ("name", f"V{width}"), ("nt", "V2")]
        if values is not None:
            vw = values.shape[1]
            fields += [("vh", f"V{len(str(vw)) + 3}"), ("value", f"V{vw}"), ("vt", "V2")]
        rec = np.empty(n, dtype=fields)
        rec["nh"] = np.void(f"${width}\r\n".encode())
        rec["name"] = np.frombuffer(b"".join(names), f"V{width}")
        rec["nt"] = np.void(b"\r\n")
        if values is not None:
            rec["vh"] = np.void(f"${vw}\r\n".encode())
            rec["value"] = np.ascontiguousarray(values, np.uint8).view(f"V{vw}").reshape(-1)
            rec["vt"] = np.void(b"\r\n")
        out.append(rec.tobytes())
    return b"".join(out)


def _parse_url(url: str) -> tuple[bool, list[tuple[str, int]], dict[str, Any]]:
    """(cluster?, [(host, port)], connection options); ValueError naming the URL."""
    shown = display_url(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = parse_qs(parts.query)
    cluster = scheme.endswith("+cluster") or query.get("cluster", ["false"])[0].lower() in (
        "1",
        "true",
        "yes",
    )
    base = scheme.removesuffix("+cluster")
    if not cluster:
        return False, [], {}
    if base not in ("redis", "rediss"):
        raise ValueError(
            f"bad Redis URL {shown!r}: a cluster URL is redis+cluster://host:port,host:port "
            "(or rediss+cluster://)"
        )
    netloc = parts.netloc.rsplit("@", 1)[-1]
    nodes = []
    for item in filter(None, netloc.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"bad Redis URL {shown!r}: {item!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"bad Redis URL {shown!r}: it names no node (host:port,...)")
    path = parts.path.strip("/")
    if path not in ("", "0"):
        raise ValueError(f"bad Redis URL {shown!r}: a Redis Cluster has only database 0")
    options: dict[str, Any] = {}
    if "@" in parts.netloc:
        user, _, password = parts.netloc.rsplit("@", 1)[0].partition(":")
        if user:
            options["username"] = unquote(user)
        if password:
            options["password"] = unquote(password)
    if base == "rediss":
        options["connection_class"] = redis.SSLConnection
    return True, nodes, options


class Deployment:
    """One Redis or a Redis Cluster (see the module docstring). Thread-safe."""

    def __init__(self, url: str, socket_timeout: float) -> None:
        self.url = display_url(url)
        self.socket_timeout = socket_timeout
        self.cluster, startup, options = _parse_url(url)
        self._lock = threading.Lock()
        self._pools: dict[str, redis.ConnectionPool] = {}
        common = {  # RESP2: flat replies (redis-py 8 speaks RESP3 by default)
            "socket_connect_timeout": 5,
            "socket_timeout": socket_timeout,
            "protocol": 2,
        }
        if not self.cluster:
            try:
                pool = redis.ConnectionPool.from_url(url, **common)
            except ValueError as error:  # a URL redis-py cannot parse
                raise ValueError(f"bad Redis URL {self.url!r}: {error}") from None
            self._pools["0"] = pool
            self._owner = np.zeros(SLOTS, np.int32)
            self._names = ["0"]
            self._options: dict[str, Any] = {}
            self._startup: list[tuple[str, int]] = []
        else:
            self._options = {**common, **options}
            self._startup = startup
            self._names = []
            self._owner = np.full(SLOTS, -1, np.int32)
            self.refresh()

    # -- nodes ---------------------------------------------------------------------

    def node_name(self, index: int) -> str:
        """A node's ``host:port`` (the URL for one Redis)."""
        return self.url if not self.cluster else self._names[index]

    def masters(self) -> list[str]:
        """The nodes holding slots (one Redis: itself)."""
        return sorted(set(self._names[i] for i in np.unique(self._owner) if i >= 0))

    def client(self, node: str | None = None) -> redis.Redis:
        """A redis-py client of one node (default: the first master)."""
        return redis.Redis(connection_pool=self._pool(node or self.masters()[0]))

    def client_of_slot(self, slot: int) -> redis.Redis:
        """A redis-py client of the node holding slot."""
        owner = int(self._owner[slot])
        return redis.Redis(connection_pool=self._pool(self._names[owner]))

    def _pool(self, name: str) -> redis.ConnectionPool:
        pool = self._pools.get(name)
        if pool is None:
            with self._lock:
                pool = self._pools.get(name)
                if pool is None:
                    host, _, port = name.rpartition(":")
                    pool = redis.ConnectionPool(host=host, port=int(port), **self._options)
                    self._pools[name] = pool
        return pool

    def refresh(self) -> None:
        """Reads the slot map (``CLUSTER SLOTS``) from the first node that answers."""
        if not self.cluster:
            return
        known = list(dict.fromkeys([*self.masters(), *(f"{h}:{p}" for h, p in self._startup)]))
        errors = []
        for name in known:
            try:
                slots = self.client(name).execute_command("CLUSTER SLOTS")
            except redis.RedisError as error:
                errors.append(f"{name}: {error}")
                continue
            owner = np.full(SLOTS, -1, np.int32)
            names = list(self._names)
            for entry in slots:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                node = f"{host or name.rpartition(':')[0]}:{int(master[1])}"
                if node not in names:
                    names.append(node)
                owner[start : end + 1] = names.index(node)
            self._names, self._owner = names, owner  # readers see one map or the other
            return
        raise RedisStoreError(
            f"cannot reach any node of the Redis Cluster at {self.url}: {'; '.join(errors)}"
        )

    def ping(self) -> None:
        """Every master answers PING; RedisStoreError naming the first that does not."""
        for name in self.masters():
            try:
                self.client(name).ping()
            except redis.RedisError as error:
                where = self.url if not self.cluster else f"{name} (of {self.url})"
                raise RedisStoreError(f"cannot reach Redis at {where}: {error}") from None

    def close(self) -> None:
        for pool in list(self._pools.values()):
            pool.disconnect()

    # -- batches -------------------------------------------------------------------

    def command(self, slot: int, *args: Any) -> Any:
        """One command (a batch of one)."""
        return self.run([Command(slot, args)])[0]

    def run(self, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply (see the module docstring); RedisStoreError if
        a node is unreachable or a command fails (naming the node)."""
        replies: list[Any] = [None] * len(commands)
        pending = list(range(len(commands)))
        asking: dict[int, str] = {}
        again: dict[int, int] = {}  # TRYAGAIN replies per command
        split: list[int] = []
        for attempt in range(_REDIRECTS):
            split += [i for i in pending if again.get(i, 0) >= 2]
            pending = [i for i in pending if again.get(i, 0) < 2]
            if not pending:
                for i in split:
                    replies[i] = self._split(commands[i])
                return replies
            groups: dict[str, list[int]] = {}
            owner, names = self._owner, self._names
            for i in pending:
                node = asking.get(i)
                if node is None:
                    index = int(owner[commands[i].slot])
                    if index < 0:
                        raise RedisStoreError(
                            f"no node of the Redis Cluster at {self.url} serves hash slot "
                            f"{commands[i].slot} (CLUSTERDOWN)"
                        )
                    node = names[index]
                groups.setdefault(node, []).append(i)
            retry, refresh, unreachable = self._round(commands, groups, asking, replies, again)
            if unreachable and attempt >= 1:
                node, error = unreachable
                where = self.url if not self.cluster else f"node {node} of {self.url}"
                raise RedisStoreError(f"Redis {where} is unreachable: {error}")
            if refresh or unreachable:
                time.sleep(_PAUSE_S * (attempt + 1) if unreachable else 0)
                try:
                    self.refresh()
                except RedisStoreError:
                    if not unreachable:
                        raise
            elif retry and any(i not in asking for i in retry):
                time.sleep(_PAUSE_S * (attempt + 1))
            pending = retry
        raise RedisStoreError(
            f"Redis Cluster at {self.url}: {len(pending)} commands still redirected after "
            f"{_REDIRECTS} rounds (resharding?)"
        )

    def _round(
        self,
        commands: Sequence[Command],
        groups: dict[str, list[int]],
        asking: dict[int, str],
        replies: list[Any],
        again: dict[int, int],
    ) -> tuple[list[int], bool, tuple[str, BaseException] | None]:
        """One round trip per node; fills replies. Returns (commands to send
        again, whether the slot map must be refreshed, an unreachable node)."""
        retry: list[int] = []
        refresh = False
        unreachable: tuple[str, BaseException] | None = None
        taken: list[tuple[str, Any, list[int]]] = []
        try:
            for node, indexes in groups.items():  # write everything first
                pool = self._pool(node)
                try:
                    conn = pool.get_connection()
                except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                    unreachable = (node, error)
                    retry += indexes
                    continue
                taken.append((node, conn, indexes))
                chunks: list[bytes] = []
                for i in indexes:
                    if i in asking:
                        chunks.append(b"*1\r\n$6\r\nASKING\r\n")
                    c = commands[i]
                    if c.packed is not None:
                        chunks.append(c.packed)
                    else:
                        chunks += conn.pack_command(*c.args)
                try:
                    conn.send_packed_command(chunks, check_health=False)
                except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                    unreachable = (node, error)
                    conn.disconnect()
                    retry += indexes
                    taken[-1] = (node, None, [])
            for node, conn, indexes in taken:  # then read, node by node
                if conn is None:
                    continue
                try:
                    for i in indexes:
                        was_asked = asking.pop(i, None) is not None
                        try:
                            if was_asked:
                                conn.read_response()
                            replies[i] = conn.read_response()
                        except redis.ResponseError as error:
                            if isinstance(error, redis.exceptions.MovedError):
                                refresh = True
                                retry.append(i)
                            elif isinstance(error, redis.exceptions.AskError):
                                asking[i] = f"{error.host}:{error.port}"
                                retry.append(i)
                            elif isinstance(
                                error,
                                redis.exceptions.TryAgainError | redis.exceptions.ClusterDownError,
                            ):
                                again[i] = again.get(i, 0) + 1
                                retry.append(i)
                            else:
                                where = self.url if not self.cluster else f"node {node}"
                                raise RedisStoreError(
                                    f"Redis {where} refused {commands[i].name()}: {error}"
                                ) from None
                except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                    unreachable = (node, error)
                    conn.disconnect()
                    retry += [i for i in indexes if i not in retry]
        except BaseException:  # replies may be left unread: those connections are dropped
            for _, conn, _ in taken:
                if conn is not None:
                    conn.disconnect()
            raise
        finally:
            for node, conn, _ in taken:
                if conn is not None:
                    self._pool(node).release(conn)
        return retry, refresh, unreachable

    def _split(self, command: Command) -> Any:
        """A multi-key command run as single-key ones (see the module docstring)."""
        args = list(command.args) if command.args else _unpack(command.packed or b"")
        name = (args[0].decode() if isinstance(args[0], bytes) else str(args[0])).upper()
        slot = command.slot
        keys = args[1:]
        if name == "MGET":
            rest = self.run([Command(slot, ("GET", k)) for k in keys[1:]])
            return [self.command(slot, "GET", keys[0]), *rest] if keys else []
        if name == "MSET":
            self.run([Command(slot, ("SET", keys[i], keys[i + 1])) for i in range(0, len(keys), 2)])
            return b"OK"
        if name in ("DEL", "UNLINK"):
            return sum(self.run([Command(slot, (name, k)) for k in keys]))
        raise RedisStoreError(
            f"Redis Cluster at {self.url}: {name} keeps getting TRYAGAIN (slot {slot} migrating)"
        )


def _unpack(packed: bytes) -> list[bytes]:
    """The arguments of one packed command (``*n``, then ``$len`` bulk strings)."""
    count, _, rest = packed[1:].partition(b"\r\n")
    args = []
    at = 0
    for _ in range(int(count)):
        end = rest.index(b"\r\n", at)
        size = int(rest[at + 1 : end])
        args.append(rest[end + 2 : end + 2 + size])
        at = end + 4 + size
    return args


def connect_deployment(url: str, socket_timeout: float) -> Deployment:
    """A ``Deployment`` of url whose nodes answer PING; RedisStoreError naming
    the node if not, ValueError for a bad URL."""
    deployment = Deployment(url, socket_timeout)
    try:
        deployment.ping()
    except BaseException:
        deployment.close()
        raise
    return deployment
