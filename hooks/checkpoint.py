"""The Checkpoint hook: resume from the newest checkpoint, save periodically
and at the end (``wuliang.checkpoint`` has the format)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from wuliang.hooks.base import SessionRunContext, SessionRunHook, SessionRunValues


class Checkpoint(SessionRunHook):
    """Saves ``model_dir/ckpt-<step>`` every ``every_steps`` steps or every
    ``every_secs`` seconds (default 600 s) and once at the end, keeping the
    newest ``keep``; when the session starts, restores the newest checkpoint
    in model_dir (if any), reader position included.

    Periodic checkpoints are exact: the session syncs the engine after the
    step being saved (its push applied, nothing of later steps pulled), which
    stalls the pipeline for about one step per checkpoint.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        every_steps: int | None = None,
        every_secs: float | None = None,
        keep: int | None = 5,
        restore: bool = True,
    ) -> None:
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be an int >= 1, got {every_steps!r}")
        if every_secs is not None and every_secs <= 0:
            raise ValueError(f"every_secs must be > 0, got {every_secs!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
        self.model_dir = Path(model_dir)
        self.every_steps = every_steps
        self.every_secs = 600.0 if every_steps is None and every_secs is None else every_secs
        self.keep = keep
        self.restore = restore
        self.saved: list[Path] = []  # what this hook wrote, oldest first
        self._lock = threading.Lock()
        self._due: set[int] = set()
        self._last_time = time.monotonic()
        self._last_saved_step = -1
        self._position: Any = None

    def after_create_session(self, session: Any) -> None:
        from wuliang.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.model_dir) if self.restore else None
        if latest is not None and session.global_step == 0:
            session.restore_checkpoint(latest)
        self._last_saved_step = session.global_step
        self._last_time = time.monotonic()

    def sync_after(self, step: int) -> bool:
        with self._lock:
            due = bool(self.every_steps) and (step + 1) % self.every_steps == 0
            now = time.monotonic()
            if self.every_secs is not None and now - self._last_time >= self.every_secs:
                due = True
                self._last_time = now
            if due:
                self._due.add(step)
            return due

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        self._position = getattr(run_context.batch, "position", None)
        with self._lock:
            due = run_context.step in self._due
            self._due.discard(run_context.step)
        if due and run_context.synced:
            self._save(run_context.session)

    def end(self, session: Any) -> None:
        if session.global_step != self._last_saved_step:
            self._save(session)

    def _save(self, session: Any) -> None:
        path = session.save_checkpoint(self.model_dir, self._position, self.keep)
        self._last_saved_step = session.global_step
        self.saved.append(path)
