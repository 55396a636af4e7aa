"""Training that follows partitions: each partition scored before it is
trained (progressive validation), exported after it (held back by the
gate), rows stamped and TTLs counted on the data's clock, and SIGTERM
finishing the step, checkpointing and exiting 0."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from small_model import BATCH, make_session

import wuliang as wl
from wuliang.hooks.metrics import auc
from wuliang.reader import PartitionSource, StreamReader

TESTS = Path(__file__).resolve().parent
DAYS = ["dt=2026-11-01", "dt=2026-11-02", "dt=2026-11-03", "dt=2026-11-04"]
ROWS = 1000  # a day's rows


def write_days(root: Path, days: list[str], rows: int = ROWS, flip: str | None = None) -> None:
    """A partition per day: users 0..299 of the day's own range, the label
    learnable (flipped in partition ``flip``, which a model cannot predict)."""
    for k, name in enumerate(days):
        rng = np.random.default_rng(k)
        users = rng.integers(0, 30, rows)  # the same users every day
        x = rng.normal(size=rows).astype(np.float32)
        label = ((users % 3 == 0) ^ (x > 1.5)).astype(np.float32)  # the user, mostly
        if name == flip:
            label = 1 - label
        items = [rng.integers(0, 50, 2).tolist() for _ in range(rows)]
        folder = root / name
        folder.mkdir(parents=True)
        table = pa.table({"user": users, "items": items, "x": x, "label": label})
        pq.write_table(table, folder / "part-0.parquet", row_group_size=64)
        (folder / "_SUCCESS").touch()


class Predictions(wl.hooks.SessionRunHook):
    """Every step's predictions and labels, by partition."""

    def __init__(self) -> None:
        self.by_partition: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def before_run(self, run_context: Any) -> Any:
        return wl.hooks.SessionRunArgs(["predictions"])

    def after_run(self, run_context: Any, run_values: Any) -> None:
        name = run_context.batch.partition.name
        pair = (run_context.batch.labels, run_values.results["predictions"])
        self.by_partition.setdefault(name, []).append(pair)


def follow(root: Path, hooks: list[Any], **session_args: Any) -> Any:
    """A session trained on root's partitions (``session.reader`` follows on)."""
    session = make_session(hooks=tuple(hooks), **session_args)
    session.reader = StreamReader(PartitionSource(root), BATCH, label="label", timeout=0)
    session.train(session.reader)
    return session


def test_each_partition_is_scored_by_the_model_before_it_trains(tmp_path: Path) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    write_days(tmp_path / "data", DAYS)
    registry = prometheus.CollectorRegistry()
    jsonl = tmp_path / "pv.jsonl"
    progressive = wl.hooks.ProgressiveValidation(jsonl=jsonl, registry=registry)
    seen = Predictions()
    session = follow(tmp_path / "data", [progressive, seen])
    try:
        records = list(progressive.records)
        assert [r["partition"] for r in records] == DAYS
        assert [r["examples"] for r in records] == [ROWS] * 4
        for record in records:  # the training steps' own predictions, before their updates
            pairs = seen.by_partition[record["partition"]]
            labels = np.concatenate([p[0] for p in pairs])
            scores = np.concatenate([p[1] for p in pairs])
            assert record["auc"] == pytest.approx(auc(labels, scores), abs=1e-9)
        assert records[-1]["auc"] > records[0]["auc"] + 0.05  # it learns, day by day
        lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert [line["partition"] for line in lines] == DAYS
        assert lines[2]["auc"] == pytest.approx(records[2]["auc"])
        assert lines[0]["time"] == "2026-11-01T00:00:00"
        assert registry.get_sample_value("wuliang_progressive_auc") == pytest.approx(
            records[-1]["auc"]
        )
        day4 = dt.datetime(2026, 11, 4, tzinfo=dt.timezone.utc).timestamp()
        assert registry.get_sample_value("wuliang_progressive_partition_time_seconds") == day4
    finally:
        session.close()
        session.context.close()


def test_a_partition_that_scores_far_below_the_trend_is_not_exported(tmp_path: Path) -> None:
    write_days(tmp_path / "data", DAYS, flip=DAYS[2])
    progressive = wl.hooks.ProgressiveValidation(gate_auc_drop=0.1, trailing=3)
    exports = wl.hooks.IncrementalExport(
        tmp_path / "exports", every_partition=True, gate=progressive
    )
    session = follow(tmp_path / "data", [progressive, exports])
    try:
        held = [r["partition"] for r in progressive.records if r["held"]]
        assert held == [DAYS[2]]
        assert progressive.held == 1 and exports.held == 1
        # a version after each partition that passed; the held one's changes go out with the next
        assert list(exports.after_partition) == [DAYS[0], DAYS[1], DAYS[3]]
        assert [r.version for r in exports.results] == [1, 2, 3]
        assert exports.results[-1].step == session.global_step
        newest = wl.export.latest(tmp_path / "exports")
        for table in ("users", "items"):  # the removals exported are forgotten
            assert session.context.ps.stats(table)["removed_floor"] == newest.engine_version
    finally:
        session.close()
        session.context.close()


def test_a_gate_must_come_before_the_export_it_gates(tmp_path: Path) -> None:
    write_days(tmp_path / "data", DAYS[:1])
    progressive = wl.hooks.ProgressiveValidation(gate_auc_drop=0.1)
    exports = wl.hooks.IncrementalExport(
        tmp_path / "exports", every_partition=True, gate=progressive
    )
    with pytest.raises(ValueError, match="gate ProgressiveValidation must come before it"):
        follow(tmp_path / "data", [exports, progressive])
    with pytest.raises(TypeError, match="gate must be a ProgressiveValidation"):
        wl.hooks.IncrementalExport(tmp_path / "exports", gate=object())


def land(root: Path, name: str, users: np.ndarray) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    table = pa.table(
        {
            "user": users,
            "items": [[1]] * len(users),
            "x": np.zeros(len(users), np.float32),
            "label": (users % 2).astype(np.float32),
        }
    )
    pq.write_table(table, folder / "part-0.parquet")
    (folder / "_SUCCESS").touch()


def test_rows_carry_the_data_time_and_ttls_count_on_it(tmp_path: Path) -> None:
    """Users of the first day only are evicted two days of data later,
    however fast the days train; a late partition does not turn the clock
    back."""
    root = tmp_path / "data"
    day = 86_400
    day1 = int(dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc).timestamp())
    land(root, DAYS[0], np.arange(0, 200))
    land(root, DAYS[1], np.arange(500, 564))
    session = follow(root, [], eviction=wl.eviction.TTL(seconds=day + 3600))
    ps = session.context.ps
    try:
        assert ps.clock() == day1 + day == session.data_time
        times = np.concatenate([chunk.times for chunk in ps.export("users")])
        assert sorted(np.unique(times).tolist()) == [day1, day1 + day]
        assert ps.evict("users")["total"] == 0  # one day of data: nothing is older
        land(root, "dt=2026-10-20", np.arange(900, 964))  # late: trained at day 2's clock
        land(root, DAYS[2], np.arange(500, 564))  # day 3: day 2's users again
        session.train(session.reader)  # the partitions landed since
        assert ps.clock() == day1 + 2 * day
        late = ps.read_rows("users", np.arange(900, 964, dtype=np.uint64))[0]
        assert set(late.times.tolist()) == {day1 + day}  # the clock did not go back
        assert ps.evict("users")["total"] == 200  # day 1's users: two days of data old
        assert ps.contains("users", np.arange(500, 564, dtype=np.uint64)).all()
        assert ps.contains("users", np.arange(900, 964, dtype=np.uint64)).all()
    finally:
        session.close()
        session.context.close()


TRAINER = """
import sys, time
sys.path.insert(0, {tests!r})
from small_model import BATCH, make_session
import wuliang as wl
from wuliang.reader import PartitionSource, StreamReader

class Slow(wl.hooks.SessionRunHook):
    def after_run(self, run_context, run_values):
        print("step", run_context.step, run_context.batch.partition.name, flush=True)
        time.sleep(0.05)

session = make_session()
reader = StreamReader(PartitionSource({data!r}, poll_s=0.1), BATCH, label="label")
checkpoint = wl.hooks.Checkpoint({model!r}, every_steps=10**6)
result = session.train(reader, hooks=[Slow(), checkpoint])
session.close()
print("stopped by", session.stopped_by, "at step", session.global_step, flush=True)
"""


def start_trainer(tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "trainer.py"
    script.write_text(
        TRAINER.format(tests=str(TESTS), data=str(tmp_path / "data"), model=str(tmp_path / "m"))
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def lines_until(proc: subprocess.Popen, pattern: str, timeout: float = 120) -> list[str]:
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip())
        if pattern in line:
            return seen
    proc.kill()
    raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(seen[-30:]))


def test_sigterm_finishes_the_step_checkpoints_and_exits_0(tmp_path: Path) -> None:
    """Mid-partition, then while waiting for the next: each time the
    trainer checkpoints where it stands and exits 0; together the two runs
    train every row once."""
    write_days(tmp_path / "data", DAYS[:2])
    first = start_trainer(tmp_path)
    try:
        lines_until(first, f"step 3 {DAYS[0]}")
        first.send_signal(signal.SIGTERM)
        out = lines_until(first, "stopped by SIGTERM")
        assert first.wait(timeout=60) == 0
    finally:
        stop(first)
    steps = int(out[-1].split()[-1])
    assert steps >= 4
    assert (tmp_path / "m" / f"ckpt-{steps}").is_dir()
    second = start_trainer(tmp_path)
    try:  # resumes inside day 1, trains the rest, then waits for day 3
        trained = lines_until(second, f"step {2 * -(-ROWS // BATCH) - 1} {DAYS[1]}")
        time.sleep(1.0)  # waiting for a partition now
        second.send_signal(signal.SIGTERM)
        out = lines_until(second, "stopped by SIGTERM", timeout=30)
        assert second.wait(timeout=60) == 0
    finally:
        stop(second)
    first_step = int(next(line for line in trained if line.startswith("step")).split()[1])
    assert first_step == steps  # nothing trained twice, nothing skipped
    total = 2 * -(-ROWS // BATCH)
    assert out[-1] == f"stopped by SIGTERM at step {total}"
    assert (tmp_path / "m" / f"ckpt-{total}").is_dir()
    manifest = json.loads((tmp_path / "m" / f"ckpt-{total}" / "manifest.json").read_text())
    assert manifest["reader_position"]["partitions"]["done"] == DAYS[:2]


def test_each_partition_is_published_to_redis(tmp_path: Path, redis_url: str) -> None:
    """``IncrementalExport(redis=...)``: a fleet reading Redis gets the
    version written after each partition (a delta on top of the one before)."""
    import redis

    write_days(tmp_path / "data", DAYS[:3])
    exports = wl.hooks.IncrementalExport(
        tmp_path / "exports", every_partition=True, redis=redis_url, redis_model="days"
    )
    session = follow(tmp_path / "data", [exports])
    try:
        assert [r.version for r in exports.published] == [1, 2, 3]
        client = redis.Redis.from_url(redis_url)
        assert client.get("wl:{days}:current") == b"3"
        client.close()
    finally:
        session.close()
        session.context.close()


class PublishFailsAt(wl.hooks.IncrementalExport):
    """Its publish of version ``down`` goes to a port nothing listens on."""

    def __init__(self, *args: Any, down: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.down = down

    def _publish(self, session: Any) -> None:
        url = self.redis
        if self.results[-1].version == self.down:
            with socket.socket() as s:  # a port nothing listens on
                s.bind(("127.0.0.1", 0))
                self.redis = f"redis://127.0.0.1:{s.getsockname()[1]}"
        try:
            super()._publish(session)
        finally:
            self.redis = url


def test_a_failed_publish_is_bridged_by_the_next(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis unreachable for version 3: training goes on, and version 4 goes
    to Redis as a delta on version 2 holding what 3 and 4 changed, so the
    fleet's rows are the export's."""
    from wuliang.serving.redis.publish import publish
    from wuliang.serving.redis.replica import RedisStore

    write_days(tmp_path / "data", DAYS)
    exports = PublishFailsAt(
        tmp_path / "exports", every_partition=True, redis=redis_url, redis_model="gap", down=3
    )
    session = follow(tmp_path / "data", [exports])
    try:
        assert [r.version for r in exports.results if r.written] == [1, 2, 3, 4]
        assert [p.version for p in exports.published] == [1, 2, 4]
        assert (exports.published[-1].kind, exports.published[-1].base) == ("delta", 2)
        assert "publishing to redis://127.0.0.1:" in caplog.text and "failed" in caplog.text
    finally:
        session.close()
        session.context.close()
    publish(tmp_path / "exports", redis_url, "whole", version=4, full=True)
    with RedisStore(redis_url, "gap") as gap, RedisStore(redis_url, "whole") as whole:
        assert gap.version == whole.version == 4
        keys = np.arange(60, dtype=np.uint64)
        for table in whole.tables():
            a, b = gap.lookup(table, keys), whole.lookup(table, keys)
            assert b.found.sum() > 0
            np.testing.assert_array_equal(a.found, b.found)
            np.testing.assert_array_equal(a.rows, b.rows)


def test_progressive_validation_keeps_nothing_of_a_reader_without_partitions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from small_model import reader, write_data

    progressive = wl.hooks.ProgressiveValidation()
    session = make_session(hooks=(progressive,))
    try:
        session.train(reader(write_data(tmp_path), 0), steps=5)
    finally:
        session.close()
        session.context.close()
    assert not progressive.records and progressive._metrics.result()["examples"] == 0
    assert "the reader's batches have none" in caplog.text
