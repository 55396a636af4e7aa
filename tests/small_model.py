"""A small model and its data, shared by the checkpoint and export tests:
a user id (Adagrad table), a bag of items (Adam table, mean), one dense
feature, and a label learnable from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import wuliang as wl
from wuliang.reader import ParquetReader

BATCH = 64


def write_data(folder: Path) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(2):
        n = 700
        users = rng.integers(0, 300, n)
        items = [rng.integers(0, 500, rng.integers(0, 4)).tolist() for _ in range(n)]
        x = rng.normal(size=n).astype(np.float32)
        label = ((users % 3 == 0) ^ (x > 0.5)).astype(np.float32)
        table = pa.table({"user": users, "items": items, "x": x, "label": label})
        path = folder / f"part-{i}.parquet"
        pq.write_table(table, path, row_group_size=128)
        paths.append(str(path))
    return paths


class Losses(wl.hooks.SessionRunHook):
    def __init__(self) -> None:
        self.values: list[float] = []

    def before_run(self, run_context: Any) -> Any:
        return wl.hooks.SessionRunArgs(["loss"])

    def after_run(self, run_context: Any, run_values: Any) -> None:
        self.values.append(float(run_values.results["loss"]))


def make_session(
    num_shards: int = 2,
    admission: wl.admission.Admission | None = None,
    hooks: tuple[wl.hooks.SessionRunHook, ...] = (),
    eviction: wl.eviction.Eviction | None = None,
    evict_every_steps: int | None = 1000,
    keras_model: bool = False,
    ps: Any = None,
    sizes: wl.Sizes | None = None,
) -> wl.Session:
    """``admission``: the items table's (default: every key at once);
    ``eviction``: the users table's (default: none); ``keras_model``: the
    tower is a ``keras.Model`` whose ``call`` takes (embeddings, dense), as in
    docs/training.md (default: a function over a Keras MLP); ``ps``: the
    context's parameter servers (default: an embedded engine of
    ``num_shards``); ``sizes``: the users table's (a sized table with a
    stats half-life of 20 steps; default: fixed)."""
    keras.utils.set_random_seed(5)
    users = wl.EmbeddingTable(
        "users",
        8,
        optimizer=wl.optimizers.Adagrad(0.1),
        **({} if eviction is None else {"eviction": eviction}),
        **({} if sizes is None else {"sizes": sizes, "stats_half_life": 20}),
    )
    items = wl.EmbeddingTable(
        "items",
        4,
        optimizer=wl.optimizers.Adam(0.01),
        **({} if admission is None else {"admission": admission}),
    )
    features = [
        wl.SparseFeature("user", users),
        wl.SparseFeature("items", items, combiner="mean"),
        wl.DenseFeature("x"),
    ]
    mlp = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])

    def tower(embeddings: dict, dense: dict) -> Any:
        return mlp(wl.embedding.concat([embeddings["user"], embeddings["items"], dense["x"]]))

    if keras_model:
        tower = Tower(mlp)

    where: dict[str, Any] = {"num_shards": num_shards} if ps is None else {"ps": ps}
    context = wl.Context(**where, staleness=0, evict_every_steps=evict_every_steps)
    return wl.Session(tower, features, context, hooks=hooks, optimizer=keras.optimizers.Adam(0.01))


class Tower(keras.Model):
    def __init__(self, mlp: keras.Model) -> None:
        super().__init__()
        self.mlp = mlp

    def call(self, embeddings: dict, dense: dict) -> Any:
        return self.mlp(wl.embedding.concat([*embeddings.values(), *dense.values()]))


def reader(files: list[str], shuffle: int) -> ParquetReader:
    return ParquetReader(
        files,
        BATCH,
        ["user", "items", "x"],
        label="label",
        shuffle_buffer=shuffle,
        seed=1,
        epochs=3,
    )


def batch_features(batch: Any) -> dict[str, Any]:
    """A batch of the small model's data as a serving client sends it."""
    items = batch.sparse["items"]
    return {
        "user": batch.sparse["user"].values.astype(np.uint64),
        "items": (items.values.astype(np.uint64), items.offsets),
        "x": batch.dense_feature("x").astype(np.float32),
    }


def trained_export(root: Path, sizes: wl.Sizes | None = None) -> dict[str, Any]:
    """A session trained 5 steps and exported (version 1) under root: the
    session, its data files, the export directory and a batch of the data."""
    files = write_data(root)
    session = make_session(sizes=sizes)
    session.train(reader(files, 0), steps=5)
    exports = root / "exports"
    session.export(exports)
    batch = next(iter(reader(files, 0)))
    return {"session": session, "files": files, "exports": exports, "batch": batch, "root": root}
