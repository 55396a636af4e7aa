"""Argument checks that every parameter server makes the same way, so that
the same bad argument raises the same error, naming it, whichever
implementation gets it (the conformance suite checks the messages)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "as_column",
    "as_float32",
    "as_keys",
    "check_clock",
    "check_float32",
    "check_step",
    "check_version",
]


def check_float32(values: Any, shape: tuple[int, ...], what: str) -> None:
    if not isinstance(values, np.ndarray):
        raise TypeError(f"{what} must be a numpy float32 array, got {type(values).__name__}")
    if values.dtype != np.float32:
        raise TypeError(f"{what} must be float32, got dtype {values.dtype}")
    if values.shape != shape:
        raise ValueError(f"{what} has shape {values.shape}, expected {shape}")


def as_float32(values: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    """An input array: checked, then made contiguous (no copy if it is)."""
    check_float32(values, shape, what)
    return np.ascontiguousarray(values)


def rows_contiguous(values: np.ndarray) -> bool:
    """Whether a 2-D array's rows are each contiguous (a C-contiguous
    array, or columns of a wider one): what the engine's many-table pulls
    and pushes take without a copy."""
    if values.ndim != 2:
        return False
    n, width = values.shape
    item = values.itemsize
    return (width <= 1 or values.strides[1] == item) and (
        n <= 1 or values.strides[0] >= item * width
    )


def check_step(step: int | None) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step < 2**63:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


MAX_CLOCK = 2**32 - 1  # rows store their time as uint32 unix seconds


def check_clock(seconds: Any) -> int | None:
    """``set_clock``'s argument: unix seconds in [0, 2**32), or None (the wall
    clock; so is 0)."""
    if seconds is None:
        return None
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | np.integer)
        or not 0 <= seconds <= MAX_CLOCK
    ):
        raise ValueError(
            f"clock must be unix seconds, an int in [0, 2**32), or None, got {seconds!r}"
        )
    return int(seconds) or None


def check_version(version: Any, what: str) -> int:
    """A version argument (``since``, ``upto``, ``floor``, ``version``) as an int."""
    if (
        isinstance(version, bool)
        or not isinstance(version, int | np.integer)
        or not 0 <= version < 2**64
    ):
        raise ValueError(f"{what} must be a version >= 0, got {version!r}")
    return int(version)


MAX_VERSION = 2**63 - 1  # the highest version a server may be restored to (never wraps)


def check_restored_version(version: Any) -> int:
    """``restore_version``'s argument: a version of at most ``MAX_VERSION``."""
    version = check_version(version, "version")
    if version > MAX_VERSION:
        raise ValueError(f"version must be at most 2**63 - 1, got {version}")
    return version


def as_column(values: Any, dtype: type, shape: tuple[int, ...], what: str) -> np.ndarray | None:
    if values is None:
        return None
    array = np.ascontiguousarray(values, dtype=dtype)
    if array.shape != shape:
        raise ValueError(f"{what} has shape {array.shape}, expected {shape}")
    return array


def as_keys(keys: Any, what: str = "keys") -> np.ndarray:
    """Keys as a contiguous 1-D int64/uint64 array (no copy if already)."""
    if not isinstance(keys, np.ndarray):
        keys = np.asarray(keys)
        if keys.size == 0:
            keys = keys.astype(np.uint64)
    if keys.dtype != np.int64 and keys.dtype != np.uint64:
        raise TypeError(f"{what} must be an int64 or uint64 array, got dtype {keys.dtype}")
    if keys.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {keys.shape}")
    return np.ascontiguousarray(keys)


def load_columns(
    spec: Any,
    keys: np.ndarray,
    weights: Any,
    state: Any = None,
    counts: Any = None,
    steps: Any = None,
    times: Any = None,
    versions: Any = None,
    shows: Any = None,
    clicks: Any = None,
) -> dict[str, np.ndarray | None]:
    """The columns of rows to load into a table of ``spec`` (``load``, rows
    given back in an exchange), checked: exact dtypes and shapes, None where
    absent (the server's default)."""
    n = len(keys)
    return {
        "keys": keys,
        "weights": as_float32(weights, (n, spec.dim), "weights"),
        "state": None if state is None else as_float32(state, (n, spec.state_dim), "state"),
        "counts": as_column(counts, np.uint32, (n,), "counts"),
        "steps": as_column(steps, np.uint64, (n,), "steps"),
        "times": as_column(times, np.uint32, (n,), "times"),
        "versions": as_column(versions, np.uint64, (n,), "versions"),
        "shows": as_column(shows, np.float32, (n,), "shows"),
        "clicks": as_column(clicks, np.float32, (n,), "clicks"),
    }
