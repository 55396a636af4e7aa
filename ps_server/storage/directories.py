"""Directories of versions: a model directory's checkpoints and an export
directory's chain of full and delta versions.

::

    model_dir/    ckpt-1200/  ckpt-1800/  ...         (checkpoints, by step)
    export_dir/   LATEST -> 3   1/ full   2/ delta of 1   3/ delta of 2

A version is committed once its folder holds ``manifest.json`` (the last
thing written, before the rename); anything else in these folders (a
``.tmp-`` left by a crash, a lock file) is not a version. ``LATEST`` names
an export directory's newest version and is written after it, so it may lag
after a crash: readers fall back to the newest committed version.

Each directory may be a local path or a URI of an object store
(``location``); there a version's folder may exist without its manifest
(written last: a writer at work or crashed, a checkpoint being removed),
and is not a version either.
"""

from __future__ import annotations

import os
import re

from wuliang.ps_server.storage.location import Location, RemotePath, location
from wuliang.ps_server.storage.manifest import CorruptVersionError
from wuliang.ps_server.storage.version import MANIFEST, Version

CHECKPOINT_PREFIX = "ckpt-"
_CHECKPOINT = re.compile(r"ckpt-(\d+)")


Dir = str | os.PathLike | RemotePath


def checkpoints(model_dir: Dir) -> list[tuple[int, Location]]:
    """(step, path) of the committed checkpoints in model_dir, oldest first."""
    return [(step, p) for step, p, committed in _checkpoint_folders(model_dir) if committed]


def uncommitted_checkpoints(model_dir: Dir) -> list[tuple[int, Location]]:
    """(step, path) of the ``ckpt-<step>`` folders without a manifest: in an
    object store, what a writer is writing, or a crashed one left."""
    return [(step, p) for step, p, committed in _checkpoint_folders(model_dir) if not committed]


def _checkpoint_folders(model_dir: Dir) -> list[tuple[int, Location, bool]]:
    root = location(model_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CHECKPOINT.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), p, (p / MANIFEST).is_file()))
    return sorted(found, key=lambda f: f[0])


def latest_checkpoint(model_dir: Dir) -> Location | None:
    """The newest committed checkpoint of model_dir, or None."""
    found = checkpoints(model_dir)
    return found[-1][1] if found else None


LATEST = "LATEST"  # file of an export directory naming its newest version


def versions(export_dir: Dir) -> list[tuple[int, Location]]:
    """(version, path) of the committed versions in export_dir, oldest first.

    A missing export_dir has none. A version is committed once its folder
    (named by its number) holds ``manifest.json``.
    """
    root = location(export_dir)
    if not root.is_dir():
        return []
    found = [
        (int(p.name), p) for p in root.iterdir() if p.name.isdigit() and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda f: f[0])


def latest(export_dir: Dir) -> Version | None:
    """The newest committed version (whatever LATEST says), or None."""
    found = versions(export_dir)
    return Version(found[-1][1]) if found else None


def chain(export_dir: Dir, version: int | None = None) -> list[Version]:
    """The versions to apply for ``version`` (default: LATEST), base first:
    a full version and the deltas on top of it.

    Without LATEST (a writer crashed before setting it) the newest committed
    version is used.

    Raises:
        FileNotFoundError: export_dir holds no version.
        CorruptVersionError: LATEST names no version, or a version of the
            chain is missing.
    """
    root = location(export_dir)
    if version is None:
        try:
            version = int((root / LATEST).read_text().strip())
        except FileNotFoundError:
            newest = latest(root)
            if newest is None:
                raise FileNotFoundError(f"{root} has no export") from None
            version = newest.number
        except ValueError:
            raise CorruptVersionError(f"{root / LATEST} does not name a version") from None
    out: list[Version] = []
    current: int | None = version
    while current is not None:
        path = root / str(current)
        if not (path / MANIFEST).is_file():
            wanted_by = f" (the parent of {out[-1].path.name})" if out else ""
            raise CorruptVersionError(f"export version {path}{wanted_by} is missing")
        v = Version(path)
        out.append(v)
        current = v.parent
    return out[::-1]
