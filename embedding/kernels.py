"""Host kernels of the training bridge, in C++ (``_embedding``, csrc/).

* ``index_in``: where each key of the previous step sits among this step's
  unique keys, so that (staleness 0) the previous step's push writes the rows
  it updates straight into this step's pulled rows (the Session's link, run
  by ``wuliang.pipeline``).
* ``scatter_add_rows``: dL/d(looked-up values) summed into the unique rows
  they were read from, the row gradients to push (``wuliang.embedding.bridge``).

Both release the GIL and are safe to call from several threads at once. They
need no TensorFlow. Callers import them from here, never from the private
extension.
"""

from __future__ import annotations

import numpy as np

from wuliang.embedding import _embedding

__all__ = ["index_in", "scatter_add_rows"]


def index_in(a: np.ndarray, b: np.ndarray, base: int = 0) -> np.ndarray:
    """Positions of a's keys in b, offset by ``base``.

    Args:
        a: int64 or uint64 keys, 1-D and C-contiguous (repeats allowed).
        b: int64 or uint64 keys, 1-D and C-contiguous, without repeats.
        base: added to every position found; ``base + len(b)`` must fit in
            int32.

    Returns:
        int32 ``[len(a)]``: ``base + j`` where ``b[j] == a[i]``, else -1.

    Raises:
        TypeError: a or b is not a 1-D contiguous 8-byte integer array.
        ValueError: ``base + len(b)`` does not fit in int32.
    """
    return _embedding.index_in(a, b, base)


def scatter_add_rows(out: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """``out[index[i]] += values[i]`` for every i, in order (deterministic sums).

    The inverse of a gather: ``np.add.at(out, index, values)``, faster.

    Args:
        out: float32 ``[rows, dim]``, C-contiguous and writable; updated in
            place.
        index: ``[n]`` row of each value (converted to int32).
        values: ``[n, dim]`` (converted to float32).

    Raises:
        TypeError: out is not a writable C-contiguous float32 2-D array.
        ValueError: the shapes of index and values do not match out's dim.
        IndexError: an index is outside ``[0, rows)`` (nothing is written).
    """
    _embedding.scatter_add_rows(out, index, values)
