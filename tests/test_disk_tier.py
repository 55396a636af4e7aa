"""The disk tier's parts as Python sees them (``_engine``'s measuring
functions over ``details/row_file.h`` and ``details/cold_index.h``); their
C++ tests are ``ps_server/csrc/tests/disk_tier_test.cc``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from wuliang.ps_server import _engine


def test_row_files_read_back_at_depth(tmp_path: Path) -> None:
    rate, _direct, per_row = _engine.row_file_reads(
        str(tmp_path / "rows"), 168, 20_000, 4096, 8, 512
    )
    assert rate > 0
    assert 168 <= per_row <= 4096 / (4096 // 168) + 1  # 24 records a 4 KiB block
    assert not list((tmp_path / "rows").glob("*.rows"))  # deleted on close


def test_the_disk_probe_and_its_arguments(tmp_path: Path) -> None:
    rate, _direct = _engine.disk_random_reads(str(tmp_path), 4 << 20, 4096, 2, 0.05)
    assert rate > 0
    assert not list(tmp_path.iterdir())  # the probe file is deleted
    with pytest.raises(ValueError, match="multiple of 512"):
        _engine.disk_random_reads(str(tmp_path), 4 << 20, 100, 2, 0.05)
    with pytest.raises(ValueError, match="1 to 4096 bytes, got 5000"):
        _engine.row_file_reads(str(tmp_path / "r"), 5000, 10, 10, 2, 5)


def test_cold_index_ram_per_key() -> None:
    assert _engine.cold_index_bytes_per_key(200_000) <= 24


# -- the engine with a disk tier --------------------------------------------------

import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

from wuliang.ps_server import Adagrad, Engine, Eviction, TableSpec, parameter_server  # noqa: E402
from wuliang.ps_server.chunk import concat_rows  # noqa: E402

SPEC = TableSpec("t", 8, optimizer=Adagrad(learning_rate=0.1), eviction=Eviction(max_rows=5000))


def train_both(a: Engine, b: Engine, steps: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for step in range(steps):
        keys = rng.zipf(1.2, 3000).astype(np.uint64) % np.uint64(40_000) + np.uint64(1)
        shows = np.ones(len(keys), np.float32)
        rows_a = a.pull("t", keys, step=step)
        rows_b = b.pull("t", keys, step=step)
        np.testing.assert_array_equal(rows_a, rows_b)
        grads = rng.standard_normal((len(keys), 8)).astype(np.float32)
        a.push("t", keys, grads, step=step, shows=shows)
        b.push("t", keys, grads, step=step, shows=shows)


def all_rows(ps: Engine, since: int = 0) -> dict[str, np.ndarray]:
    chunk = concat_rows(list(ps.export("t", since=since, chunk_rows=1000)), 8, 8)
    order = np.argsort(chunk.keys)
    return {c: getattr(chunk, c)[order] for c in ("keys", "weights", "state", "counts", "steps",
                                                  "versions", "shows", "clicks")}  # fmt: skip


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for column, values in a.items():
        np.testing.assert_array_equal(values, b[column], err_msg=column)


def test_a_table_beyond_its_budget_keeps_every_row_exactly(tmp_path: Path) -> None:
    """A tiny budget puts most rows on disk; pulls, pushes, full and delta
    exports, lookups, erase and eviction give what the engine alone gives."""
    with Engine(2) as alone, Engine(2, disk_dir=tmp_path, memory_bytes=256 << 10) as tiered:
        for ps in (alone, tiered):
            ps.create_table(SPEC)
        train_both(alone, tiered, 40)
        stats = tiered.stats("t")
        assert stats["rows"] == alone.stats("t")["rows"]
        assert stats["cold_rows"] > stats["rows"] // 2, stats  # most rows on disk
        assert stats["demoted"] > 0 and stats["cold_reads"] > 0 and stats["disk_error"] == ""
        assert stats["row_bytes"] <= (256 << 10) + 2 * (2 << 20)  # the budget, in whole chunks
        assert_same(all_rows(alone), all_rows(tiered))
        version = alone.advance_version()
        assert tiered.advance_version() == version
        train_both(alone, tiered, 10, seed=1)
        assert_same(all_rows(alone, since=version), all_rows(tiered, since=version))
        keys = np.arange(1, 41_000, dtype=np.uint64)
        np.testing.assert_array_equal(alone.contains("t", keys), tiered.contains("t", keys))
        a, b = alone.lookup("t", keys), tiered.lookup("t", keys)
        np.testing.assert_array_equal(a.rows, b.rows)
        np.testing.assert_array_equal(a.found, b.found)
        assert alone.erase("t", keys[::7]) == tiered.erase("t", keys[::7])
        assert alone.evict("t", step=60) == tiered.evict("t", step=60)  # max_rows: LFU
        assert_same(all_rows(alone), all_rows(tiered))
        for a_log, b_log in zip(alone.removed_log("t"), tiered.removed_log("t"), strict=True):
            np.testing.assert_array_equal(np.sort(a_log), np.sort(b_log))  # rows visited apart
    assert not any(tmp_path.rglob("*.rows"))  # the row files go with the engine


def test_a_shard_a_little_over_budget_demotes_between_calls(tmp_path: Path) -> None:
    """Calls that leave a shard less than a quarter over its budget return
    before demoting: its worker demotes between calls (``demoted_between_calls``),
    with the rows exact; dropping the table or closing the engine while
    demotion is pending is safe (the worker's piece runs inside the engine's
    grace period)."""
    import time

    spec = dataclasses.replace(SPEC, eviction=Eviction())
    row = 32 + 64  # dim 8 Adagrad: 32 bytes of weights, 64 of meta and state
    budget = 4000 * row
    keys = np.arange(1, 4801, dtype=np.uint64)
    with Engine(1) as alone, Engine(1, disk_dir=tmp_path, memory_bytes=budget) as tiered:
        for ps in (alone, tiered):
            ps.create_table(spec)
        for lo in range(0, len(keys), 200):  # each call a little over the budget
            for ps in (alone, tiered):
                part = keys[lo : lo + 200]
                ps.load("t", part, np.tile(part[:, None].astype(np.float32), (1, 8)))
        deadline = time.monotonic() + 10
        while tiered.stats("t")["demoted_between_calls"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = tiered.stats("t")
        assert stats["demoted_between_calls"] > 0 and stats["cold_rows"] > 0, stats
        assert_same(all_rows(alone), all_rows(tiered))
        for _ in range(20):  # demotion pending, the table goes
            tiered.drop_table("t")
            tiered.create_table(spec)
            tiered.load("t", keys, np.zeros((len(keys), 8), np.float32))
        assert tiered.stats("t")["rows"] == len(keys)
    for _ in range(5):  # and the engine goes
        with Engine(1, disk_dir=tmp_path, memory_bytes=budget) as closing:
            closing.create_table(spec)
            closing.load("t", keys, np.zeros((len(keys), 8), np.float32))


def test_a_reserve_holds_no_more_than_the_budget(tmp_path: Path) -> None:
    """A table reserved for 2M rows on a 1 MiB budget maps memory for the
    budget's rows only, not the reserve's: the rest would be held for rows
    that live on disk."""
    spec = dataclasses.replace(SPEC, reserve_rows=2_000_000)
    with Engine(2, disk_dir=tmp_path, memory_bytes=1 << 20) as tiered, Engine(2) as plain:
        tiered.create_table(spec)
        plain.create_table(spec)
        assert plain.stats("t")["bytes"] > 200 << 20  # the reserve, mapped
        assert tiered.stats("t")["bytes"] < 16 << 20, tiered.stats("t")


def test_disk_tier_addresses_and_arguments(tmp_path: Path) -> None:
    with parameter_server(f"embedded?disk_dir={tmp_path}&memory_gb=0.5", 1) as ps:
        assert isinstance(ps, Engine) and ps.disk_dir == str(tmp_path)
        ps.create_table(SPEC)
        ps.pull("t", [1, 2, 3])
        assert ps.stats("t")["cold_index_bytes"] > 0
    for bad, match in [
        ("embedded?memory_gb=1", "needs disk_dir"),
        (f"embedded?disk_dir={tmp_path}&memory_gb=-1", "memory_gb must be a number > 0"),
        ("127.0.0.1:1?disk_dir=/x", "embedded engine's options"),
        ("embedded?disk=/x", "is not an option"),
    ]:
        with pytest.raises(ValueError, match=match):
            parameter_server(bad)
    with pytest.raises(ValueError, match="memory_bytes must be an int >= 0"):
        Engine(1, disk_dir=tmp_path, memory_bytes=-5)
    from wuliang.context import Context

    with pytest.raises(ValueError, match="remote servers take wuliang ps --disk-dir"):
        Context(ps="127.0.0.1:1", disk_dir=tmp_path)
    context = Context(disk_dir=tmp_path, memory_gb=0.25, num_shards=1)
    try:
        assert isinstance(context.ps, Engine) and context.ps.disk_dir == str(tmp_path)
    finally:
        context.close()


FULL_DISK = """
import resource, signal, sys
import numpy as np
from wuliang.ps_server import Engine, TableSpec
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
with Engine(1, disk_dir=sys.argv[1], memory_bytes=64 << 10) as ps:
    ps.create_table(TableSpec("t", 8))
    keys = np.arange(1, 60_001, dtype=np.uint64)
    for start in range(0, len(keys), 5000):
        ps.push("t", keys[start:start + 5000], np.ones((5000, 8), np.float32))
    stats = ps.stats("t")
    assert stats["rows"] == 60_000, stats
    assert sys.argv[1] in stats["disk_error"], stats
    rows = ps.pull("t", keys, train=False)
    assert (rows != 0).all()  # every row read back, none lost
    print("ok", stats["cold_rows"], stats["disk_error"])
"""


def test_a_full_disk_keeps_rows_in_memory_and_says_so(tmp_path: Path) -> None:
    """Row files cannot grow past 1 MiB (RLIMIT_FSIZE, in a child process):
    the rows that do not fit stay in RAM, over budget, and stats name the
    directory in ``disk_error``; no row is lost."""
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


def test_prefetch_reads_a_batch_ahead_of_its_pull(tmp_path: Path) -> None:
    """``prefetch_many`` reads the cold rows of its keys (and keeps them
    through the next pulls), so their pull reads nothing; servers without a
    tier read nothing."""
    from wuliang.ps_server import PullPart

    with Engine(1, disk_dir=tmp_path, memory_bytes=64 << 10) as ps:
        ps.create_table(SPEC)
        keys = np.arange(1, 20_001, dtype=np.uint64)
        ps.push("t", keys, np.ones((len(keys), 8), np.float32))
        assert ps.prefetches and ps.stats("t")["cold_rows"] > 15_000
        batch = keys[::10]
        before = ps.stats("t")
        read = ps.prefetch_many([PullPart("t", batch)])
        after = ps.stats("t")
        assert read > 0 and after["cold_prefetched"] - before["cold_prefetched"] == read
        ps.pull("t", [1], step=5)  # another call: the prefetched rows stay
        rows = ps.pull("t", batch, step=6)
        assert ps.stats("t")["cold_reads"] == after["cold_reads"]  # nothing read by the pull
        assert ps.prefetch_many_async([PullPart("t", batch)]).wait() == 0  # all in RAM now
    with Engine(1) as plain:
        plain.create_table(SPEC)
        assert not plain.prefetches and plain.prefetch_many([PullPart("t", [1, 2])]) == 0
        plain.push("t", keys, np.ones((len(keys), 8), np.float32))
        np.testing.assert_array_equal(rows, plain.pull("t", batch, step=6))


# -- a kill anywhere in the tier ----------------------------------------------------

TIER_CHILD = """
import os, sys
from pathlib import Path
from crash import CRASH_ENV, set_rows, two_table_session
from wuliang.checkpoint import latest_checkpoint
from wuliang.ps_server import Engine

model_dir, disk, budget = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def tiered():
    return Engine(1, disk_dir=disk, memory_bytes=budget, row_file_bytes=1 << 20)

point = os.environ.pop(CRASH_ENV)  # not while the first checkpoint is written
session = two_table_session(tiered())
set_rows(session, 1)
session.save_checkpoint(model_dir, keep=2)
session.context.close()
os.environ[CRASH_ENV] = point  # armed for the next engine: killed somewhere below
session = two_table_session(tiered())
session.restore_checkpoint(latest_checkpoint(model_dir))
for step in range(2, 40):
    set_rows(session, step)  # every row to disk and back, files going stale
    session.save_checkpoint(model_dir, keep=2)
"""


# A one-byte budget demotes inside the calls; 230,000 bytes, a little under
# the two tables' 2,000 rows (256,000 bytes), between them (the worker's idle work).
@pytest.mark.parametrize(
    ("point", "budget"),
    [
        ("tier-demote", 1),
        ("tier-promote", 1),
        ("tier-compact:3", 1),
        ("tier-demote-idle:3", 230_000),
    ],
)
def test_a_kill_in_the_tier_leaves_checkpoints_whole(
    tmp_path: Path, point: str, budget: int
) -> None:
    """A trainer whose rows live on disk is SIGKILLed while demoting
    (in a call, or between calls), promoting or compacting; its checkpoints verify and
    hold their rows, a restore into an engine with a disk tier rebuilds the
    tiers with every row, and its row files are cleared by the next engine
    on that directory."""
    from crash import crash_at, expected_rows, sorted_rows, two_table_session

    from wuliang.checkpoint import checkpoints
    from wuliang.ps_server.storage import Version

    model_dir, disk = tmp_path / "model", tmp_path / "disk"
    args = [str(model_dir), str(disk), str(budget)]
    crash_at(TIER_CHILD, args, point, tmp_path, tmp_path / "child.log")
    assert any(disk.rglob("*.rows"))  # the killed engine's, left behind
    saved = checkpoints(model_dir)
    assert saved and saved[0][0] >= 1
    for step, path in saved:
        version = Version(path)
        version.verify()
        session = two_table_session(Engine(1, disk_dir=disk, memory_bytes=1))
        try:
            session.restore_checkpoint(path)
            engine = session.context.engine
            for table in ("a", "b"):
                rows = sorted_rows(version.read_rows(table))
                keys, weights = expected_rows(step, table)
                np.testing.assert_array_equal(rows["keys"], keys)
                np.testing.assert_array_equal(rows["weights"], weights)
                restored = sorted_rows(engine.export(table))
                for column, values in rows.items():
                    np.testing.assert_array_equal(restored[column], values, err_msg=column)
                assert engine.stats(table)["cold_rows"] == len(keys)  # on disk again
        finally:
            session.context.close()
    assert not any(disk.rglob("*.rows"))  # the dead process's folder went too
