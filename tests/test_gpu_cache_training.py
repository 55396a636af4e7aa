"""Training MovieLens through the GPU hot cache (numpy here, cupy on a GPU),
or with the engine's disk tier, gives what training without them gives: the
same loss at every step, and checkpoints and exports (a full version, then a
delta) with the same rows in every column, show and click statistics
included. The cache is small (rows come and go every step) and the disk
tier's budget tiny (rows go to disk after every call and come back ahead of
their pull), so every path of them is taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from repo_data import MOVIELENS
from small_model import Losses

import wuliang as wl
from wuliang.ps_server.storage import Version
from wuliang.reader import ParquetReader
from wuliang.reader.convert import convert_movielens

FEATURES = {
    "user_id": ("user", "sum"),
    "movie_id": ("movie", "sum"),
    "genres": ("genre", "mean"),
    "tags": ("tag", "mean"),
    "year": ("year", "sum"),
}
STATS_LABEL = {"user": "label", "movie": "label"}  # the others count shows only
RATINGS = (12_000, 6_000)  # two days of training
BATCH = 256
COLUMNS = ("keys", "weights", "state", "counts", "steps", "versions", "shows", "clicks")


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The first ratings of MovieLens in time order, as two files."""
    tmp = tmp_path_factory.mktemp("movielens")
    files = convert_movielens(MOVIELENS, tmp / "days", progress=False)
    tables, rows = [], 0
    for file in files:
        tables.append(pq.read_table(file))
        rows += tables[-1].num_rows
        if rows >= sum(RATINGS):
            break
    ratings = pa.concat_tables(tables)
    out = []
    for i, (start, n) in enumerate([(0, RATINGS[0]), (RATINGS[0], RATINGS[1])]):
        out.append(tmp / f"day-{i}.parquet")
        pq.write_table(ratings.slice(start, n), out[-1])
    return out


def train(
    days: list[Path], folder: Path, cache_rows: int | None, disk_dir: Path | None = None
) -> dict[str, Any]:
    """Two days of training, each followed by a checkpoint and an export."""
    keras.utils.set_random_seed(7)
    tables = {
        table: wl.EmbeddingTable(
            table, 8, seed=7, stats_label=STATS_LABEL.get(table), stats_half_life=50.0
        )
        for table, _ in FEATURES.values()
    }
    features = [
        wl.SparseFeature(name, tables[table], combiner=combiner)
        for name, (table, combiner) in FEATURES.items()
    ]
    mlp = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])

    def tower(embeddings: dict[str, Any], dense: dict[str, Any]) -> Any:
        return mlp(wl.embedding.concat([embeddings[name] for name in FEATURES]))

    disk = {} if disk_dir is None else {"disk_dir": disk_dir, "memory_gb": 1e-6}  # ~1 KiB
    context = wl.Context(num_shards=2, gpu_cache_rows=cache_rows, **disk)
    session = wl.Session(tower, features, context)
    losses = Losses()
    try:
        for day in days:
            reader = ParquetReader(day, BATCH, list(FEATURES), label="label", seed=1)
            session.train(reader, hooks=[losses])
            session.save_checkpoint(folder / "model")
            session.export(folder / "exports")
        cache = context.ps.cache_stats() if cache_rows else {}
        stats = context.ps.stats()
    finally:
        session.close()
        context.close()
    return {"losses": losses.values, "cache": cache, "stats": stats}


def rows_of(version: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every table's rows in key order, by column (times left out: each
    run's own clock)."""
    v = Version(version)
    out = {}
    for table in sorted(v.tables):
        chunks = list(v.read_rows(table))
        if not chunks:  # a delta in which the table did not change
            out[table] = {"keys": np.zeros(0, np.uint64)}
            continue
        columns = {name: np.concatenate([getattr(c, name) for c in chunks]) for name in COLUMNS}
        order = np.argsort(columns["keys"])
        out[table] = {name: values[order] for name, values in columns.items()}
    return out


def test_training_through_the_cache_is_training_without_it(
    days: list[Path], tmp_path: Path
) -> None:
    alone = train(days, tmp_path / "alone", None)
    cached = train(days, tmp_path / "cached", 96)
    # the cache took part: hits, rows coming and going, write-backs
    movie = cached["cache"]["movie"]
    assert movie["hits"] > 0 and movie["evicted"] > 0 and movie["written_back"] > 0
    assert movie["updated"] > 0 and movie["rows"] == 96
    assert_same_training(alone, cached, tmp_path / "alone", tmp_path / "cached")


def test_training_with_a_disk_tier_is_training_without_it(days: list[Path], tmp_path: Path) -> None:
    alone = train(days, tmp_path / "alone", None)
    tiered = train(days, tmp_path / "tiered", None, disk_dir=tmp_path / "disk")
    # the disk took part: rows went out, came back ahead of their pulls
    movie = tiered["stats"]["movie"]
    assert movie["demoted"] > 0 and movie["cold_prefetched"] > 0, movie
    assert movie["rows"] == alone["stats"]["movie"]["rows"] and movie["disk_error"] == ""
    assert_same_training(alone, tiered, tmp_path / "alone", tmp_path / "tiered")
    assert not any((tmp_path / "disk").rglob("*.rows"))


def assert_same_training(
    alone: dict[str, Any], other: dict[str, Any], alone_dir: Path, other_dir: Path
) -> None:
    """The same losses, and the same checkpoints and exports, row by row."""
    assert len(alone["losses"]) == len(other["losses"]) == sum(-(-n // BATCH) for n in RATINGS)
    np.testing.assert_allclose(other["losses"], alone["losses"], rtol=0, atol=1e-6)
    versions = []
    for kind in ("model", "exports"):
        names = sorted(p.name for p in (alone_dir / kind).iterdir() if p.is_dir())
        assert names == sorted(p.name for p in (other_dir / kind).iterdir() if p.is_dir())
        versions += [(kind, name) for name in names]
    assert len(versions) == 4  # two checkpoints, a full export and a delta
    for kind, name in versions:
        a = rows_of(alone_dir / kind / name)
        b = rows_of(other_dir / kind / name)
        assert a.keys() == b.keys()
        for table in a:
            for column in a[table]:
                np.testing.assert_array_equal(
                    a[table][column], b[table][column], err_msg=f"{kind}/{name} {table} {column}"
                )
        movies = a["movie"]
        assert len(movies["keys"]) > 96 and movies["shows"].max() > 0 and movies["clicks"].max() > 0
    assert Version(other_dir / "exports" / "2").kind == "delta"
