"""A replica's hot cache of one table's rows of one published version
(``redis.replica``): at most ``capacity`` rows, CLOCK eviction.

Rows live in numpy arrays by slot, a dict maps each key to its slot, and
CLOCK eviction is done a window of slots at a time; keys Redis has no row
for are cached too (zeros, not found). Versions are immutable, so entries
never go stale; a replica's switch to another version starts new caches,
filled before the switch with the old caches' keys read at the new version
(``RedisStore._warm``). A warm lookup is one dict probe per key and numpy gathers (measured
costs: ``docs/export.md``).
"""

from __future__ import annotations

import operator
import threading
from itertools import repeat

import numpy as np

__all__ = ["RowCache"]


class RowCache:
    """One table's rows of one version, at most ``capacity`` of them, evicted
    by CLOCK (second chance).

    Rows live in numpy arrays by slot (``rows``, ``found``: a key Redis has
    no row for is cached too, as zeros not found); ``slot_of`` maps a key
    (int) to its slot. A read is one dict probe per key and numpy gathers; a
    hit sets the slot's reference bit. Inserting sweeps the hand over a
    window of slots at once: unreferenced slots are taken, referenced ones
    lose their bit (their second chance), as CLOCK does one slot at a time.
    One lock guards it all: a slot must not change between a read's probe
    and its gather.
    """

    def __init__(self, capacity: int, dim: int) -> None:
        self.capacity = capacity
        self.dim = dim
        self.slot_of: dict[int, int] = {}
        self.keys = np.zeros(capacity, np.uint64)
        self.rows = np.zeros((capacity, dim), np.float32)  # calloc: pages come as used
        self.found = np.zeros(capacity, bool)
        self.ref = np.zeros(capacity, bool)
        self.used = 0  # slots 0 .. used-1 hold a key
        self.used_before = 0  # ``used`` before the latest ``_victims``
        self.hand = 0
        self.lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows float32 [n, dim], found bool [n], positions of the keys not
        cached); the rows and found of those positions are left to fill."""
        n = len(keys)
        with self.lock:
            if not self.slot_of:
                self.misses += n
                return (
                    np.empty((n, self.dim), np.float32),
                    np.empty(n, bool),
                    np.arange(n, dtype=np.intp),
                )
            slots = np.fromiter(map(self.slot_of.get, keys.tolist(), repeat(-1)), np.intp, n)
            hit = slots >= 0
            missing = np.flatnonzero(~hit)
            if len(missing):
                self.ref[slots[hit]] = True
                slots[missing] = 0  # gathered, then overwritten by the caller
            else:
                self.ref[slots] = True
            rows = self.rows[slots]
            found = self.found[slots]
            self.hits += n - len(missing)
            self.misses += len(missing)
        return rows, found, missing

    def insert(self, keys: np.ndarray, rows: np.ndarray, found: np.ndarray) -> None:
        """Caches distinct keys' rows (beyond capacity: the last ones)."""
        if not self.capacity:
            return
        if len(keys) > self.capacity:
            keys, rows, found = (a[-self.capacity :] for a in (keys, rows, found))
        with self.lock:
            if not self.capacity:  # cleared meanwhile (a switch)
                return
            klist = keys.tolist()
            new = np.fromiter(
                map(operator.not_, map(self.slot_of.__contains__, klist)), bool, len(klist)
            )
            if not new.all():  # another lookup cached some meanwhile
                keys, rows, found = keys[new], rows[new], found[new]
                klist = keys.tolist()
            if not klist:
                return
            slots = self._victims(len(klist))
            slot_of = self.slot_of
            for old in self.keys[slots[slots < self.used_before]].tolist():
                del slot_of[old]
            slot_of.update(zip(klist, slots.tolist(), strict=True))
            self.keys[slots] = keys
            self.rows[slots] = rows
            self.found[slots] = found
            self.ref[slots] = False

    def _victims(self, m: int) -> np.ndarray:
        """m distinct slots to fill: free ones first, then CLOCK's choice.
        Sets ``used_before``: slots below it held a key before this call."""
        self.used_before = self.used
        taken: list[np.ndarray] = []
        free = min(self.capacity - self.used, m)
        if free:
            taken.append(np.arange(self.used, self.used + free, dtype=np.intp))
            self.used += free
            m -= free
        ref = self.ref
        span = max(4 * m, 1024)  # slots swept at once; doubles while few are free
        while m:  # at most two laps: the first clears every bit it passes
            end = min(self.hand + span, self.capacity)
            span *= 2
            window = ref[self.hand : end]
            zeros = np.flatnonzero(~window)
            if len(zeros) >= m:
                last = int(zeros[m - 1]) + 1
                chosen = self.hand + zeros[:m]
                window[:last] = False
                self.hand += last
            else:
                chosen = self.hand + zeros
                window[:] = False
                self.hand = end
            ref[chosen] = True  # not chosen twice in this call
            taken.append(chosen)
            m -= len(chosen)
            if self.hand >= self.capacity:
                self.hand = 0
        return np.concatenate(taken) if len(taken) > 1 else taken[0]

    def clear(self) -> None:
        """Empties it for good (its version is no longer read)."""
        with self.lock:
            self.capacity = self.used = 0
            self.slot_of = {}
            self.keys = np.zeros(0, np.uint64)
            self.rows = np.zeros((0, self.dim), np.float32)
            self.found = np.zeros(0, bool)
            self.ref = np.zeros(0, bool)
