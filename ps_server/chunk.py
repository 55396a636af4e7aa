"""``RowChunk``: rows of one table with their metadata, as parameter servers
export them, versions store them and loads take them (a module of its own,
below both the interface and the version format)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RowChunk"]


@dataclass(frozen=True)
class RowChunk:
    """Rows of one table, as ``export`` yields them and ``load`` takes them."""

    keys: np.ndarray  # uint64 [n]
    weights: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_dim] optimizer state
    counts: np.ndarray  # uint32 [n] updates (+ sightings before admission)
    steps: np.ndarray  # uint64 [n] step of the last update
    times: np.ndarray  # uint32 [n] unix time of the last update
    versions: np.ndarray  # uint64 [n] version of the last modification

    def __len__(self) -> int:
        return len(self.keys)
