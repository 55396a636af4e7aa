"""The engine consumes keys the reader already grouped by shard."""

from __future__ import annotations

import numpy as np
import pytest

from wuliang.ps_server import SGD, Engine, TableSpec
from wuliang.reader import Csr, CsrBatch, KeyPreparer


def batch_of(values: np.ndarray) -> CsrBatch:
    offsets = np.arange(len(values) + 1, dtype=np.int64)
    return CsrBatch(
        {"f": Csr(values, offsets)}, np.zeros((len(values), 0), np.float32), None, len(values)
    )


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_pull_and_push_with_shard_offsets(num_shards: int, rng: np.random.Generator) -> None:
    values = rng.integers(0, 500, size=2000).astype(np.uint64)
    prepared = KeyPreparer({"f": "t"}, num_shards)(batch_of(values))
    keys = prepared.tables["t"].uniques
    offsets = prepared.tables["t"].shard_offsets
    with Engine(num_shards) as grouped, Engine(num_shards) as plain:
        for engine in (grouped, plain):
            engine.create_table(TableSpec("t", dim=4, optimizer=SGD(1.0)))
        grads = rng.standard_normal((len(keys), 4)).astype(np.float32)
        grouped.push("t", keys, grads, unique=True, shard_offsets=offsets)
        plain.push("t", keys, grads, unique=True)
        np.testing.assert_array_equal(
            grouped.pull("t", keys, shard_offsets=offsets), plain.pull("t", keys)
        )
        rows = grouped.pull("t", keys, shard_offsets=offsets)
        inverse = prepared.features["f"].inverse
        np.testing.assert_array_equal(rows[inverse], plain.pull("t", values))


def test_wrong_grouping_is_refused() -> None:
    keys = np.arange(1, 200, dtype=np.uint64)
    with Engine(2) as engine:
        engine.create_table(TableSpec("t", dim=4))
        with pytest.raises(ValueError, match="not grouped"):
            engine.pull("t", keys, shard_offsets=np.array([0, 100, 199]))
        with pytest.raises(ValueError, match="shard_offsets must"):
            engine.pull("t", keys, shard_offsets=np.array([0, 300, 199]))
        with pytest.raises(ValueError, match="num_shards \\+ 1"):
            engine.pull("t", keys, shard_offsets=np.array([0, 199]))
