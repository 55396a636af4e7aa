"""The job board: what the trainers of one job share besides tables.

Several trainers (the chief and the workers of a cluster) train one model.
They agree on a few things that belong to no table, and keep them on the
parameter servers (the first server of a ``RemoteServer``; in the process of
an embedded engine), where every trainer reaches them and a trainer that
restarts finds them again:

* the job's **step**: each trainer adds the steps it trains (``add_steps``);
  every answer carries the sum. A trainer passes the highest step it has seen
  as ``floor``, so a board that went back (its server restarted) is raised
  again to where the job was. Row stamps (TTL eviction) and version names use
  this step, not one process's count;
* **values** by name (bytes): the chief's ``ready`` mark (the job's tables
  and tower are in place: restored, or initialized), each trainer's reader
  position (``position/<trainer>``), the chief's ``hold`` while it cuts a
  checkpoint and each trainer's answer to it (``held/<trainer>``), …

``JobBoard.apply`` is one atomic read-modify-write; ``ParameterServer.job``
calls it. See ``wuliang.job`` for what the trainers do with it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["HELD", "HOLD", "POSITION", "READY", "JobBoard", "JobState", "checkpoint_values"]

READY = "ready"  # set once the job's tables and tower are in place (JSON)
POSITION = "position/"  # + trainer index: that trainer's reader position (JSON)
HOLD = "hold"  # the chief cuts a checkpoint: trainers stop pushing (its id)
HELD = "held/"  # + trainer index: the hold id that trainer stopped for

MAX_VALUE_BYTES = 1 << 20  # one value (a reader position is a few hundred bytes)
MAX_VALUES = 100_000


class JobState(NamedTuple):
    """The board after a call: the job's step and the values asked for."""

    step: int
    values: dict[str, bytes]


class JobBoard:
    """The step and the values of one job (see the module docstring)."""

    def __init__(self, step: int = 0, values: Mapping[str, bytes] | None = None) -> None:
        self._lock = threading.Lock()
        self._step = step
        self._values: dict[str, bytes] = dict(values or {})

    def apply(
        self,
        *,
        add_steps: int = 0,
        floor: int = 0,
        put: Mapping[str, bytes] | None = None,
        get: Iterable[str] = (),
        prefix: str | None = None,
    ) -> JobState:
        """Raises the step to ``floor``, adds ``add_steps``, stores ``put``
        (an empty value removes its name), then returns the step and the
        values named in ``get`` that exist, and every value whose name starts
        with ``prefix`` (when given)."""
        if add_steps < 0 or floor < 0:
            raise ValueError(f"add_steps and floor must be >= 0, got {add_steps} and {floor}")
        put = dict(put or {})
        for name, value in put.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"a job value needs a non-empty name, got {name!r}")
            if len(value) > MAX_VALUE_BYTES:
                raise ValueError(
                    f"job value {name!r} has {len(value)} bytes, more than {MAX_VALUE_BYTES}"
                )
        with self._lock:
            if len(self._values) + len(put) > MAX_VALUES:
                raise ValueError(f"the job board holds at most {MAX_VALUES} values")
            self._step = max(self._step, floor) + add_steps
            for name, value in put.items():
                if value:
                    self._values[name] = bytes(value)
                else:
                    self._values.pop(name, None)
            values = {n: self._values[n] for n in get if n in self._values}
            if prefix is not None:
                values.update({n: v for n, v in self._values.items() if n.startswith(prefix)})
            return JobState(self._step, values)


def checkpoint_values(step: int, trainer_positions: Mapping[str, Any] | None) -> dict[str, bytes]:
    """The board's values that a checkpoint of ``step`` stands for: the job
    ready (restored from it) and each trainer's reader position in it."""
    values = {READY: json.dumps({"restored_step": step}).encode()}
    for trainer, position in (trainer_positions or {}).items():
        values[f"{POSITION}{trainer}"] = json.dumps(position).encode()
    return values
