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


class NumpyKernels:
    """The cache's kernels on numpy arrays (the CPU twin of ``CupyKernels``)."""

    xp: Any = np
    name = "numpy"
    device = "cpu"

    def to_device(self, host: np.ndarray) -> Any:
        return np.array(host, copy=True)

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def gather(self, src: Any, slots: np.ndarray) -> Any:
        """Rows ``src[slots]`` (a new array)."""
        return src[slots]

    def gather_into(self, src: Any, slots: np.ndarray, out: np.ndarray) -> None:
        """``out[:] = src[slots]`` into a host array (a pull's answer)."""
        np.take(src, slots, axis=0, out=out)

    def scatter(self, dst: Any, slots: np.ndarray, rows: Any) -> None:
        """``dst[slots] = rows`` (slots distinct)."""
        dst[slots] = rows

    def update(
        self,
        m: OptimizerMath,
        model: FloatModel,
        weights: Any,
        state: Any,
        slots: np.ndarray,
        grads: np.ndarray,
        lr_t: np.ndarray | None,
    ) -> None:
        """The optimizer applied in place to the rows at ``slots`` (distinct)
        by the summed, finite gradients ``grads`` (host float32 ``[n, dim]``)."""
        if len(slots) == 0:
            return
        scale = clip_scales(grads, m.clip_norm, model)
        w, s = update_rows(m, model, weights[slots], state[slots], grads, scale, lr_t)
        weights[slots] = w
        if m.state_dim:
            state[slots] = s

    def touch(
        self, counts: Any, steps: Any, times: Any, slots: np.ndarray, step: int, now: int
    ) -> None:
        """The metadata of updated rows: count + 1 (saturating), step, time."""
        if len(slots) == 0:
            return
        c = counts[slots]
        counts[slots] = np.where(c == COUNT_MAX, c, c + np.uint32(1))
        steps[slots] = np.uint64(step)
        times[slots] = np.uint32(now)

    def synchronize(self) -> None:
        pass


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
    long long n, int dim, int sdim, int kind, int fused,
    float lr, float eps, float b1, float b2, float c1, float c2,
    float l1, float l2, float beta, float inv_alpha) {
  long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= n * dim) return;
  const long long r = e / dim;
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
"""
_KINDS = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 3}


class CupyKernels(NumpyKernels):
    """The cache's kernels on cupy arrays: gather and scatter as
    ``ElementwiseKernel``, clipping and the optimizers as ``RawKernel``
    (one compile per process, cached by cupy on disk)."""

    name = "cupy"

    def __init__(self, cupy: Any) -> None:
        self.xp = cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        raw_name = props.get("name", b"gpu")
        self.device = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        options = ("--fmad=false",)
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
        self._touch = cupy.ElementwiseKernel(
            "int64 slot, uint64 step, uint32 now",
            "raw uint32 counts, raw uint64 steps, raw uint32 times",
            "counts[slot] = counts[slot] == 0xffffffffu ? counts[slot] : counts[slot] + 1;"
            "steps[slot] = step; times[slot] = now;",
            "wuliang_touch",
        )
        module = cupy.RawModule(code=_CUDA_SOURCE, options=options)
        self._clip = module.get_function("wuliang_clip_scale")
        self._update = module.get_function("wuliang_update")

    def to_device(self, host: np.ndarray) -> Any:
        return self.xp.asarray(host)

    def to_host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array)

    def gather(self, src: Any, slots: np.ndarray) -> Any:
        xp = self.xp
        width = int(np.prod(src.shape[1:], dtype=np.int64)) if src.ndim > 1 else 1
        dst = xp.empty((len(slots), *src.shape[1:]), dtype=src.dtype)
        if len(slots) and width:
            self._gather(src, xp.asarray(slots, dtype=np.int64), width, dst)
        return dst

    def gather_into(self, src: Any, slots: np.ndarray, out: np.ndarray) -> None:
        self.gather(src, slots).get(out=out)

    def scatter(self, dst: Any, slots: np.ndarray, rows: Any) -> None:
        xp = self.xp
        width = int(np.prod(dst.shape[1:], dtype=np.int64)) if dst.ndim > 1 else 1
        if len(slots) and width:
            rows = xp.ascontiguousarray(xp.asarray(rows, dtype=dst.dtype))
            self._scatter(rows, xp.asarray(slots, dtype=np.int64), width, dst)

    def update(
        self,
        m: OptimizerMath,
        model: FloatModel,
        weights: Any,
        state: Any,
        slots: np.ndarray,
        grads: np.ndarray,
        lr_t: np.ndarray | None,
    ) -> None:
        n = len(slots)
        if n == 0:
            return
        xp = self.xp
        dim = m.dim
        g = xp.asarray(np.ascontiguousarray(grads, dtype=F32))
        d_slots = xp.asarray(slots, dtype=np.int64)
        scale = xp.empty(n, dtype=F32)
        threads = 256
        self._clip(
            ((n + threads - 1) // threads,),
            (threads,),
            (g, np.int64(n), np.int32(dim), m.clip_norm, np.int32(model.clip_cut(dim)),
             np.int32(model.fused), scale),
        )  # fmt: skip
        rates = xp.asarray(lr_t if lr_t is not None else np.zeros(n, F32), dtype=F32)
        total = n * dim
        self._update(
            ((total + threads - 1) // threads,),
            (threads,),
            (
                weights, state, d_slots, g, scale, rates, np.int64(n), np.int32(dim),
                np.int32(m.state_dim), np.int32(_KINDS[m.kind]), np.int32(model.fused),
                m.lr, m.eps, m.b1, m.b2, m.c1, m.c2, m.l1, m.l2, m.beta, m.inv_alpha,
            ),
        )  # fmt: skip

    def touch(
        self, counts: Any, steps: Any, times: Any, slots: np.ndarray, step: int, now: int
    ) -> None:
        if len(slots) == 0:
            return
        xp = self.xp
        self._touch(
            xp.asarray(slots, dtype=np.int64), np.uint64(step), np.uint32(now),
            counts, steps, times,
        )  # fmt: skip

    def synchronize(self) -> None:
        self.xp.cuda.Stream.null.synchronize()
