"""The Python Engine API: argument checking, key handling, counters and meta."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from wuliang.ps_server import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Constant,
    Engine,
    Eviction,
    Normal,
    PullPart,
    PushPart,
    PushResult,
    RowChunk,
    TableSpec,
    TruncatedNormal,
    Uniform,
    UnknownTableError,
    shard_of,
)
from wuliang.reader import Csr, CsrBatch
from wuliang.reader.prepare import KeyPreparer

MakeEngine = Callable[[int], Engine]  # the make_engine fixture (conftest.py)
ExportAll = Callable[..., RowChunk]  # the export_all fixture (conftest.py)

DIM = 4


@pytest.fixture
def engine(make_engine: MakeEngine) -> Engine:
    engine = make_engine(2)
    engine.create_table(
        TableSpec("emb", dim=DIM, optimizer=SGD(learning_rate=1.0), initializer=Normal(), seed=5)
    )
    return engine


def grads(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, DIM), value, np.float32)


# --- bad input ----------------------------------------------------------------

BAD_KEY_DTYPES = [np.float64, np.float32, np.int32, np.uint32, np.int16, np.bool_]


def key_calls(engine: Engine) -> dict[str, Callable[[Any], object]]:
    return {
        "pull": lambda k: engine.pull("emb", k),
        "lookup": lambda k: engine.pull("emb", k, train=False),
        "push": lambda k: engine.push("emb", k, grads(len(k))),
        "erase": lambda k: engine.erase("emb", k),
        "contains": lambda k: engine.contains("emb", k),
        "load": lambda k: engine.load("emb", k, grads(len(k))),
        "shard_of": lambda k: shard_of(k, 4),
    }


@pytest.mark.parametrize("dtype", BAD_KEY_DTYPES)
def test_keys_of_wrong_dtype_raise_type_error(engine: Engine, dtype: type) -> None:
    keys = np.array([1, 2, 3]).astype(dtype)
    for name, call in key_calls(engine).items():
        with pytest.raises(TypeError, match=f"dtype {np.dtype(dtype)}") as info:
            call(keys)
        assert "int64 or uint64" in str(info.value), name
    assert engine.stats("emb")["rows"] == 0


def test_keys_not_1d_raise_value_error(engine: Engine) -> None:
    keys = np.arange(6, dtype=np.int64).reshape(2, 3)
    for call in key_calls(engine).values():
        with pytest.raises(ValueError, match=r"1-D.*\(2, 3\)"):
            call(keys)
    with pytest.raises(ValueError, match="1-D"):
        engine.pull("emb", np.int64(5))


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int64])
def test_grads_of_wrong_dtype_raise_type_error(engine: Engine, dtype: type) -> None:
    with pytest.raises(TypeError, match=rf"float32, got dtype {np.dtype(dtype)}"):
        engine.push("emb", [1, 2], np.ones((2, DIM), dtype))


def test_grads_not_an_array_raise_type_error(engine: Engine) -> None:
    with pytest.raises(TypeError, match="numpy float32 array, got list"):
        engine.push("emb", [1], [[1.0] * DIM])  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(2, DIM + 1), (3, DIM), (2 * DIM,), (2, DIM, 1), (DIM, 2)])
def test_grads_of_wrong_shape_raise_value_error(engine: Engine, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=rf"shape \({', '.join(map(str, shape))},?\), expected"):
        engine.push("emb", [1, 2], np.ones(shape, np.float32))
    assert engine.stats("emb")["rows"] == 0


def test_out_of_wrong_dtype_or_shape(engine: Engine) -> None:
    with pytest.raises(TypeError, match="out must be float32"):
        engine.pull("emb", [1, 2], out=np.zeros((2, DIM), np.float64))
    with pytest.raises(ValueError, match=r"out has shape \(3, 4\), expected \(2, 4\)"):
        engine.pull("emb", [1, 2], out=np.zeros((3, DIM), np.float32))


def test_load_columns_of_wrong_shape(engine: Engine) -> None:
    keys = np.array([1, 2], np.int64)
    with pytest.raises(ValueError, match="weights has shape"):
        engine.load("emb", keys, np.zeros((3, DIM), np.float32))
    with pytest.raises(ValueError, match="counts has shape"):
        engine.load("emb", keys, np.zeros((2, DIM), np.float32), counts=np.zeros(3))
    assert engine.stats("emb")["rows"] == 0


def test_unknown_table(engine: Engine) -> None:
    engine.create_table(TableSpec("a", dim=2))
    calls: list[Callable[[], object]] = [
        lambda: engine.pull("nope", [1]),
        lambda: engine.push("nope", [1], grads(1)),
        lambda: engine.erase("nope", [1]),
        lambda: engine.contains("nope", [1]),
        lambda: engine.evict("nope"),
        lambda: engine.stats("nope"),
        lambda: list(engine.export("nope")),
        lambda: engine.removed_keys("nope"),
        lambda: engine.trim_removed("nope", 1),
        lambda: engine.load("nope", [1], grads(1)),
        lambda: engine.spec("nope"),
        lambda: engine.drop_table("nope"),
    ]
    for call in calls:
        with pytest.raises(UnknownTableError) as info:
            call()
        assert isinstance(info.value, KeyError)
        assert str(info.value) == "unknown table 'nope' (tables: a, emb)"


def test_unknown_table_without_tables(make_engine: MakeEngine) -> None:
    with pytest.raises(KeyError, match=r"unknown table 'x' \(tables: none\)"):
        make_engine(1).pull("x", [1])


def test_drop_and_recreate_table(engine: Engine) -> None:
    engine.create_table(TableSpec("other", dim=3))
    engine.push("emb", [1, 2], grads(2))
    engine.drop_table("emb")
    assert engine.tables() == ["other"]
    with pytest.raises(UnknownTableError, match="tables: other"):
        engine.pull("emb", [1])
    engine.create_table(TableSpec("emb", dim=8))
    assert engine.stats("emb")["rows"] == 0
    assert engine.pull("emb", [1]).shape == (1, 8)


def test_duplicate_table_and_non_spec(engine: Engine) -> None:
    with pytest.raises(ValueError, match="table 'emb' already exists"):
        engine.create_table(TableSpec("emb", dim=2))
    assert engine.spec("emb").dim == DIM  # the first one stays
    with pytest.raises(TypeError, match="TableSpec, got dict"):
        engine.create_table({"name": "x", "dim": 2})  # type: ignore[arg-type]


BAD_SPECS: dict[str, tuple[Callable[[], object], str]] = {
    "dim 0": (lambda: TableSpec("t", dim=0), "dim must be"),
    "dim too big": (lambda: TableSpec("t", dim=70000), "dim must be"),
    "dim float": (lambda: TableSpec("t", dim=4.0), "dim must be"),  # type: ignore[arg-type]
    "empty name": (lambda: TableSpec("", dim=4), "table name"),
    "negative lr": (lambda: SGD(learning_rate=-0.1), "learning_rate must be > 0"),
    "zero lr": (lambda: Adagrad(learning_rate=0.0), "learning_rate must be > 0"),
    "nan lr": (lambda: Adam(learning_rate=float("nan")), "learning_rate"),
    "negative clip": (lambda: SGD(clip_norm=-1.0), "clip_norm"),
    "adam beta1 1": (lambda: Adam(beta1=1.0), "beta1 must be in"),
    "adam beta2 neg": (lambda: Adam(beta2=-0.1), "beta2 must be in"),
    "adagrad no eps": (lambda: Adagrad(initial_accumulator=0, epsilon=0), "epsilon"),
    "ftrl l1": (lambda: FTRL(l1=-1.0), "l1 must be >= 0"),
    "ftrl l2": (lambda: FTRL(l2=-1.0), "l2 must be >= 0"),
    "uniform min>max": (lambda: Uniform(minval=1.0, maxval=0.0), "minval 1.0 must be <= maxval"),
    "normal stddev": (lambda: Normal(stddev=-1.0), "stddev"),
    "truncated stddev": (lambda: TruncatedNormal(stddev=-1.0), "stddev"),
    "nan_policy": (lambda: TableSpec("t", dim=4, nan_policy="skip"), "nan_policy"),  # type: ignore[arg-type]
    "seed": (lambda: TableSpec("t", dim=4, seed=-1), "seed"),
    "reserve_rows": (lambda: TableSpec("t", dim=4, reserve_rows=-1), "reserve_rows"),
    "reserve_rows float": (lambda: TableSpec("t", dim=4, reserve_rows=1e6), "reserve_rows"),  # type: ignore[arg-type]
    "eviction ttl": (lambda: Eviction(ttl_steps=-1), "ttl_steps"),
    "eviction max_rows": (lambda: Eviction(max_rows=1.5), "max_rows"),  # type: ignore[arg-type]
    "pending_capacity": (lambda: Admission(pending_capacity=0), "pending_capacity"),
    "admission min_count": (lambda: Admission(min_count=0), "min_count"),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_spec_names_the_field(case: str) -> None:
    make, field = BAD_SPECS[case]
    with pytest.raises(ValueError, match=field):
        make()


def test_non_finite_initializer_values_name_the_field(engine: Engine) -> None:
    inf = float("inf")
    for make, field in (
        (lambda: Normal(mean=inf), "mean"),
        (lambda: Uniform(minval=-inf), "minval"),
        (lambda: Constant(value=float("nan")), "value"),
    ):
        with pytest.raises(ValueError, match=field):
            make()
    # The engine's own check (reached by native specs) names the field too.
    native = TableSpec("t", dim=2, initializer=Normal()).to_native()
    init = native.initializer
    init.mean = inf
    native.initializer = init
    with pytest.raises(ValueError, match=r"table 't'.*mean") as info:
        engine.native.create_table(native)
    assert "stddev" not in str(info.value)


def test_bad_engine_arguments(engine: Engine) -> None:
    for shards in (0, -1, 1025, 2.0):
        with pytest.raises(ValueError, match="num_shards"):
            Engine(num_shards=shards)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step must be"):
        engine.step = -1
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        list(engine.export("emb", chunk_rows=0))
    with pytest.raises(ValueError, match="num_shards"):
        shard_of([1, 2], 0)


def test_closed_engine_raises_runtime_error(make_engine: MakeEngine) -> None:
    engine = make_engine(2)
    engine.create_table(TableSpec("emb", dim=DIM))
    engine.close()
    calls: list[Callable[[], object]] = [
        lambda: engine.pull("emb", [1]),
        lambda: engine.push("emb", [1], grads(1)),
        lambda: engine.erase("emb", [1]),
        lambda: engine.contains("emb", [1]),
        lambda: engine.stats("emb"),
        lambda: engine.evict("emb"),
        lambda: engine.evict(),
        lambda: list(engine.export("emb")),
        lambda: engine.load("emb", [1], grads(1)),
        lambda: engine.create_table(TableSpec("new", dim=2)),
        lambda: engine.advance_version(),
        lambda: engine.step,
        lambda: engine.version,
        lambda: engine.num_shards,
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="engine is closed"):
            call()
    engine.close()  # closing twice is fine


def test_closed_engine_stats_of_all_tables_raises(make_engine: MakeEngine) -> None:
    engine = make_engine(1)
    engine.create_table(TableSpec("emb", dim=DIM))
    engine.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.stats()


def test_context_manager_closes() -> None:
    with Engine(num_shards=1) as engine:
        engine.create_table(TableSpec("t", dim=2))
        assert engine.pull("t", [1]).shape == (1, 2)
    with pytest.raises(RuntimeError, match="closed"):
        engine.pull("t", [1])


# --- keys and arrays ------------------------------------------------------------


@pytest.mark.parametrize(
    "empty", [[], np.zeros(0, np.int64), np.zeros(0, np.uint64)], ids=["list", "i64", "u64"]
)
def test_empty_batches(engine: Engine, empty: Any) -> None:
    rows = engine.pull("emb", empty)
    assert rows.shape == (0, DIM) and rows.dtype == np.float32
    assert engine.pull("emb", empty, train=False).shape == (0, DIM)
    out = np.zeros((0, DIM), np.float32)
    assert engine.pull("emb", empty, out=out) is out
    assert engine.push("emb", empty, np.zeros((0, DIM), np.float32)) == PushResult(0, 0, 0, 0)
    assert engine.erase("emb", empty) == 0
    contained = engine.contains("emb", empty)
    assert contained.shape == (0,) and contained.dtype == np.bool_
    engine.load("emb", empty, np.zeros((0, DIM), np.float32))
    assert shard_of(empty, 3).shape == (0,)
    stats = engine.stats("emb")
    assert stats["rows"] == stats["pulled_keys"] == stats["pushed_keys"] == 0


def test_python_lists_of_ints(engine: Engine) -> None:
    keys = [3, 1, 2**40, 7]
    array = np.array(keys, np.int64)
    np.testing.assert_array_equal(engine.pull("emb", keys), engine.pull("emb", array))
    engine.push("emb", keys, grads(4))
    assert engine.contains("emb", keys).tolist() == [True] * 4
    np.testing.assert_array_equal(engine.pull("emb", keys), engine.pull("emb", array))
    assert engine.contains("emb", [2**64 - 1]).tolist() == [False]  # a uint64 list
    assert engine.erase("emb", keys[:2]) == 2
    assert engine.contains("emb", array).tolist() == [False, False, True, True]


def test_negative_int64_keys_are_their_uint64_twins(engine: Engine, export_all: ExportAll) -> None:
    signed = np.array([-1, -2, -(2**63), 9], np.int64)
    unsigned = signed.view(np.uint64)
    assert unsigned[0] == 2**64 - 1
    np.testing.assert_array_equal(engine.pull("emb", signed), engine.pull("emb", unsigned))
    engine.push("emb", signed, grads(4))
    assert engine.stats("emb")["rows"] == 4
    assert engine.contains("emb", [2**64 - 1, 2**64 - 2, 2**63]).all()
    np.testing.assert_array_equal(engine.pull("emb", unsigned), engine.pull("emb", signed))
    np.testing.assert_array_equal(shard_of(signed, 7), shard_of(unsigned, 7))
    assert sorted(export_all(engine, "emb").keys.tolist()) == sorted(unsigned.tolist())
    assert engine.erase("emb", unsigned[:2]) == 2
    assert engine.contains("emb", signed).tolist() == [False, False, True, True]


def test_pull_into_out(engine: Engine) -> None:
    keys = np.array([4, 5, 6], np.int64)
    expected = engine.pull("emb", keys)
    out = np.full((3, DIM), np.nan, np.float32)
    assert engine.pull("emb", keys, out=out) is out
    np.testing.assert_array_equal(out, expected)
    out[:] = np.nan
    assert engine.pull("emb", keys, train=False, out=out) is out
    np.testing.assert_array_equal(out, expected)


def test_pull_into_non_contiguous_out_writes_or_raises(engine: Engine) -> None:
    keys = np.array([4, 5, 6], np.int64)
    expected = engine.pull("emb", keys)
    buffer = np.zeros((3, 2 * DIM), np.float32)
    out = buffer[:, :DIM]
    assert not out.flags.c_contiguous
    try:
        result = engine.pull("emb", keys, out=out)
    except ValueError:
        return  # refusing it is fine too
    assert result is out
    np.testing.assert_array_equal(buffer[:, :DIM], expected)


def test_non_contiguous_keys_and_grads(engine: Engine, make_engine: MakeEngine) -> None:
    other = make_engine(3)
    other.create_table(engine.spec("emb"))
    wide = np.arange(40, dtype=np.int64) * 1001
    keys = wide[::3]
    assert not keys.flags.c_contiguous
    np.testing.assert_array_equal(engine.pull("emb", keys), other.pull("emb", keys.copy()))
    g = np.asfortranarray(np.random.default_rng(1).standard_normal((len(keys), DIM)), np.float32)
    assert not g.flags.c_contiguous
    engine.push("emb", keys, g)
    other.push("emb", keys.copy(), np.ascontiguousarray(g))
    np.testing.assert_array_equal(engine.pull("emb", keys), other.pull("emb", keys.copy()))
    assert engine.contains("emb", keys).all() and engine.erase("emb", keys) == len(keys)


def test_training_pull_creates_lookup_does_not(engine: Engine) -> None:
    initial = engine.pull("emb", [1, 2], train=False)
    assert not engine.contains("emb", [1, 2]).any()
    np.testing.assert_array_equal(engine.pull("emb", [1]), initial[:1])
    assert engine.contains("emb", [1, 2]).tolist() == [True, False]
    stats = engine.stats("emb")
    assert (stats["rows"], stats["inserted"], stats["pull_misses"]) == (1, 1, 2)


def test_erase(engine: Engine) -> None:
    initial = engine.pull("emb", [1, 2, 3])
    engine.push("emb", [1, 2, 3], grads(3))
    assert engine.erase("emb", [1, 2, 99, 1]) == 2
    assert engine.contains("emb", [1, 2, 3]).tolist() == [False, False, True]
    np.testing.assert_array_equal(engine.pull("emb", [1, 2], train=False), initial[:2])
    assert engine.stats("emb")["erased"] == 2
    assert engine.erase("emb", [1, 2]) == 0


# --- pushes, nan policy, counters, meta ----------------------------------------


def test_unique_promise_gives_same_result(engine: Engine) -> None:
    keys = np.arange(50, dtype=np.int64) * 13
    engine.create_table(TableSpec("u", dim=DIM, optimizer=SGD(1.0), initializer=Normal(), seed=5))
    g = np.random.default_rng(2).standard_normal((50, DIM)).astype(np.float32)
    assert engine.push("emb", keys, g) == PushResult(50, 0, 0, 0)
    assert engine.push("u", keys, g, unique=True) == PushResult(50, 0, 0, 0)
    np.testing.assert_array_equal(engine.pull("emb", keys), engine.pull("u", keys))


def test_nan_policy_drop(engine: Engine) -> None:
    keys = np.array([10, 20, 30, 40, 20], np.int64)
    before = engine.pull("emb", keys[:4])
    g = grads(5)
    g[1, 2] = np.nan  # key 20: its summed gradient is not finite
    g[2, 0] = np.inf
    g[3, 3] = -np.inf
    result = engine.push("emb", keys, g)
    assert result == PushResult(applied=1, dropped_nan=3, dropped_pending=0, duplicates=1)
    after = engine.pull("emb", keys[:4])
    np.testing.assert_array_equal(after[1:], before[1:])
    np.testing.assert_allclose(after[0], before[0] - 1)
    assert engine.stats("emb")["dropped_nan"] == 3


def test_nan_policy_raise(make_engine: MakeEngine) -> None:
    engine = make_engine(3)
    engine.create_table(TableSpec("r", dim=DIM, optimizer=SGD(1.0), nan_policy="raise"))
    keys = np.array([10, 20, 30], np.int64)
    before = engine.pull("r", keys)
    g = grads(3)
    g[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"table 'r'.*row 1 \(key 20\).*not finite"):
        engine.push("r", keys, g)
    g[1, 3] = 0
    g[2, 0] = np.inf
    with pytest.raises(ValueError, match=r"row 2 \(key 30\)"):
        engine.push("r", keys, g)
    np.testing.assert_array_equal(engine.pull("r", keys), before)  # nothing applied
    stats = engine.stats("r")
    assert (stats["dropped_nan"], stats["pushed_keys"]) == (0, 0)
    g[2, 0] = 1
    assert engine.push("r", keys, g).applied == 3


def test_stats_counters(engine: Engine) -> None:
    engine.pull("emb", [1, 2, 3, 3])
    engine.pull("emb", [4, 5], train=False)
    engine.push("emb", [1, 1, 6], grads(3))
    engine.erase("emb", [2, 7])
    stats = engine.stats("emb")
    expected = {
        "rows": 3,  # 1, 3, 6
        "pulled_keys": 6,
        "pull_misses": 2,
        "pushed_keys": 3,
        "inserted": 4,
        "erased": 1,
        "admitted": 0,
        "dropped_nan": 0,
        "dropped_pending": 0,
        "removed_log": 1,
        "pending_keys": 0,
        "evicted_ttl": 0,
        "evicted_min_count": 0,
        "evicted_lfu": 0,
    }
    assert {name: stats[name] for name in expected} == expected
    assert stats["bytes"] == stats["row_bytes"] + stats["index_bytes"] + stats["pending_bytes"]
    assert stats["row_bytes"] > 0 and stats["index_bytes"] > 0
    assert set(engine.stats()) == {"emb"}
    assert engine.stats()["emb"]["rows"] == 3


def test_reserve_rows_holds_memory_from_creation(make_engine: MakeEngine) -> None:
    engine = make_engine(2)
    n = 100_000
    engine.create_table(TableSpec("grows", dim=16, eviction=Eviction(ttl_steps=1)))
    engine.create_table(TableSpec("held", dim=16, eviction=Eviction(ttl_steps=1), reserve_rows=n))
    grows, held = engine.stats("grows"), engine.stats("held")
    assert grows["row_bytes"] == grows["index_bytes"] == 0
    assert held["rows"] == 0
    assert held["row_bytes"] >= n * (64 + 16 * 4)  # weights + accumulator, at least
    assert held["index_bytes"] >= n * 16 * 4 // 3  # at most 3/4 full

    keys = np.arange(1, n + 1, dtype=np.uint64) * 7919
    for name in ("grows", "held"):
        engine.pull(name, keys)
    full = engine.stats("held")
    assert full["rows"] == n
    # The reserve held them all: no chunk or index growth on the way.
    assert (full["row_bytes"], full["index_bytes"]) == (held["row_bytes"], held["index_bytes"])
    np.testing.assert_array_equal(engine.pull("held", keys), engine.pull("grows", keys))

    # Eviction and compaction give memory back, but not below the reserve.
    engine.step = 10
    for name in ("grows", "held"):
        assert engine.evict(name)["ttl"] == n
    assert engine.stats("grows")["bytes"] <= 2 * 2 * 2**20  # a current chunk per shard
    emptied = engine.stats("held")
    assert (emptied["rows"], emptied["row_bytes"]) == (0, held["row_bytes"])
    assert emptied["index_bytes"] == held["index_bytes"]

    # Past the reserve the table grows as any other.
    engine.pull("held", np.arange(1, 3 * n + 1, dtype=np.uint64))
    more = engine.stats("held")
    assert more["rows"] == 3 * n and more["row_bytes"] > held["row_bytes"]
    assert more["index_bytes"] > held["index_bytes"]


def test_reserve_larger_than_memory_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"table 'huge': reserve_rows 1099511627776 needs about"):
        engine.create_table(TableSpec("huge", dim=16, reserve_rows=2**40))
    assert engine.tables() == ["emb"]


def test_row_meta(engine: Engine, export_all: ExportAll) -> None:
    start = int(time.time())
    engine.step = 7
    engine.pull("emb", [1, 2])  # a new row is stamped too
    version = engine.advance_version()
    engine.step = 9
    engine.push("emb", [2, 2, 3], grads(3))
    engine.push("emb", [2], grads(1))
    rows = export_all(engine, "emb")
    end = int(time.time())
    assert rows.keys.tolist() == [1, 2, 3]
    assert rows.counts.tolist() == [0, 2, 1]  # one per push, repeats count once
    assert rows.steps.tolist() == [7, 9, 9]
    assert rows.versions.tolist() == [version - 1, version, version]
    assert ((rows.times >= start - 1) & (rows.times <= end)).all()  # coarse clock: 1 s
    assert rows.counts.dtype == np.uint32 and rows.steps.dtype == np.uint64
    assert rows.times.dtype == np.uint32 and rows.versions.dtype == np.uint64
    assert engine.step == 9 and engine.version == version


def test_shard_of(make_engine: MakeEngine, export_all: ExportAll) -> None:
    keys = np.arange(30_000, dtype=np.int64)
    for n in (1, 2, 3, 8, 1024):
        shards = shard_of(keys, n)
        assert shards.dtype == np.uint32 and shards.shape == keys.shape
        assert shards.max() < n
        np.testing.assert_array_equal(shards, shard_of(keys.copy(), n))
        np.testing.assert_array_equal(shards, shard_of(list(keys), n))
        if n <= 8:
            assert np.bincount(shards, minlength=n).min() > 0.9 * len(keys) / n
    np.testing.assert_array_equal(shard_of(keys, 1), 0)
    # The engine places keys where shard_of says: export goes shard by shard.
    engine = make_engine(3)
    engine.create_table(TableSpec("t", dim=2))
    engine.pull("t", keys[:3000])
    exported = np.concatenate([c.keys for c in engine.export("t", chunk_rows=500)])
    shards = shard_of(exported, 3)
    assert len(exported) == 3000
    assert (np.diff(shards.astype(np.int64)) >= 0).all()
    assert set(shards.tolist()) == {0, 1, 2}


def test_push_reports_the_rows_it_leaves(make_engine: MakeEngine) -> None:
    """push(updated=) fills what pull(train=False) would read right after:
    updated rows, rows of repeated keys, rows whose gradient was dropped as
    not finite, and the initial vector of keys still waiting for admission."""
    engine = make_engine(3)
    spec = TableSpec(
        "t", 4, optimizer=Adagrad(0.5), admission=Admission(min_count=3), initializer=Uniform()
    )
    engine.create_table(spec)
    admitted = np.arange(1, 9, dtype=np.uint64)
    for _ in range(3):
        engine.pull("t", admitted)
    keys = np.array([1, 2, 3, 2, 100, 4], np.uint64)  # 2 twice; 100 not admitted
    grads = np.ones((6, 4), np.float32)
    grads[5, 0] = np.nan  # key 4: dropped
    updated = np.full((6, 4), -7.0, np.float32)
    result = engine.push("t", keys, grads, updated=updated)
    assert (result.duplicates, result.dropped_pending, result.dropped_nan) == (1, 1, 1)
    np.testing.assert_array_equal(updated, engine.pull("t", keys, train=False))
    with pytest.raises(ValueError, match="updated"):
        engine.push("t", keys, grads, updated=np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match="writeable"):
        engine.push("t", keys, grads, updated=np.zeros((6, 8), np.float32)[:, :4])


def test_push_writes_updated_rows_where_asked(make_engine: MakeEngine) -> None:
    """push(updated=, updated_rows=) writes key i's row after the push to
    updated[updated_rows[i]], nowhere where -1, and leaves other rows alone:
    how the trainer refreshes the next step's pulled rows."""
    engine = make_engine(2)
    engine.create_table(TableSpec("t", 4, optimizer=Adagrad(0.5), initializer=Uniform()))
    keys = np.arange(1, 7, dtype=np.uint64)
    engine.pull("t", keys)
    grads = np.ones((6, 4), np.float32)
    target = np.full((10, 4), -7.0, np.float32)
    where = np.array([9, -1, 0, 4, -1, 2], np.int32)
    engine.push("t", keys, grads, unique=True, updated=target, updated_rows=where)
    after = engine.pull("t", keys, train=False)
    for i, r in enumerate(where):
        if r >= 0:
            np.testing.assert_array_equal(target[r], after[i])
    untouched = sorted(set(range(10)) - set(where.tolist()))
    assert (target[untouched] == -7.0).all()
    for bad, match in [
        (np.array([0, 1, 2, 3, 4, 10], np.int32), "outside"),
        (np.array([0, 1, 2, 3, 4, -2], np.int32), "outside"),
        (np.array([0, 1, 2, 3, 4, 0], np.int32), "twice"),
        (np.zeros(6, np.int64), "int32"),
        (np.zeros(5, np.int32), "int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.push("t", keys, grads, updated=target, updated_rows=bad)
    # The rest of a split push writes no rows: its updated_rows only pick
    # the keys without one (so repeats there are not an error).
    repeated = np.array([0, -1, 0, -1, 3, 3], np.int32)
    with pytest.raises(ValueError, match="twice"):
        engine.push_many([PushPart("t", keys, grads, None, target, repeated)], unique=True)
    before = target.copy()
    rest = engine.push_many(
        [PushPart("t", keys, grads, None, target, repeated)], unique=True, only="rest"
    )
    assert rest.applied == 2  # keys 2 and 4
    np.testing.assert_array_equal(target, before)
    with pytest.raises(ValueError, match="needs updated"):
        engine.push("t", keys, grads, updated_rows=where)
    with pytest.raises(ValueError, match="updated"):
        engine.push("t", keys, grads, updated=np.zeros((10, 3), np.float32), updated_rows=where)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_many_table_calls_equal_calls_one_by_one(make_engine: MakeEngine, num_shards: int) -> None:
    """pull_many / push_many do what pull / push per table do, in order:
    tables of other dims and optimizers, keys split by the caller or not,
    an empty part, and updated rows written where asked; so does a push in
    halves (only="updated", then only="rest")."""
    specs = [
        TableSpec("a", 4, optimizer=Adagrad(0.5), initializer=Uniform()),
        TableSpec("b", 8, optimizer=SGD(0.1), initializer=Uniform()),
        TableSpec("c", 4, optimizer=Adam(0.01), initializer=Uniform()),
    ]
    one, many, halves = make_engine(num_shards), make_engine(num_shards), make_engine(num_shards)
    for spec in specs:
        for engine in (one, many, halves):
            engine.create_table(spec)
    rng = np.random.default_rng(3)
    preparer = KeyPreparer({"a": "a", "b": "b"}, num_shards)
    for _ in range(4):
        values = {n: rng.integers(1, 200, 300).astype(np.uint64) for n in "ab"}
        offsets = np.arange(301, dtype=np.int64)
        prepared = preparer(
            CsrBatch({n: Csr(v, offsets) for n, v in values.items()}, None, None, 300, {})
        )
        keys = {
            "a": (prepared.tables["a"].uniques, prepared.tables["a"].shard_offsets),
            "b": (prepared.tables["b"].uniques, None),  # split by the engine
            "c": (np.zeros(0, np.uint64), None),
        }
        dims = {"a": 4, "b": 8, "c": 4}
        outs = {t: np.empty((len(k), dims[t]), np.float32) for t, (k, _) in keys.items()}
        many.pull_many([PullPart(t, k, outs[t], o) for t, (k, o) in keys.items()])
        halves.pull_many([PullPart(t, k, outs[t], o) for t, (k, o) in keys.items()])
        for t, (k, o) in keys.items():
            np.testing.assert_array_equal(outs[t], one.pull(t, k, shard_offsets=o))
        grads = {t: rng.standard_normal(outs[t].shape).astype(np.float32) for t in keys}
        target = np.full((500, 4), -1.0, np.float32)
        rows = np.full(len(keys["a"][0]), -1, np.int32)
        rows[::2] = np.arange(0, len(rows), 2, dtype=np.int32)
        parts = [
            PushPart("a", keys["a"][0], grads["a"], keys["a"][1], target, rows),
            PushPart("b", keys["b"][0], grads["b"]),
            PushPart("c", keys["c"][0], grads["c"]),
        ]
        result = many.push_many(parts, unique=True)
        half_target = target.copy()
        parts[0] = PushPart("a", keys["a"][0], grads["a"], keys["a"][1], half_target, rows)
        first = halves.push_many(parts, unique=True, only="updated")
        assert first.applied == (rows >= 0).sum()
        second = halves.push_many(parts, unique=True, only="rest")
        assert first.applied + second.applied == result.applied
        np.testing.assert_array_equal(half_target, target)
        applied = 0
        for t, (k, o) in keys.items():
            applied += one.push(t, k, grads[t], unique=True, shard_offsets=o).applied
        assert result.applied == applied
        after = one.pull("a", keys["a"][0], train=False)
        np.testing.assert_array_equal(target[rows[::2]], after[::2])
    for spec in specs:
        expected = {
            int(k): (w, st)
            for c in one.export(spec.name)
            for k, w, st in zip(c.keys, c.weights, c.state, strict=True)
        }
        for engine in (many, halves):
            got = {
                int(k): (w, st)
                for c in engine.export(spec.name)
                for k, w, st in zip(c.keys, c.weights, c.state, strict=True)
            }
            assert got.keys() == expected.keys()
            for k, (w, st) in expected.items():
                np.testing.assert_array_equal(got[k][0], w)
                np.testing.assert_array_equal(got[k][1], st)
    with pytest.raises(ValueError, match="no out"):
        many.pull_many([PullPart("a", keys["a"][0])])
    with pytest.raises(KeyError, match="unknown table 'zz'"):
        many.push_many([PushPart("zz", keys["a"][0], grads["a"])])
    with pytest.raises(ValueError, match="grads for table 'b'"):
        many.push_many([PushPart("b", keys["b"][0], grads["a"])])
    with pytest.raises(ValueError, match="needs unique=True"):
        many.push_many([PushPart("b", keys["b"][0], grads["b"])], only="rest")
    with pytest.raises(ValueError, match="only must be one of"):
        many.push_many([PushPart("b", keys["b"][0], grads["b"])], unique=True, only="half")
