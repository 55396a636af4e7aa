"""The ``wuliang export`` job and the trainer's ``IncrementalExport`` hook
sharing one export folder: each continues the other's chain (a delta of the
newest version, or nothing when it already holds the newest checkpoint's
step), never a second full version of a step already exported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from small_model import make_session, reader, write_data

import wuliang as wl
from wuliang.checkpoint import cut_version
from wuliang.export import SessionSource, apply_chain, export, versions
from wuliang.ps_server import Engine, TableSpec
from wuliang.ps_server.storage import Version

SCRIPT = Path(sys.executable).parent / "wuliang"
TABLES = ["users", "items"]


def job(model_dir: Path, exports: Path, cwd: Path) -> str:
    """Runs ``wuliang export`` as cron would; returns its status line."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package
    done = subprocess.run(
        [str(SCRIPT), "export", "--model-dir", str(model_dir), "--export-dir", str(exports)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def kinds(exports: Path) -> list[tuple[int, str, int | None, int]]:
    """(version, kind, parent, step) of every version, oldest first."""
    out = []
    for number, path in versions(exports):
        v = Version(path)
        out.append((number, v.kind, v.parent, v.step))
    return out


def rows(engine: Engine, table: str) -> dict[str, np.ndarray]:
    chunks = list(engine.export(table))
    keys = np.concatenate([c.keys for c in chunks])
    weights = np.concatenate([c.weights for c in chunks])
    order = np.argsort(keys)
    return {"keys": keys[order], "weights": weights[order]}


def assert_serves_the_trainer(exports: Path, trainer: Engine) -> None:
    served = Engine(num_shards=3)
    apply_chain(served, exports)
    for table in TABLES:
        got, want = rows(served, table), rows(trainer, table)
        np.testing.assert_array_equal(got["keys"], want["keys"], err_msg=table)
        np.testing.assert_array_equal(got["weights"], want["weights"], err_msg=table)
    served.close()


@pytest.mark.parametrize("checkpoint_first", [True, False], ids=["ckpt-hook-first", "export-first"])
def test_job_continues_the_hook_chain(tmp_path: Path, checkpoint_first: bool) -> None:
    files = write_data(tmp_path)
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    session = make_session()
    checkpoint = wl.hooks.Checkpoint(model_dir, every_steps=4)
    exporter = wl.hooks.IncrementalExport(exports, every_steps=4)
    hooks = [checkpoint, exporter] if checkpoint_first else [exporter, checkpoint]
    session.train(reader(files, 0), steps=8, hooks=hooks)
    assert kinds(exports) == [(1, "full", None, 4), (2, "delta", 1, 8)]
    ckpt = Version(model_dir / "ckpt-8")
    assert ckpt.engine_version == Version(exports / "2").engine_version  # same rows

    # the newest checkpoint is at the step of the hook's newest version: nothing to do
    assert job(model_dir, exports, tmp_path) == "export 2 is up to date (step 8); nothing written"
    assert job(model_dir, exports, tmp_path).startswith("export 2 is up to date")  # idempotent
    assert kinds(exports) == [(1, "full", None, 4), (2, "delta", 1, 8)]

    # a newer checkpoint: a delta of the hook's last version
    session.train(reader(files, 0), steps=3, hooks=[checkpoint])
    status = job(model_dir, exports, tmp_path)
    assert status.startswith("export 3: delta of 2 at step 11"), status
    assert kinds(exports)[-1] == (3, "delta", 2, 11)
    assert (
        0
        < Version(exports / "3").tables["users"].rows
        < session.context.engine.stats("users")["rows"]
    )
    assert_serves_the_trainer(exports, session.context.engine)
    session.context.close()


def test_hook_continues_the_job_chain(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    session = make_session()
    checkpoint = wl.hooks.Checkpoint(model_dir, every_steps=4)
    session.train(reader(files, 0), steps=4, hooks=[checkpoint])
    assert job(model_dir, exports, tmp_path).startswith(
        "export 1: full (no previous export) at step 4"
    )

    # the trainer, at the step the job exported, has nothing new
    same = export(SessionSource(session), exports)
    assert not same.written and (same.version, same.step) == (1, 4)

    exporter = wl.hooks.IncrementalExport(exports, every_steps=3)
    session.train(reader(files, 0), steps=5, hooks=[checkpoint, exporter])  # steps 5 ... 9
    assert [(r.version, r.kind, r.parent, r.step) for r in exporter.results] == [
        (2, "delta", 1, 6),
        (3, "delta", 2, 9),
    ]
    assert kinds(exports) == [(1, "full", None, 4), (2, "delta", 1, 6), (3, "delta", 2, 9)]
    assert_serves_the_trainer(exports, session.context.engine)
    assert (model_dir / "ckpt-9").is_dir()  # the Checkpoint hook's, at the end
    assert job(model_dir, exports, tmp_path) == "export 3 is up to date (step 9); nothing written"
    session.context.close()


def test_restarted_trainer_continues_the_job_chain(tmp_path: Path) -> None:
    """A new process restores the checkpoint the job exported: its hook
    writes deltas of the job's version."""
    files = write_data(tmp_path)
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    first = make_session()
    first.train(reader(files, 0), steps=5, hooks=[wl.hooks.Checkpoint(model_dir, every_steps=5)])
    first.context.close()
    assert job(model_dir, exports, tmp_path).startswith("export 1: full")

    session = make_session()
    exporter = wl.hooks.IncrementalExport(exports, every_steps=1000)
    session.train(
        reader(files, 0),
        steps=3,
        hooks=[wl.hooks.Checkpoint(model_dir, every_steps=1000), exporter],
    )
    assert session.global_step == 8
    assert [(r.version, r.kind, r.parent, r.step) for r in exporter.results] == [(2, "delta", 1, 8)]
    assert_serves_the_trainer(exports, session.context.engine)
    assert job(model_dir, exports, tmp_path) == "export 2 is up to date (step 8); nothing written"
    session.context.close()


def test_cut_version_reuses_the_version_of_unchanged_rows() -> None:
    engine = Engine(num_shards=2)
    engine.create_table(TableSpec("t", 4))
    keys = np.arange(10, dtype=np.uint64)
    engine.pull("t", keys)
    assert cut_version(engine) == 1 and engine.version == 2
    assert cut_version(engine) == 1 and engine.version == 2  # nothing changed: the same
    engine.push("t", keys[:3], np.ones((3, 4), np.float32))
    assert cut_version(engine) == 2 and engine.version == 3
    assert cut_version(engine) == 2
    engine.erase("t", keys[:1])  # a removal is a change too
    assert cut_version(engine) == 3 and engine.version == 4
    engine.advance_version()  # a version nobody recorded, with no change in it
    assert cut_version(engine) == 4 and engine.version == 5
    engine.close()
