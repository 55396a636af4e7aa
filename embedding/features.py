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

from dataclasses import KW_ONLY, dataclass, field

from wuliang.ps_server.spec import (
    Admission,
    Eviction,
    Initializer,
    Optimizer,
    TableSpec,
    default_initializer,
    default_optimizer,
)

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

    def __post_init__(self) -> None:
        self.spec()  # checks every field, naming it
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
        )


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
