"""The model store's read side: the versions of an export directory, and
loading them into an engine.

``wuliang.export`` writes an export directory (its module docstring has the
layout): numbered versions, each a ``wuliang.storage`` directory of kind
``full`` or ``delta`` (a delta names its ``parent``), and ``LATEST``, the
newest version's name, written last::

    export_dir/  LATEST -> 3     1/ full     2/ delta of 1     3/ delta of 2

Serving a version means applying its chain, base first: the full version it
rests on, then each delta on top (``chain``, ``apply_chain``). A full
version replaces its tables; a delta erases the keys it removed, then loads
its rows. Each version's files are checked (sha256) before that version
changes the engine.

Design: this module only reads. It depends on the on-disk format
(``wuliang.storage``) and the engine (``wuliang.ps_server``), never on the
export writer or TensorFlow, so an online server imports it alone; the
writer (``wuliang.export``) imports it to find the newest version and to
compact a chain, and re-exports its names.
"""

from __future__ import annotations

import os
from pathlib import Path

from wuliang.ps_server import SGD, Engine, TableSpec, Zeros
from wuliang.storage import CorruptVersionError, Version, load_args

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


def apply(engine: Engine, version: Version) -> None:
    """Applies one version to engine: a full one replaces each of its tables,
    a delta removes its keys and loads its rows. Tables the engine lacks are
    created (SGD, zero initializer: serving does not train). Every file is
    checked before anything changes.

    Raises:
        CorruptVersionError: a file of the version is missing or damaged.
        ValueError: a table's dim differs from the engine's table of that name.
    """
    version.verify()
    for table, info in version.tables.items():
        if table in engine.tables() and engine.spec(table).dim != info["dim"]:
            raise ValueError(
                f"{version.path}: table {table!r} has dim {info['dim']}, "
                f"the engine's has {engine.spec(table).dim}"
            )
    for table, info in version.tables.items():
        if version.kind == "full" and table in engine.tables():
            spec = engine.spec(table)
            engine.drop_table(table)
            engine.create_table(spec)
        elif table not in engine.tables():
            engine.create_table(TableSpec(table, info["dim"], optimizer=SGD(), initializer=Zeros()))
        gone = version.removed_keys(table, verified=True)
        if len(gone):
            engine.erase(table, gone)
        for rows in version.read_rows(table, verified=True):
            args = load_args(rows)
            if engine.spec(table).state_dim == 0:
                args["state"] = None
            engine.load(table, **args)


def apply_chain(
    engine: Engine, export_dir: str | os.PathLike, version: int | None = None
) -> list[Version]:
    """Applies the chain of ``version`` (default LATEST) to engine; returns it."""
    versions_ = chain(export_dir, version)
    for v in versions_:
        apply(engine, v)
    return versions_
