"""Rows of a table without optimizer state, as a version writes them (the
serving, precision and atomic-apply tests build their versions from these)."""

from __future__ import annotations

import numpy as np

from wuliang.ps_server import RowChunk


def version_rows(keys: np.ndarray, weights: np.ndarray, version: int = 1) -> RowChunk:
    """``keys`` with ``weights``, last written at step and version ``version``."""
    n = len(keys)
    return RowChunk(
        keys=keys,
        weights=weights,
        state=np.zeros((n, 0), np.float32),
        counts=np.ones(n, np.uint32),
        steps=np.full(n, version, np.uint64),
        times=np.zeros(n, np.uint32),
        versions=np.full(n, version, np.uint64),
    )
