"""The Evict hook: the tables' eviction policies applied during training."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from wuliang.hooks.base import HookSession
from wuliang.hooks.periodic import PeriodicSyncHook, results

log = logging.getLogger("wuliang.evict")

DEFAULT_EVERY_STEPS = 1000


class Evict(PeriodicSyncHook):
    """Applies each table's ``eviction`` policy (``EmbeddingTable(eviction=...)``)
    every ``every_steps`` steps (default 1000) or every ``every_secs`` seconds.

    Eviction runs with the engine in sync after a step (its push applied,
    nothing of later steps pulled): no row is evicted under a step that has
    pulled it, and with a policy in steps (``TTL(steps=...)``, ``MinCount``,
    ``MaxRows``) two runs with the same seeds evict the same rows at the same
    steps. Put it before a ``Checkpoint`` hook that acts on the same steps
    (as the session's own does), so that a checkpoint holds the table as
    evicted and resuming from it is exact. Not at the end of ``train``: each
    eviction scans the tables.

    Args:
        tables: the tables to evict (default: every table of the session
            whose policy evicts anything).
    """

    chief_only = True  # in a cluster, only the chief acts

    def __init__(
        self,
        every_steps: int | None = None,
        every_secs: float | None = None,
        tables: Sequence[str] | None = None,
    ) -> None:
        if every_steps is None and every_secs is None:
            every_steps = DEFAULT_EVERY_STEPS
        super().__init__(every_steps, every_secs)
        self.tables = None if tables is None else list(tables)
        self.results: list[tuple[int, dict[str, dict[str, int]]]] = results()  # (step, per table)

    def after_create_session(self, session: HookSession) -> None:
        known = session.context.tables
        unknown = [t for t in self.tables or () if t not in known]
        if unknown:
            raise ValueError(
                f"Evict: no table {', '.join(map(repr, unknown))} in this context "
                f"(tables: {', '.join(sorted(known)) or 'none'})"
            )
        super().after_create_session(session)

    def trigger(self, session: HookSession) -> None:
        context = session.context
        names = self.tables
        if names is None:
            names = [n for n, t in context.tables.items() if t.evicts]
        step = session.global_step
        evicted = {name: context.ps.evict(name, step=step) for name in names}
        self.results.append((session.global_step, evicted))
        total = sum(r["total"] for r in evicted.values())
        if total:
            per_table = ", ".join(f"{n} {r['total']:,}" for n, r in evicted.items() if r["total"])
            log.info("step %d: evicted %s rows (%s)", session.global_step, f"{total:,}", per_table)

    def end(self, session: HookSession) -> None:
        """Nothing: eviction runs on its schedule only."""
