"""Export (full and delta), removal records and load: rows move between engines exactly."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from wuliang.ps_server import SGD, Adagrad, Adam, Engine, RowChunk, TableSpec, Uniform

MakeEngine = Callable[[int], Engine]  # the make_engine fixture (conftest.py)
ExportAll = Callable[..., RowChunk]  # the export_all fixture (conftest.py)

SPEC = TableSpec("emb", dim=5, optimizer=Adam(learning_rate=0.05), initializer=Uniform(), seed=9)
COLUMNS = ("keys", "weights", "state", "counts", "steps", "times", "versions")


def train(engine: Engine, rng: np.random.Generator, keys: np.ndarray, steps: range) -> None:
    for step in steps:
        engine.step = step
        idx = rng.integers(0, len(keys), size=len(keys) // 2)
        engine.pull(SPEC.name, keys[idx])
        engine.push(SPEC.name, keys[idx], rng.standard_normal((len(idx), SPEC.dim)).astype("f4"))
        if step % 2:
            engine.advance_version()


def load_chunks(engine: Engine, chunks: list[RowChunk]) -> None:
    for c in chunks:
        engine.load(SPEC.name, c.keys, c.weights, c.state, c.counts, c.steps, c.times, c.versions)


def assert_same_rows(a: RowChunk, b: RowChunk, columns: tuple[str, ...] = COLUMNS) -> None:
    for name in columns:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_round_trip_between_shard_counts(
    make_engine: MakeEngine, export_all: ExportAll, rng: np.random.Generator
) -> None:
    source, target = make_engine(2), make_engine(5)
    source.create_table(SPEC)
    target.create_table(SPEC)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, size=400, dtype=np.int64))
    train(source, rng, keys, range(6))
    assert len(set(export_all(source, "emb").versions.tolist())) > 1

    chunks = list(source.export("emb", chunk_rows=7))
    assert all(0 < len(c) <= 7 for c in chunks)
    assert sum(len(c) for c in chunks) == source.stats("emb")["rows"]
    load_chunks(target, chunks)
    assert target.stats("emb")["rows"] == source.stats("emb")["rows"]
    assert_same_rows(export_all(target, "emb", chunk_rows=3), export_all(source, "emb"))
    np.testing.assert_array_equal(
        target.pull("emb", keys, train=False), source.pull("emb", keys, train=False)
    )

    # Training both the same way keeps them identical.
    while target.version < source.version:
        target.advance_version()
    state = rng.bit_generator.state
    train(source, rng, keys, range(6, 9))
    rng.bit_generator.state = state
    train(target, rng, keys, range(6, 9))
    a, b = export_all(source, "emb"), export_all(target, "emb")
    assert_same_rows(a, b, ("keys", "weights", "state", "counts", "steps", "versions"))
    assert np.abs(a.times.astype(np.int64) - b.times).max() <= 2


def test_load_overwrites_exactly_and_defaults(
    make_engine: MakeEngine, export_all: ExportAll
) -> None:
    engine = make_engine(3)
    engine.create_table(TableSpec("a", dim=2, optimizer=Adagrad(initial_accumulator=0.25)))
    engine.step = 42
    engine.push("a", [1, 2], np.ones((2, 2), np.float32))
    version = engine.advance_version()
    start = int(time.time())
    engine.load("a", [2, 3], np.array([[1, 2], [3, 4]], np.float32))
    rows = export_all(engine, "a")
    assert rows.keys.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(rows.weights[1:], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(rows.state[1:], 0.25)  # initial state
    assert rows.counts.tolist() == [1, 0, 0]
    assert rows.steps.tolist() == [42, 42, 42]
    assert rows.versions.tolist() == [version - 1, version, version]
    assert (rows.times[1:] >= start).all() and (rows.times[1:] <= time.time()).all()

    explicit = {
        "state": np.array([[5, 6]], np.float32),
        "counts": np.array([17], np.uint32),
        "steps": np.array([3], np.uint64),
        "times": np.array([1234], np.uint32),
        "versions": np.array([99], np.uint64),
    }
    engine.load("a", [1], np.array([[7, 8]], np.float32), **explicit)
    row = export_all(engine, "a")
    assert row.weights[0].tolist() == [7, 8]
    for name, values in explicit.items():
        np.testing.assert_array_equal(getattr(row, name)[:1], values, err_msg=name)
    assert engine.stats("a")["rows"] == 3


def test_sgd_rows_have_no_state(make_engine: MakeEngine, export_all: ExportAll) -> None:
    engine = make_engine(2)
    engine.create_table(TableSpec("s", dim=3, optimizer=SGD()))
    assert engine.spec("s").state_dim == 0
    engine.pull("s", [1, 2])
    rows = export_all(engine, "s")
    assert rows.state.shape == (2, 0) and rows.state.dtype == np.float32
    engine.load("s", rows.keys, rows.weights, rows.state)
    assert engine.stats("s")["rows"] == 2


def test_delta_export_and_removed_keys(make_engine: MakeEngine, export_all: ExportAll) -> None:
    engine = make_engine(2)
    engine.create_table(SPEC)
    old = np.arange(1, 21, dtype=np.int64)
    engine.push("emb", old, np.ones((20, 5), np.float32))
    since = engine.version
    assert engine.advance_version() == since + 1
    assert len(export_all(engine, "emb", since=since)) == 0

    engine.pull("emb", old)  # reading existing rows does not modify them
    engine.pull("emb", old, train=False)
    engine.push("emb", old[:3], np.ones((3, 5), np.float32))
    engine.pull("emb", [100, 101])  # new rows are modified rows
    engine.load("emb", [200], np.zeros((1, 5), np.float32))
    assert engine.erase("emb", old[15:]) == 5

    delta = export_all(engine, "emb", since=since, chunk_rows=2)
    assert delta.keys.tolist() == [1, 2, 3, 100, 101, 200]
    np.testing.assert_array_equal(delta.versions, since + 1)
    assert len(export_all(engine, "emb")) == 18
    assert sorted(engine.removed_keys("emb", since=since).tolist()) == list(range(16, 21))
    assert engine.stats("emb")["removed_log"] == 5

    mid = engine.advance_version()
    engine.erase("emb", [1])
    assert engine.removed_keys("emb", since=mid - 1).tolist() == [1]
    assert len(engine.removed_keys("emb", since=mid)) == 0
    assert len(engine.removed_keys("emb", since=since)) == 6
    engine.trim_removed("emb", upto=mid - 1)  # forgets the first five only
    assert engine.removed_keys("emb", since=0).tolist() == [1]
    engine.trim_removed("emb", upto=mid)
    assert len(engine.removed_keys("emb")) == 0
    assert engine.stats("emb")["removed_log"] == 0


def test_loaded_versions_drive_delta_export(make_engine: MakeEngine, export_all: ExportAll) -> None:
    engine = make_engine(3)
    engine.create_table(SPEC)
    keys = np.arange(10, dtype=np.int64)
    versions = np.arange(10, dtype=np.uint64) * 10
    engine.load("emb", keys, np.zeros((10, 5), np.float32), versions=versions)
    assert export_all(engine, "emb", since=45).keys.tolist() == [5, 6, 7, 8, 9]
    assert len(export_all(engine, "emb", since=90)) == 0


def test_export_refuses_a_table_changed_under_it(make_engine: MakeEngine) -> None:
    engine = make_engine(1)
    engine.create_table(SPEC)
    engine.pull("emb", np.arange(1000, dtype=np.int64))
    chunks = engine.export("emb", chunk_rows=100)
    first = next(chunks)
    assert len(first) == 100
    engine.erase("emb", first.keys[:1])
    with pytest.raises(RuntimeError, match="table 'emb' shard 0 changed during export"):
        next(chunks)
    assert sum(len(c) for c in engine.export("emb", chunk_rows=100)) == 999


def test_delta_follows_the_change_log_and_falls_back_to_a_scan(
    make_engine: MakeEngine, export_all: ExportAll
) -> None:
    """The change log lists the keys changed per version; once it is cut
    (bounded memory, rows loaded with old versions) a delta reaching further
    back scans the rows instead, with the same result."""
    engine = make_engine(1)
    spec = TableSpec("big", dim=2, optimizer=SGD())
    engine.create_table(spec)
    first = engine.version
    keys = np.arange(200_000, dtype=np.int64)
    engine.pull("big", keys)  # 200K new rows at the first version
    second = engine.advance_version()
    engine.push("big", keys[:5], np.ones((5, 2), np.float32))
    assert engine.erase("big", keys[10_000:]) == 190_000
    third = engine.advance_version()
    engine.push("big", keys[3:13], np.ones((10, 2), np.float32))  # 3, 4 changed twice

    stats = engine.stats("big")
    assert stats["change_floor"] == first  # the first version was dropped: 10K rows left
    assert stats["change_log"] == 15
    everything = export_all(engine, "big")
    for since in (first - 1, first, second):  # a scan, then the log twice
        delta = export_all(engine, "big", since=since)
        expected = everything.keys[everything.versions > since]
        assert delta.keys.tolist() == expected.tolist()
    assert export_all(engine, "big", since=first).keys.tolist() == list(range(13))
    assert export_all(engine, "big", since=second).keys.tolist() == list(range(3, 13))

    rows = export_all(engine, "big")  # loading rows with their versions cuts the log
    engine.load("big", rows.keys, rows.weights, versions=np.full(len(rows), third, np.uint64))
    assert engine.stats("big")["change_floor"] == third
    assert len(export_all(engine, "big", since=second)) == len(rows)  # a scan


def test_removal_log_round_trip_and_bounds(make_engine: MakeEngine) -> None:
    engine = make_engine(3)
    engine.create_table(SPEC)
    engine.pull("emb", np.arange(10, dtype=np.int64))
    v1 = engine.version
    engine.erase("emb", [1, 2])
    v2 = engine.advance_version()
    engine.erase("emb", [3])
    keys, versions = engine.removed_log("emb")
    assert sorted(keys[:2].tolist()) == [1, 2] and keys[2] == 3
    assert versions.tolist() == [v1, v1, v2]

    other = make_engine(2)
    other.create_table(SPEC)
    other.load_removed("emb", keys, versions, floor=v1 - 1)
    assert other.removed_log("emb", since=v1)[0].tolist() == [3]
    assert other.stats("emb")["removed_floor"] == v1 - 1
    with pytest.raises(ValueError, match="sorted by version"):
        other.load_removed("emb", keys[::-1].copy(), versions[::-1].copy())
    with pytest.raises(ValueError, match="versions"):
        other.load_removed("emb", keys, versions[:1])

    # Bounded: about twice the live rows (+ 8192 per shard) are kept.
    one = make_engine(1)
    one.create_table(TableSpec("churn", dim=1, optimizer=SGD()))
    for start in range(0, 400_000, 100_000):
        batch = np.arange(start, start + 100_000, dtype=np.int64)
        one.pull("churn", batch)
        one.erase("churn", batch)
        one.advance_version()
    stats = one.stats("churn")
    assert stats["removed_log"] <= 2 * 65_536 and stats["removed_floor"] > 0
    assert stats["change_log"] <= 2 * 65_536 and stats["change_floor"] > 0
