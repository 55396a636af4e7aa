"""What training does with NaN and infinite values: nothing fails silently.

A training step checks, in this order:

1. the loss (when the batch has labels);
2. the tower's gradients: the step computes, per trainable variable, whether
   its gradient is finite, and applies zeros in place of a non-finite one
   (the variable keeps its value);
3. the embedding tables' row gradients, before any of them is pushed.

``Context(non_finite="raise")`` (the default) stops training at the first
problem with ``NonFiniteError`` naming the loss, the tower variable or the
table and key, and the step (counted from 1, as the ``Logging`` hook does).
A table's rows are never half-updated by the failing step; the tower's
variables are left as they were (its optimizer's step count may advance).
With a ``hooks.NanGuard(fail=False)``, a non-finite loss instead stops
training without an error; that step is not applied either.

``Context(non_finite="drop")`` keeps training: non-finite row gradients are
dropped and counted by the engine (``engine.stats(table)["dropped_nan"]``),
non-finite tower gradients are replaced by zeros, and both, with non-finite
losses, are counted in ``Session.non_finite`` and logged (the first time,
then at most once a minute).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

POLICIES = ("raise", "drop")
log = logging.getLogger("wuliang")
_LOG_EVERY_S = 60.0


class NonFiniteError(FloatingPointError):
    """A NaN or infinite loss or gradient stopped training."""


def check_policy(value: object) -> str:
    if value not in POLICIES:
        raise ValueError(f"non_finite must be 'raise' or 'drop', got {value!r}")
    return str(value)


class NonFiniteGuard:
    """Checks one session's steps (see the module docstring)."""

    def __init__(self, policy: str) -> None:
        self.policy = check_policy(policy)
        self.counts: Counter[str] = Counter()  # "loss", "tower", table -> rows
        self._logged = -_LOG_EVERY_S

    def check_step(
        self,
        loss: Any,
        tower_finite: Any,
        tower_variables: Sequence[str],
        step: int,
        stop_on_loss: bool = False,
    ) -> bool:
        """The loss and the tower's gradients of ``step`` (0-based global
        step). Returns True when the step must not be applied: its loss is
        not finite and ``stop_on_loss`` (a ``NanGuard(fail=False)`` stops
        training instead)."""
        value = float(np.asarray(loss))
        if not np.isfinite(value):
            if stop_on_loss:
                return True
            self._found("loss", 1, f"loss is {value} at step {step + 1}")
        finite = np.asarray(tower_finite)
        if finite.size and not finite.all():
            bad = [tower_variables[i] for i in np.flatnonzero(~finite)]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            self._found(
                "tower",
                1,
                f"tower variable {bad[0]!r}{more} has a non-finite gradient at step {step + 1}",
            )
        return False

    def check_rows(
        self,
        table: str,
        keys: np.ndarray,
        grads: Any,
        step: int,
        finite_rows: Callable[[Any], np.ndarray] | None = None,
    ) -> None:
        """A table's row gradients of ``step``, before they are pushed (in
        "drop" mode the engine then drops the bad rows). ``finite_rows``:
        which rows are finite (host bool), for gradients on a device."""
        finite = (finite_rows or _finite_rows)(grads)
        if finite.all():
            return
        bad = np.flatnonzero(~finite)
        self._found(
            table,
            len(bad),
            f"table {table!r}: the gradient of key {int(keys[bad[0]])} is not finite "
            f"({len(bad)} rows) at step {step + 1}",
        )

    def _found(self, what: str, count: int, message: str) -> None:
        if self.policy == "raise":
            raise NonFiniteError(
                f"{message} (Context(non_finite='drop') skips such updates instead)"
            )
        self.counts[what] += count
        now = time.monotonic()
        if now - self._logged >= _LOG_EVERY_S:
            self._logged = now
            totals = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
            log.warning("%s; skipped so far: %s", message, totals)


def _finite_rows(grads: np.ndarray) -> np.ndarray:
    return np.isfinite(grads).all(axis=1)
