"""Admission (when a key gets a row) and eviction (which rows go, and their memory)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from wuliang import admission, eviction
from wuliang.ps_server import (
    SGD,
    Adagrad,
    Admission,
    Engine,
    Eviction,
    PullPart,
    PushPart,
    RowChunk,
    TableSpec,
    TruncatedNormal,
    Zeros,
)

MakeEngine = Callable[[int], Engine]  # the make_engine fixture (conftest.py)
ExportAll = Callable[..., RowChunk]  # the export_all fixture (conftest.py)

SHARDS = pytest.mark.parametrize("num_shards", [1, 3])


def sgd_table(
    engine: Engine,
    name: str = "t",
    dim: int = 4,
    admit: Admission | None = None,
    evict: Eviction | None = None,
) -> str:
    spec = TableSpec(
        name,
        dim=dim,
        optimizer=SGD(learning_rate=1.0),
        initializer=TruncatedNormal(stddev=0.1),
        seed=11,
        admission=admit or Admission(),
        eviction=evict or Eviction(),
    )
    engine.create_table(spec)
    return name


def ones(n: int, dim: int = 4) -> np.ndarray:
    return np.ones((n, dim), np.float32)


# --- admission ----------------------------------------------------------------


def test_wrappers_build_the_specs() -> None:
    assert admission.MinCount(3) == Admission(min_count=3)
    assert admission.MinCount(2, pending_capacity=100) == Admission(2, pending_capacity=100)
    assert eviction.TTL(steps=5) == Eviction(ttl_steps=5)
    assert eviction.TTL(seconds=7) == Eviction(ttl_seconds=7)
    assert eviction.MinCount(4) == Eviction(min_count=4)
    assert eviction.MaxRows(9) == Eviction(max_rows=9)
    combined = eviction.TTL(steps=10) | eviction.MaxRows(5) | eviction.MinCount(2)
    assert combined == Eviction(ttl_steps=10, max_rows=5, min_count=2)
    assert combined.enabled and not Eviction().enabled
    with pytest.raises(ValueError, match="steps or seconds"):
        eviction.TTL()
    with pytest.raises(ValueError, match="n >= 1"):
        eviction.MaxRows(0)


@SHARDS
def test_admitted_on_nth_training_pull(
    num_shards: int, make_engine: MakeEngine, export_all: ExportAll
) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, admit=Admission(min_count=3))
    keys = np.array([10, 20, -5], np.int64)
    initial = engine.pull(t, keys, train=False)

    for sighting in (1, 2):
        np.testing.assert_array_equal(engine.pull(t, keys), initial)
        assert not engine.contains(t, keys).any()
        assert engine.stats(t)["pending_keys"] == len(keys)
        result = engine.push(t, keys, ones(3))  # dropped: not admitted yet
        assert (result.applied, result.dropped_pending) == (0, 3)
        assert engine.stats(t)["dropped_pending"] == 3 * sighting
        for _ in range(4):  # lookups and pushes are not sightings
            engine.pull(t, keys, train=False)
        np.testing.assert_array_equal(engine.pull(t, keys, train=False), initial)

    np.testing.assert_array_equal(engine.pull(t, keys), initial)  # third sighting: admitted
    assert engine.contains(t, keys).all()
    stats = engine.stats(t)
    assert (stats["admitted"], stats["inserted"], stats["pending_keys"]) == (3, 3, 0)
    assert stats["pull_misses"] == (2 + 11) * 3  # 2 pending training pulls, 11 lookups
    np.testing.assert_array_equal(export_all(engine, t).counts, [2, 2, 2])  # n - 1

    assert engine.push(t, keys, ones(3)).applied == 3
    np.testing.assert_array_equal(export_all(engine, t).counts, [3, 3, 3])
    np.testing.assert_allclose(engine.pull(t, keys, train=False), initial - 1)


@SHARDS
def test_push_creates_rows_only_without_admission(num_shards: int, make_engine: MakeEngine) -> None:
    engine = make_engine(num_shards)
    free, gated = sgd_table(engine, "free"), sgd_table(engine, "gated", admit=Admission(2))
    keys = np.arange(100, 110, dtype=np.int64)
    assert engine.push(free, keys, ones(10)).applied == 10
    assert engine.contains(free, keys).all()
    assert engine.stats(free)["inserted"] == 10
    result = engine.push(gated, keys, ones(10))
    assert (result.applied, result.dropped_pending) == (0, 10)
    assert not engine.contains(gated, keys).any()
    assert engine.stats(gated)["pending_keys"] == 0  # a push is not a sighting


def test_erase_forgets_pending_sightings(make_engine: MakeEngine) -> None:
    engine = make_engine(2)
    t = sgd_table(engine, admit=Admission(min_count=2))
    engine.pull(t, [7])
    assert engine.erase(t, [7]) == 0
    assert engine.stats(t)["pending_keys"] == 0
    engine.pull(t, [7])
    assert not engine.contains(t, [7]).any()
    engine.pull(t, [7])
    assert engine.contains(t, [7]).all()


@pytest.mark.parametrize("capacity", [64, 4])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_pending_keys_are_bounded(num_shards: int, capacity: int, make_engine: MakeEngine) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, admit=Admission(min_count=3, pending_capacity=capacity))
    most = 0
    for batch in range(60):
        engine.pull(t, np.arange(batch * 50, batch * 50 + 50, dtype=np.int64))
        most = max(most, engine.stats(t)["pending_keys"])
    assert most <= capacity * num_shards
    stats = engine.stats(t)
    assert stats["pending_forgotten"] > 0
    assert stats["pending_keys"] + stats["pending_forgotten"] == 3000  # each key seen once
    assert stats["rows"] == 0


def test_pending_counts_are_halved_beyond_capacity(make_engine: MakeEngine) -> None:
    """The key past capacity halves every count: one-off keys go, frequent keys keep half."""
    engine = make_engine(1)
    t = sgd_table(engine, admit=Admission(min_count=10, pending_capacity=64))
    hot = np.array([7], np.int64)
    for _ in range(8):
        engine.pull(t, hot)
    engine.pull(t, np.arange(1000, 1063, dtype=np.int64))  # 64 pending keys: still exact
    assert engine.stats(t)["pending_forgotten"] == 0
    engine.pull(t, [5000])  # halves: hot 8 -> 4, the 63 one-off keys are forgotten
    stats = engine.stats(t)
    assert (stats["pending_forgotten"], stats["pending_keys"]) == (63, 2)
    for _ in range(5):
        engine.pull(t, hot)
    assert not engine.contains(t, hot).any()  # 4 + 5 sightings
    engine.pull(t, hot)
    assert engine.contains(t, hot).all()  # the 10th counted sighting
    assert engine.stats(t)["admitted"] == 1


@pytest.mark.parametrize(("source", "target"), [(1, 3), (3, 1), (2, 2)])
def test_pending_counts_reload_into_any_shard_count(
    source: int, target: int, make_engine: MakeEngine
) -> None:
    first = make_engine(source)
    t = sgd_table(first, admit=Admission(min_count=4))
    for n in (30, 20, 10):  # keys 0-9 seen 3 times, 10-19 twice, 20-29 once
        first.pull(t, np.arange(n, dtype=np.int64))
    first.pull(t, np.arange(5, dtype=np.int64))  # 0-4: a 4th sighting admits them
    keys, counts = first.pending_counts(t)
    assert keys.dtype == np.uint64 and counts.dtype == np.uint32
    np.testing.assert_array_equal(keys, np.arange(5, 30))  # sorted by key
    np.testing.assert_array_equal(counts, [3] * 5 + [2] * 10 + [1] * 10)

    second = make_engine(target)
    sgd_table(second, admit=Admission(min_count=4))
    second.pull(t, [0, 1, 2, 3, 4])  # these have rows here: their counts are skipped
    second.pull(t, [0, 1, 2, 3, 4])
    second.pull(t, [0, 1, 2, 3, 4])
    second.pull(t, [0, 1, 2, 3, 4])
    second.load_pending(
        t, np.r_[np.arange(5, dtype=np.uint64), keys], np.r_[np.full(5, 9, np.uint32), counts]
    )
    got_keys, got_counts = second.pending_counts(t)
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(got_counts, counts)
    second.pull(t, np.arange(30, dtype=np.int64))  # one more sighting each
    np.testing.assert_array_equal(
        second.contains(t, np.arange(30, dtype=np.int64)), [1] * 10 + [0] * 20
    )
    second.load_pending(t, [25], [0])  # 0 forgets
    assert 25 not in second.pending_counts(t)[0]
    with pytest.raises(ValueError, match="counts has shape"):
        second.load_pending(t, [1, 2], [1])
    with pytest.raises(TypeError, match="counts"):
        second.native.load_pending(0, np.array([1], np.uint64), None)


def test_a_push_leaves_rows_a_later_steps_pull_admitted(make_engine: MakeEngine) -> None:
    """A trainer that pulls step s + 1 before pushing step s passes each call's
    step: the key admitted by pull s + 1 had no row at step s, so push s is
    dropped for it, as when the calls run one after the other."""
    engine = make_engine(2)
    t = sgd_table(engine, admit=Admission(min_count=2))
    keys = np.array([1, 2, 3], np.int64)
    out = np.empty((3, 4), np.float32)
    engine.pull_many([PullPart(t, keys, out)], step=7)  # first sighting: no rows
    engine.pull_many([PullPart(t, keys[:2], out[:2])], step=8)  # 1, 2 admitted at step 8
    initial = engine.pull(t, keys, train=False)
    result = engine.push_many([PushPart(t, keys, ones(3))], step=7)
    assert (result.applied, result.dropped_pending) == (0, 3)
    np.testing.assert_array_equal(engine.pull(t, keys, train=False), initial)
    (chunk,) = engine.export(t)
    assert sorted(zip(chunk.keys.tolist(), chunk.steps.tolist(), strict=True)) == [(1, 8), (2, 8)]
    assert engine.push_many([PushPart(t, keys, ones(3))], step=8).applied == 2
    np.testing.assert_array_equal(engine.pull(t, keys[:2], train=False), initial[:2] - 1)
    # without a step, a push updates every row it finds (the engine's own step)
    engine.pull_many([PullPart(t, keys[2:], out[:1])], step=9)
    assert engine.push_many([PushPart(t, keys, ones(3))]).applied == 3
    for bad in (-1, 1.5, True, 2**64 - 1):
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            engine.push_many([PushPart(t, keys, ones(3))], step=bad)  # type: ignore[arg-type]


# --- eviction -----------------------------------------------------------------


@SHARDS
def test_ttl_steps(num_shards: int, make_engine: MakeEngine) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, evict=eviction.TTL(steps=10))
    old, young, pulled = (np.arange(i * 100, i * 100 + 20, dtype=np.int64) for i in (1, 2, 3))
    engine.push(t, old, ones(20))
    engine.pull(t, pulled)  # created at step 0, then only pulled: never updated
    engine.step = 5
    engine.push(t, young, ones(20))
    engine.step = 12
    engine.pull(t, pulled)
    version = engine.version
    engine.advance_version()

    result = engine.evict(t)
    assert result == {"ttl": 40, "min_count": 0, "lfu": 0, "shrunk": 0, "total": 40}
    assert not engine.contains(t, old).any() and not engine.contains(t, pulled).any()
    assert engine.contains(t, young).all()
    assert sorted(engine.removed_keys(t, since=version).tolist()) == sorted([*old, *pulled])
    engine.step = 15  # 10 steps old: not older than the TTL
    assert engine.evict(t)["ttl"] == 0
    engine.step = 16
    assert engine.evict(t)["ttl"] == 20
    stats = engine.stats(t)
    assert (stats["rows"], stats["evicted_ttl"]) == (0, 60)


@SHARDS
def test_ttl_seconds(num_shards: int, make_engine: MakeEngine) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, evict=eviction.TTL(seconds=100))
    now = int(time.time())
    keys = np.arange(1, 31, dtype=np.int64)
    times = np.repeat(np.array([now - 1000, now - 50, now + 3600], np.uint32), 10)
    engine.load(t, keys, np.zeros((30, 4), np.float32), times=times)
    engine.push(t, [1000, 1001], ones(2))  # updated now
    assert engine.evict(t) == {"ttl": 10, "min_count": 0, "lfu": 0, "shrunk": 0, "total": 10}
    np.testing.assert_array_equal(engine.contains(t, keys), times != now - 1000)
    assert engine.contains(t, [1000, 1001]).all()
    assert engine.stats(t)["evicted_ttl"] == 10


@SHARDS
def test_min_count_spares_rows_updated_since_previous_evict(
    num_shards: int, make_engine: MakeEngine
) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, evict=eviction.MinCount(3))
    frequent, rare, rare2, rare3 = (np.arange(i * 10, i * 10 + 5, dtype=np.int64) for i in range(4))

    engine.step = 1
    for _ in range(3):
        engine.push(t, frequent, ones(5))
    engine.push(t, rare, ones(5))
    engine.step = 2
    assert engine.evict(t)["min_count"] == 0  # first call: every row gets one period
    engine.step = 3
    engine.push(t, rare2, ones(5))
    engine.step = 4
    engine.push(t, rare3, ones(5))
    assert engine.evict(t)["min_count"] == 5
    assert not engine.contains(t, rare).any()
    assert engine.contains(t, np.concatenate([frequent, rare2, rare3])).all()
    engine.step = 5
    assert engine.evict(t)["min_count"] == 5  # rare2 (step 3 < 4); rare3 was updated at 4
    assert not engine.contains(t, rare2).any() and engine.contains(t, rare3).all()
    engine.step = 6
    assert engine.evict(t)["min_count"] == 5
    assert engine.contains(t, frequent).all()
    stats = engine.stats(t)
    assert (stats["rows"], stats["evicted_min_count"]) == (5, 15)


@SHARDS
def test_max_rows_evicts_least_frequently_updated(num_shards: int, make_engine: MakeEngine) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, evict=eviction.MaxRows(50))
    groups = [np.arange(i * 1000, i * 1000 + 25, dtype=np.int64) for i in range(1, 5)]
    for times, keys in enumerate(groups, start=1):  # group i is pushed i times
        for _ in range(times):
            engine.push(t, keys, ones(25))
    assert engine.evict(t) == {"ttl": 0, "min_count": 0, "lfu": 50, "shrunk": 0, "total": 50}
    assert not engine.contains(t, np.concatenate(groups[:2])).any()
    assert engine.contains(t, np.concatenate(groups[2:])).all()
    assert engine.stats(t)["evicted_lfu"] == 50
    assert engine.evict(t)["total"] == 0


@SHARDS
def test_max_rows_evicts_oldest_among_equal_counts(
    num_shards: int, make_engine: MakeEngine, rng: np.random.Generator
) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, evict=eviction.MaxRows(70))
    keys = rng.permutation(np.arange(1, 121, dtype=np.int64))
    counts = np.repeat(np.array([1, 2, 7], np.uint32), [30, 60, 30])
    steps = rng.permutation(1000).astype(np.uint64)[:120]
    engine.load(t, keys, np.zeros((120, 4), np.float32), counts=counts, steps=steps)

    assert engine.evict(t)["lfu"] == 50
    twos = np.flatnonzero(counts == 2)
    oldest_twos = twos[np.argsort(steps[twos])[:20]]
    evicted = np.zeros(120, bool)
    evicted[counts == 1] = True
    evicted[oldest_twos] = True
    np.testing.assert_array_equal(engine.contains(t, keys), ~evicted)


@SHARDS
def test_ttl_then_max_rows(num_shards: int, make_engine: MakeEngine) -> None:
    engine = make_engine(num_shards)
    t = sgd_table(engine, evict=eviction.TTL(steps=5) | eviction.MaxRows(10))
    stale, once, twice = (np.arange(i * 100, i * 100 + 10, dtype=np.int64) for i in (1, 2, 3))
    for _ in range(3):
        engine.push(t, stale, ones(10))
    engine.step = 10
    engine.push(t, once, ones(10))
    engine.push(t, twice, ones(10))
    engine.push(t, twice, ones(10))
    assert engine.evict(t) == {"ttl": 10, "min_count": 0, "lfu": 10, "shrunk": 0, "total": 20}
    assert engine.contains(t, twice).all()
    assert engine.stats(t)["rows"] == 10


def test_evict_all_tables(make_engine: MakeEngine) -> None:
    engine = make_engine(2)
    a = sgd_table(engine, "a", evict=eviction.TTL(steps=1))
    b = sgd_table(engine, "b", evict=eviction.MaxRows(3))
    c = sgd_table(engine, "c")  # no policy: nothing goes
    for name in (a, b, c):
        engine.push(name, np.arange(10, dtype=np.int64), ones(10))
    engine.step = 5
    assert engine.evict() == {"ttl": 10, "min_count": 0, "lfu": 7, "shrunk": 0, "total": 17}
    assert [engine.stats(name)["rows"] for name in (a, b, c)] == [0, 3, 10]


def test_evicted_keys_are_gone_and_listed(make_engine: MakeEngine) -> None:
    engine = make_engine(3)
    t = sgd_table(engine, evict=eviction.TTL(steps=1))
    keys = np.array([5, -7, 2**40], np.int64)
    initial = engine.pull(t, keys, train=False)
    engine.push(t, keys, ones(3))
    engine.push(t, [99], ones(1))  # not listed: removed before `since`
    engine.step = 3
    engine.erase(t, [99])
    since = engine.advance_version() - 1
    engine.evict(t)
    assert not engine.contains(t, keys).any()
    np.testing.assert_array_equal(engine.pull(t, keys, train=False), initial)
    removed = engine.removed_keys(t, since=since)
    assert removed.dtype == np.uint64
    assert sorted(removed.tolist()) == sorted(keys.view(np.uint64).tolist())
    assert sorted(engine.removed_keys(t).tolist()) == sorted([99, *keys.view(np.uint64).tolist()])


def test_eviction_compacts_memory_and_keeps_survivors(
    make_engine: MakeEngine, export_all: ExportAll, rng: np.random.Generator
) -> None:
    engine = make_engine(2)
    spec = TableSpec(
        "big",
        dim=16,
        optimizer=Adagrad(),
        initializer=Zeros(),
        eviction=eviction.TTL(steps=50),
    )
    engine.create_table(spec)
    n = 300_000
    keys = rng.permutation(n).astype(np.int64) * 7919 + 1
    weights = rng.standard_normal((n, 16)).astype(np.float32)
    state = rng.random((n, 16)).astype(np.float32)
    survive = rng.random(n) < 0.2
    steps = np.where(survive, 100, 0).astype(np.uint64)
    engine.load("big", keys, weights, state=state, steps=steps, counts=np.ones(n, np.uint32))
    before = engine.stats("big")
    assert before["rows"] == n

    engine.step = 100
    assert engine.evict("big")["ttl"] == n - survive.sum()
    after = engine.stats("big")
    assert after["rows"] == survive.sum()
    assert after["bytes"] < 0.5 * before["bytes"]
    assert after["row_bytes"] < 0.5 * before["row_bytes"]
    assert after["index_bytes"] < before["index_bytes"]
    assert after["rows_moved"] > 0 and after["chunks_released"] > 0

    rows = export_all(engine, "big")  # moved rows kept their weights, state and meta
    order = np.argsort(keys[survive].view(np.uint64))
    np.testing.assert_array_equal(rows.keys, keys[survive].view(np.uint64)[order])
    np.testing.assert_array_equal(rows.weights, weights[survive][order])
    np.testing.assert_array_equal(rows.state, state[survive][order])
    np.testing.assert_array_equal(rows.steps, 100)
    np.testing.assert_array_equal(rows.counts, 1)

    # The compacted pool takes new rows and updates them correctly.
    new = np.arange(-5000, 0, dtype=np.int64)
    engine.push("big", new, np.ones((5000, 16), np.float32))
    np.testing.assert_array_equal(engine.pull("big", keys[survive][:1000]), weights[survive][:1000])
    expected = -0.01 * 1 / (np.sqrt(np.float32(0.1) + 1) + 1e-7)
    np.testing.assert_allclose(engine.pull("big", new), expected, rtol=1e-6)
