"""A parameter server that comes back restores its part of the newest checkpoint.

When one server of a job dies and the orchestrator starts it again, the
other servers keep their rows: only the new one goes back, to the newest
checkpoint of the model directory (``wuliang ps --restore DIR``). Meta's
CPR study found such partial recovery costs little model quality, at a
fraction of the cost of rolling the whole cluster back. The server:

1. finds the newest committed checkpoint of ``DIR`` and verifies its files;
2. creates every table of the checkpoint from the spec its manifest records;
3. loads the rows it owns (``server_of(key, N) == i``: server i of N, from
   ``TF_CONFIG`` or ``--server-index``/``--num-servers``), and the removal
   records and admission counts of those keys;
4. raises its version past the checkpoint's.

It then serves; the trainers' clients, which retried meanwhile, go on. The
updates its rows had received since that checkpoint are lost (the log says
from which step it came back). When the client raises it to the job's
version (``advance_version`` raises every server to the highest first),
the server drops the removal records below that version
(``PsService.restore_version``): its log no longer reaches the last export,
so the next export is a full version, as it must be (a delta cannot
describe rows that went back in time). A directory without a checkpoint
restores nothing: a fresh job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from wuliang.ps_server.engine import Engine
from wuliang.ps_server.job import checkpoint_values
from wuliang.ps_server.routing import server_of
from wuliang.ps_server.storage import Version
from wuliang.ps_server.storage.directories import latest_checkpoint

__all__ = ["RestoredPart", "restore_own_part"]

log = logging.getLogger("wuliang.ps")


@dataclass(frozen=True)
class RestoredPart:
    """What a server took back from a checkpoint."""

    path: Path
    step: int
    rows: int
    tables: int


def restore_own_part(
    engine: Engine, model_dir: str | Path, server: int, servers: int
) -> RestoredPart | None:
    """Restores server ``server`` of ``servers``'s part of the newest
    checkpoint of ``model_dir`` into the (empty) engine; None when there is
    no checkpoint."""
    if not 0 <= server < servers:
        raise ValueError(f"server index {server} is not one of {servers} servers")
    path = latest_checkpoint(model_dir)
    if path is None:
        log.info("no checkpoint in %s: starting empty", model_dir)
        return None
    version = Version(path)
    if version.kind != "checkpoint":
        raise ValueError(f"{path} is a {version.kind} export, not a checkpoint")
    version.verify()
    rows = 0
    for name, entry in version.tables.items():
        engine.create_table(entry.spec)
        rows += engine.load_rows(
            version.path,
            name,
            version.part_files(name),
            step=version.step,
            owned=(server, servers),
        )
        keys, versions = version.removed_log(name)
        mine = server_of(keys, servers) == server
        engine.load_removed(name, keys[mine], versions[mine], entry.removed_floor)
        keys, counts = version.pending_counts(name)
        mine = server_of(keys, servers) == server
        engine.load_pending(name, keys[mine], counts[mine])
    engine.restore_version(version.engine_version + 1)
    # the job's step and the trainers' positions, for those that find the board gone back
    engine.job(
        floor=version.step,
        put=checkpoint_values(version.step, version.manifest.trainer_positions),
    )
    part = RestoredPart(version.path, version.step, rows, len(version.tables))
    log.warning(
        "restored server %d of %d from checkpoint %s (step %d): %d rows of %d tables; "
        "updates to them since that step are lost",
        server,
        servers,
        part.path,
        part.step,
        part.rows,
        part.tables,
    )
    return part
