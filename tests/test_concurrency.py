"""Many Python threads on one engine: pushes are exact, rows never torn, nothing crashes.

SGD with learning rate 1, zero initial vectors and gradients of 1.0 make every
coordinate of a row exactly -(number of times its key was pushed).
"""

from __future__ import annotations

import threading
import time
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

    def __call__(
        self,
        barrier: threading.Barrier,
        iterations: int,
        batch: int,
        until: threading.Event | None = None,
    ) -> None:
        """Runs ``iterations`` batches, then more until ``until`` is set."""
        barrier.wait()
        done = 0
        while done < iterations or (until is not None and not until.is_set()):
            done += 1
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


def check_export(chunks: list[RowChunk], since: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(keys, first coordinates) of an export's rows, by key, each row
    checked: untorn, pushed at least as often as counted, changed after
    ``since``, exported once."""
    for chunk in chunks:
        assert_untorn(chunk.weights)
        assert (-chunk.weights[:, 0] >= chunk.counts).all()
        assert (chunk.versions > since).all()
    keys = np.concatenate([np.zeros(0, np.uint64), *(c.keys for c in chunks)])
    values = np.concatenate([np.zeros(0, np.float32), *(c.weights[:, 0] for c in chunks)])
    assert len(np.unique(keys)) == len(keys)  # no row twice
    order = np.argsort(keys)
    return keys[order], values[order]


EXPORT_ROUNDS = 5  # full exports of the whole "exact" table required under load


def test_evict_stats_export_while_training(make_engine: MakeEngine, export_all: ExportAll) -> None:
    """Exports, evictions and stats run while three threads train.

    A full export scans each shard's index and is refused ("changed during
    export") if rows are removed or the index is resized in the shard being
    read. Here only the maintenance thread removes rows (evict, never during
    an export), so: the "exact" table, which never loses rows, can refuse
    only while it still grows; once it holds the whole key pool every full
    export of it must succeed, hold every key once, and each row's value must
    lie between what pulls before and after the export read (pushes only
    decrease it). The "churn" table grows back after each eviction, so its
    full exports may be refused; its delta exports (the change log, by key)
    never are. The workers train until EXPORT_ROUNDS full exports of "exact"
    and one of "churn" have succeeded.
    """
    engine = make_engine(3)
    counting_table(engine, "exact")
    counting_table(engine, "churn", Eviction(max_rows=300))
    pool = np.arange(3000, dtype=np.int64) * 104_729  # sorted as uint64 too
    keys = pool.view(np.uint64)
    workers = [Worker(engine, ["exact", "churn"], pool, seed) for seed in range(3)]
    done, enough = threading.Event(), threading.Event()
    report = {  # counts of rounds, exports by outcome, evicted rows
        "rounds": 0,
        "exact": 0,  # full exports of "exact" holding the whole pool
        "exact_growing": 0,  # ... that succeeded while it still grew
        "exact_refused": 0,  # ... refused while it still grew
        "churn": 0,
        "churn_refused": 0,
        "churn_delta": 0,
        "evicted": 0,
    }

    def export_exact(full: bool) -> None:
        before = engine.pull("exact", pool, train=False)[:, 0]
        try:
            chunks = list(engine.export("exact", chunk_rows=256))
        except RuntimeError as error:
            assert not full, f"a full export of a table that no longer changes: {error}"
            assert "changed during export" in str(error)
            report["exact_refused"] += 1
            return
        after = engine.pull("exact", pool, train=False)[:, 0]
        exported, values = check_export(chunks)
        at = np.minimum(np.searchsorted(keys, exported), len(keys) - 1)
        np.testing.assert_array_equal(keys[at], exported)  # keys of the pool only
        if full:
            np.testing.assert_array_equal(exported, keys)  # every row, once
        report["exact" if full else "exact_growing"] += 1
        assert (before[at] >= values).all() and (values >= after[at]).all()

    def export_churn(since: int) -> None:
        try:
            check_export(list(engine.export("churn", chunk_rows=256)))
            report["churn"] += 1
        except RuntimeError as error:  # the index grew back during the scan
            assert "changed during export" in str(error)
            report["churn_refused"] += 1
        changed, _ = check_export(list(engine.export("churn", since=since, chunk_rows=256)), since)
        assert np.isin(changed, keys).all()
        report["churn_delta"] += 1

    def maintain(barrier: threading.Barrier) -> None:
        barrier.wait()
        deadline = time.monotonic() + 120
        exact_rows = 0
        since = engine.version
        try:
            while not done.is_set():
                report["evicted"] += engine.evict()["total"]
                assert engine.stats("churn")["rows"] <= len(pool)
                rows = engine.stats("exact")["rows"]
                assert exact_rows <= rows <= len(pool)  # never loses a row
                exact_rows = rows
                export_exact(full=rows == len(pool))
                export_churn(since)
                gone = engine.removed_keys("churn", since=max(0, engine.version - 1))
                assert np.isin(gone, keys).all()
                engine.trim_removed("churn", engine.version - 1)
                since = engine.version
                engine.advance_version()
                report["rounds"] += 1
                exported = report["exact"] >= EXPORT_ROUNDS and report["churn"] >= 1
                if exported or time.monotonic() > deadline:
                    enough.set()
        finally:
            enough.set()  # never leave the workers waiting

    finished = []  # one entry per worker done, ok or not
    lock = threading.Lock()

    def train(barrier: threading.Barrier, worker: Worker) -> None:
        try:
            worker(barrier, iterations=120, batch=300, until=enough)
        finally:
            with lock:
                finished.append(worker)
                if len(finished) == len(workers):
                    done.set()

    jobs: list[Callable[[threading.Barrier], None]] = [lambda b, w=w: train(b, w) for w in workers]
    run_threads([*jobs, maintain])
    # every round exported both tables while the workers trained; refusals
    # only where the docstring allows them
    assert report["exact"] >= EXPORT_ROUNDS, report
    exact = report["exact"] + report["exact_growing"] + report["exact_refused"]
    assert exact == report["rounds"], report
    assert report["churn"] >= 1, report
    assert report["churn"] + report["churn_refused"] == report["rounds"], report
    assert report["churn_delta"] == report["rounds"], report  # deltas: never refused
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
