"""Key streams and timing shared by the parameter-server benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

DIM = 16
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def table_keys(index: np.ndarray) -> np.ndarray:
    """Key of row i: an odd-multiplier scramble, so keys look like hashes."""
    return index.astype(np.uint64) * GOLDEN


def zipf_indices(rng: np.random.Generator, n: int, rows: int, alpha: float) -> np.ndarray:
    out = np.empty(0, dtype=np.int64)
    while len(out) < n:
        draw = rng.zipf(alpha, size=2 * n)
        out = np.concatenate([out, draw[draw <= rows] - 1])
    return out[:n]


def make_streams(rows: int, batch: int, batches: int, seed: int) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    uniform = rng.integers(0, rows, size=batch * batches)
    zipf = rng.permutation(rows)[zipf_indices(rng, batch * batches, rows, 1.1)]
    return {
        name: [table_keys(idx[i * batch : (i + 1) * batch]) for i in range(batches)]
        for name, idx in (("uniform", uniform), ("zipf", zipf))
    }


def time_calls(
    fn: Callable[[np.ndarray], object],
    batches: list[np.ndarray],
    repeats: int,
    cpu: list[float] | None = None,
) -> float:
    """Best keys/s over `repeats` passes through the batches; with ``cpu``,
    appends the least CPU time of the process (every thread's) per key of a
    pass, in ns: steadier than a rate on a machine others share."""
    best = 0.0
    least = float("inf")
    keys_per_pass = sum(len(k) for k in batches)
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        for keys in batches:
            fn(keys)
        elapsed = time.perf_counter() - t0
        best = max(best, keys_per_pass / elapsed)
        least = min(least, (time.process_time() - c0) / keys_per_pass * 1e9)
    if cpu is not None:
        cpu.append(least)
    return best
