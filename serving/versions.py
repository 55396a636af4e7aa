"""The model store's read side: the versions of an export directory, and
loading them into an engine.

``wuliang.export`` writes an export directory (its module docstring has the
layout): numbered versions, each a ``wuliang.storage`` directory of kind
``full`` or ``delta`` (a delta names its ``parent``), and ``LATEST``, the
newest version's name, written last::

    export_dir/  LATEST -> 3     1/ full     2/ delta of 1     3/ delta of 2

Serving a version means applying its chain, base first: the full version it
rests on, then each delta on top (``chain``, ``apply_chain``). A full
version replaces its tables; a delta replaces or adds its rows and removes
the keys it removed, each table switched atomically for concurrent readers
(``ParameterServer.apply_update``). Each version's files are checked
(sha256) before that version changes the server.

Design: this module only reads. It depends on the on-disk format
(``wuliang.storage``) and the parameter server (``wuliang.ps_server``), never on the
export writer or TensorFlow, so an online server imports it alone; the
writer (``wuliang.export``) imports it to find the newest version and to
compact a chain, and re-exports its names.
"""

from __future__ import annotations

import os
from pathlib import Path

from wuliang.ps_server import SGD, ParameterServer, TableSpec, TableUpdate, Zeros
from wuliang.ps_server.spec import Precision, initializer_from_dict
from wuliang.storage import CorruptVersionError, Version

__all__ = ["LATEST", "apply", "apply_chain", "chain", "latest", "versions"]

LATEST = "LATEST"  # file of an export directory naming its newest version


def versions(export_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(version, path) of the committed versions in export_dir, oldest first.

    A missing export_dir has none. A version is committed once its folder
    (named by its number) holds ``manifest.json``.
    """
    root = Path(export_dir)
    if not root.is_dir():
        return []
    found = [
        (int(p.name), p)
        for p in root.iterdir()
        if p.name.isdigit() and (p / "manifest.json").is_file()
    ]
    return sorted(found)


def latest(export_dir: str | os.PathLike) -> Version | None:
    """The newest committed version (whatever LATEST says), or None."""
    found = versions(export_dir)
    return Version(found[-1][1]) if found else None


def chain(export_dir: str | os.PathLike, version: int | None = None) -> list[Version]:
    """The versions to apply for ``version`` (default: LATEST), base first:
    a full version and the deltas on top of it.

    Without LATEST (a writer crashed before setting it) the newest committed
    version is used.

    Raises:
        FileNotFoundError: export_dir holds no version.
        CorruptVersionError: LATEST names no version, or a version of the
            chain is missing.
    """
    root = Path(export_dir)
    if version is None:
        try:
            version = int((root / LATEST).read_text().strip())
        except FileNotFoundError:
            newest = latest(root)
            if newest is None:
                raise FileNotFoundError(f"{root} has no export") from None
            version = int(newest["version"])
        except ValueError:
            raise CorruptVersionError(f"{root / LATEST} does not name a version") from None
    out: list[Version] = []
    current: int | None = version
    while current is not None:
        path = root / str(current)
        if not (path / "manifest.json").is_file():
            wanted_by = f" (the parent of {out[-1].path.name})" if out else ""
            raise CorruptVersionError(f"export version {path}{wanted_by} is missing")
        v = Version(path)
        out.append(v)
        current = v.get("parent")
    return out[::-1]


def apply(ps: ParameterServer, version: Version, precision: Precision = "fp32") -> None:
    """Applies one version to a parameter server, atomically per table for
    concurrent readers (``ParameterServer.apply_update``; lookups then report
    the version's number): a full version
    replaces each of its tables, a delta replaces or adds its rows and
    removes its keys. Tables the server lacks are created (SGD, zero
    initializer: serving does not train) with ``precision`` (``"fp32"``,
    ``"fp16"`` or ``"int8"``, see ``TableSpec``); existing tables keep
    theirs. Every file is checked before anything changes.

    Raises:
        CorruptVersionError: a file of the version is missing or damaged.
        ValueError: a table's dim differs from the server's table of that name.
    """
    version.verify()
    tables = ps.tables()
    for table, info in version.tables.items():
        if table in tables and ps.spec(table).dim != info["dim"]:
            raise ValueError(
                f"{version.path}: table {table!r} has dim {info['dim']}, "
                f"the engine's has {ps.spec(table).dim}"
            )
    full = version.kind == "full"
    updates = {
        table: TableUpdate(
            ps.spec(table) if table in tables else serving_spec(table, info, precision),
            full=full,
            rows=version.read_rows(table, verified=True),
            removed=None if full else version.removed_keys(table, verified=True),
        )
        for table, info in version.tables.items()
    }
    ps.apply_update(updates, label=int(version["version"]))


def serving_spec(table: str, info: dict, precision: Precision = "fp32") -> TableSpec:
    """The spec of a served table from its manifest entry: a serving table
    (``TableSpec.serving``: changed by version applies only, lookups on the
    caller's thread), SGD, and the training table's initializer and seed when the
    version records them, so keys never trained can read as their initial
    vectors (``lookup(missing="initial")``); zeros otherwise. ``precision``:
    how the served vectors are stored (``TableSpec.precision``)."""
    initializer = Zeros()
    if "initializer" in info:
        initializer = initializer_from_dict(info["initializer"])
    return TableSpec(
        table,
        info["dim"],
        optimizer=SGD(),
        initializer=initializer,
        seed=int(info.get("seed", 0)),
        serving=True,
        precision=precision,
    )


def apply_chain(
    ps: ParameterServer,
    export_dir: str | os.PathLike,
    version: int | None = None,
    precision: Precision = "fp32",
) -> list[Version]:
    """Applies the chain of ``version`` (default LATEST) to a parameter
    server, version by version; returns it. ``precision``: of the tables it
    creates (see ``apply``)."""
    versions_ = chain(export_dir, version)
    for v in versions_:
        apply(ps, v, precision)
    return versions_
