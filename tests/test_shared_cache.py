"""Caches of shared rows (``CachedServer(sync_steps=k)``): several trainers
each cache rows of one set of servers and merge their changes (Geo-SGD).
Two caches over one engine stand for two trainers of a job."""

from __future__ import annotations

import numpy as np
import pytest

from wuliang.initializers import TruncatedNormal
from wuliang.optimizers import SGD, Adagrad
from wuliang.ps_server import Engine, PullPart, PushPart, TableSpec
from wuliang.ps_server.cache import CachedServer

F32 = np.float32


def pull(ps: CachedServer, keys: np.ndarray, step: int) -> np.ndarray:
    out = np.empty((len(keys), 4), F32)
    ps.pull_many([PullPart("t", keys, out)], step=step)
    return out


def push(ps: CachedServer, keys: np.ndarray, grad: float, step: int) -> None:
    grads = np.full((len(keys), 4), grad, F32)
    ps.push_many([PushPart("t", keys, grads, shows=np.ones(len(keys), F32))], step=step)


def two_trainers(
    optimizer: object, rows: int, sync_steps: int, policy: str = "stats"
) -> tuple[Engine, CachedServer, CachedServer]:
    engine = Engine(2)
    initializer = TruncatedNormal(stddev=0.1)
    spec = TableSpec("t", dim=4, optimizer=optimizer, initializer=initializer, seed=3,
                     stats_half_life=50.0)  # fmt: skip
    engine.create_table(spec)
    caches = [
        CachedServer(engine, rows=rows, xp="numpy", policy=policy, sync_steps=sync_steps)
        for _ in range(2)
    ]
    return engine, caches[0], caches[1]


@pytest.mark.parametrize(("rows", "policy"), [(256, "stats"), (32, "lru")])
def test_the_changes_of_two_trainers_add_up_on_the_server(rows: int, policy: str) -> None:
    """SGD is linear: two trainers each pushing their own gradient to the
    same keys leave each row at its start less the sum of all updates, as
    one server taking every push would, whether the rows stayed cached
    (changes merged every k pulls and at the flush) or were evicted (their
    changes merged as they left: the small LRU cache churns)."""
    engine, a, b = two_trainers(SGD(learning_rate=1.0), rows, sync_steps=3, policy=policy)
    keys = np.arange(100, dtype=np.int64)
    start = engine.lookup("t", keys, missing="initial").rows
    rng = np.random.default_rng(0)
    for step in range(10):
        for cache, grad in ((a, 0.01), (b, 0.02)):
            batch = rng.permutation(keys)[:60]  # each step a different part
            pull(cache, batch, step)
            push(cache, batch, grad, step)
            counts = np.bincount(batch, minlength=100)
            start = start - (grad * counts)[:, None].astype(F32)
    a.flush()
    b.flush()
    got = engine.lookup("t", keys).rows
    np.testing.assert_allclose(got, start, rtol=0, atol=2e-6)
    stats = a.cache_stats("t")
    assert stats["synced"] > 0 and stats["dirty"] == 0
    if policy == "lru":
        assert stats["evicted"] > 0
    rows_, _ = engine.read_rows("t", keys)
    assert rows_.counts.sum() == 2 * 10 * 60  # every update counted once


def test_a_trainer_sees_the_others_changes_after_its_next_sync() -> None:
    """Every k training pulls a cache merges the rows it changed and reads
    them back with the other trainers' changes in: a row both train is at
    most k pulls behind the other's merged changes."""
    engine, a, b = two_trainers(SGD(learning_rate=1.0), rows=64, sync_steps=2)
    key = np.array([7], np.int64)
    w0 = engine.lookup("t", key, missing="initial").rows
    for step in range(2):  # a's second pull syncs its first push
        pull(a, key, step)
        push(a, key, 0.5, step)
    np.testing.assert_allclose(engine.lookup("t", key).rows, w0 - 0.5, atol=1e-6)
    seen = pull(b, key, 0)  # comes into b's cache from the server: a's first update in
    np.testing.assert_allclose(seen, w0 - 0.5, atol=1e-6)
    push(b, key, 0.25, 0)
    pull(b, key, 1)  # b's sync: its change merged, the row read back
    np.testing.assert_allclose(engine.lookup("t", key).rows, w0 - 0.75, atol=1e-6)
    pull(a, key, 2)
    push(a, key, 0.0, 2)
    a_row = pull(a, key, 3)  # a's sync reads back b's change too
    np.testing.assert_allclose(a_row, w0 - 1.25, atol=1e-6)
    stats = a.cache_stats("t")
    assert stats["refreshed"] >= 2 and stats["hits"] >= 2


def test_adagrad_state_counts_and_shows_merge_as_sums() -> None:
    """Adagrad's accumulator takes every trainer's squared gradients (the
    changes' sum), a row's count every update, its shows every push's
    shows (decayed to the newest step)."""
    engine, a, b = two_trainers(Adagrad(learning_rate=0.1), rows=64, sync_steps=4)
    keys = np.arange(10, dtype=np.int64)
    assert not engine.contains("t", keys).any()
    for step in range(3):
        for cache, grad in ((a, 0.1), (b, 0.2)):
            pull(cache, keys, step)
            push(cache, keys, grad, step)
    a.flush()
    b.flush()
    rows, found = engine.read_rows("t", keys)
    assert found.all()
    initial = Adagrad(learning_rate=0.1).initial_accumulator
    np.testing.assert_allclose(
        rows.state.reshape(10, -1), initial + 3 * (0.1**2 + 0.2**2), rtol=1e-5
    )
    assert (rows.counts == 6).all() and (rows.steps == 2).all()
    decay = 2.0 ** (-1 / 50.0)
    np.testing.assert_allclose(rows.shows, 2 * (decay**2 + decay + 1), rtol=1e-4)


def test_a_cache_of_shared_rows_refuses_bad_sync_steps() -> None:
    engine = Engine(1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="sync_steps must be an int >= 1 or None"):
            CachedServer(engine, rows=32, xp="numpy", sync_steps=bad)  # type: ignore[arg-type]
    engine.close()


def test_reads_of_shared_rows_are_the_servers_merged_rows() -> None:
    """A cache's copy of a shared row may lack the other trainers' newest
    changes: lookups, pulls without training and ``read_rows`` merge this
    cache's changes and answer the server's rows (an evaluation after the
    job sees every trainer's updates)."""
    engine, a, b = two_trainers(SGD(learning_rate=1.0), rows=64, sync_steps=100)
    key = np.array([5], np.int64)
    w0 = engine.lookup("t", key, missing="initial").rows
    for cache, grad in ((a, 0.5), (b, 0.25)):
        pull(cache, key, 0)
        push(cache, key, grad, 0)
    a.flush()  # a's change on the server; b's still in b's cache, b's copy lacks a's
    want = w0 - 0.75
    out = np.empty((1, 4), F32)
    b.pull_many([PullPart("t", key, out)], train=False)
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_allclose(a.lookup("t", key).rows, want, atol=1e-6)
    np.testing.assert_allclose(b.read_rows("t", key)[0].weights, want, atol=1e-6)
