"""Table ids are reused, dropped tables are freed, and a call that races a
drop either runs on the live table or raises UnknownTableError."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from wuliang.ps_server import SGD, Constant, Engine, TableSpec, UnknownTableError, _engine
from wuliang.ps_server.engine import PullPart, PushPart

MakeEngine = Callable[[int], Engine]  # the make_engine fixture (conftest.py)
SLOT_BITS = 14  # Engine::kSlotBits


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_many_drop_create_cycles_reuse_ids_and_free_memory() -> None:
    """A serving process drops and re-creates tables for years: far more than
    the 16,384 tables that may live at once, without memory growing."""
    engine = Engine(num_shards=2)
    engine.create_table(TableSpec("keep", dim=4))
    spec = TableSpec("t", dim=8)
    keys = np.arange(4, dtype=np.uint64)
    ids = set()
    cycles, warmup = 100_000, 10_000
    start = time.perf_counter()
    for i in range(cycles):
        if i == warmup:
            warm_rss = rss_bytes()
        engine.create_table(spec)
        if i % 1000 == 0:
            engine.push("t", keys, np.ones((4, 8), np.float32))
            ids.add(engine._id("t"))
        engine.drop_table("t")
    elapsed = time.perf_counter() - start
    growth = rss_bytes() - warm_rss
    # Leaking a table definition (~1 KiB) per cycle would add ~90 MiB.
    assert growth < 8 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over {cycles - warmup} cycles"
    assert len(ids) == 100 and {i & ((1 << SLOT_BITS) - 1) for i in ids} == {1}
    assert engine.tables() == ["keep"]
    engine.create_table(spec)
    assert engine.pull("t", keys, train=False).shape == (4, 8)
    # Neither create nor drop hands work to the shard workers (a table
    # without reserve_rows faults nothing in): the Python wrapper dominates.
    assert elapsed < 60, f"{cycles} cycles took {elapsed:.1f} s"
    engine.close()


def test_stale_ids_raise_unknown_table(make_engine: MakeEngine) -> None:
    engine = make_engine(2)
    engine.create_table(TableSpec("a", dim=2, initializer=Constant(1.0)))
    native = engine.native
    old = native.table_id("a")
    keys = np.arange(3, dtype=np.uint64)
    engine.drop_table("a")
    engine.create_table(TableSpec("b", dim=2, initializer=Constant(2.0)))
    new = native.table_id("b")
    assert new != old and new & 0x3FFF == old & 0x3FFF  # the slot is reused
    calls = {
        "pull": lambda: native.pull(old, keys),
        "push": lambda: native.push(old, keys, np.zeros((3, 2), np.float32)),
        "pull_many": lambda: native.pull_many([(old, keys, np.zeros((3, 2), np.float32), None)]),
        "erase": lambda: native.erase(old, keys),
        "contains": lambda: native.contains(old, keys),
        "stats": lambda: native.stats(old),
        "evict": lambda: native.evict(old),
        "spec": lambda: native.spec(old),
        "export": lambda: native.export_chunk(old, 0, 10, _engine.ExportCursor()),
        "removed_log": lambda: native.removed_log(old, 0),
        "pending_counts": lambda: native.pending_counts(old),
        "load": lambda: native.load(old, keys, np.zeros((3, 2), np.float32)),
        "never issued": lambda: native.stats(12345),
        "negative": lambda: native.stats(-2),
    }
    for name, call in calls.items():
        with pytest.raises(UnknownTableError, match="no table with id") as info:
            call()
        assert isinstance(info.value, KeyError), name
        assert str(info.value).startswith("no table with id"), name  # not quoted
    assert (engine.pull("b", keys, train=False) == 2.0).all()
    stats = engine.stats("b")
    assert stats["rows"] == 0 and stats["pulled_keys"] == 3  # nothing reached b
    with pytest.raises(UnknownTableError, match=r"unknown table 'a' \(tables: b\)"):
        native.table_id("a")
    with pytest.raises(UnknownTableError, match=r"unknown table 'a' \(tables: b\)"):
        native.drop_table("a")


def test_calls_racing_drop_and_recreate(make_engine: MakeEngine) -> None:
    """Threads pull and push a table by name while another thread drops and
    re-creates it, each incarnation with its own dim and initial value: every
    call works on a live table (and sees only its values) or raises
    UnknownTableError; never a crash, never another table's data."""
    engine = make_engine(2)
    engine.create_table(TableSpec("other", dim=4, initializer=Constant(-1.0)))

    def dim_of(value: float) -> int:
        return 4 + 4 * (int(value) % 3)

    def spec(i: int) -> TableSpec:  # incarnation i: all its rows read i
        return TableSpec("t", dim_of(i), optimizer=SGD(), initializer=Constant(float(i)))

    engine.create_table(spec(0))
    stop = threading.Event()
    done = {"ok": 0, "unknown": 0}
    errors: list[BaseException] = []

    def user(seed: int) -> None:
        keys = np.arange(seed, seed + 256, dtype=np.uint64)
        try:
            while not stop.is_set():
                try:
                    rows = engine.pull("t", keys, train=seed % 2 == 0)
                    # All of one incarnation, with its own dim.
                    assert (rows == rows[0, 0]).all() and rows.shape[1] == dim_of(rows[0, 0])
                    dim = rows.shape[1]
                    # Another incarnation may have come since: the wrapper
                    # then checks shapes against its dim (ValueError below).
                    engine.push("t", keys, np.zeros((len(keys), dim), np.float32))
                    out = np.empty((len(keys), dim), np.float32)
                    engine.pull_many([PullPart("t", keys, out)])
                    assert (out == out[0, 0]).all() and dim_of(out[0, 0]) == dim
                    engine.push_many([PushPart("t", keys, np.zeros_like(out))], unique=True)
                    done["ok"] += 1
                except UnknownTableError:
                    done["unknown"] += 1
                    time.sleep(0.0001)  # the GIL to the dropping thread
                except ValueError as e:  # shape checks against a newer incarnation's dim
                    if "has shape" not in str(e):
                        raise
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=user, args=(s * 1000,)) for s in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    rounds = 0
    while rounds < 300 or done["ok"] < 100:
        engine.drop_table("t")
        engine.create_table(spec(rounds))
        rounds += 1
        seen = done["ok"]
        while done["ok"] == seen and time.monotonic() < deadline and not errors:
            time.sleep(0.0002)  # let the users reach this incarnation
        if time.monotonic() > deadline or errors:
            break
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert done["ok"] >= 100 and rounds >= 300, (done, rounds)
    assert (engine.pull("other", np.arange(10, dtype=np.uint64)) == -1.0).all()
    assert engine.stats("other")["rows"] == 10
