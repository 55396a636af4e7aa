"""What the ``Service`` serves from: the ``ServedModel`` protocol, and what a
served version brings (``ServedVersion``: its number, step, model
description and tower).

Two stores implement the protocol: ``ModelStore`` (``store.py``: an export
directory applied to an embedded engine) and ``RedisModelStore``
(``redis.model.py``: the copy ``wuliang publish`` wrote to Redis, read
through a local cache). One suite (``tests/test_store_conformance.py``)
runs both.

One version per request: ``served()`` is a snapshot of the version served
now, and ``lookup(table, keys, at=snapshot)`` reads exactly that version or
raises ``VersionMoved`` when the store can no longer read it (the embedded
engine holds one version per table; Redis keeps a few). A prediction decodes
its features with the snapshot's model description, looks every table up at
the snapshot and runs the snapshot's tower; on ``VersionMoved`` it resolves
a new snapshot and starts again (``Service.predict``). A plain lookup
(``at=None``) reads one table, which is wholly at one version by itself,
and its answer names that version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from wuliang.ps_server import LookupResult
from wuliang.ps_server.storage import SERVING, ModelDescription, Version

__all__ = ["ServedModel", "ServedVersion", "StoreCounters", "Tower", "load_tower"]


@dataclass(frozen=True)
class ServedVersion:
    """A snapshot of one served version: what a request needs besides rows.

    ``tower`` is None when the store serves lookups only; ``no_tower`` then
    says why (no export directory, towers not loaded …). ``handle`` is the
    store's own state of the version (Redis: the namespace it reads)."""

    number: int
    step: int
    model: ModelDescription  # features, tables, signature; empty when the version has none
    tower: Tower | None
    kind: str = "full"  # of the export version: "full" or "delta"
    path: Path | None = None  # the export version's directory, when there is one
    no_tower: str = ""
    handle: Any = field(default=None, repr=False, compare=False)


@dataclass
class StoreCounters:
    """Versions applied and refused since the store started."""

    applied: int = 0
    refused: int = 0
    apply_seconds: list[float] = field(default_factory=list)  # of the last applies


@runtime_checkable
class ServedModel(Protocol):
    """One served model (see the module docstring).

    Attributes:
        name: the model's name in requests.
        source: where it is served from (an export directory, a Redis URL).
        missing: what keys without a row read as: ``"zeros"`` or ``"initial"``.
        precision: how the served vectors are stored: ``"fp32"``, ``"fp16"``, ``"int8"``.
        counters: versions applied and refused.
        on_apply: called with (the new ``ServedVersion``, seconds it took)
            each time a version becomes the served one.
        on_refuse: called with (version number, why) for each refused version.
    """

    name: str
    source: str
    missing: str
    precision: str
    counters: StoreCounters
    on_apply: list[Callable[[ServedVersion, float], None]]
    on_refuse: list[Callable[[int, str], None]]

    @property
    def version(self) -> int:
        """The version served now (0: none yet)."""
        ...

    def served(self) -> ServedVersion:
        """A snapshot of the version served now; ``Unavailable`` when none."""
        ...

    def lookup(self, table: str, keys: Any, at: ServedVersion | None = None) -> LookupResult:
        """The rows of keys, which were found, and the version they were read
        at: the current one, or ``at`` 's (``VersionMoved`` when the store no
        longer reads it). ``NotFound`` for an unknown table, ``Unavailable``
        before the first version."""
        ...

    def tables(self) -> dict[str, int]:
        """The served tables and their dims (empty before the first version)."""
        ...

    def table_stats(self) -> dict[str, dict[str, Any]]:
        """Per served table: ``rows`` and ``bytes`` (0 where unknown)."""
        ...

    def start(self) -> ServedModel:
        """Loads the newest version there is (if any) and starts following
        new ones; returns the store."""
        ...

    def close(self) -> None:
        """Stops following versions and releases the store's resources."""
        ...


class Tower:
    """A version's loaded SavedModel and its ``serve`` function.

    ``serve`` is the concrete function of the export's signature, taken once
    at load: calling it skips the argument matching that calling the
    restored ``tf.function`` repeats on every request (about half the
    tower's time at batch 100)."""

    def __init__(self, module: Any) -> None:
        self.module = module  # kept: the function's variables belong to it
        self.serve = module.serve.get_concrete_function()
        # each output's shape (-1: unknown, the batch), for the signature's metadata
        self.outputs: dict[str, list[int]] = {
            name: [-1 if d is None else int(d) for d in tensor.shape.as_list()]
            for name, tensor in self.serve.structured_outputs.items()
        }

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The outputs (float32 arrays by name) of one batch of inputs
        (arrays, or tensors where they are)."""
        import tensorflow as tf

        result = self.serve(
            {name: v if tf.is_tensor(v) else tf.constant(v) for name, v in inputs.items()}
        )
        return {name: np.asarray(value.numpy(), np.float32) for name, value in result.items()}


def load_tower(version: Version) -> Tower:
    """A version's SavedModel (its tower), its files checked first.

    Raises:
        ValueError: the SavedModel is missing, damaged or does not load
            (``CorruptVersionError`` is one).
    """
    import tensorflow as tf

    try:
        version.checked(f"{SERVING}/saved_model.pb")
        module = tf.saved_model.load(str(version.local_folder(SERVING)))  # remote: downloaded
        return Tower(module)
    except (OSError, ValueError, TypeError, AttributeError, tf.errors.OpError) as error:
        raise ValueError(f"the SavedModel of {version.path} does not load: {error}") from None
