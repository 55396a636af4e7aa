"""The end-to-end examples (examples/criteo.py, examples/movielens.py) run and report.

Each example runs as a subprocess with this interpreter (the venv's python):
it must exit 0 and end with one JSON line, whose AUC shows the model learned
what the data holds. The splits it writes are checked too: every row lands on
one side, train before test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from repo_data import MOVIELENS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(script: str, args: list[str], cwd: Path) -> dict[str, Any]:
    """Runs examples/<script> and returns its final JSON line."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing; stderr:\n{proc.stderr[-5000:]}"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


def test_criteo_example(tmp_path: Path) -> None:
    work = tmp_path / "criteo"
    result = run_example(
        "criteo.py",
        [
            *("--rows", "20000", "--rows-per-file", "5000", "--bucketize"),
            *("--epochs", "2", "--batch-size", "256", "--work-dir", str(work)),
        ],
        tmp_path,
    )
    # The synthetic label is learnable (C1-C3 and I1 move it): a model that
    # learned nothing scores 0.5 (0.80-0.86 measured over seeds).
    assert result["auc"] > 0.75, result
    assert 0.2 < result["logloss"] < 0.65 and result["samples_per_s"] > 0
    assert (result["train_examples"], result["test_examples"]) == (18000, 2000)
    # The last of the 4 parts holds the boundary: written as two files, one per side.
    split = work / "split"
    assert pq.read_metadata(split / "boundary-train.parquet").num_rows == 3000
    assert pq.read_metadata(split / "boundary-test.parquet").num_rows == 2000


def test_movielens_example_at_defaults_reaches_keras(tmp_path: Path) -> None:
    """The demo as ``make demo`` runs it, with the Keras baseline: wuliang's
    library defaults reach plain Keras at its defaults (within 0.003 AUC)."""
    work = tmp_path / "movielens"
    result = run_example(
        "movielens.py", ["--data", str(MOVIELENS), "--work-dir", str(work), "--baseline"], tmp_path
    )
    assert result["auc"] >= result["baseline_auc"] - 0.003, result
    assert result["baseline_auc"] > 0.62, result  # both learn (0.5: nothing learned)
    assert result["train_examples"] + result["test_examples"] == 100_836
    full, delta = result["export_rows"]["1"], result["export_rows"]["2"]
    assert 0 < delta < full  # the next day's changed rows only
    assert (work / "exports" / "LATEST").read_text().strip() == "2"
    assert result["served_versions"] == [1, 2]  # the running server applied the delta
    assert result["served_rows_changed"]
    assert 0.79 <= result["train_examples"] / 100_836 <= 0.81
    train = pq.read_table(work / "split" / "train.parquet", columns=["timestamp"])
    test = pq.read_table(work / "split" / "test.parquet", columns=["timestamp"])
    assert (train.num_rows, test.num_rows) == (result["train_examples"], result["test_examples"])
    train_ts, test_ts = train.column(0).to_numpy(), test.column(0).to_numpy()
    assert train_ts.max() < test_ts.min()  # a time split: every train rating comes first


def test_movielens_example_on_a_prefix(tmp_path: Path) -> None:
    """--max-ratings: the first N ratings in time order, split 80/20."""
    work = tmp_path / "movielens"
    result = run_example(
        "movielens.py",
        [
            *("--data", str(MOVIELENS), "--work-dir", str(work)),
            *("--max-ratings", "6000", "--epochs", "1", "--no-export"),
        ],
        tmp_path,
    )
    assert result["train_examples"] + result["test_examples"] == 6000
    assert 0.75 <= result["train_examples"] / 6000 <= 0.85
    assert result["auc"] > 0.55, result  # learns something even from 6,000 ratings
    assert "export_rows" not in result


def test_streaming_example_follows_partitions_and_serves_each_delta(tmp_path: Path) -> None:
    """Weekly MovieLens partitions land one a second; each is scored before
    it trains, exported after, and served by a running `wuliang serve`."""
    work = tmp_path / "streaming"
    args = ["--data", str(MOVIELENS), "--work-dir", str(work), "--weeks", "6"]
    result = run_example("streaming.py", [*args, "--interval", "1"], tmp_path)
    assert result["partitions"] == 6 and result["examples"] > 600, result
    assert result["versions_exported"] >= 6 and result["served_version"] >= 6, result
    assert 0 < result["freshness_p50_s"] < 30, result  # every partition's delta was served
    assert 0.3 < result["progressive_auc"] < 0.9, result
    lines = (work / "progressive.jsonl").read_text().splitlines()
    assert [json.loads(line)["partition"] for line in lines] == sorted(
        json.loads(line)["partition"] for line in lines
    )  # in time order
    assert result["stopped_by"] is None


def test_clicks_example_converts_or_reads_strings_alike(tmp_path: Path) -> None:
    """Click logs with string columns: converted with a schema, or read
    directly as strings, train the same model (the same keys); the saved
    model is evaluated by a new estimator and exported with how each
    feature's strings hash."""
    args = ["--rows", "20000", "--epochs", "2"]
    converted = run_example("clicks.py", [*args, "--work-dir", str(tmp_path / "a")], tmp_path)
    direct = run_example(
        "clicks.py", [*args, "--work-dir", str(tmp_path / "b"), "--read-strings"], tmp_path
    )
    assert converted == direct
    # The click depends on taste, item and price: 0.5 is a model that learned nothing.
    assert converted["auc"] > 0.65, converted
    assert converted["restored_step"] == converted["trained_steps"] > 0
    assert converted["export_version"] == 1
    assert converted["hashed"] == {n: n for n in ("user", "item", "category", "tags")}
    assert converted["train_rows"] + converted["test_rows"] == 20000
