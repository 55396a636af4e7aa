"""``RowChunk``: rows of one table with their metadata, as parameter servers
export them, versions store them and loads take them (a module of its own,
below both the interface and the version format)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RowChunk", "stats_decay"]


@dataclass(frozen=True)
class RowChunk:
    """Rows of one table, as ``export`` yields them and ``load`` takes them.

    ``shows`` and ``clicks`` are the rows' statistics as of their ``steps``
    (what the row holds; ``decayed`` brings them to a later step). Left out,
    they are zeros (rows written before the statistics existed)."""

    keys: np.ndarray  # uint64 [n]
    weights: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_dim] optimizer state
    counts: np.ndarray  # uint32 [n] updates (+ sightings before admission)
    steps: np.ndarray  # uint64 [n] step of the last update
    times: np.ndarray  # uint32 [n] unix time of the last update
    versions: np.ndarray  # uint64 [n] version of the last modification
    shows: np.ndarray = None  # type: ignore[assignment]  # float32 [n] as of steps
    clicks: np.ndarray = None  # type: ignore[assignment]  # float32 [n] as of steps

    def __post_init__(self) -> None:
        for name in ("shows", "clicks"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(len(self.keys), np.float32))

    def __len__(self) -> int:
        return len(self.keys)

    def decayed(self, half_life: float, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(shows, clicks) float32 ``[n]`` decayed to ``step`` with the
        table's ``stats_half_life`` (``stats_decay``)."""
        factor = stats_decay(self.steps, half_life, step)
        return (self.shows * factor).astype(np.float32), (self.clicks * factor).astype(np.float32)


def stats_decay(steps: np.ndarray, half_life: float, step: int) -> np.ndarray:
    """float64 ``[n]``: what takes statistics stamped at ``steps`` to
    ``step``, ``0.5 ** ((step - steps) / half_life)``; 1 where ``step`` is
    not later, or everywhere when ``half_life`` is 0 (no decay)."""
    steps = np.asarray(steps, np.uint64)
    if half_life <= 0:
        return np.ones(len(steps))
    at = np.uint64(step)
    age = at - np.minimum(steps, at)
    return np.exp2(-age.astype(np.float64) / half_life)
