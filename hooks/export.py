"""The IncrementalExport hook: the trainer exports for serving by itself."""

from __future__ import annotations

import logging
import os
from typing import Any

from wuliang.hooks.base import HookSession
from wuliang.hooks.periodic import PeriodicSyncHook
from wuliang.ps_server.storage import latest, location

log = logging.getLogger("wuliang.export")


class IncrementalExport(PeriodicSyncHook):
    """Writes a version to ``export_dir`` every ``every_secs`` seconds
    (default 3600) or every ``every_steps`` steps, and at the end: a delta of
    the newest version there, or a full one when there is none or a delta
    cannot be made (``wuliang.export``). Every ``full_every``-th version is
    full, so that chains stay short (None: only when needed).

    Each export runs with the engine in sync after a step (the pipeline
    stalls for it) and takes time proportional to the rows changed.
    ``results`` lists what was written; each status line is logged at INFO.
    """

    chief_only = True  # in a cluster, only the chief acts

    def __init__(
        self,
        export_dir: str | os.PathLike,
        *,
        every_secs: float | None = None,
        every_steps: int | None = None,
        full_every: int | None = None,
    ) -> None:
        if every_steps is None and every_secs is None:
            every_secs = 3600.0
        super().__init__(every_steps, every_secs)
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise ValueError(f"full_every must be an int >= 1 or None, got {full_every!r}")
        self.export_dir = location(export_dir)  # a folder, or a URI of an object store
        self.full_every = full_every
        self.results: list[Any] = []

    def trigger(self, session: HookSession) -> None:
        kind = "auto"
        if self.full_every is not None:
            newest = latest(self.export_dir)
            if newest is not None and newest.number % self.full_every == 0:
                kind = "full"
        result = session.export(self.export_dir, kind)
        self.results.append(result)
        log.info("%s", result.status())
