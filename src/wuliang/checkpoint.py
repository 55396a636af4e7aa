"""Checkpoints: everything a model needs to continue training exactly.

``save(context, tower, model_dir)`` and ``restore(context, tower, path)``
take the model's ``Context`` (parameter server, tables, step) and its
``TowerState`` (``wuliang.tower``); ``Session.save_checkpoint`` and
``restore_checkpoint`` call them.

``model_dir/ckpt-<step>/`` is a version of kind ``checkpoint``
(``wuliang.ps_server.storage``: atomic, every file checksummed):

* every table's rows with optimizer state and metadata (count, last-update
  step and time, version): ``tables/<table>/part-*.arrow``;
* every table's removal log (key, version; ``removed.arrow``), which delta
  exports made from this checkpoint need, and its floor;
* every table's admission counts (key, sightings; ``pending.arrow``) of
  the keys seen but not admitted yet, so that admission resumes exactly;
* the tower's variables and the tower optimizer's state:
  ``dense/model.*`` (``tf.train.Checkpoint`` of the tower, or of the variables
  the traced step captures when the tower is a plain function, and the
  optimizer);
* the tower as a SavedModel for serving (``serving/``, ``wuliang.saved_model``),
  so ``wuliang export`` makes exports from checkpoints alone;
* in the manifest: the global step, the engine version, the reader position
  after the last trained batch (``ReaderPosition``), each table's whole spec
  and the model's features (``model``).

Saving cuts the engine version (``cut_version``): the rows of ``ckpt-<step>``
all carry versions <= its ``engine_version``, and rows changed later carry
higher ones, which is what an incremental export of a later checkpoint
selects. A checkpoint and an export of the same rows (the ``Checkpoint`` and
``IncrementalExport`` hooks at one step, in either order) record the same
``engine_version``, so ``wuliang export`` of that checkpoint finds the hook's
version up to date.
Retention (``keep``, ``keep_daily``; ``rotate``, its rule in
``checkpoints_to_remove``) keeps the newest ``keep`` checkpoints by step and,
with ``keep_daily=D``, the newest checkpoint (by the ``created`` time its
manifest records) of each of the D most recent UTC days that have one; the
checkpoint just written is never removed. Removal renames an old checkpoint
to a ``.tmp-`` name before deleting its files, so a crash meanwhile never
leaves a listed checkpoint with files missing.

``model_dir`` may be a URI of an object store (``s3://bucket/prefix``):
the checkpoint's files are uploaded whole and its manifest last
(``wuliang.ps_server.storage``; TensorFlow's files are written locally
first), rotation deletes an old checkpoint's manifest first, and folders
that crashed writers left without a manifest, older than the newest
checkpoint, go with the rotation.

Restoring verifies every file first (a corrupt checkpoint changes nothing),
replaces each table's rows (the engine's shard count may differ from the
writer's: rows are re-partitioned by key), sets the step and the version,
and restores the dense state at the next step, once the step function is
traced (so its variables exist).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from wuliang import resize
from wuliang.dense import STATE_TABLE, TOWER_TABLE
from wuliang.ps_server import TableSpec
from wuliang.ps_server.storage import (
    CHECKPOINT_PREFIX,
    MANIFEST,
    SERVING,
    CorruptVersionError,
    Location,
    RemotePath,
    Version,
    VersionWriter,
    checkpoints,
    latest_checkpoint,
    location,
    remove_version,
    uncommitted_checkpoints,
)
from wuliang.saved_model import quiet_tensorflow
from wuliang.tower import DENSE_PREFIX, TowerState

TOWER_TABLES = (TOWER_TABLE, STATE_TABLE)
log = logging.getLogger("wuliang.checkpoint")

__all__ = [
    "checkpoints",
    "checkpoints_to_remove",
    "cut_version",
    "latest_checkpoint",
    "restore",
    "rotate",
    "save",
]

if TYPE_CHECKING:
    from wuliang.context import Context
    from wuliang.ps_server import ParameterServer


def cut_version(engine: ParameterServer) -> int:
    """The engine version that a snapshot of the rows taken now stands for
    (checkpoints and exports record it as ``engine_version``); rows changed
    later carry higher versions.

    Normally the current version, and a new one is started. When no row and
    no removal carries the current version (nothing changed since the last
    cut, e.g. a checkpoint and an export at the same step, or right after a
    restore), the previous version already stands for these rows: it is
    returned and no version is started, so snapshots of the same rows record
    the same version whoever takes them. Call with the engine in sync.
    """
    current = engine.version
    previous = current - 1
    if previous >= 1 and all(_unchanged_since(engine, t, previous) for t in engine.tables()):
        return previous
    engine.advance_version()
    return current


def _unchanged_since(engine: ParameterServer, table: str, version: int) -> bool:
    """Whether no row of table was changed or removed after version (False
    when the engine's logs no longer reach back that far)."""
    stats = engine.stats(table)
    if stats["change_floor"] > version or stats["removed_floor"] > version:
        return False
    if len(engine.removed_keys(table, since=version)):
        return False
    return next(iter(engine.export(table, since=version, chunk_rows=1)), None) is None


def save(
    context: Context,
    tower: TowerState,
    model_dir: str | os.PathLike | RemotePath,
    position: Any = None,
    keep: int | None = 5,
    keep_daily: int | None = None,
) -> Location:
    """Writes ``model_dir/ckpt-<global step>``, then applies the retention
    rules (``rotate``): the newest ``keep`` checkpoints stay (None: every
    checkpoint), and with ``keep_daily=D`` the newest one of each of the D
    most recent UTC days that have a checkpoint too; never the one just
    written goes.

    Call when the parameter server is in sync with the step (every push
    applied, no pull ahead): ``Session.save_checkpoint`` and the
    ``Checkpoint`` hook do. A checkpoint of the same step already there is
    kept as is (and nothing is rotated). ``position``: the reader position
    to resume at.
    """
    _check_retention(keep, keep_daily)
    ps = context.ps
    step = context.global_step
    final = location(model_dir) / f"{CHECKPOINT_PREFIX}{step}"
    if (final / MANIFEST).is_file():
        return final
    version = cut_version(ps)  # later changes: versions above every row saved here
    job = context.job
    positions = None if job is None else job.positions()  # every trainer's, in a cluster
    with VersionWriter(model_dir, final.name, "checkpoint") as writer:
        for name in [*context.tables, *context.tower_tables]:  # each server writes its parts
            spec = ps.spec(name)
            files, rows = ps.write_rows(writer.dir, spec, state=True)
            writer.record_table(spec, files, rows, state=True)
            keys, versions = ps.removed_log(name)
            writer.write_removed(name, keys, versions, ps.stats(name)["removed_floor"])
            writer.write_pending(name, *ps.pending_counts(name))
        restored = tower.restored_version()
        if restored is None:
            with quiet_tensorflow():  # TensorFlow's INFO lines of every write
                tower.checkpoint().write(str(writer.path(DENSE_PREFIX)))
            writer.add_tree("dense")
            tower.write_saved_model(writer.path(SERVING))
            writer.add_tree(SERVING)
        else:  # no step since a restore: the tower is still that checkpoint's
            restored.link_tree("dense", writer)
            restored.link_tree(SERVING, writer)
        path = writer.commit(
            step=step,
            engine_version=version,
            reader_position=None if position is None else position.to_dict(),
            num_shards=context.num_shards,
            model=tower.model_description(),
            trainer_positions=positions or None,
        )
    if restored is not None:  # the restored one may be rotated out below
        tower.schedule_restore(Version(path))
    if keep is not None:
        rotate(model_dir, keep, keep_daily, written=step)
    return path


def _check_retention(keep: int | None, keep_daily: int | None) -> None:
    for name, value in (("keep", keep), ("keep_daily", keep_daily)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


def checkpoints_to_remove(
    found: Sequence[tuple[int, float]],
    keep: int | None,
    keep_daily: int | None = None,
    written: int | None = None,
) -> list[int]:
    """The steps of the checkpoints that retention removes, oldest first.

    ``found``: (step, write time as a unix time: the manifest's ``created``)
    of every checkpoint, in any order. Kept: the newest ``keep`` by step
    (``keep=None``: every checkpoint, nothing is removed); with
    ``keep_daily=D``, also the newest checkpoint (latest time; the higher
    step on a tie) of each of the D most recent UTC days that have a
    checkpoint (days without one do not count); and ``written``, the
    checkpoint just written, whatever its step or time. A pure function.
    """
    _check_retention(keep, keep_daily)
    if keep is None:
        return []
    steps = sorted({step for step, _ in found})
    kept = set(steps[-keep:])
    if keep_daily is not None:
        newest_of_day: dict[datetime.date, tuple[float, int]] = {}
        for step, created in found:
            day = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).date()
            if day not in newest_of_day or (created, step) > newest_of_day[day]:
                newest_of_day[day] = (created, step)
        for day in sorted(newest_of_day)[-keep_daily:]:
            kept.add(newest_of_day[day][1])
    if written is not None:
        kept.add(written)
    return [step for step in steps if step not in kept]


def rotate(
    model_dir: str | os.PathLike | RemotePath,
    keep: int | None = 5,
    keep_daily: int | None = None,
    *,
    written: int | None = None,
) -> list[Location]:
    """Removes the checkpoints of model_dir that the retention rules
    (``checkpoints_to_remove``) do not keep; returns them. ``written``: the
    step of the checkpoint just written (kept whatever the rules say).
    ``save`` calls it; call it after ``Session.save_checkpoint(...,
    keep=None)`` to apply ``keep_daily`` to a checkpoint saved by hand.

    Each is renamed out of sight before its files go (in an object store:
    its manifest is deleted first), so a crash leaves no listed checkpoint
    with files missing. With ``keep_daily``, each checkpoint's manifest is
    read for its time (one that cannot be read counts as written at time
    0). In an object store, folders that crashed writers left without a
    manifest, older than the newest checkpoint, go too.
    """
    _check_retention(keep, keep_daily)
    if keep is None:
        return []
    found = checkpoints(model_dir)
    paths = dict(found)
    times = [(step, _created(path) if keep_daily else 0.0) for step, path in found]
    removed = [paths[step] for step in checkpoints_to_remove(times, keep, keep_daily, written)]
    for old in removed:
        remove_version(old, "checkpoint-rotate")
    root = location(model_dir)
    if isinstance(root, RemotePath) and found:  # what crashed writers left there
        newest = max(step for step, _ in found)
        for older, stale in uncommitted_checkpoints(root):
            if older < newest:
                stale.rmtree()
    return removed


def _created(path: Location) -> float:
    """When a checkpoint was written (its manifest's ``created``); 0 when
    the manifest cannot be read (removed meanwhile, damaged)."""
    try:
        return Version(path).manifest.created
    except (CorruptVersionError, OSError, ValueError):
        return 0.0


def _migrating(context: Context, version: Version) -> dict[str, list[TableSpec]]:
    """Per table of the model whose blocks the checkpoint holds with other
    sizes (``wuliang.resize``): the saved blocks. A fixed table saved with
    another dim than the model's fixed one is not migrated: refused by name."""
    saved = {name: entry.spec for name, entry in version.tables.items()}
    out = {}
    for name, table in context.tables.items():
        if table.grow is not None:
            continue  # a block: with its base
        declared = (context.sized.get(name) or table).blocks()
        family = resize.family(saved, name)
        sized = len(family) > 1 or name in context.sized  # fixed to fixed: checked below
        if family and sized and not resize.same_family(family, declared):
            if family[0].name != name:
                raise ValueError(
                    f"checkpoint {version.path}: table {name!r} has blocks "
                    f"{', '.join(s.name for s in family)} but no base block {name!r}"
                )
            out[name] = family
    return out


def _sizes_text(specs: list[TableSpec]) -> str:
    """A table's sizes, as its blocks' columns add up: ``"4, 32"``."""
    total, sizes = 0, []
    for spec in specs:
        total += spec.dim
        sizes.append(str(total))
    return f"sizes ({', '.join(sizes)})"


def restore(
    context: Context, tower: TowerState, path: str | os.PathLike | RemotePath
) -> dict[str, Any] | None:
    """Restores a checkpoint into the model; returns its reader position
    (a dict, or None). The tower's state follows at the next step."""
    version = Version(path)
    path = version.path  # messages name a URI without its query
    if version.kind != "checkpoint":
        raise ValueError(f"{path} is a {version.kind} export, not a checkpoint")
    ps = context.ps
    tables = {name: table.spec() for name, table in context.tables.items()}
    tables.update(context.tower_tables)
    migrating = _migrating(context, version)  # tables saved with other sizes
    moved = {spec.name for saved in migrating.values() for spec in saved}
    for name, saved in version.tables.items():
        if name in TOWER_TABLES and name not in tables:
            continue  # a cluster's shared tower: here its dense/ variables restore it
        if name in moved:
            continue
        if name not in tables:
            raise ValueError(
                f"checkpoint {path} has table {name!r}, which this model does not "
                f"(tables: {', '.join(sorted(context.tables)) or 'none'})"
            )
        spec = ps.spec(name)
        if (saved.dim, saved.state_dim) != (spec.dim, spec.state_dim):
            raise ValueError(
                f"checkpoint {path}: table {name!r} has dim {saved.dim} and "
                f"{saved.state_dim} optimizer state floats; the model's has "
                f"{spec.dim} and {spec.state_dim}"
            )
    version.verify()  # every file, before changing anything
    step = version.step
    for name in reversed(tables):  # a sized table's extension blocks before their base
        ps.drop_table(name)
    for name, spec in tables.items():
        ps.create_table(spec)
        if name in moved or (spec.grow is not None and spec.grow.base in migrating):
            continue  # loaded below
        if name in version.tables:  # the files verified: the server reads them as they are
            ps.load_rows(version.path, name, version.part_files(name), step=step)
            keys, versions = version.removed_log(name)
            ps.load_removed(name, keys, versions, version.tables[name].removed_floor)
            ps.load_pending(name, *version.pending_counts(name))
    for name, saved in migrating.items():
        declared = context.sized.get(name) or context.tables[name]
        now = [b.spec() for b in declared.blocks()]
        log.info("checkpoint %s: table %r saved as %s, restored as %s by its rule", path, name,
                 _sizes_text(saved), _sizes_text(now))  # fmt: skip
        resize.migrate(ps, version, saved, declared)
        if name in version.tables:
            ps.load_pending(name, *version.pending_counts(name))
    context.global_step = step
    ps.restore_version(version.engine_version + 1)
    if version.model is not None:  # how the features' strings hash, for later exports
        tower.hash_fields.update(
            {f.name: f.hash_field for f in version.model.sparse if f.hash_field}
        )
    tower.schedule_restore(version)
    if context.job is not None:  # the job's step and every trainer's position, on the board
        context.job.call(floor=step)
        context.job.put_positions(dict(version.manifest.trainer_positions or {}))
    position = version.manifest.reader_position
    return None if position is None else dict(position)
