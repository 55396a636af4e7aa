"""The GPU hot cache's key → slot index and policy, on the device.

``SlotIndex`` holds the keys of every cached table of a cache in one
set-associative index in device memory (cupy; numpy arrays for the CPU
twin), as fbgemm's TBE cache does: each table owns a region of sets of
``ways`` entries (``ways = min(32, slots)``; a table's slots are rounded up
to whole sets), a key's set is a hash of the key, and an entry is a cache
slot. A batch of all tables' keys goes through three kernels, one launch
each whatever the number of tables (``details/cache_index.h``, the same
source for the CUDA kernels and the CPU twin):

1. **lookup**: one warp per key compares the ways of its set; a hit adds
   the key's count to its score and stamps the batch's epoch (the lock);
2. **score** the misses: ``"stats"``: the decayed count a ghost entry kept
   for the key, plus its count; ``"lru"``: its count;
3. **populate**: misses sorted by (set, score descending); one thread per
   set takes them in order, each into an empty entry or over the victim,
   the unlocked entry with the lowest score.

Policies (``policy``):

* ``"stats"`` (default): decayed show counts. Each entry's score is its
  key's count over the batches, each batch's count weighted by ``2 ^
  (clock / half_life)`` (so scores compare without decaying them; rescaled
  when the weight grows large). Over a victim, a miss comes in only when
  it was seen before (a ghost's count, or more than once in its batch) and
  its score beats the victim's. Each set keeps as many ghost entries as
  ways: keys not cached, with their scores (victims, and misses that stayed
  out), so a key that keeps coming back gets in and a key seen once never
  displaces a cached key.
* ``"lru"``: every miss comes in over the least recently used unlocked
  entry.

Locks: a training batch is an epoch; the entries a batch uses are stamped
with it, and an entry stamped by this batch or the one before is never a
victim. The pipeline pulls step i + 1 while step i trains, and step i - 1's
push has landed before step i + 1's pull: so a prefetch never evicts a row
that a step in flight reads or updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

POLICIES = ("stats", "lru")
WAYS = 32  # a warp
_RESCALE = 256.0  # rescale scores when the weight passes 2 ** this
NOT_ADMITTED, INTO_EMPTY, OVER_VICTIM, REPEAT = 0, 1, 2, 3  # populate's outcomes


@dataclass(frozen=True)
class Region:
    """One table's part of the index."""

    id: int
    entry_base: int  # first entry (the table's slot 0)
    sets: int
    ways: int

    @property
    def slots(self) -> int:
        return self.sets * self.ways


@dataclass
class Plan:
    """What one batch did to the index (``SlotIndex.observe``), per key of
    the batch (all tables' keys, in the order given)."""

    entries: Any  # xp int64 [n]: each key's entry after the batch, -1 if not cached
    miss: np.ndarray  # int64: positions of the keys that were not cached before it
    miss_entries: np.ndarray  # int64 [len(miss)]: the entry each miss took, -1 if none
    how: np.ndarray  # uint8 [len(miss)]: NOT_ADMITTED, INTO_EMPTY, OVER_VICTIM or REPEAT
    victims: np.ndarray  # uint64: keys that left the cache for misses
    victim_entries: np.ndarray  # int64: the entries they had

    @property
    def admitted(self) -> np.ndarray:
        """bool [len(miss)]: came in with this batch (a row to load)."""
        return (self.how == INTO_EMPTY) | (self.how == OVER_VICTIM)


class SlotIndex:
    """Every cached table's key → slot index, one key space (see the module
    docstring).

    Args:
        kernels: the array module's kernels (``kernels.kernels_for``).
        policy: ``"stats"`` (decayed counts) or ``"lru"``.
        half_life: batches after which a sighting counts half (``"stats"``).
    """

    def __init__(self, kernels: Any, *, policy: str = "stats", half_life: float = 1000.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be 'stats' or 'lru', got {policy!r}")
        if isinstance(half_life, bool) or not (
            isinstance(half_life, int | float) and half_life > 0
        ):
            raise ValueError(f"half_life must be > 0 (batches), got {half_life!r}")
        self.kernels = kernels
        self.xp = kernels.xp
        self.policy = policy
        self.policy_id = POLICIES.index(policy)
        self.half_life = float(half_life)
        self.ghosts = policy == "stats"
        self.regions: dict[str, Region] = {}
        self._used = 0  # entries the regions take (the arrays may have more)
        self._entry_base = np.zeros(0, np.int64)
        self._sets = np.zeros(0, np.int64)
        self._ways = np.zeros(0, np.int32)
        xp = self.xp
        self.keys = xp.zeros(0, np.uint64)
        self.scores = xp.zeros(0, np.float64)
        self.epochs = xp.zeros(0, np.int64)
        self.ghost_keys = xp.zeros(0, np.uint64) if self.ghosts else None
        self.ghost_scores = xp.zeros(0, np.float64) if self.ghosts else None
        self.device_regions: tuple = ()
        self.epoch = 0  # training batches observed
        self.clock = 0  # batches observed, training or seeding
        self._base = 0  # scores are scaled by 2 ** ((clock - base) / half_life)

    # -- regions ---------------------------------------------------------------

    def add(self, name: str, slots: int) -> Region:
        """The region of a table (made on first call, ``slots`` rounded up
        to whole sets); a table's region stays, emptied by ``clear``."""
        region = self.regions.get(name)
        if region is not None:
            return region
        if isinstance(slots, bool) or not isinstance(slots, int | np.integer) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        ways = min(WAYS, int(slots))
        sets = -(-int(slots) // ways)
        region = Region(len(self.regions), self._used, sets, ways)
        self.regions[name] = region
        self._used += sets * ways
        if self._used > len(self.keys):  # room for this and as much again
            self._grow(max(self._used, 2 * len(self.keys)))
        self._entry_base = np.append(self._entry_base, region.entry_base)
        self._sets = np.append(self._sets, sets)
        self._ways = np.append(self._ways, np.int32(ways))
        k = self.kernels
        # ghosts are laid out as the entries: a region's ghost base is its entry base
        self.device_regions = tuple(
            k.to_device(a) for a in (self._entry_base, self._entry_base, self._sets, self._ways)
        )
        return region

    def _grow(self, entries: int) -> None:
        """The index's arrays with room for ``entries`` (the new ones empty),
        so adding tables one by one copies each entry a bounded number of
        times."""
        xp = self.xp

        def grown(old: Any, fill: Any) -> Any:
            new = xp.full(entries, fill, old.dtype)
            new[: len(old)] = old
            return new

        self.keys = grown(self.keys, 0)
        self.scores = grown(self.scores, 0.0)
        self.epochs = grown(self.epochs, -1)
        if self.ghosts:
            self.ghost_keys = grown(self.ghost_keys, 0)
            self.ghost_scores = grown(self.ghost_scores, -1.0)

    def clear(self, name: str) -> None:
        """Empties a table's region (its keys and ghosts)."""
        region = self.regions.get(name)
        if region is None:
            return
        part = slice(region.entry_base, region.entry_base + region.slots)
        self.epochs[part] = -1
        self.scores[part] = 0.0
        if self.ghosts:
            self.ghost_scores[part] = -1.0

    @property
    def entries(self) -> int:
        """Entries the regions take (the arrays may be longer: room to add)."""
        return self._used

    def arrays(self) -> tuple:
        """(keys, scores, epochs, ghost_keys, ghost_scores), for the kernels."""
        return (self.keys, self.scores, self.epochs, self.ghost_keys, self.ghost_scores)

    # -- reading -----------------------------------------------------------------

    def lookup(self, keys: Any, region: Any) -> Any:
        """Each key's entry (xp int64), -1 where not cached; changes nothing.
        ``keys`` uint64 and ``region`` int32 (region ids) on the device."""
        return self.kernels.index_lookup(self, keys, region, None, False, 0, 0.0)

    def cached(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(keys uint64, table-local slots int64) of a table's cached keys, on the host."""
        region = self.regions.get(name)
        if region is None:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        k = self.kernels
        part = slice(region.entry_base, region.entry_base + region.slots)
        used = k.to_host(self.epochs[part]) >= 0
        slots = np.nonzero(used)[0].astype(np.int64)
        return k.to_host(self.keys[part])[slots], slots

    def size(self, name: str) -> int:
        """Keys cached in a table's region."""
        region = self.regions.get(name)
        if region is None:
            return 0
        part = slice(region.entry_base, region.entry_base + region.slots)
        return int((self.epochs[part] >= 0).sum())

    # -- one batch -------------------------------------------------------------------

    def observe(
        self,
        keys: Any,
        region: Any,
        counts: Any = None,
        *,
        allowed: Any = None,
    ) -> Plan:
        """One training batch: all tables' keys (uint64 on the device, with
        their ``region`` ids, int32), their ``counts`` in the batch (float32,
        or None: 1 each). Scores and locks the hits, then admits misses.
        ``allowed(miss_positions) -> bool mask`` (host) may hold misses back
        (they are still noted as ghosts; none comes in)."""
        self.epoch += 1
        self.clock += 1
        k = self.kernels
        weight = self._weight()
        entries = k.index_lookup(self, keys, region, counts, True, self.epoch, weight)
        miss = np.nonzero(k.to_host(entries) < 0)[0].astype(np.int64)
        empty64 = np.zeros(0, np.int64)
        if not len(miss):
            return Plan(entries, miss, empty64, np.zeros(0, np.uint8),
                        np.zeros(0, np.uint64), empty64)  # fmt: skip
        may = np.ones(len(miss), bool) if allowed is None else np.asarray(allowed(miss), bool)
        d_miss = k.to_device(miss)
        m_keys, m_region = keys[d_miss], region[d_miss]
        m_counts = None if counts is None else counts[d_miss]
        sets, scores = k.index_score(self, m_keys, m_region, m_counts, weight)
        xp = self.xp
        order = xp.argsort(-scores, kind="stable")
        order = order[xp.argsort(sets[order], kind="stable")]
        way, how, victim = k.index_populate(
            self, m_keys[order], m_region[order], sets[order], scores[order],
            k.to_device(may.astype(np.uint8))[order], float(self.clock), weight,
        )  # fmt: skip
        h_order, h_way, h_how = k.to_host(order), k.to_host(way), k.to_host(how)
        miss_entries = np.empty(len(miss), np.int64)
        miss_how = np.empty(len(miss), np.uint8)
        miss_entries[h_order] = h_way
        miss_how[h_order] = h_how
        entries[d_miss] = k.to_device(miss_entries)
        over = h_how == OVER_VICTIM  # in the sorted order, as the victims
        victims = k.to_host(victim)[over]
        victim_entries = h_way[over]
        return Plan(entries, miss, miss_entries, miss_how, victims, victim_entries)

    def forget(self, keys: Any, region: Any) -> Any:
        """Drops keys from the cache; returns their entries (xp, -1 where
        they were not cached)."""
        entries = self.lookup(keys, region)
        held = entries[entries >= 0]
        if len(held):
            self.epochs[held] = -1
        return entries

    def _weight(self) -> float:
        """The weight of this batch's counts ("stats"), rescaling every
        score when it grows large."""
        exponent = (self.clock - self._base) / self.half_life
        if exponent > _RESCALE and self.ghosts:
            factor = 2.0**-exponent
            xp = self.xp
            self.scores *= factor
            self.ghost_scores[...] = xp.where(
                self.ghost_scores >= 0, self.ghost_scores * factor, -1.0
            )
            self._base = self.clock
            exponent = 0.0
        return 2.0**exponent if self.ghosts else 1.0
