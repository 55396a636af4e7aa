"""The GPU hot cache's host side: which keys are cached, in which slot, and
which keys come in and go out with each batch.

``HotSet`` keeps a key → slot index over a fixed number of slots (a
``KeyIndex``: the engine's C++ open addressing hash map, one call per
batch's keys) and one of two policies:

* ``"stats"``: decayed show counts. Every key the set tracks has a score,
  its sightings in training batches with exponential decay (half-life
  ``half_life`` batches): a batch adds each key's count in the batch (the
  reader's per-batch counts) times ``2 ** (t / half_life)`` (t the batch
  clock), so scores never need a decay pass and compare directly; they are
  rescaled now and then. The set tracks the cached keys and, as a history,
  up to ``history`` keys that are not cached (recently seen or evicted),
  whose scores keep accumulating while they wait: a key comes in when its
  score beats the lowest score among cached keys not in the batch (that key
  goes out and joins the history), and the history drops its lowest scores
  when full. A key seen once never displaces a key seen often lately.
* ``"lru"``: least recently used. Every miss comes in; the cached keys
  longest unseen go out.

Either way a batch's own keys are never evicted by it. ``HotSet.observe``
is all a cache asks per batch; the benchmark drives the same class.
``seed`` gives keys scores up front (a server's ``top_keys``, say).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wuliang.ps_server import _engine

POLICIES = ("stats", "lru")
_RESCALE = 256.0  # rescale scores when the decay exponent passes this many halvings


class KeyIndex:
    """uint64 key → int64 id, for batches of keys: the engine's open
    addressing hash map (``_engine.KeyIndex``, C++: linear probing, at most
    3/4 full, deletion without tombstones), one call per batch."""

    def __init__(self, expected: int) -> None:
        self._native = _engine.KeyIndex(max(int(expected), 0))

    @property
    def size(self) -> int:
        return int(self._native.size)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The id of each key (uint64 ``[n]``), -1 where absent."""
        return self._native.lookup(np.ascontiguousarray(keys, np.uint64))

    def insert(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Adds keys (distinct, absent) with their ids (>= 0)."""
        self._native.insert(
            np.ascontiguousarray(keys, np.uint64), np.ascontiguousarray(ids, np.int64)
        )

    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Removes keys; returns the ids they had (-1 where absent)."""
        return self._native.delete(np.ascontiguousarray(keys, np.uint64))

    def clear(self) -> None:
        self._native.clear()


@dataclass
class Plan:
    """What one batch does to the cache (``HotSet.observe``), per key of the
    batch (its unique keys) and for the keys that leave."""

    slots: np.ndarray  # int64 [n]: each key's slot, -1 if it stays uncached
    admitted: np.ndarray  # bool [n]: came in with this batch (its row is to be loaded)
    victim_keys: np.ndarray  # uint64: keys that left the cache
    victim_slots: np.ndarray  # int64: the slots they had (now the admitted keys')

    @property
    def hits(self) -> np.ndarray:
        """bool [n]: cached before this batch."""
        return (self.slots >= 0) & ~self.admitted


class HotSet:
    """The cached keys of one table: slots, index and policy (see the module
    docstring).

    Args:
        rows: cache slots.
        policy: ``"stats"`` (decayed counts) or ``"lru"``.
        half_life: batches after which a sighting counts half (``"stats"``).
        history: uncached keys whose scores are kept (``"stats"``; default
            ``rows``, at least 65536).
    """

    def __init__(
        self,
        rows: int,
        *,
        policy: str = "stats",
        half_life: float = 1000.0,
        history: int | None = None,
    ) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be 'stats' or 'lru', got {policy!r}")
        if not (isinstance(half_life, int | float) and half_life > 0):
            raise ValueError(f"half_life must be > 0 (batches), got {half_life!r}")
        if history is None:
            history = max(int(rows), 1 << 16)
        if not isinstance(history, int) or history < 0:
            raise ValueError(f"history must be an int >= 0, got {history!r}")
        self.rows = int(rows)
        self.policy = policy
        self.half_life = float(half_life)
        self.history = history if policy == "stats" else 0
        entries = self.rows + self.history
        self._index = KeyIndex(entries)
        self._key = np.zeros(entries, np.uint64)
        self._slot = np.full(entries, -1, np.int64)  # entry -> slot, -1: not cached
        self._live = np.zeros(entries, bool)
        self._score = np.zeros(entries, np.float64)  # "stats": decayed counts, scaled
        self._last = np.zeros(entries, np.int64)  # "lru": batch of the last sighting
        self._free_entries = np.arange(entries - 1, -1, -1, dtype=np.int64)
        self._num_free_entries = entries
        self._entry_of_slot = np.full(self.rows, -1, np.int64)
        self._free_slots = np.arange(self.rows - 1, -1, -1, dtype=np.int64)
        self._num_free_slots = self.rows
        self._in_batch = np.zeros(entries, bool)
        self._queue = np.zeros(0, np.int64)  # the victim queue (see _lowest)
        self._queue_by = np.zeros(0, np.float64)
        self._queue_bound = np.inf
        self.clock = 0  # batches observed
        self._base = 0  # scores are scaled by 2 ** ((clock - base) / half_life)

    # -- reading ---------------------------------------------------------------

    def __len__(self) -> int:
        """Keys cached now."""
        return self.rows - self._num_free_slots

    def slots_of(self, keys: np.ndarray) -> np.ndarray:
        """Each key's slot (int64), -1 where not cached; no statistics change."""
        entries = self._index.lookup(keys)
        return np.where(entries >= 0, self._slot[np.maximum(entries, 0)], -1)

    def cached(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys uint64, slots int64) of every cached key."""
        slots = np.nonzero(self._entry_of_slot >= 0)[0]
        return self._key[self._entry_of_slot[slots]], slots

    def keys_of(self, slots: np.ndarray) -> np.ndarray:
        """The keys cached at slots (all occupied)."""
        return self._key[self._entry_of_slot[slots]]

    def scores(self, keys: np.ndarray) -> np.ndarray:
        """Decayed counts of keys as of now (0 for keys not tracked)."""
        entries = self._index.lookup(keys)
        raw = np.where(entries >= 0, self._score[np.maximum(entries, 0)], 0.0)
        return raw * 2.0 ** (-(self.clock - self._base) / self.half_life)

    # -- one batch ---------------------------------------------------------------

    def observe(self, keys: np.ndarray, counts: np.ndarray | None = None) -> Plan:
        """One training batch's unique keys (uint64) and their occurrences
        in it: updates the statistics and decides which misses come in and
        which cached keys leave for them (the index changes at once)."""
        keys = np.asarray(keys, np.uint64)
        n = len(keys)
        counts = np.ones(n, np.float64) if counts is None else np.asarray(counts, np.float64)
        self.clock += 1
        entries = self._index.lookup(keys)
        if self.policy == "lru":
            return self._observe_lru(keys, counts, entries)
        weight = self._weight()
        new = np.nonzero(entries < 0)[0]
        if len(new):
            entries[new] = self._track(keys[new], exclude=entries[entries >= 0])
        tracked = entries >= 0
        self._score[entries[tracked]] += counts[tracked] * weight
        slots = np.full(n, -1, np.int64)
        slots[tracked] = self._slot[entries[tracked]]
        candidates = np.nonzero(tracked & (slots < 0))[0]
        candidates = candidates[np.argsort(-self._score[entries[candidates]], kind="stable")]
        admit, victims = self._choose(candidates, entries, by=self._score)
        plan = self._apply(keys, entries, slots, admit, victims)
        if len(admit):  # newcomers may rank below the queue's bound
            low = float(self._score[entries[admit]].min())
            self._queue_bound = min(self._queue_bound, low)
        return plan

    def _observe_lru(self, keys: np.ndarray, counts: np.ndarray, entries: np.ndarray) -> Plan:
        hit = entries >= 0
        self._last[entries[hit]] = self.clock
        slots = np.full(len(keys), -1, np.int64)
        slots[hit] = self._slot[entries[hit]]
        candidates = np.nonzero(~hit)[0]
        candidates = candidates[np.argsort(-counts[candidates], kind="stable")]
        admit, victims = self._choose(candidates, entries, by=self._last)
        if len(victims):  # LRU forgets the keys that leave
            self._untrack(victims)
        if len(admit):
            entries[admit] = self._track(keys[admit], exclude=entries[hit])
            self._last[entries[admit]] = self.clock
        plan = self._apply(keys, entries, slots, admit, np.zeros(0, np.int64))
        plan.victim_keys, plan.victim_slots = self._victims
        return plan

    def _choose(
        self, candidates: np.ndarray, entries: np.ndarray, by: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Which candidates (positions in the batch, best first) come in and
        which cached entries leave for them: free slots first, then, while a
        candidate ranks above the lowest-ranked cached entry outside the
        batch (``"lru"``: always), one for the other."""
        free = min(len(candidates), self._num_free_slots)
        rest = candidates[free:]
        self._victims = (np.zeros(0, np.uint64), np.zeros(0, np.int64))
        if not len(rest):
            return candidates, np.zeros(0, np.int64)
        batch = entries[entries >= 0]
        self._in_batch[batch] = True
        try:
            victims = self._lowest(len(rest), by)
        finally:
            self._in_batch[batch] = False
        m = len(victims)
        if self.policy == "stats" and m:
            wins = self._score[entries[rest[:m]]] > self._score[victims]
            m = int(np.argmin(wins)) if not wins.all() else m  # both sides sorted
            victims = victims[:m]
        if m:
            window = min(len(self._queue), 4 * m + 4096)
            gone = np.isin(self._queue[:window], victims)
            self._queue = np.concatenate([self._queue[:window][~gone], self._queue[window:]])
            self._queue_by = np.concatenate(
                [self._queue_by[:window][~gone], self._queue_by[window:]]
            )
        self._victims = (self._key[victims], self._slot[victims].copy())
        return candidates[: free + m], victims

    # The victim queue: the lowest-ranked cached entries, sorted, with the
    # rank each had when queued, so that a batch finds its victims without
    # ranking every cached entry. Ranks only rise (a score grows, a last
    # sighting moves on), so a record whose rank changed is stale and
    # dropped; every cached entry not in the queue ranks at least
    # ``_queue_bound`` (lowered when a stale record or a newcomer ranks below
    # it), and records up to the bound are in order. Rebuilt (one partition
    # of all cached entries) when they run out.

    def _lowest(self, m: int, by: np.ndarray) -> np.ndarray:
        """Up to m cached entries outside the batch, lowest rank first."""
        built = False
        while True:
            if not len(self._queue):
                self._build_queue(m, by)
                built = True
            window = min(len(self._queue), 4 * m + 4096)
            rec, val = self._queue[:window], self._queue_by[:window]
            cached = self._slot[rec] >= 0
            now = by[rec].astype(np.float64)
            stale = cached & (now != val)
            if stale.any():
                self._queue_bound = min(self._queue_bound, float(now[stale].min()))
            keep = cached & ~stale
            if not keep.all():
                rec, val = rec[keep], val[keep]
                self._queue = np.concatenate([rec, self._queue[window:]])
                self._queue_by = np.concatenate([val, self._queue_by[window:]])
            usable = np.nonzero((val <= self._queue_bound) & ~self._in_batch[rec])[0]
            if len(usable) >= m or built:
                return rec[usable[:m]]
            self._queue = np.zeros(0, np.int64)  # run out: rebuild

    def _build_queue(self, m: int, by: np.ndarray) -> None:
        cached = self._entry_of_slot[self._entry_of_slot >= 0]
        values = by[cached].astype(np.float64)
        size = min(len(cached), max(4 * m, 1 << 16))
        if size < len(cached):
            part = np.argpartition(values, size)[: size + 1]
            self._queue_bound = float(values[part[size]])
            part = part[:size]
        else:
            part = np.arange(len(cached))
            self._queue_bound = np.inf
        order = part[np.argsort(values[part], kind="stable")]
        self._queue, self._queue_by = cached[order], values[order]

    def _apply(
        self,
        keys: np.ndarray,
        entries: np.ndarray,
        slots: np.ndarray,
        admit: np.ndarray,
        victims: np.ndarray,
    ) -> Plan:
        victim_keys = self._key[victims]
        victim_slots = self._slot[victims].copy()
        if len(victims):  # "stats": they stay tracked, uncached
            self._entry_of_slot[victim_slots] = -1
            self._slot[victims] = -1
            self._push_free_slots(victim_slots)
        admitted = np.zeros(len(keys), bool)
        if len(admit):
            new_slots = self._pop_free_slots(len(admit))
            self._slot[entries[admit]] = new_slots
            self._entry_of_slot[new_slots] = entries[admit]
            slots[admit] = new_slots
            admitted[admit] = True
        return Plan(slots, admitted, victim_keys, victim_slots)

    def _weight(self) -> float:
        exponent = (self.clock - self._base) / self.half_life
        if exponent > _RESCALE:
            self._score *= 2.0**-exponent
            self._base = self.clock
            self._queue = np.zeros(0, np.int64)  # its ranks changed
            exponent = 0.0
        return 2.0**exponent

    # -- entries and slots ----------------------------------------------------

    def _track(self, keys: np.ndarray, exclude: np.ndarray) -> np.ndarray:
        """New entries for untracked keys (score 0); the history makes room
        by dropping its lowest scores (never ``exclude``'s entries). Keys
        beyond room get -1."""
        need = len(keys)
        if self._num_free_entries < need and self.policy == "stats":
            self._trim_history(need, exclude)
        room = min(need, self._num_free_entries)
        entries = np.full(need, -1, np.int64)
        if room:
            top = self._num_free_entries
            taken = self._free_entries[top - room : top][::-1].copy()
            self._num_free_entries -= room
            entries[:room] = taken
            self._key[taken] = keys[:room]
            self._live[taken] = True
            self._slot[taken] = -1
            self._score[taken] = 0.0
            self._last[taken] = 0
            self._index.insert(keys[:room], taken)
        return entries

    def _trim_history(self, need: int, exclude: np.ndarray) -> None:
        """Drops the lowest-scored uncached entries until ``need`` entries
        (and an eighth of the history, so trims are rare) are free."""
        ghosts = np.nonzero(self._live & (self._slot < 0))[0]
        if len(exclude):
            keep = np.zeros(len(self._live), bool)
            keep[exclude] = True
            ghosts = ghosts[~keep[ghosts]]
        drop = min(len(ghosts), need - self._num_free_entries + self.history // 8)
        if drop <= 0:
            return
        if drop < len(ghosts):
            ghosts = ghosts[np.argpartition(self._score[ghosts], drop - 1)[:drop]]
        self._untrack(ghosts)

    def _untrack(self, entries: np.ndarray) -> None:
        """Forgets entries (freeing the slots of cached ones)."""
        cached = entries[self._slot[entries] >= 0]
        if len(cached):
            slots = self._slot[cached]
            self._entry_of_slot[slots] = -1
            self._push_free_slots(slots)
        self._index.delete(self._key[entries])
        self._live[entries] = False
        self._slot[entries] = -1
        top = self._num_free_entries
        self._free_entries[top : top + len(entries)] = entries
        self._num_free_entries += len(entries)

    def _pop_free_slots(self, n: int) -> np.ndarray:
        top = self._num_free_slots
        slots = self._free_slots[top - n : top][::-1].copy()
        self._num_free_slots -= n
        return slots

    def _push_free_slots(self, slots: np.ndarray) -> None:
        top = self._num_free_slots
        self._free_slots[top : top + len(slots)] = slots
        self._num_free_slots += len(slots)

    # -- changes from outside ----------------------------------------------------

    def forget(self, keys: np.ndarray) -> np.ndarray:
        """Drops keys from the cache and the history (erased, overwritten,
        or never loaded); returns the slots the cached ones had."""
        entries = self._index.lookup(np.asarray(keys, np.uint64))
        entries = np.unique(entries[entries >= 0])
        slots = self._slot[entries]
        self._untrack(entries)
        return slots[slots >= 0]

    def clear(self) -> None:
        """Forgets every key."""
        self._index.clear()
        self._live[:] = False
        self._slot[:] = -1
        self._entry_of_slot[:] = -1
        self._free_entries = np.arange(len(self._live) - 1, -1, -1, dtype=np.int64)
        self._num_free_entries = len(self._live)
        self._free_slots = np.arange(self.rows - 1, -1, -1, dtype=np.int64)
        self._num_free_slots = self.rows
        self._queue = np.zeros(0, np.int64)

    def seed(self, keys: np.ndarray, scores: np.ndarray | None = None) -> Plan:
        """Keys to cache ahead of training, best first (e.g. a server's
        ``top_keys``), with their (decayed) counts as scores: admitted into
        free slots, or over cached keys of lower score (``"lru"``: as
        recently seen). Returns the plan, as ``observe`` does."""
        keys = np.asarray(keys, np.uint64)
        if scores is None:
            scores = np.arange(len(keys), 0, -1, dtype=np.float64)
        return self.observe(keys, np.asarray(scores, np.float64))
