"""Restoring a table saved with other sizes: the keys' vectors migrated by
the declared table's rule.

A sized table is its blocks on the server (``EmbeddingTable.blocks``): the
base (the table's name, the first size) and ``<name>@<size>`` blocks. When a
checkpoint holds a table's blocks with other sizes than the model declares
(or holds it fixed where it is now sized, or the reverse), ``restore`` calls
``migrate``:

1. every saved block's rows are read and each key's vector put back
   together: its saved size's columns, zeros past them; its optimizer state
   likewise, per coordinate (the optimizer must be of the same kind, else
   the state starts afresh);
2. each key's new size follows the declared rule on its base row's
   statistics decayed to the checkpoint's step: the largest size whose
   ``promote`` its score reaches, or a larger one it had already reached
   while its score is at least that size's ``demote`` (the hysteresis of
   training); a fixed table keeps every key at its dim;
3. the declared blocks are loaded with those columns (truncated, or zeros
   with the optimizer's initial state for columns never trained) and the
   base row's counts, steps and times; shows and clicks stay on the base.

The migrated blocks' removal logs start at the checkpoint (a delta export
from an earlier version scans rather than lists removals).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from wuliang.embedding.features import SIZE_MARK, EmbeddingTable
from wuliang.ps_server import Engine, ParameterServer, TableSpec
from wuliang.ps_server.chunk import stats_decay
from wuliang.ps_server.storage import Version

__all__ = ["family", "migrate", "same_family"]


def family(specs: Mapping[str, TableSpec], name: str) -> list[TableSpec]:
    """The table's spec and its blocks' (``grow.base == name``), in column order."""
    blocks = [s for s in specs.values() if s.grow is not None and s.grow.base == name]
    blocks.sort(key=lambda s: int(s.name.rsplit(SIZE_MARK, 1)[-1]))
    return [specs[name], *blocks] if name in specs else blocks


def same_family(saved: list[TableSpec], declared: list[EmbeddingTable]) -> bool:
    """Whether the saved blocks are the declared ones (names, dims, state)."""
    specs = [t.spec() for t in declared]
    return [(s.name, s.dim, s.state_dim) for s in saved] == [
        (s.name, s.dim, s.state_dim) for s in specs
    ]


@dataclass
class _Rows:
    """A table's keys with their whole vectors and per-row columns."""

    keys: np.ndarray  # uint64 [n], sorted
    weights: np.ndarray  # float32 [n, width]
    segments: list[np.ndarray]  # per-coordinate optimizer state, each [n, width]
    scalars: np.ndarray  # float32 [n, b]: the rest of the state
    size: np.ndarray  # int64 [n]: the columns each key had
    counts: np.ndarray
    steps: np.ndarray
    times: np.ndarray
    shows: np.ndarray
    clicks: np.ndarray


def _state_shape(spec: TableSpec) -> tuple[int, int]:
    """(per-coordinate segments a, scalars b): state_dim = a * dim + b."""
    one = TableSpec("x", 1, optimizer=spec.optimizer).state_dim
    two = TableSpec("x", 2, optimizer=spec.optimizer).state_dim
    return two - one, 2 * one - two


def _initial_state(spec: TableSpec) -> np.ndarray:
    """The optimizer's initial state of a row of dim 1 (segments, then scalars)."""
    with Engine(1) as engine:
        engine.create_table(TableSpec("x", 1, optimizer=spec.optimizer))
        engine.load("x", np.zeros(1, np.uint64), np.zeros((1, 1), np.float32))
        (chunk,) = list(engine.export("x"))
    return chunk.state[0]


def _read(version: Version, saved: list[TableSpec]) -> _Rows:
    """Every key of the saved base with its blocks' columns put together."""
    base = saved[0]
    chunks = list(version.read_rows(base.name))
    keys = np.concatenate([c.keys for c in chunks]) if chunks else np.zeros(0, np.uint64)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]

    def column(name: str, dtype: type) -> np.ndarray:
        if not chunks:
            return np.zeros(0, dtype)
        return np.concatenate([getattr(c, name) for c in chunks])[order]

    width = sum(s.dim for s in saved)
    a, b = _state_shape(base)
    n = len(keys)
    rows = _Rows(
        keys=keys,
        weights=np.zeros((n, width), np.float32),
        segments=[np.zeros((n, width), np.float32) for _ in range(a)],
        scalars=np.zeros((n, b), np.float32),
        size=np.full(n, base.dim, np.int64),
        counts=column("counts", np.uint32),
        steps=column("steps", np.uint64),
        times=column("times", np.uint32),
        shows=column("shows", np.float32),
        clicks=column("clicks", np.float32),
    )
    weights = column("weights", np.float32).reshape(n, base.dim)
    state = column("state", np.float32).reshape(n, base.state_dim)
    _put(rows, slice(None), 0, base.dim, weights, state)
    rows.scalars[:] = state[:, a * base.dim :]
    start = base.dim
    for spec in saved[1:]:
        for chunk in version.read_rows(spec.name):
            at = np.searchsorted(keys, chunk.keys)
            mine = (at < n) & (keys[np.minimum(at, n - 1)] == chunk.keys)
            _put(rows, at[mine], start, spec.dim, chunk.weights[mine], chunk.state[mine])
            rows.size[at[mine]] = start + spec.dim
        start += spec.dim
    return rows


def _put(rows: _Rows, at: slice | np.ndarray, start: int, dim: int, weights: np.ndarray,
         state: np.ndarray) -> None:  # fmt: skip
    """A block's weights and per-coordinate state into columns [start, start
    + dim) of the rows ``at``."""
    rows.weights[at, start : start + dim] = weights
    for j, segment in enumerate(rows.segments):
        segment[at, start : start + dim] = state[:, j * dim : (j + 1) * dim]


def _new_sizes(rows: _Rows, table: EmbeddingTable, step: int) -> np.ndarray:
    """Each key's columns under the declared rule (see the module docstring)."""
    sizes = table.sizes
    if sizes is None:
        return np.full(len(rows.keys), table.dim, np.int64)
    assert sizes.demote is not None
    factor = stats_decay(rows.steps, table.stats_half_life, step)
    score = (rows.shows + sizes.click_weight * rows.clicks) * factor
    out = np.full(len(rows.keys), sizes.dims[0], np.int64)
    for i in range(1, len(sizes.dims)):
        reached = score >= sizes.promote[i - 1]
        kept = (rows.size >= sizes.dims[i]) & (score >= sizes.demote[i - 1])
        out[reached | kept] = sizes.dims[i]
    return out


def migrate(
    ps: ParameterServer, version: Version, saved: list[TableSpec], table: EmbeddingTable
) -> None:
    """Loads the checkpoint's rows of ``saved`` (a table's blocks as saved)
    into the declared table's blocks (created, empty) by its rule."""
    step = version.step
    rows = _read(version, saved)
    size = _new_sizes(rows, table, step)
    blocks = table.blocks()
    same_optimizer = type(saved[0].optimizer) is type(blocks[0].optimizer)
    if same_optimizer:  # the blocks share the table's optimizer
        initial = _initial_state(blocks[0].spec())
        a, _ = _state_shape(blocks[0].spec())
    width = rows.weights.shape[1]
    start = 0
    for i, block in enumerate(blocks):
        spec = block.spec()
        stop = start + spec.dim
        take = size >= stop if i else np.ones(len(rows.keys), bool)
        keys = rows.keys[take]
        have = max(0, min(stop, width) - start)
        weights = _padded(rows.weights[take, start : start + have], spec.dim)
        state = None
        if same_optimizer:
            # the columns each key had trained in this block; the others start afresh
            trained = np.arange(spec.dim)[None, :] < (rows.size[take] - start)[:, None]
            parts = [
                np.where(
                    trained, _padded(segment[take, start : start + have], spec.dim), initial[j]
                )
                for j, segment in enumerate(rows.segments)
            ]
            scalars = rows.scalars[take] if i == 0 else np.tile(initial[a:], (len(keys), 1))
            state = np.ascontiguousarray(np.concatenate([*parts, scalars], axis=1), np.float32)
        base = i == 0
        ps.load(
            spec.name,
            keys,
            weights,
            state,
            counts=rows.counts[take],
            steps=rows.steps[take],
            times=rows.times[take],
            shows=rows.shows[take] if base else None,
            clicks=rows.clicks[take] if base else None,
            step=step,
        )
        ps.load_removed(spec.name, np.zeros(0, np.uint64), np.zeros(0, np.uint64),
                        version.engine_version)  # fmt: skip
        start = stop


def _padded(values: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(values), width), np.float32)
    out[:, : values.shape[1]] = values
    return out
