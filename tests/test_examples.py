"""The end-to-end examples (examples/criteo.py, examples/movielens.py) run and report.

Each example runs as a subprocess with this interpreter (the venv's python) on
a small input, one epoch: it must exit 0 and end with one JSON line whose auc
is in (0, 1). The splits it writes are checked too: every row lands on one
side, train before test.
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
            *("--rows", "3000", "--rows-per-file", "1000", "--bucketize"),
            *("--epochs", "1", "--batch-size", "256", "--work-dir", str(work)),
        ],
        tmp_path,
    )
    assert 0.0 < result["auc"] < 1.0
    assert result["logloss"] > 0 and result["samples_per_s"] > 0
    assert (result["train_examples"], result["test_examples"]) == (2700, 300)
    # The last of the 3 parts holds the boundary: written as two files, one per side.
    split = work / "split"
    assert pq.read_metadata(split / "boundary-train.parquet").num_rows == 700
    assert pq.read_metadata(split / "boundary-test.parquet").num_rows == 300


def test_movielens_example(tmp_path: Path) -> None:
    work = tmp_path / "movielens"
    result = run_example(
        "movielens.py",
        [
            *("--data", str(MOVIELENS), "--work-dir", str(work)),
            *("--max-ratings", "6000", "--epochs", "1", "--baseline"),
        ],
        tmp_path,
    )
    assert 0.0 < result["auc"] < 1.0 and 0.0 < result["baseline_auc"] < 1.0
    assert result["samples_per_s"] > 0
    assert result["train_examples"] + result["test_examples"] == 6000
    full, delta = result["export_rows"]["1"], result["export_rows"]["2"]
    assert 0 < delta < full  # the next day's changed rows only
    assert (work / "exports" / "LATEST").read_text().strip() == "2"
    assert 0.75 <= result["train_examples"] / 6000 <= 0.85
    train = pq.read_table(work / "split" / "train.parquet", columns=["timestamp"])
    test = pq.read_table(work / "split" / "test.parquet", columns=["timestamp"])
    assert (train.num_rows, test.num_rows) == (result["train_examples"], result["test_examples"])
    train_ts, test_ts = train.column(0).to_numpy(), test.column(0).to_numpy()
    assert train_ts.max() < test_ts.min()  # a time split: every train rating comes first
