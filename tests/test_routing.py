"""Key routing: ``server_of`` (which parameter server) and ``shard_of`` (which
shard inside it) must split keys evenly over every (server, shard) pair, so
their hashes must not share bits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from wuliang.ps_server import server_of, shard_of

SERVERS = (1, 2, 3, 4, 8)
SHARDS = (1, 2, 4, 8, 16)
N_KEYS = 1 << 20
SIGMAS = 5.0


def key_sets() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20240611)
    return {
        "random": rng.integers(0, 2**64, size=N_KEYS, dtype=np.uint64),
        "sequential": np.arange(N_KEYS, dtype=np.uint64),
    }


KEYS = key_sets()


def cell_counts(servers: np.ndarray, num_servers: int, shards: np.ndarray, num_shards: int):
    cells = servers.astype(np.int64) * num_shards + shards
    return np.bincount(cells, minlength=num_servers * num_shards)


def max_deviation(n: int, cells: int) -> float:
    """SIGMAS binomial standard deviations of one cell's count."""
    p = 1.0 / cells
    return SIGMAS * math.sqrt(n * p * (1.0 - p))


@pytest.mark.parametrize("kind", list(KEYS))
def test_every_server_and_shard_cell_gets_its_share(kind: str) -> None:
    keys = KEYS[kind]
    n = len(keys)
    by_shards = {s: shard_of(keys, s) for s in SHARDS}
    for num_servers in SERVERS:
        servers = server_of(keys, num_servers)
        assert servers.dtype == np.uint32 and servers.max() < num_servers
        for num_shards in SHARDS:
            counts = cell_counts(servers, num_servers, by_shards[num_shards], num_shards)
            cells = num_servers * num_shards
            expected = n / cells
            worst = np.abs(counts - expected).max()
            assert worst <= max_deviation(n, cells), (
                f"{kind} keys, {num_servers} servers x {num_shards} shards: a cell is off its "
                f"share {expected:.0f} by {worst:.0f} (> {SIGMAS} sigma); counts {counts.tolist()}"
            )


def test_routing_servers_by_the_shard_hash_leaves_cells_empty() -> None:
    """The failure the independent server hash avoids: servers taken from the
    shard's own bits (shard_of(key, N)) get each a band of those bits, and
    inside a band shard_of(key, S) reaches only about S / N shards. The test
    above fails for such a scheme; this shows why."""
    keys = KEYS["random"]
    for num_servers, num_shards in ((2, 4), (4, 16), (8, 16), (3, 8)):
        naive = shard_of(keys, num_servers)
        counts = cell_counts(naive, num_servers, shard_of(keys, num_shards), num_shards)
        empty = int((counts == 0).sum())
        # Server i holds high bits in [i/N, (i+1)/N): shards of that range only.
        assert empty >= num_servers * num_shards - (num_shards + num_servers), (
            num_servers,
            num_shards,
        )
        routed = cell_counts(
            server_of(keys, num_servers), num_servers, shard_of(keys, num_shards), num_shards
        )
        assert routed.min() > 0


def mix64(x: int) -> int:
    """wuliang/ps/hash.h's Mix64, in Python."""
    mask = 2**64 - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & mask
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


PINNED = np.array([0, 1, 2, 3, 12345, 2**63, 2**64 - 1], np.uint64)


def test_server_and_shard_formulas() -> None:
    """shard: fastrange of high32(Mix64(key)); server: the same of
    high32(Mix64(key + 0x9E3779B97F4A7C15)), splitmix64's next output."""
    for n in (1, 3, 16, 1000):
        shards = [(mix64(int(k)) >> 32) * n >> 32 for k in PINNED]
        servers = [(mix64((int(k) + 0x9E3779B97F4A7C15) % 2**64) >> 32) * n >> 32 for k in PINNED]
        assert shard_of(PINNED, n).tolist() == shards
        assert server_of(PINNED, n).tolist() == servers


def test_shard_of_is_unchanged() -> None:
    """Checkpoints and the reader's key preparation depend on shard_of: these
    are the values of the release before server_of existed."""
    assert shard_of(PINNED, 16).tolist() == [0, 5, 13, 1, 15, 2, 11]
    assert shard_of(PINNED, 3).tolist() == [0, 1, 2, 0, 2, 0, 2]
    assert server_of(PINNED, 16).tolist() == [14, 9, 9, 1, 2, 4, 14]


def test_server_of_arguments() -> None:
    keys = np.arange(8, dtype=np.uint64)
    assert server_of(keys, 4).tolist() == server_of(keys.astype(np.int64), 4).tolist()
    assert server_of(list(range(8)), 4).tolist() == server_of(keys, 4).tolist()
    assert server_of(keys, 1).tolist() == [0] * 8
    assert server_of([2**64 - 1], 3).shape == (1,)
    assert server_of(np.zeros(0, np.uint64), 3).shape == (0,)
    for bad in (0, -1, 2**32, 1.5, True):
        with pytest.raises(ValueError, match="num_servers"):
            server_of(keys, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="num_shards"):
            shard_of(keys, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int64 or uint64"):
        server_of(np.arange(3, dtype=np.int32), 2)
