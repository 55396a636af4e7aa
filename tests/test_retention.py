"""Retention of checkpoints and exports, for a trainer that runs for months.

What passing guarantees:

* Checkpoints: the rule (``checkpoints_to_remove``, pure) keeps the newest
  ``keep`` by step, the newest checkpoint of each of the ``keep_daily`` most
  recent UTC days that have one (days with several, gaps between days, more
  days than ``keep_daily``, the newest ``keep`` among the daily ones), and
  always the one just written; ``rotate`` applies it to a folder and to an
  object store by each checkpoint's manifest time; the ``Checkpoint`` hook
  applies it to the checkpoints a training session writes (times injected:
  the version writer's clock), and without ``keep_daily`` keeps the newest
  ``keep`` as before.
* Exports: ``prune`` removes the oldest versions until ``keep_versions`` /
  ``keep_bytes`` hold, never one of LATEST's chain; a chain over the budget
  is kept whole and the result says so (and suggests ``compact``); in a
  folder and in an object store (a moto server); the chain left applies to
  the trainer's rows exactly. ``IncrementalExport`` prunes after each
  version it writes; ``wuliang export --keep-versions/--keep-bytes`` after
  its export.
* A prune killed after a version went out of sight (``export-prune``)
  leaves no half version listed: every listed version verifies, LATEST's
  chain applies, and the next prune clears what was left.
* A replica (``ModelStore``) that was behind when the versions it would
  have applied next were pruned moves to LATEST at its next refresh: on top
  of its own version when the next delta rests on it (even when that
  version itself was pruned), else through the newest full version, without
  refusing anything.

Exports are written from a real embedded engine through ``LiveSource``
(a stub tower: no TensorFlow); only the hook test of daily checkpoints
trains a real session.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
from crash import crash_at
from s3_server import moto_s3

import wuliang.ps_server.storage.version as version_module
from wuliang.checkpoint import checkpoints, checkpoints_to_remove, cut_version, rotate
from wuliang.cli import main as cli_main
from wuliang.export import (
    LiveSource,
    PruneResult,
    apply_chain,
    chain,
    compact,
    export,
    prune,
    versions,
)
from wuliang.hooks import IncrementalExport
from wuliang.ps_server import Engine, TableSpec
from wuliang.ps_server.storage import (
    MANIFEST,
    CorruptVersionError,
    ModelDescription,
    RemotePath,
    Version,
    VersionWriter,
    location,
)
from wuliang.serving.store import ModelStore

BUCKET = "wuliang-retention"
DAY = 86400.0
T0 = datetime.datetime(2026, 3, 1, tzinfo=datetime.timezone.utc).timestamp()  # a midnight


# -- a trainer without TensorFlow: an engine, a stub tower ----------------------------


class StubTower:
    """What ``LiveSource`` asks of a tower: a model description and a SavedModel."""

    def restored_version(self) -> None:
        return None

    def model_description(self) -> ModelDescription:
        return ModelDescription()

    def write_saved_model(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "saved_model.pb").write_bytes(b"a tower\n")


class Trainer:
    """An embedded engine whose rows change each ``train`` (new rows, changed
    rows, removed rows), exported through ``LiveSource``."""

    def __init__(self) -> None:
        self.engine = Engine(num_shards=2)
        self.engine.create_table(TableSpec("t", 4))
        self.step = 0
        self.rng = np.random.default_rng(7)

    def train(self) -> None:
        self.step += 1
        keys = np.unique(self.rng.integers(0, 400, 60)).astype(np.uint64)
        weights = self.rng.normal(size=(len(keys), 4)).astype(np.float32)
        self.engine.load("t", keys, weights, step=self.step)
        present = np.arange(400, dtype=np.uint64)
        present = present[self.engine.contains("t", present)]
        self.engine.erase("t", self.rng.choice(present, 3, replace=False))

    def export(self, export_dir: Any, kind: str = "auto") -> Any:
        context = SimpleNamespace(ps=self.engine, global_step=self.step, tables={"t": None})
        return export(LiveSource(context, StubTower()), export_dir, kind)  # type: ignore[arg-type]

    def write(self, export_dir: Any, kinds: str) -> None:
        """One version per letter: ``f`` full, ``d`` a delta, each after a step."""
        for letter in kinds:
            self.train()
            result = self.export(export_dir, "full" if letter == "f" else "auto")
            assert result.kind == {"f": "full", "d": "delta"}[letter], result.status()

    def rows(self) -> dict[int, bytes]:
        return rows_of(self.engine)

    def close(self) -> None:
        self.engine.close()


def rows_of(engine: Engine) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for chunk in engine.export("t"):
        for i, key in enumerate(chunk.keys.tolist()):
            out[key] = chunk.weights[i].tobytes()
    return out


def applied_rows(export_dir: Any, version: int | None = None) -> dict[int, bytes]:
    with Engine(num_shards=2) as engine:
        apply_chain(engine, export_dir, version)
        return rows_of(engine)


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    yield t
    t.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pafs.S3FileSystem]:
    with moto_s3(tmp_path_factory.mktemp("s3"), (BUCKET,)) as (_, fs):
        yield fs


def numbers(export_dir: Any) -> list[int]:
    return [n for n, _ in versions(export_dir)]


def assert_whole(export_dir: Any, trainer: Trainer) -> None:
    """Every listed version verifies; LATEST's chain applies to the trainer's rows."""
    for _, path in versions(export_dir):
        Version(path).verify()
    assert applied_rows(export_dir) == trainer.rows()


# -- checkpoints: the rule ------------------------------------------------------------


def at(day: int, hour: float = 12) -> float:
    return T0 + day * DAY + hour * 3600


def test_daily_rule_keeps_the_newest_of_each_recent_day() -> None:
    # day 0: steps 1, 2, 3; day 1: 4, 5; (day 2: none); day 3: 6; day 4: 7, 8
    found = [
        (1, at(0, 1)),
        (2, at(0, 9)),
        (3, at(0, 23.9)),
        (4, at(1, 0.1)),
        (5, at(1, 20)),
        (6, at(3)),
        (7, at(4, 2)),
        (8, at(4, 3)),
    ]
    # without keep_daily: the newest keep, as before
    assert checkpoints_to_remove(found, keep=2) == [1, 2, 3, 4, 5, 6]
    assert checkpoints_to_remove(found, keep=None, keep_daily=3) == []  # keep all
    # 3 days that have checkpoints: days 4, 3 and 1 (the gap, day 2, does not count)
    assert checkpoints_to_remove(found, keep=1, keep_daily=3) == [1, 2, 3, 4, 7]
    # more days than there are: one per day, the newest of each (3, 5, 6, 8)
    assert checkpoints_to_remove(found, keep=1, keep_daily=30) == [1, 2, 4, 7]
    # the newest keep overlap the daily ones: 7, 8 (newest), 8 and 6 (daily)
    assert checkpoints_to_remove(found, keep=2, keep_daily=2) == [1, 2, 3, 4, 5]
    # the checkpoint just written stays, whatever its step (a restart from step 2)
    assert checkpoints_to_remove(found, keep=1, keep_daily=1, written=2) == [1, 3, 4, 5, 6, 7]
    # order of the input does not matter; days are UTC days
    assert checkpoints_to_remove(found[::-1], keep=1, keep_daily=3) == [1, 2, 3, 4, 7]
    near_midnight = [(1, T0 - 1), (2, T0 + 1)]  # 23:59:59 and 00:00:01 UTC
    assert checkpoints_to_remove(near_midnight, keep=1, keep_daily=2) == []
    assert checkpoints_to_remove(near_midnight, keep=1, keep_daily=1) == [1]
    # the newest of a day by time, not by step (a trainer restarted from an older one)
    restarted = [(10, at(0, 8)), (5, at(0, 9)), (11, at(1))]
    assert checkpoints_to_remove(restarted, keep=1, keep_daily=2) == [10]
    assert checkpoints_to_remove([], keep=1, keep_daily=2) == []
    for bad in ({"keep": 0}, {"keep": 1, "keep_daily": 0}, {"keep": True}):
        with pytest.raises(ValueError, match="keep"):
            checkpoints_to_remove(found, **bad)  # type: ignore[arg-type]


# -- checkpoints: rotate in a folder and an object store ------------------------------


class Clock:
    """The version writer's clock (``created`` in each manifest), set by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = T0
        monkeypatch.setattr(version_module, "time", SimpleNamespace(time=lambda: self.now))


def write_checkpoint(model_dir: Any, trainer: Trainer) -> Any:
    """A checkpoint of the trainer's engine as ``wuliang.checkpoint.save``
    writes one (rows with state, removal log), a stub SavedModel, no TensorFlow."""
    engine = trainer.engine
    version = cut_version(engine)
    with VersionWriter(model_dir, f"ckpt-{trainer.step}", "checkpoint") as writer:
        spec = engine.spec("t")
        files, rows = engine.write_rows(writer.dir, spec, state=True)
        writer.record_table(spec, files, rows, state=True)
        keys, versions_ = engine.removed_log("t")
        writer.write_removed("t", keys, versions_, engine.stats("t")["removed_floor"])
        StubTower().write_saved_model(writer.path("serving"))
        writer.add_tree("serving")
        return writer.commit(step=trainer.step, engine_version=version, model=ModelDescription())


def steps_in(model_dir: Any) -> list[int]:
    return [s for s, _ in checkpoints(model_dir)]


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_rotate_keeps_daily_checkpoints(
    where: str, tmp_path: Path, trainer: Trainer, monkeypatch: pytest.MonkeyPatch, request: Any
) -> None:
    if where == "s3":
        request.getfixturevalue("s3")
        model_dir: Any = location(f"s3://{BUCKET}/rotate/model")
    else:
        model_dir = tmp_path / "model"
    clock = Clock(monkeypatch)
    # every 8 hours for 4 days, then a gap of 3 days, then 2 more
    times = [at(d, h) for d in range(4) for h in (2, 10, 18)] + [at(7, 2), at(7, 10)]
    for when in times:
        clock.now = when
        trainer.train()
        write_checkpoint(model_dir, trainer)
        rotate(model_dir, keep=2, keep_daily=3, written=trainer.step)
    # newest 2: steps 13, 14 (day 7); daily: day 7 (14), day 3 (12), day 2 (9)
    assert steps_in(model_dir) == [9, 12, 13, 14]
    for _, path in checkpoints(model_dir):
        Version(path).verify()
    if isinstance(model_dir, Path):
        assert sorted(p.name for p in model_dir.iterdir()) == [
            "ckpt-12", "ckpt-13", "ckpt-14", "ckpt-9",
        ]  # fmt: skip
    # without keep_daily: the newest keep, never the one just written
    assert [p.name for p in rotate(model_dir, keep=1, written=13)] == ["ckpt-9", "ckpt-12"]
    assert steps_in(model_dir) == [13, 14]


def test_checkpoint_hook_keeps_daily_checkpoints_of_a_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``hooks.Checkpoint`` in a training session (TensorFlow): one
    checkpoint a step, the writer's clock jumping hours at each."""
    from small_model import make_session, reader, write_data

    import wuliang as wl

    files = write_data(tmp_path)
    model_dir = tmp_path / "model"
    # steps 1-3 on day 0, 4-5 on day 1, none on day 2, 6-8 on day 3, 9 on day 5
    times = [at(0, 1), at(0, 9), at(0, 17), at(1, 3), at(1, 5), at(3, 1), at(3, 2), at(3, 3)]
    times.append(at(5, 0))
    clock = iter(times)
    monkeypatch.setattr(version_module, "time", SimpleNamespace(time=lambda: next(clock)))
    hook = wl.hooks.Checkpoint(model_dir, every_steps=1, keep=2, keep_daily=3)
    session = make_session()
    seen = []

    class Watch(wl.hooks.SessionRunHook):  # after the checkpoint hook, each step
        def after_run(self, run_context: Any, run_values: Any) -> None:
            seen.append(steps_in(model_dir))

    session.train(reader(files, 0), steps=9, hooks=[hook, Watch()])
    assert len(hook.saved) == 9 and next(clock, None) is None
    assert seen == [
        [1],
        [1, 2],
        [2, 3],  # all on day 0: the newest 2
        [3, 4],  # newest: 3, 4; daily: 4 (day 1), 3 (day 0)
        [3, 4, 5],  # newest: 4, 5; daily: 5, 3
        [3, 5, 6],  # newest: 5, 6; daily: 6 (day 3), 5, 3
        [3, 5, 6, 7],
        [3, 5, 7, 8],  # newest: 7, 8; daily: 8, 5, 3
        [5, 8, 9],  # daily: days 5, 3 and 1 (the 3 most recent with one): day 0's 3 goes
    ]
    for _, path in checkpoints(model_dir):
        Version(path).verify()
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".tmp-")]
    session.close()
    session.context.close()
    # a new session resumes from the newest, as without keep_daily
    again = make_session()
    resumed = wl.hooks.Checkpoint(model_dir, every_steps=100, keep=2, keep_daily=3)
    monkeypatch.setattr(version_module, "time", SimpleNamespace(time=lambda: at(5, 1)))
    again.train(reader(files, 0), steps=1, hooks=[resumed])
    assert again.global_step == 10 and steps_in(model_dir) == [5, 8, 9, 10]
    with pytest.raises(ValueError, match="keep_daily"):
        wl.hooks.Checkpoint(model_dir, keep_daily=0)
    again.close()
    again.context.close()


# -- exports: prune -------------------------------------------------------------------


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_prune_by_count_keeps_latest_chain(
    where: str, tmp_path: Path, trainer: Trainer, request: Any
) -> None:
    if where == "s3":
        request.getfixturevalue("s3")
        exports: Any = location(f"s3://{BUCKET}/count/exports")
    else:
        exports = tmp_path / "exports"
    trainer.write(exports, "fddfdd")  # 1 full, 2-3 deltas, 4 full, 5-6 deltas
    assert [v.number for v in chain(exports)] == [4, 5, 6]

    nothing = prune(exports, keep_versions=6)
    assert nothing.removed == [] and nothing.kept == [1, 2, 3, 4, 5, 6]
    assert not nothing.over_budget and nothing.status().startswith("pruned nothing")

    result = prune(exports, keep_versions=4)
    assert result.removed == [1, 2] and result.kept == [3, 4, 5, 6]
    assert result.needed == [4, 5, 6] and not result.over_budget
    assert numbers(exports) == [3, 4, 5, 6]
    assert_whole(exports, trainer)

    over = prune(exports, keep_versions=2)  # the chain alone is 3 versions
    assert over.removed == [3] and over.kept == [4, 5, 6] and over.over_budget
    assert "over the budget (keep_versions=2)" in over.status()
    assert "chain (4-6) is kept whole" in over.status() and "--compact" in over.status()
    assert numbers(exports) == [4, 5, 6]
    assert_whole(exports, trainer)

    assert compact(exports).version == 7  # one full version: the old chain may go
    after = prune(exports, keep_versions=2)
    assert after.removed == [4, 5] and after.kept == [6, 7] and not after.over_budget
    assert_whole(exports, trainer)
    if isinstance(exports, Path):  # nothing else left in the folder
        assert sorted(p.name for p in exports.iterdir()) == [".lock", "6", "7", "LATEST"]
    else:
        assert sorted(p.name for p in exports.iterdir()) == ["6", "7", "LATEST"]

    trainer.write(exports, "d")  # the chain goes on after a prune
    assert [v.number for v in chain(exports)] == [7, 8]
    assert_whole(exports, trainer)


def version_bytes(path: Any) -> int:
    """A version's bytes on disk (every file under it)."""
    if isinstance(path, RemotePath):
        return sum((path / f).stat().st_size for f in path.files())
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_prune_by_bytes(where: str, tmp_path: Path, trainer: Trainer, request: Any) -> None:
    if where == "s3":
        request.getfixturevalue("s3")
        exports: Any = location(f"s3://{BUCKET}/bytes/exports")
    else:
        exports = tmp_path / "exports"
    trainer.write(exports, "fdddfd")  # 1 full, 2-4 deltas, 5 full, 6 delta
    sizes = {n: version_bytes(p) for n, p in versions(exports)}
    budget = sizes[3] + sizes[4] + sizes[5] + sizes[6]
    result = prune(exports, keep_bytes=budget)
    assert result.removed == [1, 2] and result.kept == [3, 4, 5, 6]
    assert result.kept_bytes == budget and result.removed_bytes == sizes[1] + sizes[2]
    assert not result.over_budget
    assert_whole(exports, trainer)

    # both budgets: each must hold
    both = prune(exports, keep_versions=3, keep_bytes=budget)
    assert both.removed == [3] and both.kept == [4, 5, 6]

    zero = prune(exports, keep_bytes=0)  # only LATEST's chain is left, over the budget
    assert zero.removed == [4] and zero.kept == [5, 6] and zero.over_budget
    assert zero.kept_bytes == sizes[5] + sizes[6]
    assert "keep_bytes=0" in zero.status()
    assert_whole(exports, trainer)


def test_prune_keeps_versions_after_a_lagging_latest(tmp_path: Path, trainer: Trainer) -> None:
    """LATEST lags (a writer crashed before setting it): versions after its
    chain's base stay, and so does LATEST's chain."""
    exports = tmp_path / "exports"
    trainer.write(exports, "fdfdd")  # 1 full, 2 delta, 3 full, 4-5 deltas
    (exports / "LATEST").write_text("3\n")
    result = prune(exports, keep_versions=1)
    assert result.removed == [1, 2] and result.kept == [3, 4, 5] and result.needed == [3]
    assert result.over_budget
    assert applied_rows(exports, 5) == trainer.rows()


def test_prune_arguments_and_broken_chains(tmp_path: Path, trainer: Trainer) -> None:
    exports = tmp_path / "exports"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prune(exports, keep_versions=1)
    assert not exports.exists()  # nothing created
    for bad in ({"keep_versions": 0}, {"keep_bytes": -1}, {"keep_versions": True}):
        with pytest.raises(ValueError, match="keep_"):
            prune(tmp_path, **bad)  # type: ignore[arg-type]
    exports.mkdir()
    assert prune(exports, keep_versions=1) == PruneResult(exports, keep_versions=1)
    trainer.write(exports, "fdd")
    (exports / "LATEST").write_text("9\n")  # names no version: what is needed is unknown
    with pytest.raises(CorruptVersionError, match="9 is missing"):
        prune(exports, keep_versions=1)
    assert numbers(exports) == [1, 2, 3]  # nothing removed


# -- a crash while pruning ------------------------------------------------------------

PRUNE_CHILD = """
import sys
from wuliang.export import prune
print(prune(sys.argv[1], keep_versions=int(sys.argv[2])).status(), flush=True)
"""


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_a_prune_killed_midway_leaves_no_half_version(
    where: str, tmp_path: Path, trainer: Trainer, request: Any
) -> None:
    if where == "s3":
        request.getfixturevalue("s3")
        exports: Any = location(f"s3://{BUCKET}/crash/exports")
    else:
        exports = tmp_path / "exports"
    trainer.write(exports, "fddfd")  # 1 full, 2-3 deltas, 4 full, 5 delta
    # killed at the second version's removal: 1 is gone, 2 is out of sight
    crash_at(PRUNE_CHILD, [str(exports), "2"], "export-prune:2", tmp_path, tmp_path / "log")
    assert numbers(exports) == [3, 4, 5]
    assert_whole(exports, trainer)  # every listed version verifies, the chain applies
    if isinstance(exports, Path):
        left = sorted(p.name for p in exports.iterdir() if p.name.startswith(".tmp-"))
        assert len(left) == 1 and left[0].startswith(".tmp-2-pruned-")
    else:  # the folder lost its manifest first: no version, its files still there
        assert (exports / "2").files() and not (exports / "2" / MANIFEST).exists()
    # a replica following the directory passes the leftovers by
    with ModelStore(exports, poll_secs=0, load_towers=False) as store:
        assert store.version == 5 and rows_of(store.ps) == trainer.rows()

    again = prune(exports, keep_versions=2)  # the next prune clears what was left
    assert again.removed == [3] and again.kept == [4, 5]
    if isinstance(exports, Path):
        assert sorted(p.name for p in exports.iterdir()) == [".lock", "4", "5", "LATEST"]
    else:
        assert sorted(p.name for p in exports.iterdir()) == ["4", "5", "LATEST"]
    assert_whole(exports, trainer)


# -- the hook and the job -------------------------------------------------------------


class ExportingSession:
    """What ``IncrementalExport`` uses of a session: ``export``,
    ``prune_exports`` and the context's server and tables."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.context = SimpleNamespace(ps=trainer.engine, tables={"t": None})

    def export(self, export_dir: Any, kind: str = "auto") -> Any:
        return self.trainer.export(export_dir, kind)

    def prune_exports(
        self, export_dir: Any, keep_versions: int | None, keep_bytes: int | None
    ) -> Any:
        return prune(export_dir, keep_versions=keep_versions, keep_bytes=keep_bytes)


def test_incremental_export_prunes_after_each_version(tmp_path: Path, trainer: Trainer) -> None:
    exports = tmp_path / "exports"
    hook = IncrementalExport(exports, every_steps=1, full_every=3, keep_versions=4)
    session = ExportingSession(trainer)
    seen = []
    for _ in range(8):
        trainer.train()
        hook.trigger(session)  # type: ignore[arg-type]
        seen.append(numbers(exports))
    # versions 4 and 7 are full (full_every=3): the chains are [1-3], [4-6], [7-8]
    assert [v.number for v in chain(exports)] == [7, 8]
    assert seen == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6],
                    [4, 5, 6, 7], [5, 6, 7, 8]]  # fmt: skip
    assert [p.removed for p in hook.pruned] == [[], [], [], [], [1], [2], [3], [4]]
    assert_whole(exports, trainer)
    # nothing written: no prune
    hook.trigger(session)  # type: ignore[arg-type]
    assert not hook.results[-1].written and len(hook.pruned) == 8
    with pytest.raises(ValueError, match="keep_versions"):
        IncrementalExport(exports, keep_versions=0)
    with pytest.raises(ValueError, match="keep_bytes"):
        IncrementalExport(exports, keep_bytes=-5)
    plain = IncrementalExport(exports, every_steps=1)  # the default: every version stays
    trainer.train()
    plain.trigger(session)  # type: ignore[arg-type]
    assert plain.pruned == [] and numbers(exports) == [5, 6, 7, 8, 9]


def test_retention_keeps_its_budget_without_full_every(tmp_path: Path, trainer: Trainer) -> None:
    """Untuned retention works: ``keep_versions`` alone writes a full version
    every half of it, and a chain over a bytes budget makes the next version
    full, so old chains can go."""
    session = ExportingSession(trainer)
    by_count = IncrementalExport(tmp_path / "count", every_steps=1, keep_versions=4)
    assert by_count.full_every == 2
    for _ in range(10):
        trainer.train()
        by_count.trigger(session)  # type: ignore[arg-type]
    assert len(numbers(tmp_path / "count")) <= 4
    assert not any(p.over_budget for p in by_count.pruned)
    assert_whole(tmp_path / "count", trainer)
    by_bytes = IncrementalExport(tmp_path / "bytes", every_steps=1, keep_bytes=1)
    for _ in range(4):
        trainer.train()
        by_bytes.trigger(session)  # type: ignore[arg-type]
    # each chain is over a 1-byte budget: every version after it is written full
    assert [r.kind for r in by_bytes.results] == ["full"] * 4
    assert numbers(tmp_path / "bytes") == [4]
    assert_whole(tmp_path / "bytes", trainer)


def test_export_job_prunes(
    tmp_path: Path, trainer: Trainer, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir, exports = tmp_path / "model", tmp_path / "exports"

    def job(*args: str) -> list[str]:
        code = cli_main(["export", "--model-dir", str(model_dir), "--export-dir", str(exports),
                         *args])  # fmt: skip
        out = capsys.readouterr()
        assert code == 0, out.err
        return out.out.splitlines()

    for _ in range(4):
        trainer.train()
        write_checkpoint(model_dir, trainer)
        assert len(job()) == 1  # no option: no prune, one line as before
    assert numbers(exports) == [1, 2, 3, 4]
    trainer.train()
    write_checkpoint(model_dir, trainer)
    lines = job("--full", "--keep-versions", "2")
    assert lines[0].startswith("export 5: full")
    assert lines[1].startswith("pruned 3 version(s) (1-3)") and "2 version(s) left" in lines[1]
    assert numbers(exports) == [4, 5]
    lines = job("--keep-bytes", "0")  # up to date; the prune still runs
    assert "up to date" in lines[0] and lines[1].startswith("pruned 1 version(s) (4, ")
    assert numbers(exports) == [5]
    assert_whole(exports, trainer)
    with pytest.raises(SystemExit):
        cli_main(["export", "--export-dir", str(exports), "--compact", "--keep-bytes", "x"])
    assert "invalid size" in capsys.readouterr().err


def test_keep_bytes_sizes() -> None:
    from wuliang.cli import byte_size

    assert byte_size("1000") == 1000
    assert byte_size("2K") == 2048 and byte_size("2kib") == 2048 and byte_size("2KB") == 2048
    assert byte_size("1.5G") == 3 << 29 and byte_size("1T") == 1 << 40


# -- a replica behind a prune ---------------------------------------------------------


def test_a_replica_behind_a_prune_moves_to_the_newest_chain(
    tmp_path: Path, trainer: Trainer, caplog: pytest.LogCaptureFixture
) -> None:
    exports = tmp_path / "exports"
    trainer.write(exports, "fdd")
    with ModelStore(exports, poll_secs=0, load_towers=False) as store:
        assert store.version == 3
        # the next delta (4) rests on the served version, which is pruned
        trainer.write(exports, "ddfd")  # 4-5 deltas of 3, 6 full, 7 delta
        assert prune(exports, keep_versions=4).removed == [1, 2, 3]
        assert store.refresh() == [4, 5, 6, 7]
        assert store.version == 7 and rows_of(store.ps) == trainer.rows()

        # the versions after the served one are pruned too: through the newest full one
        trainer.write(exports, "ddfdd")  # 8-9 deltas of 7, 10 full, 11-12 deltas
        assert prune(exports, keep_versions=4).removed == [4, 5, 6, 7, 8]
        assert numbers(exports) == [9, 10, 11, 12]  # 9 rests on 8, which is gone
        assert store.refresh() == [10, 11, 12]
        assert store.version == 12 and rows_of(store.ps) == trainer.rows()
        assert store.counters.refused == 0
        assert store.refresh() == []  # 9 is passed by once, logged once
    passed = [r.getMessage() for r in caplog.records if "passed by" in r.getMessage()]
    assert passed == [
        "model exports: version 9 passed by: version 8, which version 9 rests on, is gone "
        "(pruned); moving on to a later full version"
    ]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
