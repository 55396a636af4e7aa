"""The IncrementalExport hook: the trainer exports for serving by itself."""

from __future__ import annotations

import logging
import os
from typing import Any

from wuliang.hooks.base import HookSession
from wuliang.hooks.periodic import PeriodicSyncHook, results
from wuliang.ps_server.storage import RemotePath, latest, location

log = logging.getLogger("wuliang.export")

KEEP_PARTITIONS = 1000  # the newest partitions after_partition remembers


class IncrementalExport(PeriodicSyncHook):
    """Writes a version to ``export_dir`` every ``every_secs`` seconds
    (default 3600), every ``every_steps`` steps, or with ``every_partition``
    after each partition of a ``StreamReader`` (its last batch), and at the
    end: a delta of
    the newest version there, or a full one when there is none or a delta
    cannot be made (``wuliang.export``). Every ``full_every``-th version is
    full, so that chains stay short (None: only when needed; with
    ``keep_versions``, half of it, so that retention can remove old chains).

    Each export runs with the engine in sync after a step (the pipeline
    stalls for it) and takes time proportional to the rows changed. The
    servers then forget the removals it holds (``trim_removed``): a delta
    from a checkpoint older than it, into another export folder, is written
    full.
    ``results`` lists what was written; each status line is logged at INFO.

    With ``keep_versions`` or ``keep_bytes``, each version written is
    followed by ``wuliang.export.prune``: the oldest versions go until at
    most that many versions (or bytes) are left, never one of LATEST's chain
    (a chain over the budget is kept whole, with a warning, and the next
    version is written full, so that the one after can remove it;
    ``full_every`` keeps chains short). ``pruned`` lists what each prune did. A prune that
    fails (a broken chain, an object store's error) is logged and training
    goes on; the next one tries again. None and None (the default): every
    version stays.

    ``gate``: a ``ProgressiveValidation`` hook (before this one in the
    hooks) whose gate holds a partition back: no version is written after a
    held partition (nor by time or at the end) until a partition passes;
    each hold is logged and counted in ``held``. ``redis``: a Redis URL
    (``redis://...``, ``redis+cluster://...``) each written version is
    published to (``wuliang.serving.redis.publish``, as ``redis_model``,
    default the export folder's name), for a fleet of replicas that read
    Redis; a folder's replicas follow ``export_dir`` itself.
    """

    chief_only = True  # in a cluster, only the chief acts

    def __init__(
        self,
        export_dir: str | os.PathLike,
        *,
        every_secs: float | None = None,
        every_steps: int | None = None,
        full_every: int | None = None,
        keep_versions: int | None = None,
        keep_bytes: int | None = None,
        every_partition: bool = False,
        gate: Any = None,
        redis: str | None = None,
        redis_model: str | None = None,
    ) -> None:
        if every_steps is None and every_secs is None and not every_partition:
            every_secs = 3600.0
        super().__init__(every_steps, every_secs, every_partition)
        if keep_versions is not None and full_every is not None and keep_versions < full_every:
            raise ValueError(
                f"keep_versions={keep_versions} cannot hold a chain of full_every={full_every} "
                "versions (a full one and its deltas stay whole): keep_versions >= full_every"
            )
        if gate is not None and not callable(getattr(gate, "verdict", None)):
            raise TypeError(f"gate must be a ProgressiveValidation hook, got {gate!r}")
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise ValueError(f"full_every must be an int >= 1 or None, got {full_every!r}")
        for name, value, low in (
            ("keep_versions", keep_versions, 1),
            ("keep_bytes", keep_bytes, 0),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < low
            ):
                raise ValueError(f"{name} must be an int >= {low} or None, got {value!r}")
        self.export_dir = location(export_dir)  # a folder, or a URI of an object store
        if full_every is None and keep_versions is not None:
            full_every = max(1, keep_versions // 2)  # else no chain could ever go
        self.full_every = full_every
        self.keep_versions = keep_versions
        self.keep_bytes = keep_bytes
        if redis is not None and isinstance(self.export_dir, RemotePath):
            raise ValueError(
                f"redis= publishes from a folder; export_dir {export_dir!s} is an object store"
            )
        self.gate = gate
        self.redis = redis
        self.redis_model = redis_model
        self.results: list[Any] = results()
        self.pruned: list[Any] = results()  # PruneResult of each prune
        self.published: list[Any] = results()  # PublishResult of each publish
        self.held = 0  # triggers the gate held back
        self.after_partition: dict[str, int] = {}  # partition -> the version written after it
        self._holding: str | None = None  # why the newest partition is held
        self._full_next = False  # LATEST's chain alone was over the budget

    def trigger(self, session: HookSession) -> None:
        if self.gate is not None:
            if self.partition is not None:
                self._holding = self.gate.verdict(self.partition.name)
            if self._holding is not None:
                self.held += 1
                log.warning("export held back: %s", self._holding)
                return
        kind = "full" if self._full_next else "auto"
        if self.full_every is not None:
            newest = latest(self.export_dir)
            if newest is not None and newest.number % self.full_every == 0:
                kind = "full"
        result = session.export(self.export_dir, kind)
        self.results.append(result)
        if self.partition is not None:
            self.after_partition[self.partition.name] = result.version
            while len(self.after_partition) > KEEP_PARTITIONS:
                del self.after_partition[next(iter(self.after_partition))]
        log.info("%s", result.status())
        if result.written:
            self._trim_removals(session)
        if result.written and self.redis is not None:
            self._publish(session)
        if result.written and (self.keep_versions is not None or self.keep_bytes is not None):
            self._prune(session)

    def _trim_removals(self, session: HookSession) -> None:
        """The servers forget the removals the version just written holds:
        the next delta lists only later ones, and the removal logs stay the
        size of what an export interval removes."""
        newest = latest(self.export_dir)
        if newest is None:
            return
        ps = session.context.ps
        for table in session.context.tables:
            ps.trim_removed(table, newest.engine_version)

    def _publish(self, session: HookSession) -> None:
        assert self.redis is not None
        try:
            published = session.publish(self.export_dir, self.redis, self.redis_model)
        except (OSError, ValueError) as error:  # RedisStoreError is an OSError
            log.error("publishing to %s failed (training goes on): %s", self.redis, error)
            return
        self.published.append(published)
        log.info("%s", published.status())

    def _prune(self, session: HookSession) -> None:
        try:
            pruned = session.prune_exports(self.export_dir, self.keep_versions, self.keep_bytes)
        except (OSError, ValueError) as error:  # CorruptVersionError is a ValueError
            log.error("pruning %s failed (training goes on): %s", self.export_dir, error)
            return
        self.pruned.append(pruned)
        self._full_next = pruned.over_budget
        if not pruned.over_budget:  # prune logged a warning for that
            log.info("%s", pruned.status())
