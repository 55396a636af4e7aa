"""Exports: full and delta versions from checkpoints (``wuliang export``) and
from the live trainer (``IncrementalExport``); base + deltas == full, bit for
bit; removals; the SavedModel; idempotence, compaction, corruption and a
SIGKILL at each point of an export's write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from crash import DIMS, crash_at, expected_rows, set_rows, sorted_rows, two_table_session
from small_model import make_session, reader, write_data

import wuliang as wl
from wuliang.export import (
    CheckpointSource,
    SessionSource,
    apply_chain,
    chain,
    compact,
    export,
    latest,
    versions,
)
from wuliang.ps_server import Engine
from wuliang.ps_server.storage import CorruptVersionError, DenseInput, SparseInput, Version

COLUMNS = ("keys", "weights", "counts", "steps", "versions")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wuliang", "export", *args],
        capture_output=True,
        text=True,
        cwd=cwd,  # not the source tree: the installed package
        timeout=300,
    )


def rows_of(engine: Engine, table: str) -> dict[str, np.ndarray]:
    """Every row of a table sorted by key, the columns exports keep."""
    chunks = list(engine.export(table))
    out = {c: np.concatenate([getattr(x, c) for x in chunks]) for c in COLUMNS}
    order = np.argsort(out["keys"])
    return {c: v[order] for c, v in out.items()}


def assert_same_tables(a: Engine, b: Engine, tables: list[str]) -> None:
    for table in tables:
        x, y = rows_of(a, table), rows_of(b, table)
        for column in COLUMNS:
            np.testing.assert_array_equal(x[column], y[column], err_msg=f"{table}.{column}")


def applied(export_dir: Path, version: int | None = None) -> Engine:
    engine = Engine(num_shards=3)
    apply_chain(engine, export_dir, version)
    return engine


def test_cli_full_then_deltas_equal_a_full_export(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir, exports, fulls = tmp_path / "model", tmp_path / "exports", tmp_path / "fulls"
    session = make_session()
    engine = session.context.engine
    session.train(reader(files, 0), steps=6)
    session.save_checkpoint(model_dir)

    first = cli("--model-dir", str(model_dir), "--export-dir", str(exports), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("export 1: full (no previous export) at step 6")
    assert len(first.stdout.strip().splitlines()) == 1
    again = cli("--model-dir", str(model_dir), "--export-dir", str(exports), cwd=tmp_path)
    assert again.returncode == 0 and "up to date" in again.stdout  # idempotent
    assert [v for v, _ in versions(exports)] == [1]

    session.train(reader(files, 0), steps=4)
    gone = {}
    for table, n in (("users", 3), ("items", 2)):
        candidates = np.arange(500, dtype=np.uint64)
        gone[table] = candidates[engine.contains(table, candidates)][:n]
        assert engine.erase(table, gone[table]) == n
    again_key = gone["users"][2:]
    back = engine.pull("users", again_key)  # removed, then back
    engine.push("users", again_key, np.ones_like(back))
    session.save_checkpoint(model_dir)
    second = cli(
        "--incremental", "--model-dir", str(model_dir), "--export-dir", str(exports), cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("export 2: delta of 1 at step 10")
    delta = Version(exports / "2")
    assert delta.parent == 1 and delta.kind == "delta"
    assert sorted(delta.removed_keys("users").tolist()) == gone["users"][:2].tolist()
    assert sorted(delta.removed_keys("items").tolist()) == gone["items"].tolist()
    since = Version(exports / "1").engine_version
    for table in ("users", "items"):  # exactly the rows changed since export 1
        changed = rows_of(engine, table)["versions"] > since
        assert delta.tables[table].rows == changed.sum() > 0
        assert changed.sum() < len(changed)
    assert (exports / "LATEST").read_text().strip() == "2"

    session.train(reader(files, 0), steps=3)
    session.save_checkpoint(model_dir)
    assert (
        cli("--model-dir", str(model_dir), "--export-dir", str(exports), cwd=tmp_path).returncode
        == 0
    )
    full = cli("--full", "--model-dir", str(model_dir), "--export-dir", str(fulls), cwd=tmp_path)
    assert full.returncode == 0, full.stderr

    tables = ["users", "items"]
    assert [v.path.name for v in chain(exports)] == ["1", "2", "3"]
    chained, whole = applied(exports), applied(fulls)
    assert_same_tables(chained, whole, tables)  # base + deltas == full, bit for bit
    assert_same_tables(chained, engine, tables)  # == the trainer's rows
    at_two = applied(exports, 2)  # removed keys are gone after the delta removing them
    assert not at_two.contains("users", gone["users"][:2]).any()
    assert at_two.contains("users", again_key).all()
    assert not at_two.contains("items", gone["items"]).any()
    assert applied(exports, 1).contains("items", gone["items"]).all()
    session.context.close()


def served(path: Path, batch: Any, embeddings: dict[str, np.ndarray]) -> np.ndarray:
    signature = tf.saved_model.load(str(path / "serving")).signatures["serving_default"]
    inputs = {name: tf.constant(value) for name, value in embeddings.items()}
    x = tf.constant(batch.dense_feature("x"), tf.float32)
    return signature(**inputs, x=x)["predictions"].numpy()


@pytest.mark.parametrize("keras_model", [False, True], ids=["function", "keras-model"])
def test_saved_model_serves_the_session_predictions(tmp_path: Path, keras_model: bool) -> None:
    files = write_data(tmp_path)
    session = make_session(keras_model=keras_model)
    batch = next(iter(reader(files, 0)))
    for version in (1, 2):  # the second one reuses the first one's graph
        session.train(reader(files, 0), steps=5)
        result = export(SessionSource(session), tmp_path / "exports")
        assert result.version == version
        want = session.run(batch, ["predictions", "user", "items"], train=False)
        embeddings = {"user": want["user"], "items": want["items"]}
        got = served(result.path, batch, embeddings)
        np.testing.assert_allclose(got, want["predictions"], rtol=1e-6)
    first = served(tmp_path / "exports" / "1", batch, embeddings)
    assert np.abs(first - want["predictions"]).max() > 1e-4  # each version its own weights
    model = Version(result.path).model
    assert model is not None
    assert model.sparse[1] == SparseInput("items", "items", "mean", None)
    assert model.dense == (DenseInput("x", 1),)
    session.context.close()


def test_incremental_export_hook_chain_equals_the_trainer(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    exports = tmp_path / "exports"
    hook = wl.hooks.IncrementalExport(exports, every_steps=4, full_every=3)
    session = make_session()
    session.train(reader(files, 300), steps=14, hooks=[hook])
    kinds = [(r.version, r.kind, r.step) for r in hook.results]
    # every 4 steps, then at the end; version 4 is full again (full_every=3)
    assert kinds == [(1, "full", 4), (2, "delta", 8), (3, "delta", 12), (4, "full", 14)]
    for version, _ in versions(exports):
        Version(exports / str(version)).verify()
    for r in hook.results[1:3]:
        assert 0 < sum(r.rows.values()) < sum(hook.results[0].rows.values()) + 100
    tables = ["users", "items"]
    assert_same_tables(applied(exports), session.context.engine, tables)
    session.context.close()
    with pytest.raises(ValueError, match="full_every"):
        wl.hooks.IncrementalExport(exports, full_every=0)


def test_compact_merges_a_chain_into_one_full_version(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    exports = tmp_path / "exports"
    session = make_session()
    for steps in (4, 3, 3):
        session.train(reader(files, 0), steps=steps)
        session.context.engine.erase("items", np.arange(steps, dtype=np.uint64))
        export(SessionSource(session), exports)
    before = applied(exports)
    result = cli("--compact", "--export-dir", str(exports), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("export 4: full (compacted versions 1, 2, 3)")
    assert [v.path.name for v in chain(exports)] == ["4"]
    assert_same_tables(applied(exports), before, ["users", "items"])
    assert "up to date" in compact(exports).status()  # already full: nothing new
    session.context.close()


def test_full_when_a_delta_cannot_be_made(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    session = make_session()
    session.train(reader(files, 0), steps=3)
    old = session.save_checkpoint(model_dir)
    session.train(reader(files, 0), steps=3)
    new = session.save_checkpoint(model_dir)
    session.context.close()
    assert export(CheckpointSource(new), exports).kind == "full"
    older = export(CheckpointSource(old), exports)  # a trainer restarted from ckpt-3
    assert (older.version, older.kind, older.reason) == (2, "full", "ckpt-3 is older than export 1")
    manifest = json.loads((new / "manifest.json").read_text())
    manifest["tables"]["users"]["removed_floor"] = 10**9  # as if the log had been cut
    (new / "manifest.json").write_text(json.dumps(manifest))
    cut = export(CheckpointSource(new), exports)
    assert (cut.version, cut.kind) == (3, "full") and "no longer reaches" in cut.reason
    assert not export(CheckpointSource(new), exports, kind="full").written  # 3 is full
    with pytest.raises(ValueError, match="kind"):
        export(CheckpointSource(new), exports, kind="delta")


def test_errors_are_clear_and_corruption_is_refused_by_name(tmp_path: Path) -> None:
    files = write_data(tmp_path)
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    missing = cli("--model-dir", str(model_dir), "--export-dir", str(exports), cwd=tmp_path)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    model_dir.mkdir()
    empty = cli("--model-dir", str(model_dir), "--export-dir", str(exports), cwd=tmp_path)
    assert empty.returncode == 1 and "no checkpoint" in empty.stderr
    no_model = cli("--export-dir", str(exports), cwd=tmp_path)
    assert no_model.returncode == 2 and "--model-dir" in no_model.stderr  # usage
    nothing = cli("--compact", "--export-dir", str(exports), cwd=tmp_path)
    assert nothing.returncode == 1 and "has no export" in nothing.stderr

    session = make_session()
    session.train(reader(files, 0), steps=3)
    ckpt = session.save_checkpoint(model_dir)
    part = ckpt / "tables" / "users" / "part-00000.arrow"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    bad = cli("--model-dir", str(model_dir), "--export-dir", str(exports), cwd=tmp_path)
    assert bad.returncode == 1 and "users/part-00000.arrow" in bad.stderr
    assert not exports.exists() or versions(exports) == []
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))

    export(CheckpointSource(ckpt), exports)
    session.train(reader(files, 0), steps=2)
    export(SessionSource(session), exports)
    target = exports / "2" / "tables" / "items" / "part-00000.arrow"
    data = bytearray(target.read_bytes())
    data[-100] ^= 0x10
    target.write_bytes(bytes(data))
    engine = Engine(2)
    with pytest.raises(CorruptVersionError, match=r"2/tables/items/part-00000\.arrow"):
        apply_chain(engine, exports)
    (exports / "1" / "manifest.json").unlink()
    with pytest.raises(CorruptVersionError, match="parent of 2"):
        chain(exports)
    session.context.close()


CRASH_CHILD = """
from wuliang.export import CheckpointSource, export
print(export(CheckpointSource(sys.argv[1]), sys.argv[2]).status(), flush=True)
"""

# The versions a crash at each point leaves (a child exporting ckpt-3 over
# versions 1 and 2), and whether it leaves a .tmp- version directory aside.
EXPORT_CRASHES = {
    "writer-open": ([1, 2], True),
    "rows-file": ([1, 2], True),
    "before-manifest": ([1, 2], True),
    "before-rename": ([1, 2], True),
    "after-rename": ([1, 2, 3], False),  # in place; LATEST not updated yet
    "latest-temp": ([1, 2, 3], False),  # LATEST's replacement written, not renamed
}


def assert_chain_is(export_dir: Path, step: int, version: int | None = None) -> None:
    """The chain of ``version`` (default LATEST) verifies and applies to the
    rows of ``set_rows(step)`` exactly."""
    engine = Engine(2)
    applied = apply_chain(engine, export_dir, version)
    assert applied[-1].step == step
    for table in DIMS:
        rows = sorted_rows(engine.export(table))
        keys, weights = expected_rows(step, table)
        np.testing.assert_array_equal(rows["keys"], keys)
        np.testing.assert_array_equal(rows["weights"], weights)
    engine.close()


@pytest.mark.parametrize("point", list(EXPORT_CRASHES))
def test_sigkill_at_each_point_of_an_export(tmp_path: Path, point: str) -> None:
    """An export killed at any point of its write leaves every committed
    version whole, shows readers no partial one (LATEST at most lags), and
    the next export removes its leftovers, repairs LATEST and succeeds."""
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    session = two_table_session()
    ckpts = {}
    for step in (1, 2, 3, 4):
        set_rows(session, step)
        ckpts[step] = session.save_checkpoint(model_dir, keep=None)
    session.context.close()
    assert export(CheckpointSource(ckpts[1]), exports).kind == "full"
    assert export(CheckpointSource(ckpts[2]), exports).kind == "delta"
    log = tmp_path / "child.log"
    assert crash_at(CRASH_CHILD, [str(ckpts[3]), str(exports)], point, tmp_path, log) == []

    left, aside = EXPORT_CRASHES[point]
    assert [v for v, _ in versions(exports)] == left
    for _, path in versions(exports):
        Version(path).verify()
    newest = latest(exports)
    assert newest is not None and newest.path.name == str(left[-1])
    assert (exports / "LATEST").read_text() == "2\n"  # only ever names a whole chain
    assert [v.path.name for v in chain(exports)] == ["1", "2"]
    assert_chain_is(exports, 2)
    stale = sorted(p for p in exports.iterdir() if p.name.startswith(".tmp-"))
    visible = {p.name for p in exports.iterdir()} - {p.name for p in stale}
    assert visible == {"LATEST", ".lock", *map(str, left)}
    if aside:  # the crash landed where asked: the version being written lies aside
        (folder,) = stale
        assert folder.name.startswith(".tmp-3-")
        files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        if point == "writer-open":
            assert files == set()
        elif point == "rows-file":
            assert files == {"tables/a/part-00000.arrow"}
        elif point == "before-manifest":
            assert "tables/b/part-00000.arrow" in files and "manifest.json" not in files
            assert any(f.startswith("serving/") for f in files)
        else:
            assert "manifest.json" in files
    elif point == "latest-temp":
        (temporary,) = stale
        assert temporary.name.startswith(".tmp-LATEST-") and temporary.read_text() == "3\n"
    else:
        assert stale == []

    again = export(CheckpointSource(ckpts[3]), exports)  # what the cron job does next
    assert (again.version, again.kind, again.parent) == (3, "delta", 2)
    assert again.written == (left[-1] == 2)  # unless the crash came after the rename
    assert (exports / "LATEST").read_text() == "3\n"
    assert not [p for p in exports.iterdir() if p.name.startswith(".tmp-")]
    assert export(CheckpointSource(ckpts[4]), exports).version == 4
    assert [v.path.name for v in chain(exports)] == ["1", "2", "3", "4"]
    assert_chain_is(exports, 3, 3)
    assert_chain_is(exports, 4)


def test_tables_without_optimizer_state_export_from_checkpoints(tmp_path: Path) -> None:
    """SGD keeps no state per row: its checkpoint parts have no state column."""
    import keras

    keras.utils.set_random_seed(2)
    table = wl.EmbeddingTable("t", 4, optimizer=wl.optimizers.SGD(0.1))
    dense = keras.layers.Dense(1)
    session = wl.Session(lambda e, d: dense(e["user"]), [wl.SparseFeature("user", table)])
    files = write_data(tmp_path)
    model_dir, exports = tmp_path / "model", tmp_path / "exports"
    plain = wl.reader.ParquetReader(files, 64, ["user"], label="label")
    session.train(plain, steps=3)
    first = export(CheckpointSource(session.save_checkpoint(model_dir)), exports)
    session.train(plain, steps=2)
    second = export(CheckpointSource(session.save_checkpoint(model_dir)), exports)
    assert (first.kind, second.kind) == ("full", "delta")
    assert 0 < second.rows["t"] < first.rows["t"] + 128
    assert_same_tables(applied(exports), session.context.engine, ["t"])
    session.context.close()
