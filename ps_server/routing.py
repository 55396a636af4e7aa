"""Where a key lives: its server among N (``server_of``) and its shard
among S inside it (``shard_of``), computed as the C++ engine and the key
preparer compute them (stable across releases)."""

from __future__ import annotations

import numpy as np

from wuliang.ps_server import _engine
from wuliang.ps_server.checks import as_keys

__all__ = ["server_of", "shard_of"]

KeyArray = np.ndarray | list[int]


def shard_of(keys: KeyArray, num_shards: int) -> np.ndarray:
    """Shard of every key (uint32) in an engine of ``num_shards`` shards, as the
    engine and the reader's key preparation compute it: the high 32 bits of
    ``Mix64(key)`` scaled to ``[0, num_shards)``. Stable across releases."""
    return _engine.shard_of(as_keys(keys), _check_count(num_shards, "num_shards"))


def server_of(keys: KeyArray, num_servers: int) -> np.ndarray:
    """Parameter server of every key (uint32) among ``num_servers`` servers.

    Inside server ``server_of(k, N)`` key ``k`` lives in shard
    ``shard_of(k, S)``. The two are computed from independent hashes
    (``Mix64(key + 0x9E3779B97F4A7C15)`` for the server, ``Mix64(key)`` for
    the shard), so every (server, shard) pair gets ``1 / (N * S)`` of the keys;
    routing servers by ``shard_of(k, N)`` would leave most shards of every
    server empty."""
    return _engine.server_of(as_keys(keys), _check_count(num_servers, "num_servers"))


def _check_count(n: int, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n < 2**32:
        raise ValueError(f"{what} must be an int in [1, 2**32), got {n!r}")
    return int(n)
