"""``KeyIndex``: uint64 key → int64 id for batches of keys, on the host
(the engine's C++ hash map); serving's device snapshots find a lookup's
cached keys with it."""

from __future__ import annotations

import numpy as np

from wuliang.ps_server import _engine


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
