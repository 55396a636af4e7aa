"""The Checkpoint hook: resume from the newest checkpoint, save periodically
and at the end (``wuliang.checkpoint`` writes it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from wuliang.hooks.base import HookSession, SessionRunContext, SessionRunValues
from wuliang.hooks.periodic import PeriodicSyncHook, results
from wuliang.ps_server.storage import latest_checkpoint, location


class Checkpoint(PeriodicSyncHook):
    """Saves ``model_dir/ckpt-<step>`` every ``every_steps`` steps or every
    ``every_secs`` seconds (default 600 s) and once at the end; when the
    session starts, restores the newest checkpoint in model_dir (if any),
    reader position included.

    Retention after each save (``wuliang.checkpoint.rotate``): the newest
    ``keep`` checkpoints by step (None: every one), and with
    ``keep_daily=D`` also the newest checkpoint of each of the D most
    recent UTC days that have one (by the time its manifest records), so a
    trainer that runs for months keeps a checkpoint a day to go back to.
    The checkpoint just written is never removed.

    Periodic checkpoints are exact: the session syncs the engine after the
    step being saved (its push applied, nothing of later steps pulled), which
    stalls the pipeline for about one step per checkpoint.
    """

    chief_only = True  # in a cluster, only the chief acts

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
        keep: int | None = 5,
        keep_daily: int | None = None,
        restore: bool = True,
    ) -> None:
        if every_steps is None and every_secs is None:
            every_secs = 600.0
        super().__init__(every_steps, every_secs)
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
        if keep_daily is not None and (
            isinstance(keep_daily, bool) or not isinstance(keep_daily, int) or keep_daily < 1
        ):
            raise ValueError(f"keep_daily must be an int >= 1 or None, got {keep_daily!r}")
        self.model_dir = location(model_dir)  # a folder, or a URI of an object store
        self.keep = keep
        self.keep_daily = keep_daily
        self.restore = restore
        self.saved: list[Path] = results()  # what this hook wrote (the newest), oldest first
        self._position: Any = None

    def restore_session(self, session: HookSession) -> None:
        latest = latest_checkpoint(self.model_dir) if self.restore else None
        if latest is not None and session.global_step == 0:
            session.restore_checkpoint(latest)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if run_context.train:  # the position after the last trained batch
            self._position = getattr(run_context.batch, "position", None)
        super().after_run(run_context, run_values)

    def trigger(self, session: HookSession) -> None:
        self.saved.append(
            session.save_checkpoint(self.model_dir, self._position, self.keep, self.keep_daily)
        )
