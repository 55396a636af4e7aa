"""What a model's inputs are: embedding tables and the features that use them.

``EmbeddingTable`` names a table of the parameter server (dimension,
optimizer, initializer, admission, eviction, seed). ``SparseFeature`` reads a
sparse column of the batch and looks its keys up in a table, then pools each
row's vectors (``combiner``) or, with ``combiner=None``, keeps them as a
padded sequence ``[B, max_len, dim]`` plus a mask, for attention models.
Several features may share a table. ``DenseFeature`` is a float column (or a
fixed-size list of them) passed to the tower as it is.
"""

from __future__ import annotations

import itertools
from dataclasses import KW_ONLY, dataclass, field, replace

from wuliang.ps_server.spec import (
    Admission,
    Eviction,
    Grow,
    Initializer,
    Optimizer,
    TableSpec,
    Zeros,
    default_initializer,
    default_optimizer,
)

SIZE_MARK = "@"  # a sized table's extension blocks: "<table>@<size>"


@dataclass(frozen=True)
class Sizes:
    """A table whose keys' vectors grow with their evidence (docs/training.md,
    "Embedding sizes").

    A key's vector is ``dims[0]`` floats at first; it grows to ``dims[i]``
    while its row's score (decayed shows plus ``click_weight`` times decayed
    clicks: the table's ``stats_half_life`` and ``stats_label``) is at
    least ``promote[i - 1]``, and shrinks back when the score falls below
    ``demote[i - 1]`` (by the table's periodic evict; default: half of
    ``promote``). A grown key keeps what it learned, its short vector being
    the prefix of the long one; the new part starts at zero with fresh
    optimizer state. The tower sees ``dims[-1]`` floats per key, zeros past
    a key's size. ``initializer``: the new columns' initial values (default
    ``Zeros()``: the tower's input does not jump when a key grows).
    """

    dims: tuple[int, ...]
    promote: tuple[float, ...]
    demote: tuple[float, ...] | None = None
    _: KW_ONLY
    click_weight: float = 0.0
    initializer: Initializer = field(default_factory=Zeros)

    def __post_init__(self) -> None:
        dims, promote = tuple(self.dims), tuple(self.promote)
        demote = tuple(p / 2 for p in promote) if self.demote is None else tuple(self.demote)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "promote", promote)
        object.__setattr__(self, "demote", demote)
        if len(dims) < 2 or not all(isinstance(d, int) and d >= 1 for d in dims):
            raise ValueError(f"Sizes: dims must be two or more ints >= 1, got {dims!r}")
        if any(b <= a for a, b in itertools.pairwise(dims)):
            raise ValueError(f"Sizes: dims must increase, got {dims!r}")
        for name, values in (("promote", promote), ("demote", demote)):
            if len(values) != len(dims) - 1:
                raise ValueError(
                    f"Sizes: {name} needs one threshold per size after the first "
                    f"({len(dims) - 1}), got {values!r}"
                )
            if any(b < a for a, b in itertools.pairwise(values)):
                raise ValueError(f"Sizes: {name} thresholds must not decrease, got {values!r}")
        if not isinstance(self.initializer, Initializer):
            raise TypeError(f"Sizes: initializer must be an Initializer, got {self.initializer!r}")
        # each Grow checks its own pair (>= 0, demote <= promote)
        for p, d in zip(promote, demote, strict=True):
            Grow("base", p, d, click_weight=self.click_weight)


COMBINERS = ("sum", "mean", "sqrtn", None)


@dataclass(frozen=True)
class EmbeddingTable:
    """A table of the parameter server: key -> float32[dim] (+ optimizer state).

    Defaults train well untuned: lazy ``Adam(1e-3)`` and small initial
    vectors, ``TruncatedNormal(stddev=0.01)`` (why: ``wuliang.ps_server.spec``'s
    ``default_initializer`` and ``default_optimizer``).

    Show and click statistics of the rows (``TableSpec.stats_half_life``,
    their decay in steps, and ``top_keys``): ``stats_label`` names the label
    column a trainer's push takes each key's clicks from (the label summed
    over the key's occurrences in the batch; its shows: those occurrences);
    None: shows only.

    ``precision``: how the weights are stored, ``"fp32"`` (the default) or
    ``"fp16"`` (half the weights' bytes; updated in float32 and stored with
    stochastic rounding, the optimizer state float32: docs/ps_engine.md,
    "Precision"). ``"int8"`` is for serving tables only.
    """

    name: str
    dim: int
    _: KW_ONLY
    optimizer: Optimizer = field(default_factory=default_optimizer)
    initializer: Initializer = field(default_factory=default_initializer)
    admission: Admission = field(default_factory=Admission)
    eviction: Eviction = field(default_factory=Eviction)
    seed: int = 0
    reserve_rows: int = 0
    stats_label: str | None = None
    stats_half_life: float = 0.0
    precision: str = "fp32"
    sizes: Sizes | None = None
    grow: Grow | None = None

    def __post_init__(self) -> None:
        self.spec()  # checks every field, naming it
        if self.sizes is not None:
            if not isinstance(self.sizes, Sizes):
                raise TypeError(f"table {self.name!r}: sizes must be a Sizes, got {self.sizes!r}")
            if self.sizes.dims[-1] != self.dim:
                raise ValueError(
                    f"table {self.name!r}: the last of sizes {self.sizes.dims} must be the "
                    f"table's dim {self.dim}"
                )
            if self.grow is not None:
                raise ValueError(f"table {self.name!r}: a sized table cannot grow from another")
            if self.precision == "int8":
                raise ValueError(f"table {self.name!r}: an int8 table serves only, not sized")
        if SIZE_MARK in self.name and self.grow is None:
            raise ValueError(
                f"table name {self.name!r}: {SIZE_MARK!r} marks a sized table's blocks"
            )
        if self.stats_label is not None and (
            not isinstance(self.stats_label, str) or not self.stats_label
        ):
            raise ValueError(
                f"table {self.name!r}: stats_label must be a column name or None, "
                f"got {self.stats_label!r}"
            )

    def spec(self) -> TableSpec:
        return TableSpec(
            self.name,
            self.dim,
            optimizer=self.optimizer,
            initializer=self.initializer,
            seed=self.seed,
            admission=self.admission,
            eviction=self.eviction,
            reserve_rows=self.reserve_rows,
            stats_half_life=self.stats_half_life,
            precision=self.precision,  # type: ignore[arg-type]
            grow=self.grow,
        )

    def blocks(self) -> list[EmbeddingTable]:
        """The parameter server's tables of this one: itself, or for a sized
        table its base block (named as the table, ``dims[0]`` wide, with all
        of the table's settings) and one extension block per larger size
        (``"<name>@<size>"``, the size's new columns: zeros at first, grown
        and shrunk by the base row's score, ``Grow``)."""
        sizes = self.sizes
        if sizes is None:
            return [self]
        base = replace(self, dim=sizes.dims[0], sizes=None)
        out = [base]
        for i in range(1, len(sizes.dims)):
            assert sizes.demote is not None
            out.append(
                EmbeddingTable(
                    f"{self.name}{SIZE_MARK}{sizes.dims[i]}",
                    sizes.dims[i] - sizes.dims[i - 1],
                    optimizer=self.optimizer,
                    initializer=sizes.initializer,
                    seed=self.seed,
                    precision=self.precision,
                    grow=Grow(
                        self.name,
                        sizes.promote[i - 1],
                        sizes.demote[i - 1],
                        click_weight=sizes.click_weight,
                    ),
                )
            )
        return out

    @property
    def evicts(self) -> bool:
        """Whether ``evict`` removes anything of this table: an eviction
        policy, or a sized table's block (its keys shrink by evict)."""
        return self.eviction.enabled or self.grow is not None

    @property
    def block_columns(self) -> list[tuple[str, int, int]]:
        """Each block's table and its columns ``[start, stop)`` of the
        table's vectors."""
        out, start = [], 0
        for block in self.blocks():
            out.append((block.name, start, start + block.dim))
            start += block.dim
        return out


@dataclass(frozen=True)
class SparseFeature:
    """A sparse column looked up in ``table``.

    Args:
        name: the batch's sparse feature (the Parquet column).
        table: where its keys live.
        combiner: ``"sum"``, ``"mean"``, ``"sqrtn"`` pool each row to
            ``[B, dim]`` (an empty row pools to zeros); ``None`` keeps the
            row's vectors as a sequence ``[B, max_len, dim]`` (first
            ``max_len`` values, zero-padded) with a float32 mask ``[B, max_len]``.
        max_len: sequence length for ``combiner=None``.
    """

    name: str
    table: EmbeddingTable
    combiner: str | None = "sum"
    max_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"feature name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.table, EmbeddingTable):
            raise TypeError(
                f"feature {self.name!r}: table must be an EmbeddingTable, got {self.table!r}"
            )
        if self.combiner not in COMBINERS:
            raise ValueError(
                f"feature {self.name!r}: combiner must be one of sum, mean, sqrtn or None, "
                f"got {self.combiner!r}"
            )
        if self.combiner is None and not (isinstance(self.max_len, int) and self.max_len >= 1):
            raise ValueError(
                f"feature {self.name!r}: a sequence feature (combiner=None) needs max_len >= 1"
            )

    @property
    def is_sequence(self) -> bool:
        return self.combiner is None


@dataclass(frozen=True)
class DenseFeature:
    """A dense column of the batch (``dim`` floats per row)."""

    name: str
    dim: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"feature name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dense feature {self.name!r}: dim must be >= 1, got {self.dim!r}")


Feature = SparseFeature | DenseFeature


def split_features(
    features: list[Feature],
) -> tuple[list[SparseFeature], list[DenseFeature], dict[str, EmbeddingTable]]:
    """Sparse and dense features and the tables they use; checks names are unique
    and that a table name means one table."""
    sparse: list[SparseFeature] = []
    dense: list[DenseFeature] = []
    tables: dict[str, EmbeddingTable] = {}
    seen: set[str] = set()
    for f in features:
        if not isinstance(f, SparseFeature | DenseFeature):
            raise TypeError(f"features must be SparseFeature or DenseFeature, got {f!r}")
        if f.name in seen:
            raise ValueError(f"feature {f.name!r} is listed twice")
        seen.add(f.name)
        if isinstance(f, SparseFeature):
            sparse.append(f)
            known = tables.setdefault(f.table.name, f.table)
            if known != f.table:
                raise ValueError(
                    f"two different tables are named {f.table.name!r} "
                    f"(features {f.name!r} and another)"
                )
        else:
            dense.append(f)
    if not sparse and not dense:
        raise ValueError("a model needs at least one feature")
    return sparse, dense, tables
