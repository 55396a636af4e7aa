"""The GPU hot cache's device kernels, each with a numpy twin.

A cached table keeps its rows in arrays indexed by slot (``weights [rows,
dim]``, ``state [rows, state_dim]``, ``counts``, ``steps``, ``times``),
allocated through an array module: cupy where a GPU is present, numpy
otherwise. The kernels gather rows by slot, scatter rows into slots, and
apply a table's optimizer to the rows of some slots. ``CupyKernels`` runs
them as cupy ``ElementwiseKernel``/``RawKernel``; ``NumpyKernels`` is the
same arithmetic in numpy (what the tests run without a GPU, and the
reference the GPU tests compare with).

Exactness. The cached rows must come out bit for bit as the engine's C++
optimizer (``ps_server/csrc/details/optimizers.h``) leaves them, in float32.
That code is compiled with GCC's default floating-point contraction, so
``a * b + c`` may become one fused multiply-add (rounded once) depending on
the build (``-march=native`` on a CPU with FMA: yes; a portable x86-64
build: no), and the clipping norm's sum of squares is partly vectorized
(products of the first ``lanes * (dim // lanes)`` coordinates added one by
one, unfused, the rest fused). ``FloatModel`` names these choices, and
``engine_float_model()`` finds the ones of the engine built here by pushing
a few rows through a scratch engine and comparing (once per process). Both
twins then spell every rounding out: the CUDA code with ``__fmaf_rn``,
``__fmul_rn``, ``__fadd_rn``, ... (which the compiler never contracts),
numpy with an exact float32 fused multiply-add (``fma32``: float64 products
are exact, the sum is rounded to odd, then to float32). Adam's per-row
learning rate is computed on the host in double with the C library's
``exp2`` and ``log2``, as the engine does, from a host copy of each cached
row's step count ``t``.

Non-finite gradients are found on the host, before the copy to the device
(the gradients arrive there), and those rows are not updated, as the engine
drops them.

cupy is optional: it is imported only when asked for (``array_module``), and
any warning its import raises is silenced (the test suite turns warnings into
errors).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from wuliang.ps_server.spec import FTRL, SGD, Adagrad, Adam, Optimizer, TableSpec

log = logging.getLogger("wuliang")

F32 = np.float32
COUNT_MAX = np.uint32(2**32 - 1)
ARRAY_MODULES = ("auto", "numpy", "cupy")


# --- the array module ---------------------------------------------------------


def _import_cupy() -> Any | None:
    """cupy, or None when it is not installed or finds no GPU; silent."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy  # type: ignore[import-not-found]

            if cupy.cuda.runtime.getDeviceCount() < 1:
                return None
            return cupy
    except Exception:  # not installed, no driver, no device: all mean "no GPU"
        return None


def gpu_available() -> bool:
    """Whether cupy is installed and sees a GPU."""
    return _import_cupy() is not None


def array_module(name: str = "auto") -> Any:
    """The array module for the cache's arrays: ``"cupy"`` (ImportError when
    it is missing or sees no GPU), ``"numpy"``, or ``"auto"`` (cupy when a
    GPU is present, else numpy). A module object passes through."""
    if not isinstance(name, str):
        if name is np or getattr(name, "__name__", "") == "cupy":
            return name
        raise ValueError(f"xp must be 'auto', 'numpy', 'cupy' or a module, got {name!r}")
    if name not in ARRAY_MODULES:
        raise ValueError(f"xp must be one of {', '.join(ARRAY_MODULES)}, got {name!r}")
    if name == "numpy":
        return np
    cupy = _import_cupy()
    if cupy is None and name == "cupy":
        raise ImportError("xp='cupy' needs cupy and a GPU: neither a GPU nor cupy was found")
    return cupy if cupy is not None else np


def kernels_for(xp: Any) -> NumpyKernels:
    """The kernels of an array module (numpy or cupy)."""
    return NumpyKernels() if xp is np else CupyKernels(xp)


# --- how the engine's float32 arithmetic rounds ---------------------------------


@dataclass(frozen=True)
class FloatModel:
    """Where the engine's compiled optimizer code rounds.

    ``fused``: ``a * b + c`` in an update formula is one fused multiply-add
    (the forms GCC chooses: ``acc + g*g``, ``w - lr*g``, Adam's ``b1*m +
    (1-b1)*g`` fused on the first product, FTRL's ``g - sigma*w`` and its
    denominator). ``clip_lanes``: the clipping norm's sum of squares adds the
    squares of the first ``clip_lanes * (dim // clip_lanes)`` coordinates
    unfused and fuses the rest (0: all fused); without ``fused`` all are
    unfused."""

    fused: bool = True
    clip_lanes: int = 4

    def clip_cut(self, dim: int) -> int:
        """Coordinates whose squares are added unfused."""
        if not self.fused:
            return dim
        return self.clip_lanes * (dim // self.clip_lanes) if self.clip_lanes else 0


MODELS = tuple([FloatModel(True, lanes) for lanes in (4, 8, 16, 0, 1)] + [FloatModel(False, 1)])
_model: FloatModel | None = None
_model_exact = True
_model_lock = threading.Lock()


def engine_float_model() -> tuple[FloatModel, bool]:
    """The rounding model of the engine built here and whether it reproduced
    every probe exactly (found once per process; see the module docstring)."""
    global _model, _model_exact
    with _model_lock:
        if _model is None:
            _model, _model_exact = _calibrate()
            if not _model_exact:
                log.warning(
                    "GPU cache: no rounding model reproduces this build's engine exactly "
                    "(closest: %s); cached rows may differ from the engine's in the last bit",
                    _model,
                )
        return _model, _model_exact


def _probe_specs() -> list[TableSpec]:
    return [
        TableSpec("sgd", 47, optimizer=SGD(0.1)),
        TableSpec("sgd-clip", 47, optimizer=SGD(0.1, clip_norm=1.5)),
        TableSpec("adagrad-clip", 13, optimizer=Adagrad(0.05, clip_norm=1.5)),
        TableSpec("adam-clip", 11, optimizer=Adam(0.01, beta1=0.8, beta2=0.99, clip_norm=1.5)),
        TableSpec("ftrl-clip", 9, optimizer=FTRL(0.05, l1=0.2, l2=0.1, clip_norm=1.5)),
    ]


def _calibrate() -> tuple[FloatModel, bool]:
    """Pushes random rows through a scratch engine and returns the first
    model that reproduces all of them (or the one that misses fewest)."""
    from wuliang.ps_server.engine import Engine

    rng = np.random.default_rng(7)
    probes = []
    with Engine(1) as engine:
        for spec in _probe_specs():
            engine.create_table(spec)
            n = 512
            keys = np.arange(1, n + 1, dtype=np.uint64)
            weights = (rng.standard_normal((n, spec.dim)) * 0.5).astype(F32)
            state = _random_state(spec, n, rng)
            engine.load(spec.name, keys, weights, state if spec.state_dim else None)
            grads = rng.standard_normal((n, spec.dim)).astype(F32)
            grads *= rng.uniform(0.01, 1.0, (n, 1)).astype(F32)
            engine.push(spec.name, keys, grads, unique=True)
            chunk = next(iter(engine.export(spec.name)))
            order = np.argsort(chunk.keys)
            probes.append((spec, weights, state, grads, chunk.weights[order], chunk.state[order]))
    best, best_misses = MODELS[0], None
    for model in MODELS:
        misses = 0
        for spec, weights, state, grads, want_w, want_s in probes:
            math_ = OptimizerMath(spec.optimizer, spec.dim)
            w, s = weights.copy(), state.copy()
            lr_t = math_.lr_t(s[:, 2 * spec.dim] + F32(1)) if math_.kind == "adam" else None
            scale = clip_scales(grads, math_.clip_norm, model)
            w, s = update_rows(math_, model, w, s, grads, scale, lr_t)
            misses += int((w != want_w).sum() + (s != want_s).sum())
        if misses == 0:
            return model, True
        if best_misses is None or misses < best_misses:
            best, best_misses = model, misses
    return best, False


def _random_state(spec: TableSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    dim, opt = spec.dim, spec.optimizer
    if isinstance(opt, Adagrad):
        return rng.uniform(0.01, 4, (n, dim)).astype(F32)
    if isinstance(opt, Adam):
        m = rng.standard_normal((n, dim)) * 0.1
        v = rng.uniform(0, 2, (n, dim))
        return np.concatenate([m, v, rng.integers(0, 40, (n, 1))], axis=1).astype(F32)
    if isinstance(opt, FTRL):
        z = rng.standard_normal((n, dim))
        return np.concatenate([z, rng.uniform(0.01, 4, (n, dim))], axis=1).astype(F32)
    return np.zeros((n, 0), F32)


# --- an optimizer's constants, as the engine holds them -------------------------


def _libm_function(name: str) -> Any:
    """The C library's ``name(double) -> double`` (what the engine calls)."""
    found = getattr(math, name, None)
    if found is not None:  # CPython's math.exp2/log2 call the C library's
        return found
    lib = ctypes.CDLL(ctypes.util.find_library("m"))
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_double]
    return fn


libm_exp2 = _libm_function("exp2")
_log2 = _libm_function("log2")


class OptimizerMath:
    """A table's optimizer as the engine's ``RowOptimizer`` holds it: float32
    hyper-parameters (Adam's ``log2`` betas in double) and the initial state."""

    def __init__(self, opt: Optimizer, dim: int) -> None:
        self.dim = dim
        self.kind = {SGD: "sgd", Adagrad: "adagrad", Adam: "adam", FTRL: "ftrl"}[type(opt)]
        self.lr = F32(opt.learning_rate)
        self.clip_norm = F32(opt.clip_norm)
        self.eps = F32(getattr(opt, "epsilon", 0.0))
        self.b1 = F32(getattr(opt, "beta1", 0.0))
        self.b2 = F32(getattr(opt, "beta2", 0.0))
        self.c1, self.c2 = F32(1) - self.b1, F32(1) - self.b2  # (1.0f - beta)
        self.l1 = F32(getattr(opt, "l1", 0.0))
        self.l2 = F32(getattr(opt, "l2", 0.0))
        self.beta = F32(getattr(opt, "beta", 0.0))
        self.inv_alpha = F32(1) / self.lr
        self.native = opt._native()  # the engine's spec (the CPU twin's argument)
        self.initial_accumulator = F32(getattr(opt, "initial_accumulator", 0.0))
        self.log2_b1 = _log2(float(self.b1)) if self.b1 > 0 else -math.inf
        self.log2_b2 = _log2(float(self.b2)) if self.b2 > 0 else -math.inf
        self._lr_t: dict[float, np.float32] = {}

    @property
    def state_dim(self) -> int:
        return {"sgd": 0, "adagrad": self.dim, "adam": 2 * self.dim + 1, "ftrl": 2 * self.dim}[
            self.kind
        ]

    def initial_state(self, n: int) -> np.ndarray:
        """``InitState`` of n new rows (float32 ``[n, state_dim]``)."""
        state = np.zeros((n, self.state_dim), F32)
        if self.kind == "adagrad":
            state[:] = self.initial_accumulator
        elif self.kind == "ftrl":
            state[:, self.dim :] = self.initial_accumulator
        return state

    def lr_t(self, t: np.ndarray) -> np.ndarray:
        """Adam's learning rate of rows at their (new) step count ``t``
        (float32), computed as ``UpdateRow`` does: in double, with the C
        library's exp2, then rounded to float32. Memoized per ``t``."""
        t = np.asarray(t, F32)
        values, inverse = np.unique(t, return_inverse=True)
        out = np.empty(len(values), F32)
        lr = float(self.lr)
        for i, value in enumerate(values.tolist()):
            rate = self._lr_t.get(value)
            if rate is None:
                rate = F32(
                    lr
                    * math.sqrt(1.0 - libm_exp2(value * self.log2_b2))
                    / (1.0 - libm_exp2(value * self.log2_b1))
                )
                if len(self._lr_t) < 1 << 20:
                    self._lr_t[value] = rate
            out[i] = rate
        return out[inverse.reshape(-1)]

    def rate_table(self, size: int) -> np.ndarray:
        """float32 ``[size]``: Adam's rate at each t (``lr_t``; t = 0 unused)."""
        table = np.zeros(size, F32)
        table[1:] = self.lr_t(np.arange(1, size, dtype=F32))
        return table


# --- the numpy arithmetic ---------------------------------------------------------


def fma32(a: Any, b: Any, c: Any) -> np.ndarray:
    """``a * b + c`` rounded once to float32 (an exact fused multiply-add):
    the float64 product of two float32 is exact; the float64 sum is made
    round-to-odd (from its exact error), which then rounds to float32 as the
    exact sum would."""
    a64 = np.asarray(a, F32).astype(np.float64)
    b64 = np.asarray(b, F32).astype(np.float64)
    c64 = np.asarray(c, F32).astype(np.float64)
    p = a64 * b64
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)  # TwoSum: s + err == p + c exactly
    even = (s.view(np.int64) & 1) == 0
    fix = (err != 0) & even & np.isfinite(s) & np.isfinite(err)
    if fix.any():
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def _mul_add(a: Any, b: Any, c: Any) -> np.ndarray:
    """``a * b + c`` with the product rounded first (no contraction)."""
    return (np.asarray(a, F32) * np.asarray(b, F32) + np.asarray(c, F32)).astype(F32)


def clip_scales(grads: np.ndarray, clip_norm: np.float32, model: FloatModel) -> np.ndarray:
    """``ClipScale`` of each gradient row (float32 ``[n]``; 1 when disabled)."""
    n, dim = grads.shape
    if not clip_norm > 0:
        return np.ones(n, F32)
    with np.errstate(all="ignore"):
        cut = model.clip_cut(dim)
        sq = np.zeros(n, F32)
        for j in range(dim):
            col = grads[:, j]
            sq = (sq + col * col).astype(F32) if j < cut else fma32(col, col, sq)
        norm = np.sqrt(sq)
        return np.where(norm > clip_norm, clip_norm / norm, F32(1)).astype(F32)


def update_rows(
    m: OptimizerMath,
    model: FloatModel,
    w: np.ndarray,
    s: np.ndarray,
    g: np.ndarray,
    scale: np.ndarray,
    lr_t: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``UpdateRow`` of rows ``w`` (float32 ``[n, dim]``) and their state
    ``s`` by the summed gradients ``g``, clipped by ``scale``; returns the
    new weights and state. ``lr_t``: Adam's rate at each row's new ``t``."""
    mac = fma32 if model.fused else _mul_add
    dim = m.dim
    with np.errstate(all="ignore"):
        sc = scale[:, None]
        if m.kind == "sgd":
            lr = (m.lr * scale)[:, None]
            return mac(-lr, g, w), s
        gj = (g * sc).astype(F32)
        if m.kind == "adagrad":
            acc = mac(gj, gj, s)
            step = (m.lr * gj) / (np.sqrt(acc) + m.eps)
            return (w - step).astype(F32), acc
        if m.kind == "adam":
            assert lr_t is not None
            t = (s[:, 2 * dim] + F32(1)).astype(F32)
            mom = mac(np.full_like(gj, m.b1), s[:, :dim], (m.c1 * gj).astype(F32))
            vel = mac(np.full_like(gj, m.b2), s[:, dim : 2 * dim], ((m.c2 * gj) * gj).astype(F32))
            step = (lr_t.astype(F32)[:, None] * mom) / (np.sqrt(vel) + m.eps)
            state = np.concatenate([mom, vel, t[:, None]], axis=1)
            return (w - step).astype(F32), state
        # FTRL-Proximal
        z, n = s[:, :dim], s[:, dim:]
        n_new = mac(gj, gj, n)
        sqrt_new = np.sqrt(n_new)
        sigma = ((sqrt_new - np.sqrt(n)) * m.inv_alpha).astype(F32)
        z_new = (z + mac(-sigma, w, gj)).astype(F32)
        shrunk = (z_new - np.copysign(m.l1, z_new)).astype(F32)
        denom = mac((m.beta + sqrt_new).astype(F32), np.full_like(gj, m.inv_alpha),
                    np.full_like(gj, m.l2))  # fmt: skip
        solved = ((-shrunk) / denom).astype(F32)
        w_new = np.where(np.abs(z_new) <= m.l1, F32(0), solved).astype(F32)
        return w_new, np.concatenate([z_new, n_new], axis=1)


# --- the kernels ----------------------------------------------------------------------


@dataclass
class SlotRows:
    """One cached table's rows by slot, in the array module's memory."""

    weights: Any  # [slots, dim] float32
    state: Any  # [slots, state_dim] float32: optimizer state, the engine's layout
    counts: Any  # [slots] uint32: updates (and sightings before admission)
    steps: Any  # [slots] uint64: step of the last update
    times: Any  # [slots] uint32: unix seconds of the last update
    shows: Any  # [slots] float32: decayed shows as of steps
    clicks: Any  # [slots] float32
    dirty: Any  # [slots] bool: updated since it came in (to write back)
    admitted_at: Any  # [slots] uint64: step + 1 of an admission no push followed, else 0

    COLUMNS = ("weights", "state", "counts", "steps", "times", "shows", "clicks")

    def arrays(self) -> tuple:
        """Every column, the CPU twin's argument order."""
        return (*(getattr(self, c) for c in self.COLUMNS), self.dirty, self.admitted_at)

    @staticmethod
    def zeros(xp: Any, slots: int, dim: int, state_dim: int) -> SlotRows:
        if xp is np:  # written now: the pages are not faulted in during steps
            xp = _TouchedNumpy
        return SlotRows(
            weights=xp.zeros((slots, dim), F32),
            state=xp.zeros((slots, state_dim), F32),
            counts=xp.zeros(slots, np.uint32),
            steps=xp.zeros(slots, np.uint64),
            times=xp.zeros(slots, np.uint32),
            shows=xp.zeros(slots, F32),
            clicks=xp.zeros(slots, F32),
            dirty=xp.zeros(slots, bool),
            admitted_at=xp.zeros(slots, np.uint64),
        )


class _TouchedNumpy:
    """``np.zeros`` that writes its memory (``np.full``), so a cache's host
    arrays are faulted in when made, not by the first steps' scatters."""

    @staticmethod
    def zeros(shape: Any, dtype: Any) -> np.ndarray:
        return np.full(shape, 0, dtype)


class NumpyKernels:
    """The cache's kernels on numpy arrays: the CPU twin of ``CupyKernels``.
    The index runs the C++ twin of the CUDA kernels (``_engine.cache_*``,
    the same source); a push runs the engine's own row arithmetic on the
    cached rows (``_engine.cache_apply``)."""

    xp: Any = np
    name = "numpy"
    device = "cpu"

    # -- memory ----------------------------------------------------------------

    def to_device(self, host: Any) -> Any:
        return np.array(host, copy=True)

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def on_device(self, array: Any) -> bool:
        """Whether an array is in this module's memory."""
        return isinstance(array, np.ndarray)

    def as_device(self, array: Any) -> Any:
        """An array in this module's memory (no copy if it is already)."""
        return np.asarray(array)

    def synchronize(self) -> None:
        pass

    # -- rows ------------------------------------------------------------------

    def gather(self, src: Any, slots: Any) -> Any:
        """Rows ``src[slots]`` (a new array)."""
        return src[slots]

    def gather_into(self, src: Any, slots: Any, out: Any) -> None:
        """``out[:] = src[slots]`` (``out`` on the host or the device)."""
        np.take(src, slots, axis=0, out=out)

    def scatter(self, dst: Any, slots: Any, rows: Any) -> None:
        """``dst[slots] = rows`` (slots distinct)."""
        dst[slots] = rows

    def put_rows(self, out: Any, positions: Any, rows: Any) -> None:
        """``out[positions] = rows``: rows (host or device) into ``out``
        (host or device)."""
        out[positions] = rows

    def put_slots(
        self, rows: SlotRows, slots: np.ndarray, columns: dict[str, np.ndarray], admitted_at: Any
    ) -> None:
        """Whole rows (host columns by name, ``SlotRows.COLUMNS``) into
        distinct slots, marked clean, with their admission marks."""
        from wuliang.ps_server import _engine

        values = tuple(
            np.ascontiguousarray(columns[c], dtype=getattr(rows, c).dtype) for c in SlotRows.COLUMNS
        )
        _engine.cache_put(
            rows.arrays(), np.ascontiguousarray(slots, np.int64),
            (*values, np.ascontiguousarray(admitted_at, np.uint64)),
        )  # fmt: skip

    def scatter_add_rows(self, out: Any, index: Any, values: Any) -> None:
        """``out[index[i]] += values[i]`` for i in order (float32 rows), the
        sums rounded as a sequential loop rounds them."""
        np.add.at(out, np.asarray(index), np.asarray(values, F32))

    def finite_rows(self, grads: Any) -> np.ndarray:
        """bool ``[n]`` on the host: rows whose values are all finite."""
        return np.isfinite(grads).all(axis=1)

    # -- the index (details/cache_index.h) ---------------------------------------

    def index_lookup(
        self, index: Any, keys: Any, region: Any, counts: Any, observe: bool, epoch: int,
        weight: float,
    ) -> Any:  # fmt: skip
        """Each key's entry, -1 where absent; ``observe``: hits scored and
        stamped with ``epoch``."""
        from wuliang.ps_server import _engine

        return _engine.cache_lookup(
            index.device_regions, index.arrays(), keys, region, counts, observe, epoch,
            index.policy_id, weight, float(index.clock),
        )  # fmt: skip

    def index_score(self, index: Any, keys: Any, region: Any, counts: Any, weight: float) -> Any:
        """(set, score) of each miss."""
        from wuliang.ps_server import _engine

        return _engine.cache_score_misses(
            index.device_regions, index.arrays(), keys, region, counts, index.policy_id, weight
        )

    def index_populate(
        self, index: Any, keys: Any, region: Any, sets: Any, scores: Any, allowed: Any,
        clock: float, weight: float,
    ) -> Any:  # fmt: skip
        """(entry, how, victim) of misses sorted by (set, score descending)."""
        from wuliang.ps_server import _engine

        return _engine.cache_populate(
            index.device_regions, index.arrays(), keys, region, sets, scores, allowed,
            index.epoch, index.policy_id, clock, weight,
        )  # fmt: skip

    # -- a push ------------------------------------------------------------------

    def apply(
        self,
        spec: TableSpec,
        m: OptimizerMath,
        model: FloatModel,
        rows: SlotRows,
        slots: Any,
        grads: Any,
        add_shows: Any,
        add_clicks: Any,
        step: int,
        now: int,
    ) -> np.ndarray:
        """The engine's push of summed gradients (``[n, dim]``) to the rows
        at distinct ``slots``: non-finite rows dropped, the optimizer with
        clipping, statistics decayed to ``step`` then increased, count + 1,
        step and time, marked dirty. Returns which rows were applied (bool,
        in the module's memory)."""
        from wuliang.ps_server import _engine

        applied = _engine.cache_apply(
            m.native, rows.arrays(), np.ascontiguousarray(slots, np.int64),
            np.ascontiguousarray(grads, F32), add_shows, add_clicks, int(step), int(now),
            float(spec.stats_half_life),
        )  # fmt: skip
        return applied.view(bool)

    def update(
        self,
        m: OptimizerMath,
        model: FloatModel,
        weights: Any,
        state: Any,
        slots: Any,
        grads: Any,
        lr_t: np.ndarray | None,
    ) -> None:
        """The optimizer alone, in place, on the rows at ``slots`` (distinct)
        by summed, finite gradients, with every rounding of the device
        kernel spelled out (``update_rows``): the reference the CUDA kernel
        is checked against."""
        if len(slots) == 0:
            return
        scale = clip_scales(grads, m.clip_norm, model)
        w, s = update_rows(m, model, weights[slots], state[slots], grads, scale, lr_t)
        weights[slots] = w
        if m.state_dim:
            state[slots] = s


_CUDA_SOURCE = r"""
// The engine's UpdateRow (ps_server/csrc/details/optimizers.h), one thread
// per coordinate; every rounding spelled out (the _rn intrinsics are never
// contracted), FUSED choosing the fused forms of the engine's build.
#define MAC(a, b, c) (fused ? __fmaf_rn((a), (b), (c)) : __fadd_rn(__fmul_rn((a), (b)), (c)))

extern "C" __global__ void wuliang_clip_scale(
    const float* g,  // (n, dim)
    long long n, int dim, float clip, int cut, int fused,
    float* scale) {  // (n,)
  long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n) return;
  if (!(clip > 0.0f)) { scale[r] = 1.0f; return; }
  const float* row = g + r * dim;
  float sq = 0.0f;
  for (int j = 0; j < dim; ++j) {
    const float x = row[j];
    sq = j < cut ? __fadd_rn(sq, __fmul_rn(x, x)) : __fmaf_rn(x, x, sq);
  }
  const float norm = __fsqrt_rn(sq);
  scale[r] = norm > clip ? __fdiv_rn(clip, norm) : 1.0f;
}

extern "C" __global__ void wuliang_update(
    float* w,                 // (rows, dim)
    float* s,                 // (rows, sdim)
    const long long* slots,   // (n,)
    const float* g,           // (n, dim)
    const float* scale,       // (n,)
    const float* lr_t,        // (n,) Adam only
    const bool* ok,           // (n,) rows to update (finite gradients)
    long long n, int dim, int sdim, int kind, int fused,
    float lr, float eps, float b1, float b2, float c1, float c2,
    float l1, float l2, float beta, float inv_alpha) {
  long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= n * dim) return;
  const long long r = e / dim;
  if (!ok[r]) return;
  const int j = (int)(e % dim);
  const long long slot = slots[r];
  float* wp = w + slot * dim + j;
  float* sp = s + slot * sdim;
  const float gr = g[e];
  const float sc = scale[r];
  if (kind == 0) {  // SGD: w -= (lr * scale) * g
    const float rate = __fmul_rn(lr, sc);
    *wp = MAC(-rate, gr, *wp);
    return;
  }
  const float gj = __fmul_rn(gr, sc);
  if (kind == 1) {  // Adagrad
    const float acc = MAC(gj, gj, sp[j]);
    sp[j] = acc;
    *wp = __fsub_rn(*wp, __fdiv_rn(__fmul_rn(lr, gj), __fadd_rn(__fsqrt_rn(acc), eps)));
  } else if (kind == 2) {  // lazy Adam
    const float m = MAC(b1, sp[j], __fmul_rn(c1, gj));
    const float v = MAC(b2, sp[dim + j], __fmul_rn(__fmul_rn(c2, gj), gj));
    sp[j] = m;
    sp[dim + j] = v;
    if (j == 0) sp[2 * dim] = __fadd_rn(sp[2 * dim], 1.0f);
    *wp = __fsub_rn(*wp, __fdiv_rn(__fmul_rn(lr_t[r], m), __fadd_rn(__fsqrt_rn(v), eps)));
  } else {  // FTRL-Proximal
    const float z = sp[j], nn = sp[dim + j];
    const float n_new = MAC(gj, gj, nn);
    const float sqrt_new = __fsqrt_rn(n_new);
    const float sigma = __fmul_rn(__fsub_rn(sqrt_new, __fsqrt_rn(nn)), inv_alpha);
    const float z_new = __fadd_rn(z, MAC(-sigma, *wp, gj));
    sp[j] = z_new;
    sp[dim + j] = n_new;
    const float shrunk = __fsub_rn(z_new, copysignf(l1, z_new));
    const float denom = MAC(__fadd_rn(beta, sqrt_new), inv_alpha, l2);
    const float solved = __fdiv_rn(-shrunk, denom);
    *wp = fabsf(z_new) <= l1 ? 0.0f : solved;
  }
}

// What the engine's push does to an updated row besides the optimizer
// (details/row_layout.h): shows and clicks decayed from the row's step to
// `step` (factor from the host's table of exp2(-gap / half_life), the C
// library's, for gaps below decay_n), increased, rounded as the engine
// rounds; count + 1 (saturating), step and time stamped, marked dirty.
extern "C" __global__ void wuliang_touch_stats(
    const long long* slots, const bool* ok, long long n, unsigned int* counts,
    unsigned long long* steps,
    unsigned int* times, float* shows, float* clicks, bool* dirty,
    unsigned long long* admitted_at, const float* add_shows,  // (n,)
    const float* add_clicks,                                   // (n,)
    unsigned long long step, unsigned int now, double half_life, const double* decay,
    long long decay_n) {
  long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n || !ok[r]) return;
  const long long s = slots[r];
  float sh = shows[s], cl = clicks[s];
  const unsigned long long from = steps[s];
  if ((sh != 0.0f || cl != 0.0f) && half_life > 0.0 && step > from) {
    const unsigned long long gap = step - from;
    const double f = gap < (unsigned long long)decay_n ? decay[gap]
                                                        : exp2(-(double)gap / half_life);
    if (f != 1.0) {
      sh = __double2float_rn(__dmul_rn((double)sh, f));
      cl = __double2float_rn(__dmul_rn((double)cl, f));
    }
  }
  shows[s] = __fadd_rn(sh, add_shows[r]);
  clicks[s] = __fadd_rn(cl, add_clicks[r]);
  counts[s] = counts[s] == 0xffffffffu ? counts[s] : counts[s] + 1u;
  steps[s] = step;
  times[s] = now;
  dirty[s] = true;
  admitted_at[s] = 0ull;
}

// out[index[order[k]]] += values[order[k]] for k in each segment of equal
// index, in order: `order` sorts index stably, seg (segments + 1) bounds the
// segments. One thread per (segment, coordinate): the sums round as a
// sequential loop over the values does.
extern "C" __global__ void wuliang_scatter_add_rows(
    float* out, const long long* index, const long long* order, const long long* seg,
    long long segments, const float* values, int dim) {
  long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= segments * dim) return;
  const long long g = e / dim;
  const int j = (int)(e % dim);
  const long long begin = seg[g], end = seg[g + 1];
  const long long row = index[order[begin]];
  float acc = out[row * dim + j];
  for (long long k = begin; k < end; ++k) acc = __fadd_rn(acc, values[order[k] * dim + j]);
  out[row * dim + j] = acc;
}
"""
_KINDS = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 3}


class CupyKernels(NumpyKernels):
    """The cache's kernels on cupy arrays: the index from
    ``details/cache_index.h`` (compiled by NVRTC at first use), gather and
    scatter as ``ElementwiseKernel``, clipping, the optimizers and the row
    statistics as ``RawKernel`` (one compile per process, cached by cupy on
    disk). Everything stays on the device but what the host asks for."""

    name = "cupy"
    _THREADS = 256

    def __init__(self, cupy: Any) -> None:
        self.xp = cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        raw_name = props.get("name", b"gpu")
        self.device = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        self._gather = cupy.ElementwiseKernel(
            "raw T src, raw int64 slots, int64 width",
            "T dst",
            "dst = src[slots[i / width] * width + i % width]",
            "wuliang_gather",
        )
        self._scatter = cupy.ElementwiseKernel(
            "T src, raw int64 slots, int64 width",
            "raw T dst",
            "dst[slots[i / width] * width + i % width] = src",
            "wuliang_scatter",
        )
        module = cupy.RawModule(code=_CUDA_SOURCE, options=("--fmad=false",))
        self._clip = module.get_function("wuliang_clip_scale")
        self._update = module.get_function("wuliang_update")
        self._touch_stats = module.get_function("wuliang_touch_stats")
        self._scatter_add = module.get_function("wuliang_scatter_add_rows")
        index = cupy.RawModule(code=index_source())
        self._lookup = index.get_function("wl_lookup")
        self._score = index.get_function("wl_score_misses")
        self._populate = index.get_function("wl_populate")
        self._tables: dict[tuple, Any] = {}  # device copies of host tables (rates, decay)

    def _grid(self, threads: int) -> tuple[tuple[int], tuple[int]]:
        return ((threads + self._THREADS - 1) // self._THREADS,), (self._THREADS,)

    # -- memory ----------------------------------------------------------------

    def to_device(self, host: Any) -> Any:
        return self.xp.asarray(host)

    def to_host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array) if isinstance(array, self.xp.ndarray) else np.asarray(array)

    def on_device(self, array: Any) -> bool:
        return isinstance(array, self.xp.ndarray)

    def as_device(self, array: Any) -> Any:
        return self.xp.asarray(array)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    # -- rows ------------------------------------------------------------------

    def gather(self, src: Any, slots: Any) -> Any:
        xp = self.xp
        width = int(np.prod(src.shape[1:], dtype=np.int64)) if src.ndim > 1 else 1
        dst = xp.empty((len(slots), *src.shape[1:]), dtype=src.dtype)
        if len(slots) and width:
            self._gather(src, xp.asarray(slots, dtype=np.int64), width, dst)
        return dst

    def gather_into(self, src: Any, slots: Any, out: Any) -> None:
        rows = self.gather(src, slots)
        if self.on_device(out):
            out[...] = rows
        else:
            rows.get(out=out)

    def scatter(self, dst: Any, slots: Any, rows: Any) -> None:
        xp = self.xp
        width = int(np.prod(dst.shape[1:], dtype=np.int64)) if dst.ndim > 1 else 1
        if len(slots) and width:
            rows = xp.ascontiguousarray(xp.asarray(rows, dtype=dst.dtype))
            self._scatter(rows, xp.asarray(slots, dtype=np.int64), width, dst)

    def put_rows(self, out: Any, positions: Any, rows: Any) -> None:
        if self.on_device(out):
            out[self.xp.asarray(positions)] = self.xp.asarray(rows)
        else:
            out[self.to_host(positions)] = self.to_host(rows)

    def put_slots(
        self, rows: SlotRows, slots: np.ndarray, columns: dict[str, np.ndarray], admitted_at: Any
    ) -> None:
        d_slots = self.xp.asarray(slots, dtype=np.int64)
        for name in SlotRows.COLUMNS:
            target = getattr(rows, name)
            if target.ndim == 1 or target.shape[1]:
                self.scatter(target, d_slots, self.xp.asarray(columns[name]))
        rows.dirty[d_slots] = False
        rows.admitted_at[d_slots] = self.xp.asarray(admitted_at, dtype=np.uint64)

    def scatter_add_rows(self, out: Any, index: Any, values: Any) -> None:
        xp = self.xp
        n = len(index)
        if n == 0:
            return
        dim = out.shape[1]
        index = xp.asarray(index, dtype=np.int64)
        order = xp.argsort(index)  # stable
        ordered = index[order]
        starts = xp.nonzero(ordered[1:] != ordered[:-1])[0] + 1
        seg = xp.concatenate([xp.zeros(1, np.int64), starts.astype(np.int64),
                              xp.full(1, n, np.int64)])  # fmt: skip
        segments = len(seg) - 1
        values = xp.ascontiguousarray(xp.asarray(values, dtype=F32))
        args = (out, index, order, seg, np.int64(segments), values, np.int32(dim))
        self._scatter_add(*self._grid(segments * dim), args)

    def finite_rows(self, grads: Any) -> np.ndarray:
        return self.to_host(self.xp.isfinite(grads).all(axis=1))

    # -- the index -----------------------------------------------------------------

    def _counts(self, counts: Any, n: int) -> Any:
        return self.xp.ones(n, F32) if counts is None else self.xp.asarray(counts, dtype=F32)

    def _ghosts(self, index: Any) -> tuple[Any, Any]:
        if index.ghost_keys is None:
            return self.xp.zeros(1, np.uint64), self.xp.full(1, -1.0)
        return index.ghost_keys, index.ghost_scores

    def index_lookup(
        self, index: Any, keys: Any, region: Any, counts: Any, observe: bool, epoch: int,
        weight: float,
    ) -> Any:  # fmt: skip
        xp = self.xp
        n = len(keys)
        out = xp.empty(n, np.int64)
        if n:
            entry_base, _, sets, ways = index.device_regions
            self._lookup(*self._grid(32 * n), (
                keys, region, self._counts(counts, n), np.int64(n), entry_base, sets, ways,
                index.keys, index.scores, index.epochs, np.int32(observe), np.int64(epoch),
                np.int32(index.policy_id), np.float64(weight), np.float64(index.clock), out,
            ))  # fmt: skip
        return out

    def index_score(self, index: Any, keys: Any, region: Any, counts: Any, weight: float) -> Any:
        xp = self.xp
        m = len(keys)
        sets, scores = xp.empty(m, np.int64), xp.empty(m, np.float64)
        if m:
            entry_base, ghost_base, n_sets, ways = index.device_regions
            gkeys, gscores = self._ghosts(index)
            self._score(*self._grid(m), (
                keys, region, self._counts(counts, m), np.int64(m), entry_base, ghost_base,
                n_sets, ways, gkeys, gscores, np.int32(index.ghosts), np.int32(index.policy_id),
                np.float64(weight), sets, scores,
            ))  # fmt: skip
        return sets, scores

    def index_populate(
        self, index: Any, keys: Any, region: Any, sets: Any, scores: Any, allowed: Any,
        clock: float, weight: float,
    ) -> Any:  # fmt: skip
        xp = self.xp
        m = len(keys)
        way, how, victim = xp.empty(m, np.int64), xp.empty(m, np.uint8), xp.zeros(m, np.uint64)
        if m:
            entry_base, ghost_base, _, ways = index.device_regions
            gkeys, gscores = self._ghosts(index)
            self._populate(*self._grid(m), (
                keys, region, sets, scores, allowed, np.int64(m), entry_base, ghost_base, ways,
                index.keys, index.scores, index.epochs, gkeys, gscores, np.int32(index.ghosts),
                np.int64(index.epoch), np.int32(index.policy_id), np.float64(clock),
                np.float64(weight), way, how, victim,
            ))  # fmt: skip
        return way, how, victim

    # -- a push ------------------------------------------------------------------

    def _host_table(self, key: tuple, make: Callable[[], np.ndarray]) -> Any:
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self.xp.asarray(make())
        return table

    def apply(
        self,
        spec: TableSpec,
        m: OptimizerMath,
        model: FloatModel,
        rows: SlotRows,
        slots: Any,
        grads: Any,
        add_shows: Any,
        add_clicks: Any,
        step: int,
        now: int,
    ) -> np.ndarray:
        xp = self.xp
        grads = xp.ascontiguousarray(xp.asarray(grads, dtype=F32))
        slots = xp.asarray(slots, dtype=np.int64)
        n = len(slots)
        finite = xp.isfinite(grads).all(axis=1)  # rows not finite are left alone
        if n == 0:
            return finite
        lr_t = None
        if m.kind == "adam":  # each row's rate at its new t, from the host's exact table
            t = rows.state[slots, 2 * m.dim].astype(np.int64) + 1
            size = 1 << max(16, int(self.to_host(t.max())).bit_length())
            rates = self._host_table(("adam", id(m), size), lambda: m.rate_table(size))
            lr_t = rates[t]
        self.update(m, model, rows.weights, rows.state, slots, grads, lr_t, ok=finite)
        half_life = float(spec.stats_half_life)
        decay = self._host_table(("decay", half_life), lambda: decay_table(half_life))
        zeros = xp.zeros(n, F32)
        add_s = zeros if add_shows is None else xp.asarray(add_shows, dtype=F32)
        add_c = zeros if add_clicks is None else xp.asarray(add_clicks, dtype=F32)
        self._touch_stats(*self._grid(n), (
            slots, finite, np.int64(n), rows.counts, rows.steps, rows.times, rows.shows,
            rows.clicks, rows.dirty, rows.admitted_at, add_s, add_c, np.uint64(step),
            np.uint32(now), np.float64(half_life), decay, np.int64(len(decay)),
        ))  # fmt: skip
        return finite

    def update(
        self,
        m: OptimizerMath,
        model: FloatModel,
        weights: Any,
        state: Any,
        slots: Any,
        grads: Any,
        lr_t: Any,
        ok: Any = None,
    ) -> None:
        n = len(slots)
        if n == 0:
            return
        xp = self.xp
        dim = m.dim
        g = xp.ascontiguousarray(xp.asarray(grads, dtype=F32))
        d_slots = xp.asarray(slots, dtype=np.int64)
        scale = xp.empty(n, dtype=F32)
        self._clip(*self._grid(n), (
            g, np.int64(n), np.int32(dim), m.clip_norm, np.int32(model.clip_cut(dim)),
            np.int32(model.fused), scale,
        ))  # fmt: skip
        rates = xp.asarray(lr_t if lr_t is not None else xp.zeros(n, F32), dtype=F32)
        ok = xp.ones(n, bool) if ok is None else ok
        self._update(*self._grid(n * dim), (
            weights, state, d_slots, g, scale, rates, ok, np.int64(n), np.int32(dim),
            np.int32(m.state_dim), np.int32(_KINDS[m.kind]), np.int32(model.fused),
            m.lr, m.eps, m.b1, m.b2, m.c1, m.c2, m.l1, m.l2, m.beta, m.inv_alpha,
        ))  # fmt: skip


def index_source() -> str:
    """The index kernels' CUDA source (``details/cache_index.h``, installed
    beside this module)."""
    from importlib import resources

    return (resources.files("wuliang.ps_server.cache") / "cache_index.h").read_text()


def decay_table(half_life: float, size: int = 1 << 16) -> np.ndarray:
    """float64 ``[size]``: the engine's decay factor ``exp2(-gap /
    half_life)`` (the C library's) of each gap; 1 without decay."""
    if not half_life > 0:
        return np.ones(size)
    return np.array([libm_exp2(-gap / half_life) for gap in range(size)])
