"""``RowChunk``: rows of one table with their metadata, as parameter servers
export them, versions store them and loads take them (a module of its own,
below both the interface and the version format)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

__all__ = ["RowChunk", "concat_rows", "empty_rows", "stats_decay", "take_rows"]


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


def take_rows(rows: RowChunk, which: np.ndarray | slice) -> RowChunk:
    """The rows ``which`` picks (indices, repeats allowed, a mask or a
    slice), every column."""
    return RowChunk(**{f.name: getattr(rows, f.name)[which] for f in fields(RowChunk)})


def empty_rows(dim: int, state_dim: int) -> RowChunk:
    """No rows, with the column shapes of a table of ``dim`` and ``state_dim``."""
    return RowChunk(
        keys=np.zeros(0, np.uint64),
        weights=np.zeros((0, dim), np.float32),
        state=np.zeros((0, state_dim), np.float32),
        counts=np.zeros(0, np.uint32),
        steps=np.zeros(0, np.uint64),
        times=np.zeros(0, np.uint32),
        versions=np.zeros(0, np.uint64),
    )


def concat_rows(parts: Sequence[RowChunk], dim: int, state_dim: int) -> RowChunk:
    """The rows of ``parts`` one after the other (``empty_rows`` for none)."""
    if not parts:
        return empty_rows(dim, state_dim)
    if len(parts) == 1:
        return parts[0]
    return RowChunk(
        **{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(RowChunk)}
    )
