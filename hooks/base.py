"""The hook protocol, with TensorFlow's names.

A hook sees every step of a ``Session``::

    begin()                               before the first step (graph/state may be extended)
    restore_session(session)              restore the session's state (Checkpoint): after
                                          every begin(), before any after_create_session()
    after_create_session(session)         the session exists, restored
    before_run(run_context) -> SessionRunArgs | None   fetch more names this step
    after_run(run_context, run_values)    run_values.results: the fetched values by name
    sync_after(step) -> bool              ahead of a step: want the engine in sync after it
    sync_after_batch(step, batch) -> bool the same, seeing the step's batch (default: sync_after)
    end(session)                          after the last step

``run_context.request_stop()`` ends the training loop after the current step.
Hooks run in the order given; ``after_run`` in the same order.

What a hook may use of the session that runs it is ``HookSession``: the
step, the context (parameter server, tables), checkpoint and export calls,
evaluation and the trace. Nothing else of the session is part of the contract.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from wuliang.ps_server import ParameterServer


class HookContext(Protocol):
    """The model's state as hooks see it (``wuliang.Context`` implements it)."""

    @property
    def ps(self) -> ParameterServer:
        """The parameter server holding the model's tables."""
        ...

    @property
    def tables(self) -> Mapping[str, Any]:
        """The model's tables (``EmbeddingTable`` s) by name."""
        ...

    @property
    def sized(self) -> Mapping[str, Any]:
        """The sized tables by name (their blocks are in ``tables``)."""
        ...

    def size_stats(self, name: str) -> dict[str, Any]:
        """A sized table's keys and bytes per size, keys grown and shrunk."""
        ...


class HookTrace(Protocol):
    """Per-stage timings of the steps (``wuliang.context.Trace``)."""

    def enable(self) -> None: ...

    def disable(self) -> None: ...

    def events(self) -> list[tuple[str, int, float, float, str]]:
        """(stage, step, start, end, thread name) of each recorded stage."""
        ...


class HookSession(Protocol):
    """The session as hooks see it (``wuliang.Session`` implements it)."""

    @property
    def global_step(self) -> int:
        """Training steps done (the step the next one gets)."""
        ...

    @property
    def context(self) -> HookContext:
        """The model's parameter server (``context.ps``), tables
        (``context.tables``) and settings."""
        ...

    @property
    def trace(self) -> HookTrace:
        """Per-stage timings, recorded while enabled (``Timeline``)."""
        ...

    def save_checkpoint(
        self,
        model_dir: str | os.PathLike,
        position: Any = None,
        keep: int | None = 5,
        keep_daily: int | None = None,
    ) -> Path:
        """Writes ``model_dir/ckpt-<step>`` (when ``run_context.synced``)
        and applies the retention rules."""
        ...

    def restore_checkpoint(self, path: str | os.PathLike) -> bool:
        """Restores a checkpoint (from ``restore_session``)."""
        ...

    def export(self, export_dir: str | os.PathLike, kind: str = "auto") -> Any:
        """Writes the next export version (when ``run_context.synced``)."""
        ...

    def prune_exports(
        self,
        export_dir: str | os.PathLike,
        keep_versions: int | None = None,
        keep_bytes: int | None = None,
    ) -> Any:
        """Removes export_dir's oldest versions, never LATEST's chain."""
        ...

    def publish(self, export_dir: str | os.PathLike, redis_url: str, model: str | None) -> Any:
        """Puts export_dir's newest version into Redis for a fleet of replicas."""
        ...

    def evaluate(self, reader: Any, steps: int | None = None) -> dict[str, float]:
        """Metrics over a reader (between steps)."""
        ...


@dataclass(frozen=True)
class SessionRunArgs:
    """Names a hook wants fetched in this step (``loss``, ``predictions`` …)."""

    fetches: Sequence[str] = ()


@dataclass
class SessionRunContext:
    """What a hook knows of the step about to run, and how it stops training."""

    session: HookSession
    step: int  # global step of this run (before it is counted)
    batch: Any  # the CsrBatch
    train: bool
    stop_requested: bool = False
    synced: bool = False  # every push of this step applied and nothing pulled ahead

    @property
    def labeled(self) -> bool:
        """The batch has labels (``loss`` can be fetched)."""
        return self.batch.labels is not None

    def request_stop(self) -> None:
        self.stop_requested = True


@dataclass
class SessionRunValues:
    """What the step produced: fetched values by name, and its timings."""

    results: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds


class SessionRunHook:
    """Base class: every method is optional."""

    def begin(self) -> None:
        pass

    def restore_session(self, session: HookSession) -> None:
        """Where a hook restores the session (a checkpoint), so that every
        hook's ``after_create_session`` sees the restored step."""

    def after_create_session(self, session: HookSession) -> None:
        pass

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        pass

    def sync_after(self, step: int) -> bool:
        """Asked ahead of step ``step`` (from the pipeline's thread): True makes
        the session wait, after that step, until its push is applied, and pull
        nothing of later steps until every ``after_run`` of it returned, which
        then sees ``run_context.synced`` (to checkpoint or export the engine)."""
        return False

    def sync_after_batch(self, step: int, batch: Any) -> bool:
        """``sync_after``, for a hook that decides by the step's batch (the
        one that ends a partition, say); what the session asks."""
        return self.sync_after(step)

    def end(self, session: HookSession) -> None:
        pass
