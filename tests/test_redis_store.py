"""The Redis store for a fleet (``wuliang publish``: ``redis.publish``; the
replica's ``RedisStore``: ``redis.replica``, ``redis.cache``) against a real
redis-server started on a free loopback port: lookups equal ``apply_chain``
into an engine; replicas switch on an announcement (and by polling the
pointer when one is missed), and may start before the first publish; the
pointer flips only after every row is written; retention, readers'
versions, idempotence and rollback; concurrent lookups while versions are
published and retired (each answer exactly one version's rows); the command
line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from row_chunks import version_rows
from small_model import make_session, reader, write_data

from wuliang.export import SessionSource, export
from wuliang.ps_server import SGD, Engine, RowChunk, TableSpec, UnknownTableError
from wuliang.ps_server.storage import ModelDescription, SparseInput, Version, VersionWriter
from wuliang.serving.redis import publish as redis_publish
from wuliang.serving.redis import replica as redis_replica
from wuliang.serving.redis.cache import RowCache
from wuliang.serving.redis.keys import Keys, Layout, RedisStoreError, row_keys
from wuliang.serving.redis.publish import publish
from wuliang.serving.redis.replica import NoVersionError, RedisStore
from wuliang.serving.versions import apply_chain

SCRIPT = Path(sys.executable).parent / "wuliang"
DIMS = {"users": 4, "items": 3}
UNKNOWN = np.array([10**12, 10**12 + 1, 2**64 - 1], np.uint64)  # never published


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the server, emptied for each test."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


# -- exports written directly: each row of version v reads [v, key, key/2, ...] --


def signed_rows(version: int, table: str, keys: np.ndarray) -> RowChunk:
    keys = np.asarray(keys, np.uint64)
    dim = DIMS[table]
    weights = np.empty((len(keys), dim), np.float32)
    weights[:, 0] = version
    weights[:, 1] = keys
    weights[:, 2:] = (keys.astype(np.float32) / 2)[:, None] + np.arange(dim - 2)
    return version_rows(keys, weights, version)


def write_version(
    root: Path,
    number: int,
    tables: dict[str, np.ndarray],
    parent: int | None = None,
    removed: dict[str, np.ndarray] | None = None,
) -> Version:
    """An export version as ``wuliang export`` lays it out (no SavedModel):
    full when parent is None, else a delta of parent; LATEST names it."""
    with VersionWriter(root, str(number), "full" if parent is None else "delta") as writer:
        for table, keys in tables.items():
            spec = TableSpec(table, DIMS[table], optimizer=SGD())
            writer.write_table(spec, [signed_rows(number, table, keys)], state=False)
            if parent is not None:
                gone = (removed or {}).get(table, np.zeros(0, np.uint64))
                writer.write_removed(table, np.asarray(gone, np.uint64))
        path = writer.commit(
            number=number,
            parent=parent,
            engine_version=number,
            step=10 * number,
            model=ModelDescription(sparse=tuple(SparseInput(t, t) for t in tables)),
            source="test",
            reason="",
        )
    (root / "LATEST").write_text(f"{number}\n")
    return Version(path)


def full(root: Path, number: int, n: int = 300, offset: int = 0) -> Version:
    keys = np.arange(offset + 1, offset + n + 1, dtype=np.uint64)
    return write_version(root, number, {"users": keys, "items": keys[::2] * 7})


def engine_at(export_dir: Path, version: int | None = None) -> Engine:
    engine = Engine(num_shards=2)
    apply_chain(engine, export_dir, version)
    return engine


def all_keys(engine: Engine, table: str) -> np.ndarray:
    return np.sort(np.concatenate([c.keys for c in engine.export(table)]))


def assert_serves(store: RedisStore, engine: Engine, version: int, tables: list[str]) -> None:
    """Every key of every table reads as the engine's row, unknown keys as
    zeros not found, all labelled version."""
    assert store.tables() == {t: engine.spec(t).dim for t in tables}
    for table in tables:
        keys = np.concatenate([all_keys(engine, table), UNKNOWN])
        for _ in range(2):  # cold, then from the cache
            got = store.lookup(table, keys)
            want = engine.lookup(table, keys)
            assert got.version == version
            assert got.rows.dtype == np.float32 and got.rows.shape == want.rows.shape
            np.testing.assert_array_equal(got.rows, want.rows, err_msg=table)
            np.testing.assert_array_equal(got.found, want.found, err_msg=table)
            assert not got.found[-len(UNKNOWN) :].any()
            assert not got.rows[-len(UNKNOWN) :].any()


def namespaces(client: redis.Redis, model: str) -> set[int]:
    """The versions that have any key in Redis: listed in the index, a
    metadata key, a sentinel."""
    found = {int(v) for v in client.zrange(Keys(model).index, 0, -1)}
    for name in client.scan_iter(match=f"wl:{{{model}*", count=1000):
        parts = name.decode(errors="replace").split("}:", 1)[1].split(":")
        if parts[-1] == "meta" or (len(parts) == 1 and parts[0].startswith("v")):
            found.add(int(parts[0].lstrip("v")))
    return found


def wait_for(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- tests --------------------------------------------------------------------------


def test_a_trained_model_serves_from_redis_as_from_its_chain(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    files = write_data(tmp_path)
    exports = tmp_path / "exports"
    session = make_session()
    session.train(reader(files, 0), steps=5)
    export(SessionSource(session), exports)
    session.train(reader(files, 0), steps=3)
    erased = {}
    for table in ("users", "items"):
        keys = np.arange(40, dtype=np.uint64)
        erased[table] = keys[session.context.engine.contains(table, keys)][:3]
        session.context.engine.erase(table, erased[table])
    assert export(SessionSource(session), exports).kind == "delta"
    session.context.close()

    result = publish(exports, redis_url)  # model: the folder's name
    assert (result.model, result.version, result.written) == ("exports", 2, True)
    assert result.status().startswith("publish exports version 2: items ")
    engine = engine_at(exports)
    assert result.rows == {t: len(all_keys(engine, t)) for t in ("users", "items")}
    with RedisStore(redis_url, "exports") as store:
        assert store.version == 2
        assert_serves(store, engine, 2, ["users", "items"])
        assert store.model_description() == Version(exports / "2").model.to_dict()
        assert store.metadata()["step"] == Version(exports / "2").step
        for table, keys in erased.items():  # removed by the delta: gone
            assert not store.lookup(table, keys).found.any()
        as_int64 = store.lookup("users", all_keys(engine, "users").astype(np.int64))
        np.testing.assert_array_equal(
            as_int64.rows, engine.lookup("users", all_keys(engine, "users")).rows
        )
        empty = store.lookup("items", np.zeros(0, np.uint64))
        assert empty.rows.shape == (0, 4) and empty.found.shape == (0,)
        with pytest.raises(UnknownTableError, match=r"no table 'nope'.*tables: items, users"):
            store.lookup("nope", [1])
    with pytest.raises(RuntimeError, match="closed"):
        store.lookup("users", [1])
    engine.close()


def test_large_lookups_go_in_several_mgets(
    tmp_path: Path, redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_replica, "READ_BATCH", 64)
    full(tmp_path / "m", 1, n=1000)
    publish(tmp_path / "m", redis_url)
    engine = engine_at(tmp_path / "m")
    with RedisStore(redis_url, "m", cache_rows=100) as store:  # evicts as it goes
        assert_serves(store, engine, 1, ["users", "items"])
        assert store.stats()["tables"]["users"]["cached"] == 100
    with RedisStore(redis_url, "m", cache_rows=0) as store:  # no cache
        assert_serves(store, engine, 1, ["users", "items"])
        assert store.stats()["tables"]["users"]["hits"] == 0
    engine.close()


def test_a_delta_switches_replicas_by_announcement_and_by_polling(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    full(root, 1)
    publish(root, redis_url)
    changed = np.arange(1, 50, dtype=np.uint64)
    new = np.arange(5000, 5020, dtype=np.uint64)
    write_version(
        root,
        2,
        {"users": np.concatenate([changed, new]), "items": new},
        parent=1,
        removed={"users": np.arange(100, 110, dtype=np.uint64)},
    )
    with (
        RedisStore(redis_url, "m", poll_s=60) as heard,  # only an announcement moves it
        RedisStore(redis_url, "m", poll_s=0.2) as polling,
    ):
        assert heard.version == polling.version == 1
        assert heard.lookup("users", changed).rows[:, 0].tolist() == [1.0] * len(changed)
        result = publish(root, redis_url)
        assert (result.version, result.previous) == (2, 1)
        wait_for(lambda: heard.version == 2, timeout=5)
        engine = engine_at(root)
        assert_serves(heard, engine, 2, ["users", "items"])
        assert heard.lookup("users", changed).rows[:, 0].tolist() == [2.0] * len(changed)
        assert heard.stats()["switches"] == 1

        r.set(Keys("m").current, 1)  # a rollback nobody announced
        wait_for(lambda: polling.version == 1, timeout=5)
        assert polling.lookup("users", changed).version == 1
        assert heard.version == 2  # polls once a minute
    engine.close()


def test_the_pointer_flips_only_after_every_row_is_written(
    tmp_path: Path, redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_publish, "WRITE_BATCH", 500)
    monkeypatch.setattr(redis_publish, "PIPELINE_ROWS", 1000)  # many round trips
    root, n = tmp_path / "m", 20_000
    full(root, 1, n=n)
    publish(root, redis_url)
    full(root, 2, n=n, offset=3)
    keys = Keys("m")
    expected = {}
    for v in (1, 2):
        engine = engine_at(root, v)
        layout = Layout.new("m", v, 1)  # generation v, one shard on one Redis
        names = [
            name for t in DIMS for name in row_keys(layout.cell_prefix(0, t), all_keys(engine, t))
        ]
        expected[v] = names
        engine.close()
    problems: list[str] = []
    seen: dict[str, int] = {"paused": 0, "checks": 0}
    done = threading.Event()

    def check() -> None:
        current = int(reader.get(keys.current))
        if reader.get(keys.meta(current)) is None:
            problems.append(f"version {current} current without its metadata")
        missing = sum(v is None for v in reader.mget(expected[current]))
        if missing:
            problems.append(f"version {current} current with {missing} rows missing")
        seen["checks"] += 1

    def poll() -> None:
        base = reader.dbsize()
        while not done.is_set():
            check()
            if not seen["paused"] and reader.dbsize() > base + 10:  # 2 is being written
                reader.execute_command("CLIENT", "PAUSE", 2000, "WRITE")  # the publisher waits
                try:
                    partial = sum(v is not None for v in reader.mget(expected[2]))
                    current = int(reader.get(keys.current))
                    # half written and not current (or, on a slow machine, every
                    # row written and the pointer not flipped yet)
                    if partial == 0 or (current != 1 and partial < len(expected[2])):
                        problems.append(f"paused at {partial} rows of 2, current {current}")
                    check()
                finally:
                    reader.execute_command("CLIENT", "UNPAUSE")
                seen["paused"] = partial

    def poll_safely() -> None:
        try:
            poll()
        except Exception as error:
            problems.append(f"poller: {error!r}")

    reader = redis.Redis.from_url(redis_url)
    thread = threading.Thread(target=poll_safely)
    thread.start()
    try:
        result = publish(root, redis_url)
    finally:
        done.set()
        thread.join(timeout=30)
    check()
    assert not thread.is_alive()
    assert result.version == 2 and int(r.get(keys.current)) == 2
    assert problems == []
    assert seen["paused"], "the poller never saw version 2 half written"
    reader.close()


def test_retention_keeps_the_newest_versions_and_those_replicas_read(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    for v in range(1, 5):
        full(root, v, n=50, offset=v)
        result = publish(root, redis_url)  # retention 2
        assert namespaces(r, "m") == {v - 1, v} - {0}
        assert result.removed == ([v - 2] if v > 2 else [])
    assert sorted(int(v) for v in r.zrange(Keys("m").index, 0, -1)) == [3, 4]
    full(root, 5, n=50)
    assert publish(root, redis_url, retention=1).removed == [3, 4]
    assert namespaces(r, "m") == {5}

    with RedisStore(redis_url, "m", version=5) as pinned:  # a replica reading 5
        full(root, 6, n=50)
        result = publish(root, redis_url, retention=1)
        assert (result.removed, result.kept_for_readers) == ([], [5])
        assert "kept versions 5 (replicas read them)" in result.status()
        assert namespaces(r, "m") == {5, 6}
        assert pinned.lookup("users", [1, 2]).version == 5
    full(root, 7, n=50)
    assert publish(root, redis_url, retention=1).removed == [5, 6]  # its reader key is gone
    assert namespaces(r, "m") == {7}
    with pytest.raises(ValueError, match="retention must be an integer >= 1"):
        publish(root, redis_url, retention=0)


def test_a_lookup_on_a_retired_version_moves_to_the_current_one(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    full(root, 1)
    publish(root, redis_url)
    store = RedisStore(redis_url, "m", cache_rows=0, poll_s=60)
    store._stop.set()  # its follower falls behind: it hears nothing more
    store._thread.join()
    r.zrem(Keys("m").readers, store._member)  # and its reader entry expired
    for v in (2, 3):
        full(root, v, offset=v)
        publish(root, redis_url, retention=1)
    assert namespaces(r, "m") == {3} and store.version == 1
    got = store.lookup("users", [5, 6])
    assert got.version == 3 and got.rows[:, 0].tolist() == [3.0, 3.0]
    assert store.stats()["retries"] == 1 and store.version == 3
    store.close()


def test_publishing_again_writes_nothing_and_rollback_rewrites_nothing(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    full(root, 1)
    publish(root, redis_url)
    meta = r.get(Keys("m").meta(1))

    def writes() -> int:
        stats = r.info("commandstats")
        calls = ("mset", "eval", "evalsha")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in calls)

    before, size = writes(), r.dbsize()
    again = publish(root, redis_url)
    assert (again.written, again.made_current) == (False, False)
    assert again.status() == (
        f"publish m version 1 is already current at {redis_url}; nothing written"
    )
    assert writes() == before and r.dbsize() == size and r.get(Keys("m").meta(1)) == meta

    full(root, 2, offset=9)
    publish(root, redis_url)
    with RedisStore(redis_url, "m") as store:
        assert store.version == 2
        calls = r.info("commandstats").get("cmdstat_mset", {}).get("calls", 0)
        back = publish(root, redis_url, version=1)  # still in Redis (retention 2)
        assert (back.written, back.made_current, back.previous) == (False, True, 2)
        assert "already in Redis, rows not rewritten; now current (was 2)" in back.status()
        assert r.info("commandstats")["cmdstat_mset"]["calls"] == calls
        wait_for(lambda: store.version == 1, timeout=5)
        assert store.lookup("users", [1]).rows[0, 0] == 1.0

    other = tmp_path / "other" / "m"  # another export under the same name and number
    full(other, 1, n=10)
    with pytest.raises(ValueError, match="already holds version 1 of model 'm' from another"):
        publish(other, redis_url)


def test_a_publish_killed_midway_leaves_nothing_behind(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    full(root, 1)
    publish(root, redis_url)
    full(root, 2, n=200_000)
    size = r.dbsize()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child = subprocess.Popen(
        [str(SCRIPT), "publish", "--export-dir", str(root), "--redis", redis_url],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: r.dbsize() > size + 1000, timeout=60)  # writing version 2's rows
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert int(r.get(Keys("m").current)) == 1
    assert r.get(Keys("m").lock) is not None  # it expires after 30 s; an operator may delete it
    r.delete(Keys("m").lock)
    full(root, 3, n=20)
    result = publish(root, redis_url, retention=1)  # removes the dead publish's rows too
    assert result.removed == [1, 2] and namespaces(r, "m") == {3}
    # metadata, cells, sentinel; pointer, index, generation map and counter
    assert r.dbsize() == 1 + 20 + 10 + 1 + 4


def test_a_publisher_that_lost_its_lock_changes_nothing_it_no_longer_owns(
    tmp_path: Path, redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_publish, "WRITE_BATCH", 100)
    monkeypatch.setattr(redis_publish, "PIPELINE_ROWS", 100)  # a renewal every 100 rows
    root, keys = tmp_path / "m", Keys("m")
    full(root, 1)
    publish(root, redis_url)
    full(root, 2, n=30_000)
    size = r.dbsize()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            publish(root, redis_url)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: r.dbsize() > size + 200, timeout=30)  # rows of 2 are being written
    r.set(keys.lock, "another publisher")  # its lock expired and someone took it
    thread.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], RedisStoreError), outcome
    assert "lost the publish lock wl:{m}:lock" in str(outcome[0])
    assert int(r.get(keys.current)) == 1 and r.get(keys.lock) == b"another publisher"
    assert r.zscore(keys.index, "2") == 0  # its rows stay listed, not deleted: not its lock now
    assert 2 in namespaces(r, "m")
    r.delete(keys.lock)
    again = publish(root, redis_url)  # clears the leftovers, writes 2 whole
    assert again.written and again.rows["users"] == 30_000
    engine = engine_at(root)
    with RedisStore(redis_url, "m") as store:
        assert_serves(store, engine, 2, ["users", "items"])
    engine.close()


def test_concurrent_lookups_each_read_exactly_one_version(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    root = tmp_path / "m"
    n = 2000
    full(root, 1, n=n)
    publish(root, redis_url)
    expected = {}
    engines = {}
    keys = np.arange(0, n + 400, dtype=np.uint64)  # some never there, some from later versions
    errors: list[str] = []
    answers: dict[int, int] = {}
    stop = threading.Event()

    def expect(v: int) -> None:
        engines[v] = engine_at(root, v)
        expected[v] = {t: engines[v].lookup(t, keys) for t in DIMS}

    expect(1)
    lock = threading.Lock()

    def work(store: RedisStore, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            table = ("users", "items")[int(rng.integers(2))]
            pick = rng.integers(0, len(keys), int(rng.integers(1, 300)))
            got = store.lookup(table, keys[pick])
            with lock:
                answers[got.version] = answers.get(got.version, 0) + 1
                want = expected.get(got.version)
            if want is None:
                errors.append(f"version {got.version} answered before it was published")
                continue
            if not (
                np.array_equal(got.rows, want[table].rows[pick])
                and np.array_equal(got.found, want[table].found[pick])
            ):
                errors.append(f"{table} answer labelled {got.version} has other rows")

    stores = [RedisStore(redis_url, "m", cache_rows=500, poll_s=0.5) for _ in range(2)]
    threads = [threading.Thread(target=work, args=(stores[i % 2], i)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for v in (2, 3, 4):
            full(root, v, n=n, offset=v * 100)
            expect(v)
            time.sleep(0.3)
            publish(root, redis_url, retention=1)  # retires versions being read
        wait_for(lambda: all(s.version == 4 for s in stores), timeout=10)
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        for s in stores:
            s.close()
        for e in engines.values():
            e.close()
    assert errors == []
    assert set(answers) == {1, 2, 3, 4}, answers


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package
    return subprocess.run(
        [str(SCRIPT), "publish", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_the_command_line(tmp_path: Path, redis_url: str, r: redis.Redis) -> None:
    root = tmp_path / "exports"
    full(root, 1)
    done = cli("--export-dir", str(root), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "publish exports version 1: items 150 rows, users 300 rows written at step 10; "
        "now current (first version); "
    )
    assert lines[0].endswith(f"-> {redis_url}")
    again = cli("--export-dir", str(root), "--redis", redis_url, "--model", "exports", cwd=tmp_path)
    assert again.returncode == 0 and "already current" in again.stdout

    port = free_port()  # nothing listens there
    down = f"redis://:secret@127.0.0.1:{port}/0"
    failed = cli("--export-dir", str(root), "--redis", down, cwd=tmp_path)
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.startswith(
        f"wuliang publish: error: cannot reach Redis at redis://:***@127.0.0.1:{port}/0"
    )
    assert "secret" not in failed.stderr and "Traceback" not in failed.stderr

    failed = cli("--export-dir", str(root), "--redis", "localhost:6379", cwd=tmp_path)
    assert failed.returncode == 1
    assert failed.stderr.startswith("wuliang publish: error: bad Redis URL 'localhost:6379'")
    failed = cli("--export-dir", str(tmp_path / "none"), "--redis", redis_url, cwd=tmp_path)
    assert failed.returncode == 1
    assert failed.stderr.strip() == (
        f"wuliang publish: error: export directory {tmp_path / 'none'} does not exist"
    )
    failed = cli("--export-dir", str(root), "--redis", redis_url, "--version", "9", cwd=tmp_path)
    assert failed.returncode == 1
    assert failed.stderr.strip() == (
        f"wuliang publish: error: {root} has no version 9 (versions: 1)"
    )
    failed = cli("--export-dir", str(root), "--redis", redis_url, "--model", "a b", cwd=tmp_path)
    assert failed.returncode == 1 and "model name 'a b' cannot be used" in failed.stderr
    failed = cli("--export-dir", str(root), "--redis", redis_url, "--retention", "0", cwd=tmp_path)
    assert failed.returncode == 2 and "must be an integer >= 1" in failed.stderr
    failed = cli("--export-dir", str(root), cwd=tmp_path)
    assert failed.returncode == 2 and "--redis" in failed.stderr


def test_store_errors_name_what_is_wrong(redis_url: str, r: redis.Redis) -> None:
    with RedisStore(redis_url, "ghost") as ghost:  # waits for its first publish
        assert ghost.version == 0 and ghost.tables() == {} and ghost.metadata() == {}
        with pytest.raises(NoVersionError, match=r"model 'ghost' has no published version"):
            ghost.lookup("users", [1])
    port = free_port()
    with pytest.raises(RedisStoreError, match=f"cannot reach Redis at redis://127.0.0.1:{port}"):
        RedisStore(f"redis://127.0.0.1:{port}", "m")
    with pytest.raises(ValueError, match="model name 'a:b'"):
        RedisStore(redis_url, "a:b")
    r.set(Keys("m").current, 4)
    with pytest.raises(RedisStoreError, match=r"version 4 of model 'm' is not in Redis"):
        RedisStore(redis_url, "m")


def test_the_clock_cache_stays_bounded_and_exact() -> None:
    cache = RowCache(64, 3)
    rng = np.random.default_rng(7)
    truth = {}  # key -> (row, found), what every insert said

    def row_of(key: int) -> np.ndarray:
        return np.array([key, key % 7, -key], np.float32)

    hot = np.arange(5, dtype=np.uint64)  # read before every insert: CLOCK keeps them
    for step in range(300):
        keys = np.unique(rng.integers(0, 400, int(rng.integers(1, 40))).astype(np.uint64))
        rows, found, missing = cache.read(np.concatenate([hot, keys]))
        hit = np.setdiff1d(np.arange(len(hot) + len(keys)), missing)
        for i in hit:  # whatever is cached is exactly what was inserted
            key = int(np.concatenate([hot, keys])[i])
            np.testing.assert_array_equal(rows[i], truth[key][0])
            assert found[i] == truth[key][1]
        if step > 2:
            assert not np.isin(np.arange(len(hot)), missing).any(), "a hot key was evicted"
        todo = np.unique(np.concatenate([hot, keys])[missing])
        new_rows = np.stack([row_of(int(k)) for k in todo]) if len(todo) else np.zeros((0, 3))
        new_found = todo % 3 != 0
        cache.insert(todo, new_rows.astype(np.float32), new_found)
        for k, r, f in zip(todo.tolist(), new_rows, new_found, strict=True):
            truth[k] = (r, f)
        assert len(cache.slot_of) == min(cache.used, 64) <= 64
        slots = np.array(list(cache.slot_of.values()))
        assert len(np.unique(slots)) == len(slots)  # one key per slot
        np.testing.assert_array_equal(cache.keys[slots], list(cache.slot_of))
    assert cache.hits > 0 and cache.misses > 0
    cache.insert(
        np.arange(1000, 1200, dtype=np.uint64), np.ones((200, 3), np.float32), np.ones(200, bool)
    )
    assert len(cache.slot_of) == 64 and set(cache.slot_of) == set(range(1136, 1200))
    cache.clear()
    rows, found, missing = cache.read(np.arange(3, dtype=np.uint64))
    assert len(missing) == 3 and cache.slot_of == {}


def test_a_switch_carries_the_hot_rows_read_at_the_new_version(
    tmp_path: Path, redis_url: str, r: redis.Redis
) -> None:
    """The keys a replica's cache holds are read again at the new version
    before it switches: after a publish its lookups of them hit the cache,
    and the rows are the new version's (changed ones changed, removed ones
    gone)."""
    root = tmp_path / "m"
    full(root, 1)
    publish(root, redis_url)
    hot = np.arange(1, 120, dtype=np.uint64)
    changed = hot[::3]
    removed = np.setdiff1d(hot[1::10], changed)  # an export never lists a key in both
    nothing = np.zeros(0, np.uint64)
    write_version(
        root, 2, {"users": changed, "items": nothing}, parent=1, removed={"users": removed}
    )
    with RedisStore(redis_url, "m", poll_s=60) as store:
        store.lookup("users", hot)  # cached at version 1
        assert store.stats()["tables"]["users"]["cached"] == len(hot)
        publish(root, redis_url)
        wait_for(lambda: store.version == 2, timeout=5)
        stats = store.stats()
        assert stats["warmed"] >= len(hot)
        assert stats["tables"]["users"]["cached"] == len(hot)
        got = store.lookup("users", hot)
        assert store.stats()["tables"]["users"]["misses"] == 0  # every one was cached
        engine = engine_at(root)
        want = engine.lookup("users", hot)
        engine.close()
        assert got.version == 2
        np.testing.assert_array_equal(got.rows, want.rows)
        np.testing.assert_array_equal(got.found, want.found)
        assert not got.found[np.isin(hot, removed)].any()
        assert (got.rows[np.isin(hot, changed), 0] == 2).all()
