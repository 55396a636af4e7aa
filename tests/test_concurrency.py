"""Many Python threads on one engine: pushes are exact, rows never torn, nothing crashes.

SGD with learning rate 1, zero initial vectors and gradients of 1.0 make every
coordinate of a row exactly -(number of times its key was pushed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from wuliang.ps_server import SGD, Engine, Eviction, RowChunk, TableSpec, Zeros

MakeEngine = Callable[[int], Engine]  # the make_engine fixture (conftest.py)
ExportAll = Callable[..., RowChunk]  # the export_all fixture (conftest.py)
SEED = 20240611

DIM = 8


def counting_table(engine: Engine, name: str, eviction: Eviction | None = None) -> None:
    spec = TableSpec(
        name,
        dim=DIM,
        optimizer=SGD(learning_rate=1.0),
        initializer=Zeros(),
        eviction=eviction or Eviction(),
    )
    engine.create_table(spec)


def assert_untorn(rows: np.ndarray) -> None:
    """Every row has equal, integral coordinates <= 0."""
    np.testing.assert_array_equal(rows, np.broadcast_to(rows[:, :1], rows.shape))
    np.testing.assert_array_equal(rows, np.round(rows))
    assert (rows <= 0).all()


class Worker:
    """Pulls and pushes random batches of a key pool; counts what it pushed."""

    def __init__(self, engine: Engine, tables: list[str], pool: np.ndarray, seed: int) -> None:
        self.engine, self.tables, self.pool = engine, tables, pool
        self.rng = np.random.default_rng([SEED, seed])
        self.pushed = np.zeros(len(pool), np.int64)  # occurrences
        self.updates = np.zeros(len(pool), np.int64)  # pushes that had the key

    def __call__(self, barrier: threading.Barrier, iterations: int, batch: int) -> None:
        barrier.wait()
        for _ in range(iterations):
            idx = self.rng.integers(0, len(self.pool), size=batch)
            keys = self.pool[idx]
            for table in self.tables:
                assert_untorn(self.engine.pull(table, keys))
                result = self.engine.push(table, keys, np.ones((batch, DIM), np.float32))
                assert result.dropped_nan == result.dropped_pending == 0
            np.add.at(self.pushed, idx, 1)
            self.updates[np.unique(idx)] += 1


def run_threads(jobs: list[Callable[[threading.Barrier], None]]) -> None:
    barrier = threading.Barrier(len(jobs), timeout=60)
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(job, barrier) for job in jobs]
        for future in futures:
            future.result()  # re-raises a thread's failure


@pytest.mark.parametrize("num_shards", [1, 3, 64])  # 64: batches sorted by shard
def test_overlapping_pushes_are_exact(
    num_shards: int, make_engine: MakeEngine, export_all: ExportAll
) -> None:
    engine = make_engine(num_shards)
    counting_table(engine, "t")
    pool = np.arange(2000, dtype=np.int64) * 7_777_777 - 3
    workers = [Worker(engine, ["t"], pool, seed) for seed in range(4)]
    run_threads([lambda b, w=w: w(b, iterations=300, batch=400) for w in workers])

    stats = engine.stats("t")
    assert stats["pushed_keys"] == stats["pulled_keys"] == 4 * 300 * 400
    pushed = sum(w.pushed for w in workers)
    updates = sum(w.updates for w in workers)
    seen = pushed > 0
    assert stats["rows"] == seen.sum()
    rows = engine.pull("t", pool[seen], train=False)
    np.testing.assert_array_equal(rows, -np.repeat(pushed[seen, None], DIM, axis=1))
    exported = export_all(engine, "t")
    order = np.argsort(pool[seen].view(np.uint64))
    np.testing.assert_array_equal(exported.counts, updates[seen][order])


def test_threads_on_different_tables(make_engine: MakeEngine) -> None:
    engine = make_engine(2)
    names = [f"table{i}" for i in range(6)]
    for name in names:
        counting_table(engine, name)
    pool = np.arange(500, dtype=np.int64)
    workers = [Worker(engine, [name], pool, seed) for seed, name in enumerate(names)]

    def churn_tables(barrier: threading.Barrier) -> None:
        barrier.wait()
        for i in range(30):  # create and drop tables while the others train
            counting_table(engine, f"tmp{i}")
            engine.push(f"tmp{i}", pool[:50], np.ones((50, DIM), np.float32))
            assert engine.stats(f"tmp{i}")["rows"] == 50
            engine.drop_table(f"tmp{i}")

    jobs = [lambda b, w=w: w(b, iterations=60, batch=200) for w in workers]
    run_threads([*jobs, churn_tables])
    assert sorted(engine.tables()) == names
    for name, worker in zip(names, workers, strict=True):
        rows = engine.pull(name, pool, train=False)
        np.testing.assert_array_equal(rows[:, 0], -worker.pushed)
        assert_untorn(rows)


def test_evict_stats_export_while_training(make_engine: MakeEngine, export_all: ExportAll) -> None:
    engine = make_engine(3)
    counting_table(engine, "exact")
    counting_table(engine, "churn", Eviction(max_rows=300))
    pool = np.arange(3000, dtype=np.int64) * 104_729
    workers = [Worker(engine, ["exact", "churn"], pool, seed) for seed in range(3)]
    done = threading.Event()
    report = {"exports": 0, "refused": 0, "evicted": 0}

    def maintain(barrier: threading.Barrier) -> None:
        barrier.wait()
        while not done.is_set():
            report["evicted"] += engine.evict()["total"]
            assert engine.stats("churn")["rows"] >= 0
            for table in ("exact", "churn"):
                try:
                    for chunk in engine.export(table, chunk_rows=256):
                        assert_untorn(chunk.weights)
                        assert (-chunk.weights[:, 0] >= chunk.counts).all()
                    report["exports"] += 1
                except RuntimeError as error:
                    assert "changed during export" in str(error)
                    report["refused"] += 1
            engine.removed_keys("churn", since=max(0, engine.version - 1))
            engine.trim_removed("churn", engine.version - 1)
            engine.advance_version()

    finished = []  # one entry per worker done, ok or not
    lock = threading.Lock()

    def train(barrier: threading.Barrier, worker: Worker) -> None:
        try:
            worker(barrier, iterations=120, batch=300)
        finally:
            with lock:
                finished.append(worker)
                if len(finished) == len(workers):
                    done.set()

    jobs: list[Callable[[threading.Barrier], None]] = [lambda b, w=w: train(b, w) for w in workers]
    run_threads([*jobs, maintain])
    assert report["exports"] + report["refused"] > 0
    assert report["evicted"] > 0

    pushed = sum(w.pushed for w in workers)
    rows = engine.pull("exact", pool, train=False)
    np.testing.assert_array_equal(rows[:, 0], -pushed)
    assert_untorn(rows)

    engine.evict("churn")
    churn = export_all(engine, "churn")
    assert 0 < len(churn) <= 300
    assert len(np.unique(churn.keys)) == len(churn) == engine.stats("churn")["rows"]
    assert engine.contains("churn", churn.keys).all()
    np.testing.assert_array_equal(engine.pull("churn", churn.keys, train=False), churn.weights)
    assert_untorn(churn.weights)
    assert (-churn.weights[:, 0] >= churn.counts).all()
    gone = np.setdiff1d(pool.view(np.uint64), churn.keys)
    assert not engine.contains("churn", gone).any()
    assert engine.stats("churn")["evicted_lfu"] > 0
