"""Checkpoints: exact resume, restore into other shard counts, corruption
refused by name, and a SIGKILL at each point of a checkpoint's write leaves
the previous ones valid."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from crash import DIMS, crash_at, expected_rows, set_rows, sorted_rows, two_table_session
from small_model import Losses, make_session, reader, write_data

import wuliang as wl
from wuliang.checkpoint import checkpoints, latest_checkpoint
from wuliang.ps_server.storage import CorruptVersionError, Version


def train(
    files: list[str], shuffle: int, steps: int, hooks: list[Any], admission: Any = None
) -> list[float]:
    losses = Losses()
    session = make_session(admission=admission)
    try:
        session.train(reader(files, shuffle), steps=steps, hooks=[*hooks, losses])
    finally:
        session.close()
        session.context.close()
    return losses.values


@pytest.mark.parametrize("shuffle", [0, 300])
def test_resume_equals_uninterrupted(tmp_path: Path, shuffle: int) -> None:
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    n, m = 12, 15
    whole = train(files, shuffle, n + m, [])

    first = train(files, shuffle, n, [wl.hooks.Checkpoint(model_dir, every_steps=5, keep=None)])
    assert [s for s, _ in checkpoints(model_dir)] == [5, 10, 12]  # periodic, then at the end
    second = train(files, shuffle, m, [wl.hooks.Checkpoint(model_dir, every_steps=1000)])
    assert first + second == whole  # bit for bit

    # a periodic checkpoint (taken mid-run, pipeline synced) resumes exactly too
    for step in (12, n + m):
        os.rename(model_dir / f"ckpt-{step}", tmp_path / f"moved-{step}")
    again = train(files, shuffle, m, [wl.hooks.Checkpoint(model_dir, every_steps=1000)])
    assert again == whole[10 : 10 + m]


def test_resume_with_admission_keeps_the_sighting_counts(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    admit = wl.admission.MinCount(3)
    n, m = 10, 14
    whole = train(files, 0, n + m, [], admit)
    first = train(files, 0, n, [wl.hooks.Checkpoint(model_dir, every_steps=1000)], admit)
    pending = Version(model_dir / f"ckpt-{n}").pending_counts("items")
    assert len(pending[0]) > 100 and set(pending[1].tolist()) == {1, 2}  # waiting keys
    second = train(files, 0, m, [wl.hooks.Checkpoint(model_dir, every_steps=1000)], admit)
    assert first + second == whole  # bit for bit: keys seen before the stop count


def test_periodic_checkpoints_of_a_run_loop(tmp_path: Path) -> None:
    """Session hooks act on schedule when the caller drives Session.run."""
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    hook = wl.hooks.Checkpoint(model_dir, every_steps=2, keep=None)
    session = make_session(hooks=(hook,))
    for batch, _ in zip(reader(files, 0), range(5), strict=False):
        session.run(batch, "loss")
    assert [s for s, _ in checkpoints(model_dir)] == [2, 4]
    session.run(next(iter(reader(files, 0))), "loss", train=False)  # evaluation: no step
    session.close()  # ends the hooks: the last step is saved
    assert [s for s, _ in checkpoints(model_dir)] == [2, 4, 5]
    session.context.close()


def test_saving_right_after_a_restore_keeps_the_restored_tower(tmp_path: Path) -> None:
    """No step between restore and save: the tower is restored only at the
    next step, so the new checkpoint must hold the restored one, not the
    fresh tower."""
    files = write_data(tmp_path)
    batch = next(iter(reader(files, 0)))
    trained = make_session()
    trained.train(reader(files, 0), steps=6)
    want = trained.run(batch, "predictions", train=False)
    first = trained.save_checkpoint(tmp_path / "a")
    trained.context.close()

    again = make_session()
    again.restore_checkpoint(first)
    second = again.save_checkpoint(tmp_path / "b", keep=1)
    again.train(reader(files, 0), steps=1)  # restores from the new one
    again.context.close()
    check = make_session()
    check.restore_checkpoint(second)
    np.testing.assert_array_equal(check.run(batch, "predictions", train=False), want)
    check.context.close()


def test_evaluation_runs_leave_the_checkpoint_position_alone(tmp_path: Path) -> None:
    """The final checkpoint resumes after the last trained batch, whatever the
    caller evaluated after training (a batch without a position included)."""
    files = write_data(tmp_path)
    hook = wl.hooks.Checkpoint(tmp_path / "model", every_steps=100)
    session = make_session(hooks=(hook,))
    session.train(reader(files, 0), steps=4)
    batch = next(iter(reader(files, 0)))
    batch.position = None  # as a hand-built batch
    session.run(batch, "predictions", train=False)
    session.close()
    (path,) = hook.saved
    assert Version(path).manifest.reader_position["batches"] == 4
    session.context.close()


def table_state(session: wl.Session) -> dict[str, dict[int, tuple]]:
    state: dict[str, dict[int, tuple]] = {}
    for table in session.context.tables:
        rows = state.setdefault(table, {})
        for chunk in session.context.engine.export(table):
            for i, key in enumerate(chunk.keys.tolist()):
                rows[key] = (
                    chunk.weights[i].tobytes(),
                    chunk.state[i].tobytes(),
                    int(chunk.counts[i]),
                    int(chunk.steps[i]),
                )
    return state


def test_restore_into_1_3_8_shards(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    admit = wl.admission.MinCount(2)
    session = make_session(admission=admit)
    session.train(reader(files, 0), steps=6)
    path = session.save_checkpoint(model_dir)
    want = table_state(session)
    pending = session.context.engine.pending_counts("items")
    assert len(pending[0]) > 50
    keys = {t: np.array(sorted(rows), np.uint64) for t, rows in want.items()}
    pulled = {t: session.context.engine.pull(t, k, train=False) for t, k in keys.items()}
    session.context.close()
    assert all(len(rows) > 50 for rows in want.values())
    for shards in (1, 3, 8):
        other = make_session(num_shards=shards, admission=admit)
        other.restore_checkpoint(model_dir)  # the newest one in the folder
        assert other.global_step == 6
        assert table_state(other) == want
        for got, saved in zip(other.context.engine.pending_counts("items"), pending, strict=True):
            np.testing.assert_array_equal(got, saved)
        for t, k in keys.items():
            np.testing.assert_array_equal(other.context.engine.pull(t, k, train=False), pulled[t])
        other.context.close()
    assert Version(path).step == 6


def test_tampered_or_missing_file_is_refused_by_name(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    session = make_session()
    session.train(reader(files, 0), steps=3)
    path = session.save_checkpoint(model_dir)
    before = table_state(session)
    part = path / "tables" / "users" / "part-00000.arrow"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    part.write_bytes(bytes(data))
    with pytest.raises(CorruptVersionError, match=r"users/part-00000\.arrow"):
        session.restore_checkpoint(path)
    assert table_state(session) == before  # nothing changed
    dense = sorted((path / "dense").iterdir())[0]
    dense.unlink()
    part.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptVersionError, match=r"bytes|missing"):
        session.restore_checkpoint(path)
    session.context.close()


CRASH_CHILD = """
from crash import set_rows, two_table_session
session = two_table_session()
set_rows(session, 3)
session.save_checkpoint(sys.argv[1], keep=2)
print("saved", flush=True)
"""

# The checkpoints a crash at each point leaves (a child saving ckpt-3 with
# keep=2 over ckpt-1 and ckpt-2), and what it leaves aside under .tmp-
# ("writer-open", the same for every version, is tested with exports: each
# checkpoint child costs seconds of TensorFlow import).
CHECKPOINT_CRASHES = {
    "rows-file": ([1, 2], "ckpt-3"),
    "before-manifest": ([1, 2], "ckpt-3"),
    "before-rename": ([1, 2], "ckpt-3"),
    "after-rename": ([1, 2, 3], None),  # in place, not rotated yet
    "checkpoint-rotate": ([2, 3], "ckpt-1"),  # ckpt-1 out of sight, not removed yet
}


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def assert_checkpoint_is(path: Path, step: int) -> None:
    """The checkpoint verifies, holds the rows of ``set_rows(step)`` and
    restores them exactly (every column) into a new session."""
    version = Version(path)
    version.verify()
    assert version.step == step
    session = two_table_session()
    session.restore_checkpoint(path)
    for table in DIMS:
        saved = sorted_rows(version.read_rows(table))
        keys, weights = expected_rows(step, table)
        np.testing.assert_array_equal(saved["keys"], keys)
        np.testing.assert_array_equal(saved["weights"], weights)
        loaded = sorted_rows(session.context.engine.export(table))
        for column, values in saved.items():
            np.testing.assert_array_equal(loaded[column], values, err_msg=f"{table}.{column}")
    session.context.close()


@pytest.mark.parametrize("point", list(CHECKPOINT_CRASHES))
def test_sigkill_at_each_point_of_a_checkpoint(tmp_path: Path, point: str) -> None:
    """A writer killed at any point of a checkpoint leaves the previous ones
    whole and loadable, shows readers no partial one, and the next save
    removes its leftovers and succeeds."""
    model_dir = tmp_path / "model"
    session = two_table_session()
    for step in (1, 2):
        set_rows(session, step)
        session.save_checkpoint(model_dir, keep=2)
    crash_at(CRASH_CHILD, [str(model_dir)], point, tmp_path, tmp_path / "child.log")

    left, aside = CHECKPOINT_CRASHES[point]
    assert [s for s, _ in checkpoints(model_dir)] == left
    assert latest_checkpoint(model_dir) == model_dir / f"ckpt-{left[-1]}"
    for step, path in checkpoints(model_dir):
        assert_checkpoint_is(path, step)
    stale = sorted(p for p in model_dir.iterdir() if p.name.startswith(".tmp-"))
    visible = {p.name for p in model_dir.iterdir()} - {p.name for p in stale}
    assert visible == {f"ckpt-{s}" for s in left}  # nothing else, partial or not
    if aside is None:
        assert stale == []
    else:  # the crash landed where asked: what it was writing lies aside
        (folder,) = stale
        assert folder.name.startswith(f".tmp-{aside}-")
        files = files_under(folder)
        if point == "rows-file":
            assert files == {"tables/a/part-00000.arrow"}
        elif point == "before-manifest":
            assert "tables/b/part-00000.arrow" in files and "manifest.json" not in files
            assert any(f.startswith("serving/") for f in files)
        else:  # before-rename, checkpoint-rotate: a complete version
            assert "manifest.json" in files
            Version(folder).verify()

    set_rows(session, 4)
    path = session.save_checkpoint(model_dir, keep=2)
    assert [s for s, _ in checkpoints(model_dir)] == [left[-1], 4]
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".tmp-")]
    assert_checkpoint_is(path, 4)
    session.context.close()


def test_bad_arguments_and_mismatched_tables_are_refused(tmp_path: Path) -> None:
    for kwargs, message in [
        ({"every_steps": 0}, "every_steps"),
        ({"every_secs": -1}, "every_secs"),
        ({"keep": 0}, "keep"),
    ]:
        with pytest.raises(ValueError, match=message):
            wl.hooks.Checkpoint(tmp_path, **kwargs)
    files = write_data(tmp_path)
    session = make_session()
    session.train(reader(files, 0), steps=2)
    path = session.save_checkpoint(tmp_path / "model")
    session.context.close()
    keras.utils.set_random_seed(5)
    wider = wl.EmbeddingTable("users", 16, optimizer=wl.optimizers.Adagrad(0.1))
    items = wl.EmbeddingTable("items", 4, optimizer=wl.optimizers.Adam(0.01))
    features = [wl.SparseFeature("user", wider), wl.SparseFeature("items", items)]
    other = wl.Session(lambda e, d: keras.layers.Dense(1)(e["user"]), features)
    with pytest.raises(ValueError, match="table 'users' has dim 8"):
        other.restore_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        other.restore_checkpoint(tmp_path / "empty")
    other.context.close()
