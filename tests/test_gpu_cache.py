"""The GPU hot cache (``wuliang.ps_server.cache``): the same rows as the
engine alone, bit for bit, for every optimizer and both policies; its
counters; write-back, versions and the change log; the policy and its
index; the kernels against the engine's compiled arithmetic; the factory's
address form and ``Context(gpu_cache_rows=)``; a silent cupy import.

Every case runs with numpy arrays here and again with cupy (``needs_gpu``)
where a GPU is present. The conformance suite (tests/test_ps_conformance.py)
runs the cache through the whole interface as well."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wuliang.ps_server import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Engine,
    Eviction,
    Optimizer,
    ParameterServer,
    PullPart,
    PushPart,
    RowChunk,
    TableSpec,
    TruncatedNormal,
    parameter_server,
)
from wuliang.ps_server.cache import CachedServer, KeyIndex, SlotIndex, array_module, gpu_available
from wuliang.ps_server.cache.index import OVER_VICTIM, REPEAT
from wuliang.ps_server.cache.kernels import (
    F32,
    OptimizerMath,
    engine_float_model,
    kernels_for,
)
from wuliang.ps_server.chunk import concat_rows, take_rows

XPS = ["numpy", pytest.param("cupy", marks=pytest.mark.needs_gpu)]
OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": SGD(learning_rate=0.1),
    "sgd-clip": SGD(learning_rate=0.1, clip_norm=0.5),
    "adagrad": Adagrad(learning_rate=0.05, initial_accumulator=0.1, epsilon=1e-7),
    "adagrad-clip": Adagrad(learning_rate=0.05, initial_accumulator=0.2, clip_norm=0.7),
    "adam": Adam(learning_rate=0.01, beta1=0.9, beta2=0.999, epsilon=1e-7),
    "adam-clip": Adam(learning_rate=0.02, beta1=0.8, beta2=0.99, epsilon=1e-6, clip_norm=0.6),
    "ftrl": FTRL(learning_rate=0.05, l1=0.2, l2=0.1, beta=1.0, initial_accumulator=0.1),
    "ftrl-clip": FTRL(learning_rate=0.1, l1=0.05, l2=0.3, beta=0.5, clip_norm=0.8),
}
COLUMNS = ("keys", "weights", "state", "counts", "steps", "times", "versions", "shows", "clicks")
SAME_STATS = (
    "rows",
    "pulled_keys",
    "pull_misses",
    "pushed_keys",
    "dropped_nan",
    "dropped_pending",
    "inserted",
    "change_log",
    "change_floor",
    "removed_log",
)


def all_rows(ps: ParameterServer, table: str, since: int = 0) -> RowChunk:
    spec = ps.spec(table)
    rows = concat_rows(list(ps.export(table, since=since)), spec.dim, spec.state_dim)
    return take_rows(rows, np.argsort(rows.keys))


def assert_same_rows(a: RowChunk, b: RowChunk) -> None:
    for name in COLUMNS:
        if name == "times":  # unix seconds of the push: each side's own clock
            assert np.abs(a.times.astype(np.int64) - b.times.astype(np.int64)).max(initial=0) <= 2
        else:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def twins(
    spec: TableSpec, xp: str, rows: int, policy: str = "stats"
) -> tuple[Engine, CachedServer]:
    alone = Engine(2)
    cached = CachedServer(Engine(2), rows=rows, xp=xp, policy=policy, half_life=20)
    alone.create_table(spec)
    cached.create_table(spec)
    return alone, cached


def run_both(
    alone: ParameterServer,
    cached: ParameterServer,
    table: str,
    rng: np.random.Generator,
    steps: int,
    pool: np.ndarray,
    start: int = 1,
) -> None:
    """Training steps on both servers (Zipf-like keys with repeats, gradient
    rows of every size, a non-finite row now and then, pushes in halves,
    show and click increments), checking that every pull and push result
    is the same."""
    dim = alone.spec(table).dim
    weights = 1.0 / np.arange(1, len(pool) + 1) ** 1.1
    for step in range(start, start + steps):
        keys = pool[rng.choice(len(pool), size=48, p=weights / weights.sum())]
        outs = [np.empty((len(keys), dim), F32) for _ in range(2)]
        for ps, out in zip((alone, cached), outs, strict=True):
            ps.pull_many([PullPart(table, keys, out)], step=step)
        np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"pull of step {step}")
        grads = rng.standard_normal((len(keys), dim)).astype(F32)
        grads *= rng.uniform(0.05, 2.0, (len(keys), 1)).astype(F32)
        if step % 5 == 0:
            grads[3, 0] = np.nan
        shows = rng.uniform(0.5, 3.0, len(keys)).astype(F32)
        clicks = (rng.random(len(keys)) < 0.3).astype(F32)
        if step % 3 == 0:  # unique keys in two halves, with the rows they report
            unique, first = np.unique(keys, return_index=True)
            g = grads[first]
            stats = {"shows": shows[first], "clicks": clicks[first]} if step % 2 else {}
            shared = np.where(np.arange(len(unique)) % 2 == 0, np.arange(len(unique)), -1)
            shared = shared.astype(np.int32)
            results, reports = [], []
            for ps in (alone, cached):
                updated = np.full((len(unique), dim), -7, F32)
                part = PushPart(table, unique, g, updated=updated, updated_rows=shared, **stats)
                first_half = ps.push_many([part], unique=True, only="updated", step=step)
                second = ps.push_many([part], unique=True, only="rest", step=step)
                results.append((first_half, second))
                reports.append(updated)
            assert results[0] == results[1], f"push of step {step}"
            np.testing.assert_array_equal(reports[0], reports[1])
        else:
            results = [
                ps.push(table, keys, grads, step=step, shows=shows, clicks=clicks)
                for ps in (alone, cached)
            ]
            assert results[0] == results[1], f"push of step {step}"


@pytest.mark.parametrize("policy", ["stats", "lru"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("xp", XPS)
def test_same_rows_as_the_engine_alone(xp: str, opt_name: str, policy: str) -> None:
    """Pulls and pushes through a small cache (rows come and go every step)
    give exactly what the engine alone gives: every pulled row, push result
    and reported row, then every exported column (times to the second),
    the deltas since a version, and the engine's counters."""
    spec = TableSpec(
        "t",
        7,
        optimizer=OPTIMIZERS[opt_name],
        initializer=TruncatedNormal(0.1),
        seed=3,
        stats_half_life=7.5,
    )
    alone, cached = twins(spec, xp, rows=24, policy=policy)
    rng = np.random.default_rng(5)
    pool = (np.arange(120, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(77)
    try:
        run_both(alone, cached, "t", rng, 12, pool)
        v = alone.advance_version()
        assert cached.advance_version() == v
        run_both(alone, cached, "t", rng, 12, pool, start=13)
        assert_same_rows(all_rows(alone, "t", since=v), all_rows(cached, "t", since=v))
        assert_same_rows(all_rows(alone, "t"), all_rows(cached, "t"))
        a, b = alone.stats("t"), cached.stats("t")
        assert {k: a[k] for k in SAME_STATS} == {k: b[k] for k in SAME_STATS}
        assert b["cache_evicted"] > 0 and b["cache_written_back"] > 0 and b["cache_hits"] > 0
        assert b["cache_dirty"] == 0  # stats wrote everything back
        assert cached.exact
    finally:
        alone.close()
        cached.close()


@pytest.mark.parametrize("policy", ["stats", "lru"])
def test_hit_miss_and_write_back_counters(policy: str) -> None:
    """A known sequence on a cache of two rows: hits, misses, rows swapped
    in (created by the pull or read whole), evictions and write-backs."""
    with CachedServer(Engine(1), rows=2, xp="numpy", policy=policy) as ps:
        ps.create_table(TableSpec("t", 2, optimizer=SGD(0.5)))
        out = np.empty((2, 2), F32)
        ps.pull_many([PullPart("t", [1, 2], out)], step=1)  # 2 misses, both new rows
        ps.pull_many([PullPart("t", [1], out[:1])], step=2)  # a hit
        ps.push("t", [2], np.ones((1, 2), F32), step=2)  # 2 updated in the cache
        assert ps.cache_stats("t")["dirty"] == 1
        twice = np.array([2], F32)  # seen twice in the batch: it may displace a cached key
        ps.pull_many([PullPart("t", [3], out[:1], counts=twice)], step=3)  # 2 (least seen) leaves
        c = ps.cache_stats("t")
        assert (c["hits"], c["misses"], c["swapped_in"]) == (1, 3, 3)
        assert (c["evicted"], c["written_back"], c["updated"], c["rows"]) == (1, 1, 1, 2)
        ps.push("t", [1], np.ones((1, 2), F32), step=3)
        assert ps.stats("t")["cache_written_back"] == 2  # stats writes 1 back
        np.testing.assert_array_equal(ps.inner.pull("t", [1, 2], train=False),
                                      ps.pull("t", [1, 2], train=False))  # fmt: skip
        ps.pull_many([PullPart("t", [2, 3], out)], step=4)  # 2 comes back: read whole
        c = ps.cache_stats("t")
        assert (c["hits"], c["misses"], c["swapped_in"]) == (2, 4, 4)
        # as the engine alone counts: 8 keys through the cache, 2 straight to the engine
        assert ps.stats("t")["pulled_keys"] == 10


def test_a_failed_write_back_is_tried_again_and_never_dropped() -> None:
    """Evicted rows go back in the pull's exchange; when it fails, the pull
    raises and the rows are kept: the next call on the inner server loads
    them first, and a load that fails again raises naming the table, its
    rows kept until a try succeeds."""
    engine = Engine(1)
    real_exchange, real_load, failures = engine.exchange_many, engine.load, []

    def flaky(real: Any) -> Any:
        def call(*args: object, **kwargs: object) -> object:
            if failures:
                failures.pop()
                raise OSError("disk on fire")
            return real(*args, **kwargs)

        return call

    engine.exchange_many = flaky(real_exchange)  # type: ignore[method-assign]
    engine.load = flaky(real_load)  # type: ignore[method-assign]
    with CachedServer(engine, rows=2, xp="numpy") as ps:
        ps.create_table(TableSpec("t", 2, optimizer=SGD(0.5)))
        out = np.empty((2, 2), F32)
        often = np.array([10], F32)  # seen often: it displaces the least seen cached key
        for attempts, (hot, cold, new) in ((1, (1, 2, 3)), (2, (3, 1, 4))):
            ps.pull_many([PullPart("t", [hot, cold], out)], step=attempts * 10)
            ps.pull_many([PullPart("t", [hot], out[:1])], step=attempts * 10 + 1)
            ps.push("t", [cold], np.ones((1, 2), F32), step=attempts * 10 + 1)  # in the cache
            want = ps.pull("t", [cold], train=False)
            failures[:] = [True] * attempts  # the exchange, then (twice) its retry
            with pytest.raises(OSError, match="disk on fire"):
                ps.pull_many([PullPart("t", [new], out[:1], counts=often)], step=attempts * 10 + 2)
            assert ps.cache_stats("t")["evicted"] == attempts  # cold left
            if attempts == 2:
                with pytest.raises(RuntimeError, match=r"1 evicted rows of tables \['t'\]"):
                    ps.inner.pull("t", [cold], train=False)
            np.testing.assert_array_equal(ps.inner.pull("t", [cold], train=False), want)
            assert not failures
        assert ps.cache_stats("t")["written_back"] == 2


def test_write_back_keeps_versions_and_the_change_log() -> None:
    """Rows updated in the cache reach the engine with the version they were
    updated in (a cut writes them back first) and in its change log: delta
    exports read the log (no scan), eviction and the removal log agree."""
    spec = TableSpec("t", 4, optimizer=Adagrad(0.1), eviction=Eviction(max_rows=30))
    alone, cached = twins(spec, "numpy", rows=10)
    rng = np.random.default_rng(9)
    pool = np.arange(1, 60, dtype=np.uint64)
    try:
        for round_ in range(3):
            run_both(alone, cached, "t", rng, 4, pool, start=1 + 4 * round_)
            v = alone.advance_version()
            assert cached.advance_version() == v
            since = v - 1
            assert_same_rows(all_rows(alone, "t", since), all_rows(cached, "t", since))
            a, b = alone.stats("t"), cached.stats("t")
            assert a["change_floor"] == b["change_floor"] <= since  # the log reaches back
            assert alone.evict("t", step=4 * round_ + 4) == cached.evict("t", step=4 * round_ + 4)
            np.testing.assert_array_equal(alone.removed_log("t")[0], cached.removed_log("t")[0])
            assert_same_rows(all_rows(alone, "t"), all_rows(cached, "t"))
    finally:
        alone.close()
        cached.close()


@pytest.mark.xfail(
    strict=True,
    reason="the cache stamps written-back rows with the inner server's version at the "
    "write-back: a version advanced on the inner server directly (not through the "
    "cache: a direct call on its inner server) lands rows updated before it in the newer version",
)
def test_version_advanced_behind_the_cache_is_not_the_update_version() -> None:
    spec = TableSpec("t", 2, optimizer=SGD(0.1))
    alone, cached = twins(spec, "numpy", rows=4)
    try:
        for ps in (alone, cached):
            ps.pull_many([PullPart("t", [1], np.empty((1, 2), F32))], step=1)
            ps.push("t", [1], np.ones((1, 2), F32), step=1)
        alone.advance_version()
        cached.inner.advance_version()  # behind the cache's back
        assert_same_rows(all_rows(alone, "t"), all_rows(cached, "t"))
    finally:
        alone.close()
        cached.close()


def test_admission_mark_and_lookup_through_the_cache() -> None:
    """Admission after two sightings: the rows a later step's pull admitted
    (and the cache took in) are left alone by an earlier step's push, as
    the engine does; lookups read cached rows."""
    spec = TableSpec("t", 3, optimizer=SGD(1.0), admission=Admission(min_count=2))
    alone, cached = twins(spec, "numpy", rows=8)
    try:
        keys = np.array([4, 5, 6], np.int64)
        for ps in (alone, cached):
            ps.pull_many([PullPart("t", keys, np.empty((3, 3), F32))], step=7)
            ps.pull_many([PullPart("t", keys[:2], np.empty((2, 3), F32))], step=8)
        assert cached.cache_stats("t")["rows"] == 2
        for step in (7, 8):
            g = np.ones((3, 3), F32)
            assert alone.push("t", keys, g, step=step) == cached.push("t", keys, g, step=step)
        for missing in ("zeros", "initial"):
            a, b = (
                alone.lookup("t", keys, missing=missing),
                cached.lookup("t", keys, missing=missing),
            )
            np.testing.assert_array_equal(a.rows, b.rows)
            np.testing.assert_array_equal(a.found, b.found)
        assert_same_rows(all_rows(alone, "t"), all_rows(cached, "t"))
    finally:
        alone.close()
        cached.close()


def test_load_erase_and_seed() -> None:
    """``load`` and ``erase`` through the cache replace or remove cached
    rows; ``seed`` takes rows in ahead of training (keys without a row are
    skipped)."""
    with CachedServer(Engine(1), rows=4, xp="numpy") as ps:
        ps.create_table(TableSpec("t", 2, optimizer=SGD(1.0)))
        ps.load("t", [1, 2, 3], np.arange(6, dtype=F32).reshape(3, 2))
        assert ps.seed("t", [3, 1, 99]) == 2
        assert ps.cache_stats("t")["rows"] == 2
        ps.push("t", [1, 3], np.ones((2, 2), F32), step=1)
        ps.load("t", [1], np.full((1, 2), 9, F32))  # replaces the cached row
        assert ps.erase("t", [3, 99]) == 1
        assert ps.cache_stats("t")["rows"] == 0
        np.testing.assert_array_equal(ps.pull("t", [1, 2], train=False), [[9, 9], [2, 3]])
        assert not ps.contains("t", [3])[0]


# --- the policy and its index ---------------------------------------------------


def test_a_restored_table_brings_its_hottest_rows_in(tmp_path: Path) -> None:
    """After ``load_rows`` (a checkpoint's restore) the rows with the most
    decayed shows are cached, as they were: the first pull of them hits."""
    spec = TableSpec("t", 3, optimizer=Adagrad(0.1), stats_half_life=10.0)
    keys = np.arange(1, 41, dtype=np.int64)
    with Engine(2) as source, CachedServer(Engine(2), rows=8, xp="numpy") as ps:
        source.create_table(spec)
        source.pull("t", keys, step=1)
        shows = np.arange(40, 0, -1).astype(F32)  # key 1 the hottest
        shows[30:] = 0  # ten rows never shown
        source.push("t", keys, np.ones((40, 3), F32), step=1, shows=shows)
        files, n = source.write_rows(tmp_path, spec, state=True)
        ps.create_table(spec)
        assert ps.load_rows(tmp_path, "t", [name for name, _ in files], step=1) == n
        c = ps.cache_stats("t")
        assert (c["rows"], c["swapped_in"], c["dirty"]) == (8, 8, 0)
        out = np.empty((8, 3), F32)
        ps.pull_many([PullPart("t", keys[:8], out)], step=2)
        assert ps.cache_stats("t")["hits"] == 8  # the 8 most shown
        np.testing.assert_array_equal(out, source.lookup("t", keys[:8]).rows)
        assert_same_rows(all_rows(ps, "t"), all_rows(source, "t"))


def test_key_index_matches_a_dict() -> None:
    """Inserts, deletes and lookups in batches agree with a dict, through
    growth and rebuilds."""
    rng = np.random.default_rng(1)
    index, truth = KeyIndex(16), {}
    next_id = 0
    for _ in range(60):
        keys = np.unique(rng.integers(0, 3000, 200).astype(np.uint64))
        keys[:1] = np.uint64(2**64 - 1)
        fresh = np.array([k for k in keys.tolist() if k not in truth], np.uint64)
        ids = np.arange(next_id, next_id + len(fresh), dtype=np.int64)
        next_id += len(fresh)
        index.insert(fresh, ids)
        truth.update(zip(fresh.tolist(), ids.tolist(), strict=True))
        gone = keys[rng.random(len(keys)) < 0.4]
        index.delete(gone)
        for k in gone.tolist():
            truth.pop(k, None)
        probe = rng.integers(0, 3000, 500).astype(np.uint64)
        np.testing.assert_array_equal(
            index.lookup(probe), [truth.get(k, -1) for k in probe.tolist()]
        )
        assert index.size == len(truth)


MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """details/cache_index.h's wl_mix, in Python."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    return x ^ (x >> 33)


class ReferenceIndex:
    """The set-associative index and its policies spelled out in plain
    Python from the design (docs/gpu_cache.md), to check the kernels'
    decisions one by one."""

    def __init__(self, slots: list[int], policy: str, half_life: float) -> None:
        self.policy, self.half_life = policy, half_life
        self.regions = []
        base = 0
        for n in slots:
            ways = min(32, n)
            sets = -(-n // ways)
            self.regions.append((base, sets, ways))
            base += sets * ways
        self.keys = [0] * base
        self.scores = [0.0] * base
        self.epochs = [-1] * base
        self.gkeys = [0] * base
        self.gscores = [-1.0] * base
        self.epoch = self.clock = 0

    def set_start(self, key: int, r: int) -> tuple[int, int]:
        base, sets, ways = self.regions[r]
        return base + ((mix64(key) * sets) >> 64) * ways, ways

    def find(self, start: int, ways: int, key: int) -> int:
        for w in range(ways):
            if self.epochs[start + w] >= 0 and self.keys[start + w] == key:
                return start + w
        return -1

    def find_ghost(self, start: int, ways: int, key: int) -> int:
        for g in range(start, start + ways):
            if self.gscores[g] >= 0 and self.gkeys[g] == key:
                return g
        return -1

    def ghost_for(self, start: int, ways: int, key: int) -> int:
        own = self.find_ghost(start, ways, key)
        if own >= 0:
            return own
        low = -1
        for g in range(start, start + ways):
            if self.gscores[g] < 0:
                return g
            if low < 0 or self.gscores[g] < self.gscores[low]:
                low = g
        return low

    def observe(self, keys: list[int], region: list[int], counts: list[float]) -> tuple:
        stats = self.policy == "stats"
        self.epoch += 1
        self.clock += 1
        weight = 2.0 ** (self.clock / self.half_life) if stats else 1.0
        entries, misses = [], []
        for i, (key, r, c) in enumerate(zip(keys, region, counts, strict=True)):
            start, ways = self.set_start(key, r)
            e = self.find(start, ways, key)
            entries.append(e)
            if e >= 0:
                self.epochs[e] = self.epoch
                if stats:
                    self.scores[e] += float(np.float32(c)) * weight
                else:
                    self.scores[e] = float(self.clock)
            else:
                g = self.find_ghost(start, ways, key) if stats else -1
                score = (self.gscores[g] if g >= 0 else 0.0) + float(np.float32(c)) * weight
                misses.append((start, -(score if stats else float(np.float32(c))), i, ways))
        victims = []
        for start, neg, i, ways in sorted(misses):
            key, score = keys[i], -neg
            again = self.find(start, ways, key)
            if again >= 0:
                entries[i] = again
                continue
            empty = [w for w in range(start, start + ways) if self.epochs[w] < 0]
            v = empty[0] if empty else -1
            if not empty:
                for w in range(start, start + ways):
                    if self.epochs[w] < self.epoch - 1 and (
                        v < 0 or self.scores[w] < self.scores[v]
                    ):
                        v = w
            once = stats and not empty and not score > weight  # a key seen once stays out
            if v < 0 or once or (stats and not empty and not score > self.scores[v]):
                if stats:
                    g = self.ghost_for(start, ways, key)
                    self.gkeys[g], self.gscores[g] = key, score
                continue
            if empty and stats:
                g = self.find_ghost(start, ways, key)
                if g >= 0:
                    self.gscores[g] = -1.0
            elif not empty:
                victims.append(self.keys[v])
                if stats:
                    g = self.ghost_for(start, ways, key)
                    self.gkeys[g], self.gscores[g] = self.keys[v], self.scores[v]
            self.keys[v], self.epochs[v], entries[i] = key, self.epoch, v
            self.scores[v] = score if stats else float(self.clock)
        return entries, sorted(victims)


@pytest.mark.parametrize("policy", ["stats", "lru"])
def test_slot_index_takes_the_designed_decisions(policy: str) -> None:
    """Batches of Zipf keys with repeats over three tables (one set of 24
    ways, sets of 32 ways, a single slot) through the index (the C++ twin of
    the CUDA kernels): every key's entry, every victim and every entry's
    key, score and lock equal a plain Python spelling of the design; the
    batch's own keys and the previous batch's are never victims."""
    from wuliang.ps_server.cache.kernels import NumpyKernels

    sizes = {"a": 24, "b": 100, "c": 1}
    index = SlotIndex(NumpyKernels(), policy=policy, half_life=7.0)
    ref = ReferenceIndex(list(sizes.values()), policy, 7.0)
    for name, n in sizes.items():
        region = index.add(name, n)
        assert region.slots == ref.regions[region.id][1] * ref.regions[region.id][2]
    assert index.add("a", 999) is index.regions["a"]  # made once
    rng = np.random.default_rng(4)
    pool = (np.arange(1, 400, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(3)
    p = 1.0 / np.arange(1, len(pool) + 1) ** 1.1
    previous: set[tuple[int, int]] = set()
    for _ in range(40):
        keys = pool[rng.choice(len(pool), size=90, p=p / p.sum())]
        region = rng.integers(0, 3, len(keys)).astype(np.int32)
        counts = rng.integers(1, 5, len(keys)).astype(F32)
        plan = index.observe(keys, region, counts)
        want, victims = ref.observe(keys.tolist(), region.tolist(), counts.tolist())
        np.testing.assert_array_equal(plan.entries, want)
        assert sorted(plan.victims.tolist()) == victims
        n = index.entries
        used = index.epochs[:n] >= 0
        assert (index.epochs[n:] == -1).all()  # room to add tables: empty
        np.testing.assert_array_equal(used, np.array(ref.epochs) >= 0)
        np.testing.assert_array_equal(index.keys[:n][used], np.array(ref.keys, np.uint64)[used])
        np.testing.assert_array_equal(index.scores[:n][used], np.array(ref.scores)[used])
        np.testing.assert_array_equal(index.epochs[:n], ref.epochs)
        this = set(zip(keys.tolist(), region.tolist(), strict=True))
        entry_region = np.searchsorted([r.entry_base for r in index.regions.values()],
                                       plan.victim_entries, side="right") - 1  # fmt: skip
        for key, r in zip(plan.victims.tolist(), entry_region.tolist(), strict=True):
            assert (key, r) not in this | previous, "a locked key was evicted"
        previous = this
    for name in sizes:  # no key twice in a table; lookups find what is cached
        keys, slots = index.cached(name)
        assert len(np.unique(keys)) == len(keys)
        region = index.regions[name]
        found = index.lookup(keys, np.full(len(keys), region.id, np.int32))
        np.testing.assert_array_equal(found, slots + region.entry_base)


def test_stats_policy_keeps_frequent_keys_lru_does_not() -> None:
    """Four keys seen in every batch, then batches of keys seen once: the
    decayed counts keep the four; LRU lets the one-off keys push them out.
    A one-off key that comes back often enough gets in."""
    from wuliang.ps_server.cache.kernels import NumpyKernels

    frequent = np.arange(1, 5, dtype=np.uint64)
    one = np.zeros(4, np.int32)
    sets = {}
    for policy in ("stats", "lru"):
        index = sets[policy] = SlotIndex(NumpyKernels(), policy=policy, half_life=50)
        index.add("t", 4)
        for _ in range(10):
            plan = index.observe(frequent, one, np.full(4, 3, F32))
        assert len(plan.miss) == 0
        for batch in range(5):
            index.observe(np.arange(100 + 4 * batch, 104 + 4 * batch, dtype=np.uint64), one)
    assert (sets["stats"].lookup(frequent, one) >= 0).all()
    assert (sets["lru"].lookup(frequent, one) < 0).all()
    stats = sets["stats"]
    for _ in range(40):
        plan = stats.observe(np.array([500], np.uint64), one[:1], np.array([5], F32))
    assert plan.entries[0] >= 0 and len(plan.victims) == 0  # it came in earlier
    assert stats.size("t") == 4 and (stats.lookup(frequent, one) >= 0).sum() == 3


def test_a_keys_repeats_in_a_batch_are_decided_alike() -> None:
    """A key twice in a batch, never seen before, over a full set: neither
    occurrence displaces a cached key (the first one's ghost must not let the
    second in: a push would then update it in two places)."""
    from wuliang.ps_server.cache.kernels import NumpyKernels

    index = SlotIndex(NumpyKernels(), half_life=10.0)
    index.add("t", 2)
    one = np.zeros(3, np.int32)
    index.observe(np.array([1, 2], np.uint64), one[:2])
    index.observe(np.array([3], np.uint64), one[:1])  # 1 and 2 are locked: 3 stays out
    plan = index.observe(np.array([5, 9, 5], np.uint64), one)  # 1 and 2 may leave now
    np.testing.assert_array_equal(plan.miss_entries, [-1, -1, -1])
    plan = index.observe(np.array([5, 5], np.uint64), one[:2])  # seen before: it gets in
    assert plan.how.tolist() == [OVER_VICTIM, REPEAT] and plan.miss_entries[0] >= 0
    assert plan.miss_entries[0] == plan.miss_entries[1]


def test_slot_index_regions_and_arguments() -> None:
    """A key cached in two tables has two slots; clearing one table leaves
    the other; bad arguments are errors naming them."""
    from wuliang.ps_server.cache.kernels import NumpyKernels

    index = SlotIndex(NumpyKernels())
    index.add("a", 40)
    index.add("b", 40)
    keys = np.array([7, 7], np.uint64)
    regions = np.array([0, 1], np.int32)
    plan = index.observe(keys, regions)
    assert plan.entries[0] >= 0 and plan.entries[1] >= 64 and len(plan.miss) == 2
    index.clear("a")
    np.testing.assert_array_equal(index.lookup(keys, regions) >= 0, [False, True])
    plan = index.observe(keys, regions, allowed=lambda miss: miss != 0)  # the first held back
    np.testing.assert_array_equal(plan.miss, [0])
    assert plan.miss_entries.tolist() == [-1] and index.lookup(keys, regions)[0] == -1
    with pytest.raises(ValueError, match="policy"):
        SlotIndex(NumpyKernels(), policy="lfu")
    with pytest.raises(ValueError, match="half_life"):
        SlotIndex(NumpyKernels(), half_life=0)
    with pytest.raises(ValueError, match="slots"):
        index.add("c", 0)
    with pytest.raises(ValueError, match="rows"):
        CachedServer(Engine(1), rows=-1)


# --- the kernels --------------------------------------------------------------------


def random_state(math_: OptimizerMath, n: int, rng: np.random.Generator) -> np.ndarray:
    dim = math_.dim
    if math_.kind == "adagrad":
        return rng.uniform(0.01, 4, (n, dim)).astype(F32)
    if math_.kind == "adam":
        parts = [rng.standard_normal((n, dim)) * 0.1, rng.uniform(0, 2, (n, dim))]
        return np.concatenate([*parts, rng.integers(0, 400, (n, 1))], axis=1).astype(F32)
    if math_.kind == "ftrl":
        return np.concatenate(
            [rng.standard_normal((n, dim)), rng.uniform(0.01, 4, (n, dim))], axis=1
        ).astype(F32)
    return np.zeros((n, 0), F32)


@pytest.mark.parametrize("xp", XPS)
def test_kernels_reproduce_the_engines_arithmetic(xp: str) -> None:
    """The update kernels leave rows (weights and state) bit for bit as the
    engine's compiled optimizers do, for every optimizer with and without
    clipping, at dims that are and are not multiples of the vector width;
    gather and scatter move rows exactly."""
    model, exact = engine_float_model()
    assert exact, f"no rounding model reproduces this build's engine ({model})"
    module = array_module(xp)
    kernels = kernels_for(module)
    rng = np.random.default_rng(11)
    n = 300
    for name, opt in OPTIMIZERS.items():
        for dim in (1, 3, 4, 9, 16, 37):
            spec = TableSpec("t", dim, optimizer=opt)
            math_ = OptimizerMath(opt, dim)
            with Engine(1) as engine:
                engine.create_table(spec)
                keys = np.arange(1, n + 1, dtype=np.uint64)
                weights = (rng.standard_normal((n, dim)) * 0.5).astype(F32)
                state = random_state(math_, n, rng)
                engine.load("t", keys, weights, state if math_.state_dim else None)
                grads = rng.standard_normal((n, dim)).astype(F32)
                grads *= rng.uniform(0.01, 2.0, (n, 1)).astype(F32)
                engine.push("t", keys, grads, unique=True)
                want = all_rows(engine, "t")
            slots = rng.permutation(2 * n)[:n].astype(np.int64)  # rows scattered over slots
            w = kernels.to_device(np.zeros((2 * n, dim), F32))
            s = kernels.to_device(np.zeros((2 * n, math_.state_dim), F32))
            kernels.scatter(w, slots, kernels.to_device(weights))
            if math_.state_dim:
                kernels.scatter(s, slots, kernels.to_device(state))
            lr_t = math_.lr_t(state[:, 2 * dim] + F32(1)) if math_.kind == "adam" else None
            kernels.update(math_, model, w, s, slots, grads, lr_t)
            got_w = kernels.to_host(kernels.gather(w, slots))
            got_s = kernels.to_host(kernels.gather(s, slots))
            np.testing.assert_array_equal(got_w, want.weights, err_msg=f"{name} dim {dim}")
            np.testing.assert_array_equal(got_s, want.state, err_msg=f"{name} dim {dim} state")


def test_array_module_choice_and_a_silent_cupy_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy is always there; ``xp="cupy"`` without a GPU is an ImportError
    saying so; a cupy whose import warns (as it does on a machine without
    CUDA) and finds no device leaves no warning behind (this suite turns
    warnings into errors)."""
    assert array_module("numpy") is np
    with pytest.raises(ValueError, match="xp"):
        array_module("torch")
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("a real cupy is installed: the fake one would shadow it")
    fake = tmp_path / "cupy"
    (fake / "cuda").mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import warnings\n"
        "warnings.warn('CUDA path could not be detected', UserWarning)\n"
        "from cupy import cuda\n"
    )
    (fake / "cuda" / "__init__.py").write_text(
        "class runtime:\n    @staticmethod\n    def getDeviceCount():\n        return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, name)
    assert not gpu_available()
    assert array_module("auto") is np
    with pytest.raises(ImportError, match="cupy and a GPU"):
        array_module("cupy")


# --- the factory and the context -------------------------------------------------


def test_cached_addresses_and_the_context() -> None:
    """``"<address>?gpu_cache_rows=N&..."`` makes a cached server in front of
    the address's; bad options are ValueErrors naming them;
    ``Context(gpu_cache_rows=N)`` puts a cache in front of its server."""
    with parameter_server("embedded?gpu_cache_rows=8&policy=lru&half_life=5&xp=numpy", 2) as ps:
        assert isinstance(ps, CachedServer) and isinstance(ps.inner, Engine)
        assert ps.inner.num_shards == 2 and ps.array_module_name == "numpy"
        ps.create_table(TableSpec("t", 2))
        ps.pull("t", [1, 2], step=1)
        assert ps.cache_stats("t")["rows"] == 2
    for bad, match in [
        ("embedded?gpu_cache_rows=x", "gpu_cache_rows must be a number"),
        ("embedded?rows=3", "is not an option"),
        ("embedded?policy=lru", "needs gpu_cache_rows"),
        ("nowhere?gpu_cache_rows=3", "not a parameter-server address"),
        ("embedded?gpu_cache_rows=3&policy=mru", "policy"),
        ("embedded?gpu_cache_rows=3&host_cache_rows=3", "not both"),
        ("embedded?host_cache_rows=3&xp=cupy", "host cache's rows are numpy"),
        ("embedded?host_cache_rows=y", "host_cache_rows must be a number"),
        ("embedded?sync_steps=2", "needs gpu_cache_rows=N or host_cache_rows=N"),
    ]:
        with pytest.raises(ValueError, match=match):
            parameter_server(bad)
    with parameter_server("embedded?host_cache_rows=8&sync_steps=4", 1) as ps:
        assert isinstance(ps, CachedServer) and ps.array_module_name == "numpy"
        assert ps.sync_steps == 4

    from wuliang.context import Context

    context = Context(gpu_cache_rows=16, num_shards=1)
    try:
        assert isinstance(context.ps, CachedServer) and context.ps.inner.num_shards == 1
    finally:
        context.close()
    with Context(host_cache_rows=16, num_shards=1) as context:  # a warning: nothing to save
        assert isinstance(context.ps, CachedServer) and context.ps.array_module_name == "numpy"
    with pytest.raises(ValueError, match="gpu_cache_rows"):
        Context(gpu_cache_rows=0)
    with pytest.raises(ValueError, match="host_cache_rows must be an int"):
        Context(host_cache_rows=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        Context(gpu_cache_rows=8, host_cache_rows=8)


def test_float_model_helpers_are_exact() -> None:
    """``fma32`` rounds ``a * b + c`` once: checked against exact rationals."""
    from fractions import Fraction

    from wuliang.ps_server.cache.kernels import fma32

    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal(2000).astype(F32) * s for s in (1, 1e-3, 1e3))
    c[:500] = -(a[:500].astype(np.float64) * b[:500]).astype(F32)  # near-cancellation
    got = fma32(a, b, c)
    for x, y, z, r in zip(a[:800], b[:800], c[:800], got[:800], strict=True):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        below = F32(float(exact))  # float32 neighbours of the exact value
        candidates = {
            below,
            np.nextafter(below, F32(math.inf)),
            np.nextafter(below, F32(-math.inf)),
        }
        best = min(
            candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.int32)) & 1)
        )
        assert r == best, (x, y, z, r, best)


def test_the_cuda_sources_compile() -> None:
    """Every CUDA source of the cache compiles with nvcc where there is one
    (a machine without a GPU included): tools/check_cuda.py."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here")
    tool = Path(__file__).resolve().parents[1] / "tools" / "check_cuda.py"
    done = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["kernels:", "ok", "index:", "ok"]


# --- the benchmark ------------------------------------------------------------------

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_cache_bench.py"


def test_the_benchmark_runs_without_tensorflow(tmp_path: Path) -> None:
    """benchmarks/gpu_cache_bench.py, tiny: its last line is one JSON object
    with the hit rates by stream, size and policy and the rows/s of cache and
    engine, and it never imports TensorFlow."""
    args = [
        "--universe", "100000", "--batch", "8192", "--batches", "3", "--warmup", "3",
        "--table-rows", "20000", "--cache-rows", "8192", "--rows-batch", "4096",
        "--read-table-rows", "20000", "--rate-batches", "1", "--repeats", "1", "--xp", "numpy",
        "--step-keys", "2600", "--step-universe", "200000", "--step-tables", "1,26",
        "--step-warmup", "3", "--step-measured", "2",
    ]  # fmt: skip
    code = (
        "import runpy, sys\n"
        "class NoTensorFlow:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorflow' or name.startswith('tensorflow.'):\n"
        "            raise ImportError('the benchmark must not import TensorFlow')\n"
        "sys.meta_path.insert(0, NoTensorFlow())\n"
        f"sys.argv = ['gpu_cache_bench.py', *{args!r}]\n"
        f"runpy.run_path({str(BENCH)!r}, run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["array_module"] == "numpy" and result["device"] == "cpu"
    assert set(result["hit_rate"]) == {"zipf1.05", "zipf1.1", "zipf1.2"}
    for stream in result["hit_rate"].values():
        assert set(stream) == {"1%", "5%", "20%"}
        for size in stream.values():
            assert set(size) == {"stats", "lru"} and all(0 <= v <= 1 for v in size.values())
    for key in (
        "cache_lookup_rows_per_s",
        "cache_update_rows_per_s",
        "device_hit_path_rows_per_s",
        "engine_pull_rows_per_s",
        "engine_push_rows_per_s",
        "swap_in_new_rows_per_s",
        "swap_in_read_rows_per_s",
        "step_cache_vs_host",
        "step_vs_miss_bound",
    ):
        assert result[key] > 0, key
    assert set(result["step"]) == {"1", "26"}
    assert result["step"]["26"]["unique_keys"] == 2600
