"""Cells: a row's recent values in one Redis string (the layout is in
``redis.keys``), decoded for lookups and rewritten by publishes; numpy
only, no I/O.

A cell is a sequence of fixed-size entries, newest first: the version that
wrote it (uint64; ``TOMBSTONE`` bit: removed) and the row. Reading a cell
at version ``V`` takes its newest entry labelled ``<= V``.

Which entries a cell keeps: its newest one (the generation's next versions
read it), and for each *live* version ``v`` (one that replicas may read)
the newest entry ``<= v``; everything else is unreachable and dropped. A
tombstone that would be the oldest entry kept is dropped too (no entry
reads as removed already), and a cell left with no entry is deleted. So a
generation holds one entry per row plus the entries of the deltas that
live versions still need.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from wuliang.serving.redis.keys import TOMBSTONE, cell_dtype

__all__ = ["Rewritten", "decode", "rewrite"]

_CLEAN = ~TOMBSTONE


def _entries(values: Sequence[bytes | None], dim: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(all entries of the cells, in order; each cell's entry count)."""
    size = 8 + 4 * dim
    lengths = np.fromiter((0 if v is None else len(v) for v in values), np.int64, len(values))
    if (lengths % size).any():
        bad = int(lengths[np.flatnonzero(lengths % size)[0]])
        raise ValueError(
            f"{what}: a cell of {bad} bytes, expected a multiple of {size} (dim {dim})"
        )
    present = [v for v in values if v]
    flat = (
        np.frombuffer(b"".join(present), cell_dtype(dim))
        if present
        else np.zeros(0, cell_dtype(dim))
    )
    return flat, lengths // size


def decode(
    values: Sequence[bytes | None], dim: int, version: int, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """(rows float32 [n, dim], found bool [n]) of cells read at ``version``;
    ValueError naming ``what`` for a damaged cell."""
    n = len(values)
    flat, counts = _entries(values, dim, what)
    rows = np.zeros((n, dim), np.float32)
    found = np.zeros(n, bool)
    if not len(flat):
        return rows, found
    if (counts <= 1).all():  # one entry each: a tombstone's version exceeds any version
        cells = np.flatnonzero(counts)
        ok = flat["version"] <= np.uint64(version)
        rows[cells[ok]] = flat["row"][ok]
        found[cells[ok]] = True
        return rows, found
    cell_of = np.repeat(np.arange(n), counts)
    candidate = np.flatnonzero((flat["version"] & _CLEAN) <= np.uint64(version))
    cells, first = np.unique(cell_of[candidate], return_index=True)  # newest <= version
    entry = candidate[first]
    alive = (flat["version"][entry] & TOMBSTONE) == 0
    rows[cells[alive]] = flat["row"][entry[alive]]
    found[cells[alive]] = True
    return rows, found


@dataclass
class Rewritten:
    """Cells after ``rewrite``: their entries, grouped per cell (``entries``
    and ``counts``, a count of 0: delete the cell), what changed, and whether
    each cell's newest entry was (``before``) and is (``after``) a row."""

    entries: np.ndarray  # cell_dtype, the cells' entries one cell after another
    counts: np.ndarray  # int64 [n]
    changed: np.ndarray  # bool [n]: differs from the cell read (write or delete it)
    before: np.ndarray  # bool [n]
    after: np.ndarray  # bool [n]

    @cached_property
    def ends(self) -> np.ndarray:
        """Where each cell's entries end in ``entries``."""
        return np.cumsum(self.counts)

    def cells(self) -> list[bytes | None]:
        """Each cell's bytes, None where it is to be deleted."""
        size = self.entries.dtype.itemsize
        blob = self.entries.tobytes()
        ends = self.ends * size
        begins = ends - self.counts * size
        return [
            blob[b:e] if e > b else None
            for b, e in zip(begins.tolist(), ends.tolist(), strict=True)
        ]

    def by_count(self, cells: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """For the given cells (indexes) that are kept, grouped by their entry
        count: (those cells, their bytes as a uint8 array [m, count * entry])."""
        counts = self.counts[cells]
        raw = self.entries.view(np.uint8).reshape(len(self.entries), self.entries.dtype.itemsize)
        for count in np.unique(counts[counts > 0]).tolist():
            mine = cells[counts == count]
            first = (self.ends[mine] - count)[:, None] + np.arange(count)
            yield mine, raw[first].reshape(len(mine), -1)


def rewrite(
    values: Sequence[bytes | None],
    dim: int,
    live: np.ndarray,
    new: np.ndarray | None = None,
    drop: int | None = None,
    what: str = "cells",
) -> Rewritten:
    """Cells rewritten: ``new`` (one entry per cell, ``cell_dtype``) put
    first, entries of version ``drop`` removed, then trimmed for the sorted
    versions ``live`` (see the module docstring)."""
    n = len(values)
    flat, counts = _entries(values, dim, what)
    read = counts
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    before = np.zeros(n, bool)
    has = counts > 0
    before[has] = (flat["version"][starts[has]] & TOMBSTONE) == 0
    if new is not None:
        merged = np.empty(len(flat) + n, flat.dtype)
        at_new = starts + np.arange(n)
        old_at = np.ones(len(merged), bool)
        old_at[at_new] = False
        merged[at_new] = new
        merged[old_at] = flat
        flat, counts = merged, counts + 1
    cell_of = np.repeat(np.arange(n), counts)
    if drop is not None:
        keep = (flat["version"] & _CLEAN) != np.uint64(drop)
        flat, cell_of = flat[keep], cell_of[keep]
    version = flat["version"] & _CLEAN
    first = np.ones(len(flat), bool)
    first[1:] = cell_of[1:] != cell_of[:-1]
    newer = np.empty(len(flat), np.uint64)  # the next newer entry's version in the cell
    newer[1:] = version[:-1]
    newer[first] = np.iinfo(np.uint64).max
    live = np.asarray(live, np.uint64)
    spans = np.searchsorted(live, newer, "left") - np.searchsorted(live, version, "left")
    keep = first | (spans > 0)
    flat, cell_of = flat[keep], cell_of[keep]
    last = np.ones(len(flat), bool)  # the oldest entry kept of each cell
    last[:-1] = cell_of[:-1] != cell_of[1:]
    keep = ~(last & ((flat["version"] & TOMBSTONE) != 0))
    flat, cell_of = flat[keep], cell_of[keep]
    counts = np.bincount(cell_of, minlength=n)
    after = np.zeros(n, bool)
    has = counts > 0
    after[has] = (flat["version"][(np.cumsum(counts) - counts)[has]] & TOMBSTONE) == 0
    # entries are only ever removed, and a new one is put first: a cell
    # changed if it has a new entry or lost one
    changed = counts != read if new is None else (counts > 0) | (read > 0)
    return Rewritten(flat, counts, changed, before, after)
