"""Every optimizer against a numpy reference that mirrors csrc/details/optimizers.cc.

The references compute in float32 where the C++ code does (and in float64 for
Adam's bias correction, as the C++ code does), so results agree to ~1e-6.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from wuliang.ps_server import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Engine,
    Optimizer,
    RowChunk,
    TableSpec,
    TruncatedNormal,
    Zeros,
)

MakeEngine = Callable[[int], Engine]  # the make_engine fixture (conftest.py)
ExportAll = Callable[..., RowChunk]  # the export_all fixture (conftest.py)

F32 = np.float32
DIM = 8
TOL = {"rtol": 1e-6, "atol": 1e-6}

OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": SGD(learning_rate=0.1),
    "sgd-clip": SGD(learning_rate=0.1, clip_norm=0.5),
    "adagrad": Adagrad(learning_rate=0.05, initial_accumulator=0.1, epsilon=1e-7),
    "adagrad-clip": Adagrad(learning_rate=0.05, initial_accumulator=0.2, clip_norm=0.7),
    "adam": Adam(learning_rate=0.01, beta1=0.9, beta2=0.999, epsilon=1e-7),
    "adam-clip": Adam(learning_rate=0.02, beta1=0.8, beta2=0.99, epsilon=1e-6, clip_norm=0.6),
    "ftrl": FTRL(learning_rate=0.05, l1=0.2, l2=0.1, beta=1.0, initial_accumulator=0.1),
    "ftrl-clip": FTRL(learning_rate=0.1, l1=0.05, l2=0.3, beta=0.5, clip_norm=0.8),
}


# --- numpy reference ----------------------------------------------------------


def initial_state(opt: Optimizer, dim: int) -> np.ndarray:
    if isinstance(opt, Adagrad):
        return np.full(dim, opt.initial_accumulator, F32)
    if isinstance(opt, Adam):
        return np.zeros(2 * dim + 1, F32)  # m, v, t
    if isinstance(opt, FTRL):
        return np.concatenate([np.zeros(dim, F32), np.full(dim, opt.initial_accumulator, F32)])
    return np.zeros(0, F32)


def clip_scale(opt: Optimizer, g: np.ndarray) -> F32:
    clip = F32(opt.clip_norm)
    if clip <= 0:
        return F32(1.0)
    sq = F32(0.0)
    for x in g:  # sequential float32 sum, as in ClipScale
        sq = F32(sq + x * x)
    norm = np.sqrt(sq, dtype=F32)
    return F32(clip / norm) if norm > clip else F32(1.0)


def apply_update(
    opt: Optimizer, w: np.ndarray, state: np.ndarray, g: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One update of one row from its (summed) gradient; returns new (w, state)."""
    dim = len(w)
    scale = clip_scale(opt, g)
    lr = F32(opt.learning_rate)
    if isinstance(opt, SGD):
        return w - (lr * scale) * g, state
    gs = g * scale
    if isinstance(opt, Adagrad):
        acc = state + gs * gs
        return w - lr * gs / (np.sqrt(acc) + F32(opt.epsilon)), acc
    if isinstance(opt, Adam):
        m, v, t = state[:dim], state[dim : 2 * dim], state[2 * dim] + F32(1.0)
        b1, b2, eps = F32(opt.beta1), F32(opt.beta2), F32(opt.epsilon)
        td = float(t)
        lr_t = F32(float(lr) * math.sqrt(1.0 - float(b2) ** td) / (1.0 - float(b1) ** td))
        m = b1 * m + (F32(1.0) - b1) * gs
        v = b2 * v + (F32(1.0) - b2) * gs * gs
        w = w - lr_t * m / (np.sqrt(v) + eps)
        return w, np.concatenate([m, v, np.array([t], F32)])
    if isinstance(opt, FTRL):
        z, n = state[:dim], state[dim:]
        inv_alpha = F32(1.0) / lr
        l1, l2, beta = F32(opt.l1), F32(opt.l2), F32(opt.beta)
        n_new = n + gs * gs
        sqrt_new = np.sqrt(n_new)
        sigma = (sqrt_new - np.sqrt(n)) * inv_alpha
        z = z + (gs - sigma * w)
        shrunk = z - np.copysign(l1, z)
        w = np.where(np.abs(z) <= l1, F32(0.0), -shrunk / ((beta + sqrt_new) * inv_alpha + l2))
        return w.astype(F32), np.concatenate([z, n_new])
    raise AssertionError(f"no reference for {opt!r}")


def summed_by_key(idx: np.ndarray, grads: np.ndarray) -> dict[int, np.ndarray]:
    """Gradient rows of repeated indices summed in order of occurrence (float32)."""
    sums: dict[int, np.ndarray] = {}
    for i, g in zip(idx.tolist(), grads, strict=True):
        sums[i] = sums[i] + g if i in sums else g.copy()
    return sums


# --- tests --------------------------------------------------------------------


def make_table(engine: Engine, opt: Optimizer, name: str = "t", dim: int = DIM) -> str:
    init = TruncatedNormal(stddev=0.1)
    engine.create_table(TableSpec(name, dim=dim, optimizer=opt, initializer=init, seed=7))
    return name


def random_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    keys = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True)
    keys[:2] = [0, 2**64 - 1]
    assert len(np.unique(keys)) == n
    return keys


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_matches_numpy_reference(
    opt_name: str,
    num_shards: int,
    make_engine: MakeEngine,
    export_all: ExportAll,
    rng: np.random.Generator,
) -> None:
    opt = OPTIMIZERS[opt_name]
    engine = make_engine(num_shards)
    table = make_table(engine, opt)
    keys = random_keys(rng, 64)
    weights = engine.pull(table, keys)  # creates the rows
    state = np.tile(initial_state(opt, DIM), (len(keys), 1))
    pushes = np.zeros(len(keys), np.int64)
    order = np.argsort(keys)

    rows = export_all(engine, table)
    np.testing.assert_array_equal(rows.state, state[order])

    for step in range(1, 7):
        engine.step = step * 10
        idx = rng.integers(0, len(keys), size=48)  # repeats and untouched keys
        grads = rng.standard_normal((len(idx), DIM)).astype(F32)
        grads *= rng.uniform(0.05, 1.5, size=(len(idx), 1)).astype(F32)
        result = engine.push(table, keys[idx], grads)

        sums = summed_by_key(idx, grads)
        assert result.applied == len(sums)
        assert result.duplicates == len(idx) - len(sums)
        assert result.dropped_nan == result.dropped_pending == 0
        for i, g in sums.items():
            weights[i], state[i] = apply_update(opt, weights[i], state[i], g)
            pushes[i] += 1

        np.testing.assert_allclose(engine.pull(table, keys, train=False), weights, **TOL)
        rows = export_all(engine, table)
        np.testing.assert_array_equal(rows.keys, keys[order])
        np.testing.assert_allclose(rows.weights, weights[order], **TOL)
        np.testing.assert_allclose(rows.state, state[order], **TOL)
        np.testing.assert_array_equal(rows.counts, pushes[order])
        assert set(rows.steps[idx_rank(order, list(sums))].tolist()) == {step * 10}

    if isinstance(opt, FTRL):  # both branches of the l1 threshold were exercised
        assert (weights == 0).any() and (weights != 0).any()


def idx_rank(order: np.ndarray, indices: list[int]) -> np.ndarray:
    """Positions in the key-sorted export of the given key indices."""
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[indices]


@pytest.mark.parametrize("num_shards", [1, 3])
def test_adam_is_lazy(
    num_shards: int, make_engine: MakeEngine, export_all: ExportAll, rng: np.random.Generator
) -> None:
    """A row's step t only advances when the row is pushed; others keep m, v, t and w."""
    opt = Adam(learning_rate=0.05, beta1=0.9, beta2=0.99)
    engine = make_engine(num_shards)
    table = make_table(engine, opt, dim=4)
    keys = random_keys(rng, 20)
    groups = {"a": np.arange(0, 10), "b": np.arange(10, 20)}
    weights = engine.pull(table, keys)
    state = np.tile(initial_state(opt, 4), (len(keys), 1))
    order = np.argsort(keys)

    for name in ["a", "a", "b", "a", "b", "a"]:
        idx = groups[name]
        before = export_all(engine, table)
        grads = rng.standard_normal((len(idx), 4)).astype(F32)
        assert engine.push(table, keys[idx], grads).applied == len(idx)
        for i, g in zip(idx, grads, strict=True):
            weights[i], state[i] = apply_update(opt, weights[i], state[i], g)

        after = export_all(engine, table)
        untouched = np.isin(order, idx, invert=True)
        np.testing.assert_array_equal(after.weights[untouched], before.weights[untouched])
        np.testing.assert_array_equal(after.state[untouched], before.state[untouched])
        np.testing.assert_allclose(after.weights, weights[order], **TOL)
        np.testing.assert_allclose(after.state, state[order], **TOL)

    t = export_all(engine, table).state[:, 2 * 4]
    expected_t = np.where(np.isin(order, groups["a"]), 4, 2)
    np.testing.assert_array_equal(t, expected_t)


# 64 shards: more than 2 per core, so the engine sorts batches by shard
# instead of letting every shard filter the batch (Engine::PlanBatch).
@pytest.mark.parametrize("num_shards", [1, 3, 64])
@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam-clip", "ftrl"])
def test_duplicates_equal_one_summed_push(
    opt_name: str,
    num_shards: int,
    make_engine: MakeEngine,
    export_all: ExportAll,
    rng: np.random.Generator,
) -> None:
    opt = OPTIMIZERS[opt_name]
    engine = make_engine(num_shards)
    repeated, summed = make_table(engine, opt, "repeated"), make_table(engine, opt, "summed")
    keys = random_keys(rng, 30)
    idx = rng.permutation(np.repeat(np.arange(len(keys)), 3))
    grads = rng.standard_normal((len(idx), DIM)).astype(F32)
    sums = summed_by_key(idx, grads)
    unique_idx = np.array(list(sums))

    result = engine.push(repeated, keys[idx], grads)
    assert result.applied == len(keys)
    assert result.duplicates == 2 * len(keys)
    result = engine.push(summed, keys[unique_idx], np.stack(list(sums.values())))
    assert result.applied == len(keys)
    assert result.duplicates == 0

    a, b = export_all(engine, repeated), export_all(engine, summed)
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.state, b.state)
    np.testing.assert_array_equal(a.counts, np.ones(len(keys)))  # one update per key
    np.testing.assert_array_equal(b.counts, np.ones(len(keys)))


def test_repeated_pushes_differ_from_summed_push_for_adam(make_engine: MakeEngine) -> None:
    """Sanity check of the test above: for Adam, three updates are not one."""
    engine = make_engine(1)
    opt = Adam(learning_rate=0.1)
    three, one = make_table(engine, opt, "three"), make_table(engine, opt, "one")
    g = np.array([[0.5] * DIM], F32)
    for _ in range(3):
        engine.push(three, [5], g)
    engine.push(one, [5, 5, 5], np.repeat(g, 3, axis=0))
    assert not np.allclose(engine.pull(three, [5]), engine.pull(one, [5]), rtol=1e-3)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_clip_norm_by_hand(num_shards: int, make_engine: MakeEngine) -> None:
    engine = make_engine(num_shards)
    spec = TableSpec(
        "t", dim=2, optimizer=SGD(learning_rate=1.0, clip_norm=1.0), initializer=Zeros()
    )
    engine.create_table(spec)
    engine.push("t", [1, 2], np.array([[3, 4], [0.3, 0.4]], F32))  # norms 5 and 0.5
    np.testing.assert_allclose(engine.pull("t", [1, 2]), [[-0.6, -0.8], [-0.3, -0.4]], **TOL)
    # The summed gradient of a repeated key is clipped, not each part.
    engine.push("t", [3, 3], np.array([[0.3, 0.4], [0.3, 0.4]], F32))  # sum has norm 1.0
    engine.push("t", [4, 4, 4], np.array([[0.3, 0.4]] * 3, F32))  # sum has norm 1.5
    np.testing.assert_allclose(engine.pull("t", [3, 4]), [[-0.6, -0.8], [-0.6, -0.8]], **TOL)
