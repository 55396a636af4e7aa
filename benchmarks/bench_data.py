"""What the benchmarks share: the core count, the datagen Parquet files and
Zipf-distributed keys."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from wuliang.reader.datagen import DatagenConfig, generate


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def parquet_files(folder: Path, rows: int) -> tuple[list[Path], bool]:
    """The datagen files of `rows` rows in folder: reused when present, else
    written; returns (files, written)."""
    cfg = DatagenConfig(rows=rows)
    n_files = (rows + cfg.rows_per_file - 1) // cfg.rows_per_file
    expected = [folder / f"part-{i:05d}.parquet" for i in range(n_files)]
    present = sorted(folder.glob("part-*.parquet"))
    if present == expected and sum(pq.ParquetFile(f).metadata.num_rows for f in present) == rows:
        print(f"data: reusing {n_files} Parquet files in {folder}", flush=True)
        return expected, False
    for f in present:
        f.unlink()
    t0 = time.perf_counter()
    files = generate(folder, cfg)
    print(
        f"data: wrote {rows:,} rows in {n_files} Parquet files to {folder} "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return files, True


def zipf_keys(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """``n`` keys in ``[0, rows)`` drawn from Zipf(1.1) (key 0 the most frequent)."""
    draws = rng.zipf(1.1, size=n * 2)
    draws = draws[draws <= rows][:n]
    while len(draws) < n:
        more = rng.zipf(1.1, size=n)
        draws = np.concatenate([draws, more[more <= rows]])[:n]
    return (draws - 1).astype(np.uint64)


def movielens_example() -> Any:
    """The repository's MovieLens example (``examples/movielens.py``) as a
    module: its data preparation, features and tower."""
    path = Path(__file__).resolve().parents[1] / "examples" / "movielens.py"
    spec = importlib.util.spec_from_file_location("movielens", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
