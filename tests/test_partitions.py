"""A partitioned dataset followed as it lands (``wuliang.reader.partitions``):
complete partitions only, in time order, listed anew at every look, late
ones trained or skipped by policy, files split between trainers, the state a
checkpoint keeps; in a folder and in an S3-protocol store."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from s3_server import moto_s3

from wuliang.reader.partitions import Partition, PartitionError, PartitionSource


def land(root: Path, name: str, files: int = 2, marker: str | None = "_SUCCESS") -> Path:
    """A partition folder with ``files`` Parquet-named files and its marker."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"part-{i:05d}.parquet").write_bytes(b"PAR1")
    if marker is not None:
        (folder / marker).write_bytes(b"")
    return folder


def names(partitions: list[Partition]) -> list[str]:
    return [p.name for p in partitions]


def test_complete_hive_partitions_come_in_time_order(tmp_path: Path) -> None:
    land(tmp_path, "dt=2026-11-29/hour=05")
    land(tmp_path, "dt=2026-11-28/hour=23")
    land(tmp_path, "dt=2026-11-29/hour=06", marker=None)  # still being written
    land(tmp_path, "dt=2026-11-29/hour=04", files=1)
    (tmp_path / "dt=2026-11-29/hour=04/_temporary").mkdir()
    (tmp_path / "dt=2026-11-29/hour=04/_temporary/part-9.parquet").write_bytes(b"")
    (tmp_path / "dt=2026-11-29/hour=04/.part-0.parquet.crc").write_bytes(b"")
    source = PartitionSource(tmp_path)
    ready = source.ready()
    assert names(ready) == [
        "dt=2026-11-28/hour=23",
        "dt=2026-11-29/hour=04",
        "dt=2026-11-29/hour=05",
    ]
    assert ready[1].time == dt.datetime(2026, 11, 29, 4)
    assert ready[1].files == (str(tmp_path / "dt=2026-11-29/hour=04/part-00000.parquet"),)
    (tmp_path / "dt=2026-11-29/hour=06/_SUCCESS").write_bytes(b"")  # it completes
    assert names(source.ready())[-1] == "dt=2026-11-29/hour=06"  # listed anew


@pytest.mark.parametrize(
    ("layout", "name", "when"),
    [
        ("{YYYY}{MM}{DD}/{HH}", "20261129/05", dt.datetime(2026, 11, 29, 5)),
        ("events-{YYYY}-{MM}-{DD}", "events-2026-11-29", dt.datetime(2026, 11, 29)),
        ("{YYYY}/{MM}/{DD}/{HH}{mm}", "2026/11/29/0530", dt.datetime(2026, 11, 29, 5, 30)),
    ],
)
def test_a_pattern_of_time_fields_names_partitions(
    tmp_path: Path, layout: str, name: str, when: dt.datetime
) -> None:
    land(tmp_path, name)
    land(tmp_path, "not-a-partition")  # logged and left alone
    (ready,) = PartitionSource(tmp_path, layout=layout).ready()
    assert (ready.name, ready.time) == (name, when)


@pytest.mark.parametrize(
    ("layout", "message"),
    [("{YYYY}{QQ}", r"unknown field \{QQ\}"), ("{MM}{DD}", "no {YYYY}"), ("{YYYY}{YYYY}", "twice")],
)
def test_a_bad_layout_is_named(tmp_path: Path, layout: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PartitionSource(tmp_path, layout=layout)


def test_a_manifest_completes_a_partition_and_lists_its_files(tmp_path: Path) -> None:
    folder = land(tmp_path, "dt=2026-11-29", files=3, marker=None)
    source = PartitionSource(tmp_path, manifest="manifest.json")
    assert source.ready() == []
    (folder / "manifest.json").write_text(json.dumps({"files": ["part-00002.parquet"]}))
    (ready,) = source.ready()
    assert ready.files == (str(folder / "part-00002.parquet"),)
    (folder / "manifest.json").write_text(json.dumps({"files": ["part-00009.parquet"]}))
    with pytest.raises(PartitionError, match=r"dt=2026-11-29/manifest.json lists 1 files .*00009"):
        source.ready()
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(PartitionError, match=r"dt=2026-11-29/manifest.json: not a manifest"):
        source.ready()


def test_trainers_split_a_partitions_files_without_overlap(tmp_path: Path) -> None:
    land(tmp_path, "dt=2026-11-29", files=7)
    (partition,) = PartitionSource(tmp_path).ready()
    parts = [partition.files_for(i, 3) for i in range(3)]
    assert sorted(f for part in parts for f in part) == list(partition.files)
    assert [len(p) for p in parts] == [3, 2, 2]
    with pytest.raises(ValueError, match=r"trainer index 3 is not in \[0, 3\)"):
        partition.files_for(3, 3)


class Clock:
    """A clock whose sleeps run ``during`` (a partition landing meanwhile)."""

    def __init__(self, during: Callable[[float], None] = lambda now: None) -> None:
        self.now = 0.0
        self.during = during
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.during(self.now)


def test_next_waits_for_the_next_partition_with_bounded_polling(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    land(tmp_path, "dt=2026-11-28")
    clock = Clock(lambda now: land(tmp_path, "dt=2026-11-29") if now >= 90 else None)
    source = PartitionSource(tmp_path, poll_s=30, clock=clock, sleep=clock.sleep)
    first = source.next()
    assert first is not None and first.name == "dt=2026-11-28"
    source.done(first)
    assert source.next(timeout=45) is None  # nothing within 45 s: two looks, then None
    assert clock.sleeps == [30, 15]
    with caplog.at_level(logging.INFO, logger="wuliang"):
        second = source.next()
    assert second is not None and second.name == "dt=2026-11-29"
    assert clock.now == 105  # found at the first look after it landed
    assert "waiting for a complete partition after 2026-11-28T00:00:00" in caplog.text
    assert "a _SUCCESS marker" in caplog.text


@pytest.mark.parametrize("policy", ["train", "skip"])
def test_a_late_partition_is_trained_when_it_lands_or_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    land(tmp_path, "dt=2026-11-29/hour=05")
    source = PartitionSource(tmp_path, late=policy)
    partition = source.next(timeout=0)
    assert partition is not None
    source.done(partition)
    land(tmp_path, "dt=2026-11-29/hour=02")  # three hours older, landing now
    land(tmp_path, "dt=2026-11-29/hour=06")
    with caplog.at_level(logging.WARNING, logger="wuliang"):
        got = source.next(timeout=0)
    assert got is not None
    if policy == "train":
        assert got.name == "dt=2026-11-29/hour=02"  # oldest first, when it lands
        assert source.late_trained == 1 and "3:00:00 older than" in caplog.text
    else:
        assert got.name == "dt=2026-11-29/hour=06"
        assert source.late_skipped == 1 and "skipped (late='skip')" in caplog.text
        assert source.is_done("dt=2026-11-29/hour=02")  # never trained later


def test_the_state_resumes_where_it_was(tmp_path: Path) -> None:
    for hour in ("01", "02", "03"):
        land(tmp_path, f"dt=2026-11-29/hour={hour}")
    source = PartitionSource(tmp_path)
    for _ in range(2):
        partition = source.next(timeout=0)
        assert partition is not None
        source.done(partition)
    state = json.loads(json.dumps(source.state()))  # as a checkpoint keeps it
    again = PartitionSource(tmp_path, state=state)
    assert names(again.ready()) == ["dt=2026-11-29/hour=03"]
    assert again.newest == dt.datetime(2026, 11, 29, 2)
    with pytest.raises(ValueError, match="not a partition source's state"):
        PartitionSource(tmp_path, state={"done": "all"})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"late": "drop"}, "late"),
        ({"poll_s": 0}, "poll_s"),
        ({"marker": "a/b"}, "marker"),
        ({"manifest": ""}, "manifest"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PartitionSource(tmp_path, **kwargs)


def test_partitions_in_an_object_store_are_listed_anew(tmp_path: Path) -> None:
    with moto_s3(tmp_path, ("events",)) as (_, fs):
        local = tmp_path / "local"
        land(local, "dt=2026-11-28")
        pafs.copy_files(str(local), "events/data", pafs.LocalFileSystem(), fs)
        source = PartitionSource("s3://events/data")
        (first,) = source.ready()
        assert first.files == ("s3://events/data/dt=2026-11-28/part-00000.parquet",
                               "s3://events/data/dt=2026-11-28/part-00001.parquet")  # fmt: skip
        source.done(first)
        land(local, "dt=2026-11-29")
        pafs.copy_files(str(local / "dt=2026-11-29"), "events/data/dt=2026-11-29",
                        pafs.LocalFileSystem(), fs)  # fmt: skip
        assert names(source.ready()) == ["dt=2026-11-29"]
