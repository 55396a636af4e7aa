"""The data sets shipped with the repository, for the tests that use them."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
MOVIELENS = REPO / "datasets" / "movielens-small"  # ml-latest-small, CSVs gzip-compressed


def open_movielens(name: str) -> IO[str]:
    """A MovieLens CSV (``ratings.csv``, ...) of the shipped copy, as text."""
    return gzip.open(MOVIELENS / f"{name}.gz", "rt", encoding="utf-8", newline="")
