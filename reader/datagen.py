"""Synthetic Criteo-shaped data for benchmarks and tests (``wuliang datagen``).

Each row has

* ``C1`` … ``C26``: single-valued sparse features, uint64 keys; the ids behind
  them are Zipf(alpha)-distributed over an unbounded space (about
  ``ids_per_field`` possible ids per field), keys = ``hash(field, id)``;
* ``M1`` … ``M5``: multi-valued sparse features (``list<uint64>``), lengths
  Poisson(``mean_length``), ids Zipf(alpha) like the above;
* ``I1`` … ``I13``: dense float32 features, ``log1p`` of Poisson counts;
* ``label``: float32 0/1, Bernoulli(sigmoid(z)) where z sums a fixed effect of
  the keys of C1 … C8 and M1 (a pseudo-random weight per key) and of I1, I2,
  so a model can learn it (AUC clearly above 0.5; frequent keys carry it).

The output is a pure function of ``seed`` and the arguments: files
``part-00000.parquet`` … of ``rows_per_file`` rows, written atomically. A
re-run into the same folder overwrites them and removes the parts of an
earlier run beyond the new ones (other files are left alone), as the
converters do.
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from wuliang.reader.convert._common import PART_NAME, make_out_dir, part_name, remove_stale
from wuliang.reader.hashing import hash_ints
from wuliang.reader.io import AnyPath, named, write_parquet

SINGLE = [f"C{i}" for i in range(1, 27)]
MULTI = [f"M{i}" for i in range(1, 6)]
DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = SINGLE + MULTI
LABEL = "label"
_WEIGHTED = SINGLE[:8]  # fields whose keys move the label


@dataclass(frozen=True)
class DatagenConfig:
    rows: int
    _: KW_ONLY
    rows_per_file: int = 100_000
    alpha: float = 1.1
    ids_per_field: int = 1_000_000_000
    mean_length: float = 10.0
    seed: int = 0
    row_group_rows: int = 65_536

    def __post_init__(self) -> None:
        for name in ("rows", "rows_per_file", "ids_per_field", "row_group_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.alpha > 1.0:
            raise ValueError(f"alpha must be > 1, got {self.alpha}")
        if self.mean_length < 0 or self.seed < 0:
            raise ValueError(
                f"mean_length and seed must be >= 0, got {self.mean_length} and {self.seed}"
            )


def zipf_ids(rng: np.random.Generator, n: int, alpha: float, ids: int) -> np.ndarray:
    """n Zipf(alpha) ids in [1, ids] (larger draws are redrawn)."""
    out = rng.zipf(alpha, size=n)
    bad = out > ids
    while bad.any():
        out[bad] = rng.zipf(alpha, size=int(bad.sum()))
        bad = out > ids
    return out.astype(np.int64)


def key_effect(keys: np.ndarray) -> np.ndarray:
    """The fixed effect of each key on the label, in [-1, 1)."""
    mixed = hash_ints(keys.view(np.int64), "label-effect")
    return (mixed >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0


def generate_table(cfg: DatagenConfig, rows: int, rng: np.random.Generator) -> pa.Table:
    columns: dict[str, pa.Array] = {}
    z = np.full(rows, -1.2)
    for name in SINGLE:
        keys = hash_ints(zipf_ids(rng, rows, cfg.alpha, cfg.ids_per_field), name)
        columns[name] = pa.array(keys, type=pa.uint64())
        if name in _WEIGHTED:
            z += 0.6 * key_effect(keys)
    for name in MULTI:
        lengths = rng.poisson(cfg.mean_length, size=rows)
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        keys = hash_ints(zipf_ids(rng, int(offsets[-1]), cfg.alpha, cfg.ids_per_field), name)
        columns[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(keys, pa.uint64()))
        if name == MULTI[0]:
            sums = np.add.reduceat(key_effect(keys), offsets[:-1]) if len(keys) else 0.0
            z += 0.8 * np.where(lengths > 0, sums / np.maximum(lengths, 1), 0.0)
    for j, name in enumerate(DENSE):
        counts = rng.poisson(2.0 + j, size=rows)
        dense = np.log1p(counts).astype(np.float32)
        columns[name] = pa.array(dense, type=pa.float32())
        if j < 2:
            z += (0.5 if j == 0 else -0.4) * (dense - dense.mean()) / (dense.std() + 1e-6)
    label = rng.random(rows) < 1.0 / (1.0 + np.exp(-z))
    columns[LABEL] = pa.array(label.astype(np.float32))
    return pa.table(columns)


def generate(
    out_dir: str | os.PathLike, cfg: DatagenConfig, progress: bool = False
) -> list[Path | str]:
    """Writes cfg.rows rows into out_dir (created if missing; a URI such as
    ``s3://bucket/prefix`` too); returns the files written (URIs for a remote
    out_dir). Parts of an earlier run beyond these are removed once every new
    part is in place.

    Raises:
        NotADirectoryError: out_dir exists and is not a folder.
    """
    out = make_out_dir(out_dir)
    files: list[AnyPath] = []
    n_files = (cfg.rows + cfg.rows_per_file - 1) // cfg.rows_per_file
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.rows, unit="rows", desc="datagen")
    for i in range(n_files):
        rows = min(cfg.rows_per_file, cfg.rows - i * cfg.rows_per_file)
        rng = np.random.default_rng([cfg.seed, i])  # each file on its own stream
        path = out / part_name(i)
        write_parquet(generate_table(cfg, rows, rng), path, cfg.row_group_rows)
        files.append(path)
        if bar is not None:
            bar.update(rows)
    if bar is not None:
        bar.close()
    remove_stale(out, files, PART_NAME)
    return named(files)
