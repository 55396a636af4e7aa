"""Key preparation: the keys a training step pulls, found ahead of the step.

For a batch and a map feature -> table, ``KeyPreparer`` computes (in C++,
without the GIL) per table the unique keys of all its features grouped by
parameter-server shard, and per feature the int32 inverse index of every value
into its table's uniques. The trainer pulls ``uniques`` (already split the way
the engine splits them), gathers rows with ``inverse`` and pools them per row
with the feature's ``offsets``; gradients are pushed against the same uniques::

    genres -> item_attr: values [7, 9, 7, 3]     tags -> item_attr: values [9, 4]
    item_attr: uniques [9, 3 | 7, 4], shard_offsets [0, 2, 4]   (2 shards)
    genres: inverse [2, 0, 2, 1]                 tags: inverse [0, 3]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from wuliang.reader import _reader
from wuliang.reader.batch import Csr, CsrBatch


@dataclass(frozen=True)
class TableKeys:
    uniques: np.ndarray  # uint64 [U], grouped by shard
    shard_offsets: np.ndarray  # int64 [S + 1]: shard s owns uniques[off[s]:off[s+1]]

    def shard(self, s: int) -> np.ndarray:
        return self.uniques[self.shard_offsets[s] : self.shard_offsets[s + 1]]


@dataclass(frozen=True)
class FeatureIndex:
    table: str
    inverse: np.ndarray  # int32 [nnz]: values = uniques[inverse]
    offsets: np.ndarray  # int64 [B + 1], the feature's CSR offsets
    weights: np.ndarray | None  # float32 [nnz]


@dataclass(frozen=True)
class PreparedKeys:
    tables: dict[str, TableKeys]
    features: dict[str, FeatureIndex]
    num_shards: int  # per server
    feature_tables: dict[str, str] = field(default_factory=dict)  # the map they were prepared for
    max_lens: dict[str, int] = field(default_factory=dict)  # the trims they were prepared with
    num_servers: int = 1  # uniques grouped by (server, shard) cells


class KeyPreparer:
    """Prepares the keys of batches for a fixed feature -> table map.

    Args:
        feature_tables: sparse feature name -> table name; several features
            may share a table (their keys are deduplicated together).
        num_shards: the engine's shard count (uniques are grouped by shard).
        num_servers: parameter servers of ``num_shards`` shards each: the
            uniques are grouped by cell, ``server_of(key, num_servers) *
            num_shards + shard_of(key, num_shards)``, so each server's keys
            are one run (``shard_offsets`` has ``num_servers * num_shards +
            1`` entries).
        max_lens: feature name -> the most values a row keeps (its first
            ones): a sequence feature's ``max_len``. The rest are dropped
            before the keys are found, so they are neither pulled nor pushed.
    """

    def __init__(
        self,
        feature_tables: Mapping[str, str],
        num_shards: int = 1,
        max_lens: Mapping[str, int] | None = None,
        *,
        num_servers: int = 1,
    ) -> None:
        if not feature_tables:
            raise ValueError("feature_tables must map at least one feature to a table")
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")
        self.max_lens = dict(max_lens or {})
        for name, n in self.max_lens.items():
            if name not in feature_tables:
                raise KeyError(f"max_lens names {name!r}, not one of the features")
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"max_lens[{name!r}] must be an int >= 1, got {n!r}")
        self.feature_tables = dict(feature_tables)
        self.tables = list(dict.fromkeys(self.feature_tables.values()))
        self._table_index = {t: i for i, t in enumerate(self.tables)}
        self.num_shards = num_shards
        self.num_servers = num_servers

    def __call__(self, batch: CsrBatch) -> PreparedKeys:
        inputs = []
        csrs = {}
        for name, table in self.feature_tables.items():
            csr = batch.sparse.get(name)
            if csr is None:
                if name in batch.dense_columns:
                    raise ValueError(
                        f"sparse feature {name!r}: the batch has {name!r} as a dense feature "
                        "(the reader reads float and bool columns as dense); a sparse "
                        "feature needs an int or list<int> column of keys "
                        "(hash other values first, e.g. with `wuliang convert csv`)"
                    )
                known = ", ".join(batch.sparse) or "none"
                raise KeyError(f"batch has no sparse feature {name!r} (features: {known})")
            if name in self.max_lens:
                csr = _first_values(csr, self.max_lens[name])
            csrs[name] = csr
            inputs.append((self._table_index[table], np.ascontiguousarray(csr.values)))
        tables, inverses = _reader.prepare_keys(
            inputs, len(self.tables), self.num_shards, self.num_servers
        )
        features = {
            name: FeatureIndex(table, inverse, csrs[name].offsets, csrs[name].weights)
            for (name, table), inverse in zip(self.feature_tables.items(), inverses, strict=True)
        }
        return PreparedKeys(
            tables={t: TableKeys(u, o) for t, (u, o) in zip(self.tables, tables, strict=True)},
            features=features,
            num_shards=self.num_shards,
            feature_tables=self.feature_tables,
            max_lens=self.max_lens,
            num_servers=self.num_servers,
        )


def _first_values(csr: Csr, max_len: int) -> Csr:
    """The CSR with each row's first ``max_len`` values (itself when no row has more)."""
    lengths = np.diff(csr.offsets)
    if len(lengths) == 0 or lengths.max() <= max_len:
        return csr
    kept = np.minimum(lengths, max_len)
    positions = np.arange(len(csr.values)) - np.repeat(csr.offsets[:-1], lengths)
    keep = positions < max_len
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(kept, out=offsets[1:])
    weights = None if csr.weights is None else csr.weights[keep]
    return Csr(csr.values[keep], offsets, weights)
