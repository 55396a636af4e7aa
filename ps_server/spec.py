"""Table specifications: optimizer, initializer, admission and eviction.

Plain frozen dataclasses, checked on construction (errors name the field), and
converted to the engine's C++ structs by :func:`TableSpec.to_native`. The
public names are re-exported as ``wuliang.optimizers``, ``wuliang.initializers``,
``wuliang.admission`` and ``wuliang.eviction``.

Every spec class has ``to_dict()`` (JSON: plain numbers, strings and nested
objects; an optimizer's or initializer's class is its ``"kind"``) and
``from_dict(data)``, its exact inverse: a version's manifest records each
table's whole spec this way, so a process holding nothing but the version
directory (a parameter server, a serving replica) recreates the tables
exactly, and the same dictionaries travel over the wire. ``from_dict`` fills
in defaults for missing fields and refuses unknown ones (ValueError naming
the field and the spec).

Optimizer formulas (per coordinate, ``g`` the summed gradient of a key):

* ``SGD``:      ``w -= lr * g``
* ``Adagrad``:  ``acc += g²;  w -= lr * g / (sqrt(acc) + epsilon)``
* ``Adam``:     lazy: a row's step ``t`` only advances when the row is pushed,
  so bias correction is per row: ``m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g²;
  w -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + epsilon)``
* ``FTRL``:     FTRL-Proximal of McMahan et al. (2013), Algorithm 1, with
  ``alpha = lr``; ``l2`` is the paper's λ2 (TensorFlow's
  ``l2_regularization_strength`` is half of it).

``clip_norm > 0`` scales each key's gradient row to at most that L2 norm first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

from wuliang.ps_server import _engine


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive(owner: str, name: str, value: float) -> None:
    _check(math.isfinite(value) and value > 0, f"{owner}: {name} must be > 0, got {value!r}")


def _finite(owner: str, name: str, value: float) -> None:
    _check(math.isfinite(value), f"{owner}: {name} must be finite, got {value!r}")


def _non_negative(owner: str, name: str, value: float) -> None:
    _check(math.isfinite(value) and value >= 0, f"{owner}: {name} must be >= 0, got {value!r}")


S = TypeVar("S")


def _fields_of(spec: Any) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in fields(spec)}


def _build(cls: type[S], data: Any, who: str, drop: tuple[str, ...] = ()) -> S:
    """``cls(**data)``; ValueError naming ``who`` for a non-object, an
    unknown field or a bad value. ``drop``: keys of data that are not fields
    (a ``"kind"`` already dispatched on)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{who}: expected an object, got {data!r}")
    values = {k: v for k, v in data.items() if k not in drop}
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"{who}: unknown field {unknown[0]!r} (fields: {', '.join(known) or 'none'})"
        )
    try:
        return cls(**values)
    except TypeError as error:
        raise ValueError(f"{who}: {error}") from None


def _by_kind(base: type[S], kinds: tuple[type, ...], data: Any) -> S:
    """The ``kinds`` member that ``data["kind"]`` names, built from data; a
    subclass of ``base`` asked directly must match the kind."""
    what = base.__name__.lower()
    if not isinstance(data, Mapping):
        raise ValueError(f"{what}: expected an object, got {data!r}")
    by_name = {k.__name__: k for k in kinds}
    kind = data.get("kind")
    if kind not in by_name:
        raise ValueError(f"unknown {what} kind {kind!r} (kinds: {', '.join(by_name)})")
    chosen = by_name[kind]
    if not issubclass(chosen, base):
        raise ValueError(f"{what}: expected a {base.__name__}, got kind {kind!r}")
    return _build(chosen, data, f"{what} {kind}", drop=("kind",))


# --- optimizers -------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer:
    """Base of the optimizers applied on the parameter server."""

    learning_rate: float = 0.01
    _: KW_ONLY
    clip_norm: float = 0.0

    def __post_init__(self) -> None:
        name = type(self).__name__
        _positive(name, "learning_rate", self.learning_rate)
        _non_negative(name, "clip_norm", self.clip_norm)

    def _native(self) -> _engine.OptimizerSpec:
        spec = _engine.OptimizerSpec()
        spec.learning_rate = self.learning_rate
        spec.clip_norm = self.clip_norm
        return spec

    def to_dict(self) -> dict[str, Any]:
        """JSON of the optimizer: its ``kind`` (class name) and fields."""
        return {"kind": type(self).__name__, **_fields_of(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Optimizer:
        """The optimizer ``to_dict`` described (ValueError naming a bad kind or field)."""
        return _by_kind(cls, (SGD, Adagrad, Adam, FTRL), data)


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain gradient descent."""

    def _native(self) -> _engine.OptimizerSpec:
        spec = super()._native()
        spec.kind = _engine.OptimizerKind.SGD
        return spec


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad with a per-coordinate squared-gradient accumulator."""

    _: KW_ONLY
    initial_accumulator: float = 0.1
    epsilon: float = 1e-7

    def __post_init__(self) -> None:
        super().__post_init__()
        _non_negative("Adagrad", "initial_accumulator", self.initial_accumulator)
        _non_negative("Adagrad", "epsilon", self.epsilon)
        _check(
            self.initial_accumulator > 0 or self.epsilon > 0,
            "Adagrad: initial_accumulator or epsilon must be > 0",
        )

    def _native(self) -> _engine.OptimizerSpec:
        spec = super()._native()
        spec.kind = _engine.OptimizerKind.ADAGRAD
        spec.initial_accumulator = self.initial_accumulator
        spec.epsilon = self.epsilon
        return spec


@dataclass(frozen=True)
class Adam(Optimizer):
    """Lazy Adam: only pushed rows advance, bias correction per row."""

    learning_rate: float = 0.001
    _: KW_ONLY
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-7

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _check(0 <= value < 1, f"Adam: {name} must be in [0, 1), got {value!r}")
        _non_negative("Adam", "epsilon", self.epsilon)

    def _native(self) -> _engine.OptimizerSpec:
        spec = super()._native()
        spec.kind = _engine.OptimizerKind.ADAM
        spec.beta1, spec.beta2, spec.epsilon = self.beta1, self.beta2, self.epsilon
        return spec


@dataclass(frozen=True)
class FTRL(Optimizer):
    """FTRL-Proximal (McMahan et al. 2013); learning_rate is alpha."""

    learning_rate: float = 0.05
    _: KW_ONLY
    l1: float = 0.0
    l2: float = 0.0
    beta: float = 1.0
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("l1", "l2", "beta", "initial_accumulator"):
            _non_negative("FTRL", name, getattr(self, name))

    def _native(self) -> _engine.OptimizerSpec:
        spec = super()._native()
        spec.kind = _engine.OptimizerKind.FTRL
        spec.l1, spec.l2, spec.beta = self.l1, self.l2, self.beta
        spec.initial_accumulator = self.initial_accumulator
        return spec


# --- initializers -----------------------------------------------------------


@dataclass(frozen=True)
class Initializer:
    """Base of the initial-value distributions; values depend on (seed, key)."""

    def _native(self, dim: int) -> _engine.InitSpec:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """JSON of the initializer: its ``kind`` (class name) and fields."""
        return {"kind": type(self).__name__, **_fields_of(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Initializer:
        """The initializer ``to_dict`` described (ValueError naming a bad kind or field)."""
        return _by_kind(cls, (Normal, TruncatedNormal, Uniform, Constant, Zeros), data)


@dataclass(frozen=True)
class Normal(Initializer):
    stddev: float = 0.05
    mean: float = 0.0

    def __post_init__(self) -> None:
        _non_negative("Normal", "stddev", self.stddev)
        _finite("Normal", "mean", self.mean)

    def _native(self, dim: int) -> _engine.InitSpec:
        spec = _engine.InitSpec()
        spec.kind = _engine.InitKind.NORMAL
        spec.mean, spec.stddev = self.mean, self.stddev
        return spec


@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """Normal truncated to mean +- 2 stddev (by its inverse CDF). stddev None = 1/sqrt(dim)."""

    stddev: float | None = None
    mean: float = 0.0

    def __post_init__(self) -> None:
        if self.stddev is not None:
            _non_negative("TruncatedNormal", "stddev", self.stddev)
        _finite("TruncatedNormal", "mean", self.mean)

    def _native(self, dim: int) -> _engine.InitSpec:
        spec = _engine.InitSpec()
        spec.kind = _engine.InitKind.TRUNCATED_NORMAL
        spec.mean = self.mean
        spec.stddev = self.stddev if self.stddev is not None else 1.0 / math.sqrt(dim)
        return spec


@dataclass(frozen=True)
class Uniform(Initializer):
    minval: float = -0.05
    maxval: float = 0.05

    def __post_init__(self) -> None:
        _finite("Uniform", "minval", self.minval)
        _finite("Uniform", "maxval", self.maxval)
        _check(
            self.minval <= self.maxval,
            f"Uniform: minval {self.minval!r} must be <= maxval {self.maxval!r}",
        )

    def _native(self, dim: int) -> _engine.InitSpec:
        spec = _engine.InitSpec()
        spec.kind = _engine.InitKind.UNIFORM
        spec.minval, spec.maxval = self.minval, self.maxval
        return spec


@dataclass(frozen=True)
class Constant(Initializer):
    value: float = 0.0

    def __post_init__(self) -> None:
        _finite("Constant", "value", self.value)

    def _native(self, dim: int) -> _engine.InitSpec:
        spec = _engine.InitSpec()
        spec.kind = _engine.InitKind.CONSTANT
        spec.value = self.value
        return spec


@dataclass(frozen=True)
class Zeros(Initializer):
    def _native(self, dim: int) -> _engine.InitSpec:
        spec = _engine.InitSpec()
        spec.kind = _engine.InitKind.ZEROS
        return spec


def default_initializer() -> Initializer:
    """``TruncatedNormal(stddev=0.01)``, every table's default.

    A key that was never trained reads as its initial vector, and in a time
    split (as in production) most keys of the newest users and items are such
    keys: their initial vectors go straight into the tower as noise, so the
    default is small (measured on a MovieLens time split: docs/performance.md,
    "Default initializer and optimizer"). Zeros would leave a ReLU tower
    without any gradient at the start (every input and bias zero).
    """
    return TruncatedNormal(stddev=0.01)


def default_optimizer() -> Optimizer:
    """``Adam(1e-3)`` (lazy), every table's default, as Keras's default
    optimizer: it trains well untuned over a wide range of tables. Adagrad
    or FTRL keep half the optimizer state per row (``dim`` floats instead of
    ``2 * dim``) where memory matters more."""
    return Adam()


# --- admission and eviction -------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """A key gets a row on its ``min_count``-th training pull.

    Until then it reads as its initial vector and pushes to it are dropped
    (counted as ``dropped_pending``). At most ``pending_capacity`` waiting keys
    per shard are counted exactly; beyond that, counts are halved and keys
    reaching zero forgotten (counted as ``pending_forgotten``).
    """

    min_count: int = 1
    _: KW_ONLY
    pending_capacity: int = 1 << 20

    def __post_init__(self) -> None:
        _check(
            isinstance(self.min_count, int) and self.min_count >= 1,
            f"Admission: min_count must be an int >= 1, got {self.min_count!r}",
        )
        _check(
            isinstance(self.pending_capacity, int) and 1 <= self.pending_capacity < 2**32,
            f"Admission: pending_capacity must be in [1, 2**32), got {self.pending_capacity!r}",
        )

    def to_dict(self) -> dict[str, Any]:
        return _fields_of(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Admission:
        return _build(cls, data, "admission")


@dataclass(frozen=True)
class Eviction:
    """Which rows ``Engine.evict`` removes; 0 disables a criterion.

    * ``ttl_steps`` / ``ttl_seconds``: rows not updated for longer than this;
    * ``min_count``: rows seen fewer times than this that were not updated
      since the previous ``evict`` call (every row gets one full period);
    * ``max_rows``: then, while the table is larger, the least frequently
      seen rows (oldest first among equal counts).

    Combine criteria with ``|``: ``TTL(steps=10_000) | MaxRows(1_000_000)``.
    """

    _: KW_ONLY
    ttl_steps: int = 0
    ttl_seconds: int = 0
    min_count: int = 0
    max_rows: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            _check(
                isinstance(value, int) and value >= 0,
                f"Eviction: {f.name} must be an int >= 0, got {value!r}",
            )

    def __or__(self, other: Eviction) -> Eviction:
        merged = {f.name: getattr(other, f.name) or getattr(self, f.name) for f in fields(self)}
        return Eviction(**merged)

    @property
    def enabled(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, Any]:
        return _fields_of(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Eviction:
        return _build(cls, data, "eviction")


# --- the table --------------------------------------------------------------


@dataclass(frozen=True)
class Grow:
    """Makes a table an extension block of a sized table (docs/ps_engine.md,
    "Sizes"): a key gets a row here at a push (with that push's gradient; a
    training pull makes none) once its row in table ``base`` (the same
    engine's, created first) scores at least ``promote``, where a row's
    score is its decayed shows plus ``click_weight`` times its decayed
    clicks (``base``'s ``stats_half_life``). A pull of a key without one
    reads its initial vector (``Zeros`` for a sized table's blocks) and its
    pushes are dropped; ``evict`` removes the rows whose base row scores
    below ``demote`` (``demote <= promote``: the gap keeps a key near a
    threshold from flapping) or has gone.
    """

    base: str
    promote: float
    demote: float
    _: KW_ONLY
    click_weight: float = 0.0

    def __post_init__(self) -> None:
        _check(
            isinstance(self.base, str) and self.base != "",
            f"Grow: base must be a table name, got {self.base!r}",
        )
        _non_negative("Grow", "promote", self.promote)
        _non_negative("Grow", "demote", self.demote)
        _non_negative("Grow", "click_weight", self.click_weight)
        _check(
            self.demote <= self.promote,
            f"Grow: demote must be <= promote, got demote={self.demote!r} > "
            f"promote={self.promote!r}",
        )

    def to_dict(self) -> dict[str, Any]:
        return _fields_of(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Grow:
        return _build(cls, data, "grow")


NanPolicy = Literal["drop", "raise"]
Precision = Literal["fp32", "fp16", "int8"]
_PRECISIONS = {
    "fp32": _engine.Precision.FP32,
    "fp16": _engine.Precision.FP16,
    "int8": _engine.Precision.INT8,
}


@dataclass(frozen=True)
class TableSpec:
    """An embedding table of the engine.

    Args:
        name: unique within an engine.
        dim: floats per embedding vector.
        optimizer: applied on the engine at every push (default
            ``Adam(1e-3)``, see ``default_optimizer``).
        initializer: initial vectors, a pure function of (seed, key)
            (default ``TruncatedNormal(stddev=0.01)``, see
            ``default_initializer``).
        seed: table seed of the initial vectors.
        admission: when a key gets a row (default: at first sight).
        eviction: what ``Engine.evict`` removes (default: nothing).
        nan_policy: ``"drop"`` skips and counts non-finite gradient rows;
            ``"raise"`` rejects the whole push with ValueError.
        reserve_rows: rows to hold memory for from the start (the memory
            pool and the index, faulted in when the table is created, split
            over the shards), as one sizes a table for its vocabulary. The
            table still grows past it, and its memory never shrinks below
            it. Growing costs page faults on fresh memory while training
            (on some virtual machines a large part of a step, see
            docs/performance.md); a reserve pays them before. 0: grow from
            empty.
        precision: how the weights are stored: ``"fp32"`` (exact, the
            default), ``"fp16"`` (IEEE half, round to nearest even,
            saturating at +-65504) or ``"int8"`` (int8 with a float32 scale
            per row, ``max|w| / 127``). Rows go in and out as float32
            either way. An fp16 table trains too: pushes update its
            weights in float32 and store them rounded stochastically, its
            optimizer state float32. An int8 table is for serving: it
            loads (``load``, ``apply_update``) and answers ``lookup``,
            ``pull(train=False)``, ``contains`` and ``export``; training
            calls on it (``pull`` with ``train=True``, ``push``) raise
            ValueError. See docs/ps_engine.md, "Precision".
        serving: only version applies (``apply_update``) change the table;
            pushes, training pulls, loads, erases and evictions are refused
            (ValueError naming it), and lookups read on the calling thread,
            without a hand-off to the shard workers: what a serving process
            needs. ``wuliang.serving`` creates its tables so.
        stats_half_life: half-life in steps of the rows' show and click
            statistics (fed by pushes, ``PushPart.shows``/``clicks``): a
            row's are multiplied by ``0.5 ** ((s - s0) / stats_half_life)``
            when it is updated at step s after its last update at s0, and
            read so by ``top_keys``. 0 (the default): no decay.
        grow: this table is an extension block of a sized table (``Grow``):
            its keys are those whose row in ``grow.base`` scores enough.
            None (the default): a plain table.
    """

    name: str
    dim: int
    _: KW_ONLY
    optimizer: Optimizer = field(default_factory=default_optimizer)
    initializer: Initializer = field(default_factory=default_initializer)
    seed: int = 0
    admission: Admission = field(default_factory=Admission)
    eviction: Eviction = field(default_factory=Eviction)
    nan_policy: NanPolicy = "drop"
    reserve_rows: int = 0
    precision: Precision = "fp32"
    serving: bool = False
    stats_half_life: float = 0.0
    grow: Grow | None = None

    def __post_init__(self) -> None:
        _check(
            isinstance(self.name, str) and self.name != "",
            f"table name must be a non-empty string, got {self.name!r}",
        )
        if self.grow is not None and not isinstance(self.grow, Grow):
            raise TypeError(f"table {self.name!r}: grow must be a Grow or None, got {self.grow!r}")
        _check(
            self.grow is None or self.grow.base != self.name,
            f"table {self.name!r}: grow.base must be another table",
        )
        who = f"table {self.name!r}"
        _check(
            isinstance(self.dim, int) and 1 <= self.dim <= 65536,
            f"{who}: dim must be an int in [1, 65536], got {self.dim!r}",
        )
        for name, kind in (
            ("optimizer", Optimizer),
            ("initializer", Initializer),
            ("admission", Admission),
            ("eviction", Eviction),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(f"{who}: {name} must be a {kind.__name__}, got {value!r}")
        _check(
            isinstance(self.seed, int) and 0 <= self.seed < 2**64,
            f"{who}: seed must be an int in [0, 2**64), got {self.seed!r}",
        )
        _check(
            isinstance(self.reserve_rows, int) and 0 <= self.reserve_rows < 2**63,
            f"{who}: reserve_rows must be an int >= 0, got {self.reserve_rows!r}",
        )
        _check(
            isinstance(self.serving, bool), f"{who}: serving must be a bool, got {self.serving!r}"
        )
        _check(
            self.nan_policy in ("drop", "raise"),
            f"{who}: nan_policy must be 'drop' or 'raise', got {self.nan_policy!r}",
        )
        _check(
            isinstance(self.precision, str) and self.precision in _PRECISIONS,
            f"{who}: precision must be 'fp32', 'fp16' or 'int8', got {self.precision!r}",
        )
        _check(
            isinstance(self.stats_half_life, int | float)
            and not isinstance(self.stats_half_life, bool)
            and math.isfinite(self.stats_half_life)
            and self.stats_half_life >= 0,
            f"{who}: stats_half_life must be a number >= 0 (steps), got {self.stats_half_life!r}",
        )

    @property
    def state_dim(self) -> int:
        """Floats of optimizer state per row."""
        return _engine.state_dim(self.optimizer._native().kind, self.dim)

    def with_name(self, name: str) -> TableSpec:
        return replace(self, name=name)

    def to_dict(self) -> dict[str, Any]:
        """JSON of the whole spec (nested specs as their ``to_dict``)."""
        out = _fields_of(self)
        for name in _NESTED:
            out[name] = out[name].to_dict()
        if self.grow is None:
            del out["grow"]  # a plain table's dictionary is as before
        else:
            out["grow"] = self.grow.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableSpec:
        """The spec ``to_dict`` described; missing fields take their
        defaults; ValueError naming the table and the bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"table spec: expected an object, got {data!r}")
        who = f"table {data.get('name')!r}"
        values = dict(data)
        for name, kind in {**_NESTED, "grow": Grow}.items():
            if values.get(name) is not None:
                try:
                    values[name] = kind.from_dict(values[name])
                except ValueError as error:
                    raise ValueError(f"{who}: {name}: {error}") from None
        return _build(cls, values, who)

    def to_native(self) -> _engine.TableSpec:
        spec = _engine.TableSpec()
        spec.name = self.name
        spec.dim = self.dim
        spec.optimizer = self.optimizer._native()
        spec.initializer = self.initializer._native(self.dim)
        spec.seed = self.seed
        admission = _engine.AdmissionSpec()
        admission.min_count = self.admission.min_count
        admission.pending_capacity = self.admission.pending_capacity
        spec.admission = admission
        eviction = _engine.EvictionSpec()
        eviction.ttl_steps = self.eviction.ttl_steps
        eviction.ttl_seconds = self.eviction.ttl_seconds
        eviction.min_count = self.eviction.min_count
        eviction.max_rows = self.eviction.max_rows
        spec.eviction = eviction
        spec.nan_policy = (
            _engine.NanPolicy.RAISE if self.nan_policy == "raise" else _engine.NanPolicy.DROP
        )
        spec.reserve_rows = self.reserve_rows
        spec.serving = self.serving
        spec.precision = _PRECISIONS[self.precision]
        spec.stats_half_life = float(self.stats_half_life)
        if self.grow is not None:
            spec.grow_base = self.grow.base
            spec.grow_promote = float(self.grow.promote)
            spec.grow_demote = float(self.grow.demote)
            spec.grow_click_weight = float(self.grow.click_weight)
        return spec


_NESTED: dict[str, Any] = {
    "optimizer": Optimizer,
    "initializer": Initializer,
    "admission": Admission,
    "eviction": Eviction,
}
