"""Exactly once across SIGKILLs: a trainer following partitions as they land
is killed at random moments and started again, alone and in a `wuliang
launch` job whose servers are killed too (`--recovery full`); the final
model's per-row update counts (a table keyed by row,
`benchmarks/stream_bench.py`) show every row trained once."""

from __future__ import annotations

import sys
from pathlib import Path

from repo_data import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import stream_bench


def test_a_trainer_killed_twice_trains_every_row_once(tmp_path: Path) -> None:
    result = stream_bench.kills(tmp_path, partitions=4, rows=2048, interval=2.0, n=2, every=3)
    assert result["kills"] == 2, result
    assert (result["duplicated_rows"], result["skipped_rows"]) == (0, 0), result


def test_a_job_whose_roles_are_killed_trains_every_row_once(tmp_path: Path) -> None:
    """The servers and the trainer of a job killed, ``--recovery full``: the
    job restarts from the newest checkpoint each time."""
    result = stream_bench.cluster_kills(
        tmp_path,
        partitions=4,
        rows=2048,
        interval=2.0,
        n=2,
        every=3,
        recovery="full",
        workers=0,
        roles=["chief-0", "ps-1"],
    )
    name = "cluster_full_one_trainer"
    assert result[f"{name}_kills"] == ["chief-0", "ps-1"], result
    counted = result[f"{name}_duplicated_rows"], result[f"{name}_skipped_rows"]
    assert counted == (0, 0), result


def test_a_job_of_two_trainers_killed_trains_every_row_once(tmp_path: Path) -> None:
    """A chief and a worker, each killed once: the chief's checkpoints are
    one cut of both (it holds the worker while it writes, ``wuliang.job``)."""
    result = stream_bench.cluster_kills(
        tmp_path,
        partitions=5,
        rows=2048,
        interval=2.0,
        n=2,
        every=3,
        recovery="full",
        workers=1,
        roles=["worker-0", "chief-0"],
    )
    assert result["cluster_full_kills"] == ["worker-0", "chief-0"], result
    counted = result["cluster_full_duplicated_rows"], result["cluster_full_skipped_rows"]
    assert counted == (0, 0), result
