"""Initial vectors: a pure function of (table seed, key), with the right distribution."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

import wuliang as wl
from wuliang.ps_server import (
    SGD,
    Adam,
    Constant,
    Engine,
    Initializer,
    Normal,
    TableSpec,
    TruncatedNormal,
    Uniform,
    Zeros,
)

MakeEngine = Callable[[int], Engine]  # the make_engine fixture (conftest.py)

INITIALIZERS: dict[str, Initializer] = {
    "truncated": TruncatedNormal(stddev=0.1, mean=0.5),
    "normal": Normal(stddev=2.0, mean=-1.0),
    "uniform": Uniform(minval=-0.3, maxval=0.7),
    "zeros": Zeros(),
    "constant": Constant(value=1.5),
}


def table(name: str, dim: int, init: Initializer | None = None, seed: int = 3) -> TableSpec:
    if init is None:
        return TableSpec(name, dim=dim, optimizer=SGD(0.1), seed=seed)
    return TableSpec(name, dim=dim, optimizer=SGD(0.1), initializer=init, seed=seed)


def initial_vectors(
    make_engine: MakeEngine,
    init: Initializer | None,
    keys: np.ndarray,
    dim: int = 16,
    seed: int = 3,
) -> np.ndarray:
    engine = make_engine(2)
    engine.create_table(table("t", dim, init, seed))
    return engine.pull("t", keys, train=False)


@pytest.fixture
def keys(rng: np.random.Generator) -> np.ndarray:
    keys = np.unique(rng.integers(0, 2**64 - 1, size=500, dtype=np.uint64, endpoint=True))
    return np.concatenate([keys, np.array([0, 1, 2**63, 2**64 - 1], np.uint64)])


@pytest.mark.parametrize("init_name", list(INITIALIZERS))
def test_same_vectors_for_any_shard_count_and_engine(
    init_name: str, keys: np.ndarray, make_engine: MakeEngine
) -> None:
    init = INITIALIZERS[init_name]
    reference = initial_vectors(make_engine, init, keys)
    for num_shards in (1, 3, 8, 8):  # 8 twice: two separate engines
        engine = make_engine(num_shards)
        engine.create_table(table("t", 16, init))
        np.testing.assert_array_equal(engine.pull("t", keys, train=False), reference)
        np.testing.assert_array_equal(engine.pull("t", keys, train=True), reference)  # new rows
        assert engine.contains("t", keys).all()
        np.testing.assert_array_equal(engine.pull("t", keys, train=False), reference)
        perm = np.random.default_rng(num_shards).permutation(len(keys))
        np.testing.assert_array_equal(engine.pull("t", keys[perm]), reference[perm])


@pytest.mark.parametrize("dim", [3, 16, 40])
@pytest.mark.parametrize("new_every", [1, 3, 20])
def test_rows_created_in_batches_get_their_initial_vectors(
    dim: int, new_every: int, rng: np.random.Generator, make_engine: MakeEngine
) -> None:
    """New rows get their weights in batches, after the index probes: a row's
    visit (the pull's copy, the push's update) must still see them, with new
    keys dense or sparse among known ones, repeated in the batch, or created
    by a push."""
    init = TruncatedNormal(stddev=0.2)
    keys = np.unique(rng.integers(0, 2**63, size=3000, dtype=np.uint64))
    rng.shuffle(keys)
    reference = initial_vectors(make_engine, init, keys, dim=dim)
    engine = make_engine(2)
    engine.create_table(table("t", dim, init))
    known = np.ones(len(keys), bool)
    known[::new_every] = False
    engine.pull("t", keys[known])  # rows for all but every new_every-th key
    batch = np.concatenate([keys, keys[:50]])  # the first 50 keys twice
    np.testing.assert_array_equal(engine.pull("t", batch), reference[np.r_[: len(keys), :50]])
    fresh = np.unique(rng.integers(0, 2**63, size=500, dtype=np.uint64))
    engine.push("t", fresh, np.zeros((len(fresh), dim), np.float32))  # created by the push
    np.testing.assert_array_equal(
        engine.pull("t", fresh, train=False), initial_vectors(make_engine, init, fresh, dim=dim)
    )


def test_int64_and_uint64_keys_share_initial_vectors(make_engine: MakeEngine) -> None:
    signed = np.array([-1, -2, -(2**63), 5], np.int64)
    a = initial_vectors(make_engine, Normal(), signed)
    b = initial_vectors(make_engine, Normal(), signed.view(np.uint64))
    np.testing.assert_array_equal(a, b)


def test_initial_vector_comes_back_after_erase(make_engine: MakeEngine) -> None:
    engine = make_engine(3)
    engine.create_table(table("t", 8, Uniform()))
    first = engine.pull("t", [11, 12])
    engine.push("t", [11, 12], np.ones((2, 8), np.float32))
    assert not np.array_equal(engine.pull("t", [11, 12]), first)
    assert engine.erase("t", [11, 12]) == 2
    np.testing.assert_array_equal(engine.pull("t", [11, 12], train=False), first)
    np.testing.assert_array_equal(engine.pull("t", [11, 12]), first)


def test_seed_changes_vectors_name_does_not(keys: np.ndarray, make_engine: MakeEngine) -> None:
    engine = make_engine(2)
    for name, seed in (("a", 1), ("b", 2), ("c", 1)):
        engine.create_table(table(name, 16, TruncatedNormal(), seed=seed))
    a, b, c = (engine.pull(name, keys, train=False) for name in "abc")
    np.testing.assert_array_equal(a, c)
    assert not np.any(np.all(a == b, axis=1))  # no key keeps its vector under another seed
    assert len(np.unique(a, axis=0)) == len(keys)  # keys get different vectors


def test_zeros_and_constant(keys: np.ndarray, make_engine: MakeEngine) -> None:
    zeros = initial_vectors(make_engine, Zeros(), keys)
    assert zeros.dtype == np.float32 and zeros.shape == (len(keys), 16)
    assert not zeros.any()
    np.testing.assert_array_equal(initial_vectors(make_engine, Constant(1.5), keys), 1.5)
    np.testing.assert_array_equal(initial_vectors(make_engine, Constant(-3.25), keys), -3.25)


# --- distributions over many keys --------------------------------------------

MANY_KEYS = np.arange(1, 20_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def truncated_std_factor(bound: float = 2.0) -> float:
    """Standard deviation of a standard normal truncated to [-bound, bound]."""
    pdf = math.exp(-(bound**2) / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(bound / math.sqrt(2))
    return math.sqrt(1 - 2 * bound * pdf / mass)


def test_truncated_normal_distribution(make_engine: MakeEngine) -> None:
    values = initial_vectors(make_engine, TruncatedNormal(stddev=0.1, mean=0.5), MANY_KEYS)
    assert values.min() >= 0.3 - 1e-6 and values.max() <= 0.7 + 1e-6
    assert values.min() < 0.31 and values.max() > 0.69  # the whole range is used
    assert abs(values.mean() - 0.5) < 0.001
    assert values.std() == pytest.approx(0.1 * truncated_std_factor(), rel=0.01)
    # Coordinates of one vector are uncorrelated.
    corr = np.corrcoef(values, rowvar=False)
    assert np.abs(corr - np.eye(16)).max() < 0.03
    # The whole shape: Kolmogorov-Smirnov distance to the exact CDF.
    z = np.sort((values.ravel().astype(np.float64) - 0.5) / 0.1)
    mass = math.erf(2 / math.sqrt(2))
    cdf = (np.vectorize(math.erf)(z / math.sqrt(2)) + mass) / (2 * mass)
    n = len(z)
    distance = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert distance < 1.95 / math.sqrt(n)  # p = 0.001


@pytest.mark.parametrize("dim", [4, 64])
def test_truncated_normal_without_stddev_is_inverse_sqrt_dim(
    dim: int, make_engine: MakeEngine
) -> None:
    stddev = 1 / math.sqrt(dim)
    keys = MANY_KEYS[: 200_000 // dim]
    values = initial_vectors(make_engine, TruncatedNormal(), keys, dim=dim)
    explicit = initial_vectors(make_engine, TruncatedNormal(stddev=stddev), keys, dim=dim)
    np.testing.assert_array_equal(values, explicit)
    assert np.abs(values).max() <= 2 * stddev + 1e-6
    assert values.std() == pytest.approx(stddev * truncated_std_factor(), rel=0.02)
    assert abs(values.mean()) < 0.02 * stddev


@pytest.mark.parametrize("dim", [4, 64])
def test_the_default_initializer_is_small_whatever_the_dim(
    dim: int, make_engine: MakeEngine
) -> None:
    spec = TableSpec("t", dim=dim)
    assert spec.initializer == TruncatedNormal(stddev=0.01)
    assert wl.EmbeddingTable("t", dim).initializer == spec.initializer
    assert spec.optimizer == Adam(learning_rate=1e-3)
    assert wl.EmbeddingTable("t", dim).optimizer == spec.optimizer
    keys = MANY_KEYS[: 200_000 // dim]
    values = initial_vectors(make_engine, None, keys, dim=dim)
    assert np.abs(values).max() <= 0.02 + 1e-6
    assert values.std() == pytest.approx(0.01 * truncated_std_factor(), rel=0.02)


def test_normal_distribution(make_engine: MakeEngine) -> None:
    values = initial_vectors(make_engine, Normal(stddev=2.0, mean=-1.0), MANY_KEYS).astype(float)
    z = (values - values.mean()) / values.std()
    assert values.mean() == pytest.approx(-1.0, abs=0.01)
    assert values.std() == pytest.approx(2.0, rel=0.01)
    assert abs(np.mean(z**3)) < 0.02  # skewness
    assert np.mean(z**4) == pytest.approx(3.0, abs=0.05)  # kurtosis
    beyond_two = np.mean(np.abs(values + 1.0) > 4.0)
    assert beyond_two == pytest.approx(1 - math.erf(2 / math.sqrt(2)), abs=0.003)
    assert np.abs(z).max() > 4.0  # not truncated


def test_uniform_distribution(make_engine: MakeEngine) -> None:
    values = initial_vectors(make_engine, Uniform(minval=-0.3, maxval=0.7), MANY_KEYS)
    assert values.min() >= -0.3 and values.max() <= 0.7
    assert values.min() < -0.299 and values.max() > 0.699
    assert values.mean() == pytest.approx(0.2, abs=0.002)
    assert values.std() == pytest.approx(1 / math.sqrt(12), rel=0.01)
    histogram, _ = np.histogram(values, bins=10, range=(-0.3, 0.7))
    np.testing.assert_allclose(histogram / values.size, 0.1, atol=0.003)


def test_degenerate_uniform_and_zero_stddev(keys: np.ndarray, make_engine: MakeEngine) -> None:
    np.testing.assert_array_equal(initial_vectors(make_engine, Uniform(0.25, 0.25), keys), 0.25)
    np.testing.assert_array_equal(initial_vectors(make_engine, Normal(0.0, mean=0.5), keys), 0.5)
