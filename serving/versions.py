"""Applying an export directory's versions to a parameter server.

``wuliang.export`` writes an export directory: numbered versions of kind
``full`` or ``delta`` (a delta names its ``parent``) and ``LATEST``
(``wuliang.ps_server.storage.directories`` lists them and finds a version's
chain)::

    export_dir/  LATEST -> 3     1/ full     2/ delta of 1     3/ delta of 2

Serving a version means applying its chain, base first: the full version it
rests on, then each delta on top (``apply_chain``). A full
version replaces its tables; a delta replaces or adds its rows and removes
the keys it removed, each table switched atomically for concurrent readers
(``ParameterServer.apply_update``). Each version's files are checked
(sha256, once per ``Version`` object) before that version changes the server.

Design: this module only reads. It depends on the parameter server and its
on-disk format (``wuliang.ps_server``, ``wuliang.ps_server.storage``), never
on the export writer or TensorFlow, so an online server imports it alone;
the writer (``wuliang.export``) imports it to compact a chain.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from wuliang.ps_server import (
    SGD,
    Admission,
    Eviction,
    ParameterServer,
    RowChunk,
    TableSpec,
    TableUpdate,
)
from wuliang.ps_server.spec import Precision
from wuliang.ps_server.storage import TableEntry, Version, chain

__all__ = ["apply", "apply_chain", "serving_spec"]


def apply(
    ps: ParameterServer,
    version: Version,
    precision: Precision = "fp32",
    touched: Callable[[str, np.ndarray], None] | None = None,
) -> None:
    """Applies one version to a parameter server, atomically per table for
    concurrent readers (``ParameterServer.apply_update``; lookups then report
    the version's number): a full version
    replaces each of its tables, a delta replaces or adds its rows and
    removes its keys. Tables the server lacks are created (SGD, zero
    initializer: serving does not train) with ``precision`` (``"fp32"``,
    ``"fp16"`` or ``"int8"``, see ``TableSpec``); existing tables keep
    theirs. Every file is checked before anything changes. ``touched``, when
    given, is called with (table, keys) for the keys each table's rows write
    and for the keys it removes, as they are staged (the serving device cache
    rereads those it holds).

    Raises:
        CorruptVersionError: a file of the version is missing or damaged.
        ValueError: a table's dim differs from the server's table of that name.
    """
    version.verify()  # once per Version: reading its rows below checks nothing again
    tables = ps.tables()
    for table, entry in version.tables.items():
        if table in tables and ps.spec(table).dim != entry.dim:
            raise ValueError(
                f"{version.path}: table {table!r} has dim {entry.dim}, "
                f"the engine's has {ps.spec(table).dim}"
            )
    full = version.kind == "full"
    updates = {}
    for table, entry in version.tables.items():
        rows: Iterable[RowChunk] = version.read_rows(table)
        removed = None if full else version.removed_keys(table)
        if touched is not None:
            rows = _telling(table, rows, touched)
            if removed is not None and len(removed):
                touched(table, np.asarray(removed, np.uint64))
        updates[table] = TableUpdate(
            ps.spec(table) if table in tables else serving_spec(entry, precision),
            full=full,
            rows=rows,
            removed=removed,
        )
    ps.apply_update(updates, label=version.number)


def _telling(
    table: str, rows: Iterable[RowChunk], touched: Callable[[str, np.ndarray], None]
) -> Iterator[RowChunk]:
    """``rows``, each chunk's keys told to ``touched`` as it is staged."""
    for chunk in rows:
        touched(table, np.asarray(chunk.keys, np.uint64))
        yield chunk


def serving_spec(entry: TableEntry, precision: Precision = "fp32") -> TableSpec:
    """The spec of a served table from its manifest entry: the training
    table's dim, initializer and seed (keys never trained read as their
    initial vectors with ``lookup(missing="initial")``), as a serving table
    (``TableSpec.serving``: changed by version applies only, lookups on the
    caller's thread) without the training lifecycle: SGD, no admission,
    eviction or reserve. ``precision``: how the served vectors are stored
    (``TableSpec.precision``)."""
    return dataclasses.replace(
        entry.spec,
        optimizer=SGD(),
        admission=Admission(),
        eviction=Eviction(),
        reserve_rows=0,
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
