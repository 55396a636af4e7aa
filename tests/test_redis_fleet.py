"""Deltas published to Redis and Redis Cluster (``redis.publish``,
``redis.replica``, ``redis.nodes``, ``redis.cells``), against real
redis-servers on free loopback ports: a delta writes only its rows and
reads exactly as its chain applied; retention frees the deltas' entries;
lookups never mix versions while deltas land; a 3-node cluster
(``redis-server --cluster-enabled yes``, ``redis-cli --cluster create``)
serves the same answers with one round trip per node, follows a slot
migrated under it (ASK, then MOVED), and names a node that is down."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from test_redis_store import (
    DIMS,
    all_keys,
    assert_serves,
    engine_at,
    free_port,
    full,
    wait_for,
    write_version,
)

from wuliang.serving.errors import Unavailable
from wuliang.serving.redis import nodes as redis_nodes
from wuliang.serving.redis.cells import decode, rewrite
from wuliang.serving.redis.keys import TOMBSTONE, Keys, Layout, RedisStoreError, cell_dtype
from wuliang.serving.redis.model import RedisModelStore
from wuliang.serving.redis.publish import publish
from wuliang.serving.redis.replica import RedisStore


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


class Cluster:
    """Three redis-servers in cluster mode on loopback, slots split evenly."""

    def __init__(self, folder: Path) -> None:
        server = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if server is None or cli is None:
            pytest.fail("redis-server and redis-cli are needed (apt-get install redis-server)")
        self.cli = cli
        self.ports = cluster_ports(3)
        self.procs: dict[int, subprocess.Popen] = {}
        for port in self.ports:
            work = folder / str(port)
            work.mkdir()
            args = [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled",
                    "yes", "--cluster-config-file", str(work / "nodes.conf"), "--save", "",
                    "--appendonly", "no", "--dir", str(work)]  # fmt: skip
            with open(work / "log", "w") as log:
                self.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        for port in self.ports:
            client = redis.Redis(host="127.0.0.1", port=port)
            proc = self.procs[port]
            wait_for(lambda c=client, p=proc: p.poll() is not None or _pings(c), timeout=10)
            client.close()
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited: see its log")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        wait_for(self.ok, timeout=20)
        self.url = "redis+cluster://" + ",".join(nodes)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port)

    def ok(self) -> bool:
        for port in self.ports:
            if port not in self.procs:
                continue
            with self.client(port) as c:
                info = c.execute_command("CLUSTER INFO")  # parsed by redis-py
                if info.get("cluster_state") != "ok":
                    return False
        return True

    def owner(self, slot: int) -> int:
        with self.client(self.ports[0]) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise AssertionError(f"slot {slot} has no owner")

    def node_id(self, port: int) -> str:
        with self.client(port) as c:
            return c.execute_command("CLUSTER MYID").decode()

    def flush(self) -> None:
        for port in self.ports:
            with self.client(port) as c:
                c.flushall()

    def stop(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def cluster_ports(n: int) -> list[int]:
    """n free ports whose cluster bus ports (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A fresh 3-node cluster per test (about a second to start)."""
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.close()


class Deaf(RedisStore):
    """A replica that hears no announcement: it follows by polling alone."""

    def _subscribe(self) -> redis.client.PubSub:
        pubsub = self._nodes.client_of_slot(self.keys.slot).pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe("nothing-is-announced-here")
        return pubsub


def delta(root: Path, number: int, parent: int, changed: np.ndarray, removed: np.ndarray) -> None:
    write_version(
        root,
        number,
        {"users": changed, "items": changed[::3]},
        parent=parent,
        removed={"users": removed, "items": removed[:2]},
    )


def redis_bytes(client: redis.Redis) -> int:
    """Bytes of the model's keys (MEMORY USAGE summed)."""
    return sum(
        client.memory_usage(name, samples=0) or 0 for name in client.scan_iter("wl:*", count=1000)
    )


# -- cells --------------------------------------------------------------------------


def test_cells_read_the_newest_entry_at_or_below_a_version_and_trim_to_the_live_ones() -> None:
    dim = 2
    dtype = cell_dtype(dim)

    def entry(version: int, value: float, removed: bool = False) -> np.ndarray:
        e = np.zeros(1, dtype)
        e["version"] = np.uint64(version) | (TOMBSTONE if removed else np.uint64(0))
        e["row"] = 0 if removed else value
        return e

    base = [entry(1, 1.0).tobytes(), None, entry(1, 3.0).tobytes()]
    new = np.concatenate([entry(2, 2.0), entry(2, 5.0), entry(2, 0, removed=True)])
    out = rewrite(base, dim, np.array([1], np.uint64), new)
    cells = out.cells()
    assert out.before.tolist() == [True, False, True]
    assert out.after.tolist() == [True, True, False]
    assert out.changed.all()
    for version, rows, found in (
        (1, [1.0, 0.0, 3.0], [True, False, True]),
        (2, [2.0, 5.0, 0.0], [True, True, False]),
        (9, [2.0, 5.0, 0.0], [True, True, False]),
    ):
        got, ok = decode(cells, dim, version, "test")
        assert got[:, 0].tolist() == rows and ok.tolist() == found, version
    # version 1 retired: only the newest entries stay; a lone tombstone goes
    trimmed = rewrite(cells, dim, np.array([2], np.uint64))
    assert trimmed.cells() == [entry(2, 2.0).tobytes(), entry(2, 5.0).tobytes(), None]
    assert trimmed.changed.tolist() == [True, False, True]  # the second held one entry
    groups = [(g.tolist(), raw.tobytes()) for g, raw in trimmed.by_count(np.arange(3))]
    assert groups == [([0, 1], entry(2, 2.0).tobytes() + entry(2, 5.0).tobytes())]
    # a dead publish's entries dropped, what was there before kept
    stripped = rewrite(cells, dim, np.array([1], np.uint64), drop=2)
    assert stripped.cells() == [base[0], None, base[2]]
    two = [(g.tolist(), raw.tobytes()) for g, raw in out.by_count(np.array([0, 2]))]
    assert two == [([0, 2], cells[0] + cells[2])]
    gone = rewrite([entry(3, 0, removed=True).tobytes()], dim, np.array([3], np.uint64))
    assert gone.cells() == [None] and gone.changed.tolist() == [True]
    assert list(gone.by_count(np.arange(1))) == []  # nothing left to write: deleted
    with pytest.raises(ValueError, match=r"test: a cell of 7 bytes, expected a multiple of 16"):
        decode([b"1234567"], dim, 1, "test")


# -- deltas on one Redis ------------------------------------------------------------


def test_a_delta_writes_only_its_rows_and_reads_as_its_chain(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    full(root, 1, n=3000)
    first = publish(root, redis_url)
    assert first.kind == "full"
    size = redis_bytes(r)
    with RedisStore(redis_url, "m", cache_rows=1000, poll_s=60) as store:
        assert_serves(store, engine_at(root), 1, ["users", "items"])
        rng = np.random.default_rng(3)
        for v in range(2, 7):  # five deltas: changed, new and removed rows
            changed = np.unique(np.concatenate([
                rng.integers(1, 3001, 30), np.arange(10_000 + v * 10, 10_000 + v * 10 + 5),
            ])).astype(np.uint64)  # fmt: skip
            removed = rng.integers(1, 3001, 4).astype(np.uint64)
            removed = np.setdiff1d(removed, changed)
            delta(root, v, v - 1, changed, removed)
            sets = r.info("commandstats").get("cmdstat_mset", {}).get("calls", 0)
            result = publish(root, redis_url)
            assert (result.kind, result.base, result.previous) == ("delta", v - 1, v - 1)
            assert result.rows == {"users": len(changed), "items": len(changed[::3])}
            assert result.removed_rows == {"users": len(removed), "items": len(removed[:2])}
            assert "delta on" in result.status() and "removed" in result.status()
            # one MSET per table and cell length (1-3 entries) for the delta and for the
            # trim of the version retention lets go; not one per row (3000 rows)
            assert r.info("commandstats")["cmdstat_mset"]["calls"] - sets <= 10
            wait_for(lambda v=v: store.version == v, timeout=5)
            engine = engine_at(root, v)
            assert_serves(store, engine, v, ["users", "items"])
            meta = store.metadata()
            assert meta["written"] == "delta" and meta["chain"] == list(range(1, v + 1))
            assert meta["tables"]["users"]["rows"] == len(all_keys(engine, "users"))
            engine.close()
    assert sorted(int(v) for v in r.zrange(Keys("m").index, 0, -1)) == [5, 6]
    # about one copy: the retired deltas' entries and lists are gone
    assert redis_bytes(r) < size * 1.2, (redis_bytes(r), size)
    # a rollback to 5 (retained) rewrites nothing and reads 5's rows
    back = publish(root, redis_url, version=5)
    assert (back.written, back.made_current) == (False, True)
    with RedisStore(redis_url, "m") as store:
        assert_serves(store, engine_at(root, 5), 5, ["users", "items"])
    # 7 on 6 (6 is still its generation's newest): a delta again
    delta(root, 7, 6, np.arange(1, 20, dtype=np.uint64), np.zeros(0, np.uint64))
    assert publish(root, redis_url).kind == "delta"
    # a delta whose parent is not in Redis: written as a full copy
    r.flushall()
    again = publish(root, redis_url, version=7)
    assert again.kind == "full"
    with RedisStore(redis_url, "m") as store:
        assert_serves(store, engine_at(root, 7), 7, ["users", "items"])


def test_a_replica_that_missed_deltas_catches_up_and_lookups_never_mix_versions(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    n = 2000
    full(root, 1, n=n)
    publish(root, redis_url)
    deaf = Deaf(redis_url, "m", cache_rows=0, poll_s=0.3)
    keys = np.arange(0, n + 50, dtype=np.uint64)
    expected = {1: {t: engine_at(root, 1).lookup(t, keys) for t in DIMS}}
    errors: list[str] = []
    seen: set[int] = set()
    stop = threading.Event()

    def work(store: RedisStore, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            table = ("users", "items")[int(rng.integers(2))]
            pick = rng.integers(0, len(keys), 200)
            got = store.lookup(table, keys[pick])
            seen.add(got.version)
            want = expected.get(got.version)
            if want is None:
                errors.append(f"version {got.version} answered before it was published")
            elif not (
                np.array_equal(got.rows, want[table].rows[pick])
                and np.array_equal(got.found, want[table].found[pick])
            ):
                errors.append(f"{table} answer labelled {got.version} mixes versions")

    with RedisStore(redis_url, "m", cache_rows=300, poll_s=0.2) as store:
        threads = [threading.Thread(target=work, args=(s, i)) for i, s in enumerate([store, deaf])]
        for t in threads:
            t.start()
        try:
            for v in range(2, 12):
                rng = np.random.default_rng(v)
                changed = rng.integers(0, n + 50, 200).astype(np.uint64)
                removed = np.setdiff1d(rng.integers(0, n, 20).astype(np.uint64), changed)
                delta(root, v, v - 1, np.unique(changed), removed)
                engine = engine_at(root, v)
                expected[v] = {t: engine.lookup(t, keys) for t in DIMS}
                engine.close()
                assert publish(root, redis_url, retention=2).kind == "delta"
            wait_for(lambda: store.version == 11 and deaf.version == 11, timeout=10)
            time.sleep(0.2)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
            deaf.close()
    assert errors == []
    assert len(seen) > 2, seen


# -- Redis Cluster ------------------------------------------------------------------


def test_a_cluster_serves_fulls_and_deltas_with_one_round_trip_per_node(
    tmp_path: Path, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "m"
    full(root, 1, n=3000)
    result = publish(root, cluster.url)
    assert result.kind == "full" and result.url == cluster.url
    changed = np.arange(1, 400, 3, dtype=np.uint64)
    delta(root, 2, 1, changed, np.arange(2000, 2010, dtype=np.uint64))
    rounds: list[list[str]] = []
    original = redis_nodes.Deployment._round

    def counting(self, commands, groups, *rest):  # type: ignore[no-untyped-def]
        rounds.append(sorted(groups))
        return original(self, commands, groups, *rest)

    with RedisStore(cluster.url, "m", cache_rows=0, poll_s=60) as store:
        layout = store.state.layout  # type: ignore[union-attr]
        assert layout.shards == 24  # 8 per master
        owners = {cluster.owner(int(s)) for s in layout.slots}
        assert owners == set(cluster.ports)  # the shards spread over the three nodes
        assert_serves(store, engine_at(root, 1), 1, ["users", "items"])
        assert publish(root, cluster.url).kind == "delta"
        wait_for(lambda: store.version == 2, timeout=5)
        assert_serves(store, engine_at(root, 2), 2, ["users", "items"])
        monkeypatch.setattr(redis_nodes.Deployment, "_round", counting)
        store.lookup("users", np.arange(1, 1001, dtype=np.uint64))
        assert len(rounds) == 1 and len(rounds[0]) == 3  # one round, every node once
    # the same through a serving replica, and the query form of the URL
    first = f"redis://127.0.0.1:{cluster.ports[0]}?cluster=true"
    with RedisModelStore(first, "m", None).start() as served:
        got = served.lookup("users", changed)
        assert got.version == 2 and got.found.all() and (got.rows[:, 0] == 2).all()


def test_a_cluster_follows_a_slot_migrated_under_it(tmp_path: Path, cluster: Cluster) -> None:
    root = tmp_path / "m"
    full(root, 1, n=4000)
    publish(root, cluster.url, shards=3)
    engine = engine_at(root)
    with RedisStore(cluster.url, "m", cache_rows=0) as store:
        layout: Layout = store.state.layout  # type: ignore[union-attr]
        slot = int(layout.slots[0])
        source = cluster.owner(slot)
        target = next(p for p in cluster.ports if p != source)
        src, dst = cluster.client(source), cluster.client(target)
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", cluster.node_id(source))
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", cluster.node_id(target))
        raw = redis_nodes.Deployment(cluster.url, 5)  # binary key names, undecoded
        names = raw.command(slot, "CLUSTER", "GETKEYSINSLOT", slot, 100_000)
        raw.close()
        half = names[: len(names) // 2]
        src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *half)
        assert_serves(store, engine, 1, ["users", "items"])  # ASK, TRYAGAIN: followed
        rest = names[len(names) // 2 :]
        src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *rest)
        left = src.execute_command("CLUSTER COUNTKEYSINSLOT", slot)
        assert left == 0, (left, src.execute_command("CLUSTER GETKEYSINSLOT", slot, 10))
        for port in [target, source, *(p for p in cluster.ports if p not in (source, target))]:
            with cluster.client(port) as c:
                c.execute_command("CLUSTER SETSLOT", slot, "NODE", cluster.node_id(target))
        wait_for(lambda: cluster.owner(slot) == target, timeout=10)
        assert_serves(store, engine, 1, ["users", "items"])  # MOVED: the map refreshed
        src.close()
        dst.close()
        delta(root, 2, 1, np.arange(1, 50, dtype=np.uint64), np.zeros(0, np.uint64))
        assert publish(root, cluster.url).kind == "delta"  # writes follow it too
        wait_for(lambda: store.version == 2, timeout=5)
        assert_serves(store, engine_at(root, 2), 2, ["users", "items"])
    engine.close()


def test_a_node_down_is_named(tmp_path: Path, cluster: Cluster) -> None:
    root = tmp_path / "m"
    full(root, 1, n=500)
    publish(root, cluster.url)
    with RedisModelStore(cluster.url, "m", None, cache_rows=0).start() as served:
        assert served.lookup("users", [1, 2]).found.all()
        keys = Keys("m")
        down = next(p for p in cluster.ports if p != cluster.owner(keys.slot))
        cluster.stop(down)
        with pytest.raises(Unavailable, match=rf"node 127\.0\.0\.1:{down} .*unreachable"):
            served.lookup("users", np.arange(1, 501, dtype=np.uint64))
        with pytest.raises(RedisStoreError, match=rf"127\.0\.0\.1:{down}"):
            RedisStore(cluster.url, "m")


def test_bad_cluster_urls_are_named() -> None:
    for url, why in (
        ("redis+cluster://", "names no node"),
        ("redis+cluster://h1", "'h1' is not host:port"),
        ("redis+cluster://h1:1/3", "only database 0"),
        ("unix+cluster://x:1", "a cluster URL is redis\\+cluster://"),
    ):
        with pytest.raises(ValueError, match=rf"bad Redis URL .*{why}"):
            redis_nodes.Deployment(url, 1)
    port = free_port()
    with pytest.raises(RedisStoreError, match=rf"any node of the Redis Cluster.*:{port}"):
        redis_nodes.Deployment(f"redis+cluster://:pw@127.0.0.1:{port}", 1)
