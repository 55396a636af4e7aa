"""Compressed tables (``TableSpec(precision="fp16" | "int8")``): encodings
against numpy references bit for bit and within their error bounds,
saturation and NaN, zero rows, lookup / pull / contains / export, full and
delta versions applied, training calls refused, and memory per row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from row_chunks import version_rows

from wuliang.ps_server import (
    SGD,
    Adagrad,
    Engine,
    PullPart,
    PushPart,
    TableSpec,
    TableUpdate,
    TruncatedNormal,
    Zeros,
)
from wuliang.ps_server.storage import VersionWriter
from wuliang.serving.versions import apply_chain

PRECISIONS = ("fp32", "fp16", "int8")
COMPRESSED = ("fp16", "int8")
HALF_MAX = np.float32(65504)
CHUNK_BYTES = 2 << 20  # memory pool chunk


def spec(name: str, dim: int, precision: str, **kw: object) -> TableSpec:
    kw.setdefault("optimizer", SGD())
    kw.setdefault("initializer", Zeros())
    return TableSpec(name, dim, precision=precision, **kw)  # type: ignore[arg-type]


def int8_scale(w: np.ndarray) -> np.ndarray:
    """Per row: the largest finite |w| / 127, in float32 as the engine."""
    finite = np.where(np.isfinite(w), np.abs(w), np.float32(0))
    return (finite.max(axis=1) / np.float32(127)).astype(np.float32)


def stored(w: np.ndarray, precision: str) -> np.ndarray:
    """What a table of ``precision`` reads back for rows w (float32 [n, dim])."""
    if precision == "fp32":
        return w
    if precision == "fp16":  # numpy's conversion rounds to nearest even
        return np.clip(w, -HALF_MAX, HALF_MAX).astype(np.float16).astype(np.float32)
    scale = int8_scale(w)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(np.clip(w / scale, -127, 127))  # float32 division, ties to even
    q[np.broadcast_to(scale == 0, q.shape)] = 0
    out = q.astype(np.float32) * scale
    out[np.isnan(w)] = np.nan
    return out


def loaded(engine: Engine, name: str, dim: int, precision: str, w: np.ndarray) -> np.ndarray:
    """Creates a table, loads rows w at keys 1..n, returns the keys."""
    engine.create_table(spec(name, dim, precision))
    keys = np.arange(1, len(w) + 1, dtype=np.uint64)
    engine.load(name, keys, w)
    return keys


def exported(engine: Engine, table: str, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(keys, weights) of an export, sorted by key."""
    chunks = list(engine.export(table, since=since, chunk_rows=777))
    keys = np.concatenate([c.keys for c in chunks])
    weights = np.concatenate([c.weights for c in chunks])
    order = np.argsort(keys)
    return keys[order], weights[order]


# --- the spec ----------------------------------------------------------------


def test_precision_is_checked_and_named() -> None:
    assert TableSpec("t", 4).precision == "fp32"
    for bad in ("fp64", "FP16", 16, None):
        with pytest.raises(ValueError, match=rf"table 't': precision must be .* got {bad!r}"):
            TableSpec("t", 4, precision=bad)  # type: ignore[arg-type]
    for p in PRECISIONS:
        assert TableSpec("t", 4, precision=p).to_native().precision.name == p.upper()


# --- encodings ---------------------------------------------------------------


def test_fp16_rounds_to_nearest_even_and_saturates(make_engine) -> None:
    rng = np.random.default_rng(1)
    # Every magnitude a half has (subnormals, underflow, near the top) and
    # the ties between neighbouring halves, both signs.
    magnitudes = np.exp2(rng.uniform(-30, 16.5, 200_000)).astype(np.float32)
    halves = np.arange(0, 0x7BFF, dtype=np.uint16).view(np.float16).astype(np.float32)
    ties = (halves[:-1] + halves[1:]) / 2  # exact in float32
    extremes = np.array([65504, 65519.99, 65520, 1e6, 3.4e38, np.inf, np.nan], np.float32)
    values = np.concatenate([magnitudes, halves, ties, extremes])
    values = np.concatenate([values, -values])
    dim = 7  # rows of 7: the vector blocks and the scalar tail
    values = np.concatenate([values, np.zeros(-len(values) % dim, np.float32)])
    w = values.reshape(-1, dim)
    engine = make_engine(2)
    keys = loaded(engine, "h", dim, "fp16", w)
    rows, found, _ = engine.lookup("h", keys)
    assert found.all()
    np.testing.assert_array_equal(rows, stored(w, "fp16"))  # NaN where NaN
    # Saturation: beyond 65504 (infinities included) reads +-65504, never inf.
    big = np.abs(w) > HALF_MAX
    assert np.isfinite(rows[~np.isnan(w)]).all()
    np.testing.assert_array_equal(rows[big], np.sign(w[big]) * HALF_MAX)
    assert np.isnan(rows[np.isnan(w)]).all() and np.isnan(w).sum() == 2
    # Normal halves: relative error <= 2^-11.
    normal = (np.abs(w) >= 2.0**-14) & (np.abs(w) <= HALF_MAX)
    err = np.abs(rows[normal].astype(np.float64) - w[normal])
    assert (err <= np.abs(w[normal]) * 2.0**-11).all()


@pytest.mark.parametrize("dim", [1, 5, 16, 33, 64])
def test_int8_error_is_at_most_half_a_step(make_engine, dim: int) -> None:
    rng = np.random.default_rng(dim)
    n = 3000
    spread = np.exp2(rng.uniform(-20, 20, (n, 1)))
    w = (rng.normal(size=(n, dim)) * spread).astype(np.float32)
    w[0] = 0  # a zero row: scale 0, zeros back
    w[1] = -0.0
    engine = make_engine(2)
    keys = loaded(engine, "q", dim, "int8", w)
    rows, found, _ = engine.lookup("q", keys)
    assert found.all()
    np.testing.assert_array_equal(rows, stored(w, "int8"))
    assert not rows[:2].any()
    scale = int8_scale(w).astype(np.float64)[:, None]
    err = np.abs(rows.astype(np.float64) - w)
    # Half a step, up to float rounding (of w / scale and of q * scale).
    slack = scale * 2.0**-16 + np.abs(w) * 2.0**-23
    assert (err <= scale / 2 + slack).all()
    assert (np.abs(rows) <= 127 * scale * (1 + 2.0**-22)).all()


def test_int8_nan_stays_nan_and_infinities_saturate(make_engine) -> None:
    w = np.array(
        [
            [0.5, np.nan, -1.0, 0.25],
            [np.inf, 2.0, -np.inf, 0.0],
            [np.inf, 0.0, np.nan, 0.0],  # nothing finite but zeros: scale 0
        ],
        np.float32,
    )
    engine = make_engine(1)
    keys = loaded(engine, "q", 4, "int8", w)
    rows = engine.lookup("q", keys).rows
    np.testing.assert_array_equal(rows, stored(w, "int8"))
    assert np.isnan(rows[0, 1]) and not np.isnan(rows[0, [0, 2, 3]]).any()
    assert rows[1, 0] == -rows[1, 2] == rows[1, 1]  # +-inf: +-the row's largest value
    assert abs(rows[1, 1] - 2.0) <= 1e-6
    np.testing.assert_array_equal(rows[2], [0, 0, np.nan, 0])


# --- reads -------------------------------------------------------------------


@pytest.mark.parametrize("precision", COMPRESSED)
def test_every_read_decodes_the_same_rows(make_engine, precision: str) -> None:
    rng = np.random.default_rng(3)
    dim, n = 12, 5000
    w = rng.normal(0, 0.1, (n, dim)).astype(np.float32)
    engine = make_engine(3)
    keys = loaded(engine, "t", dim, precision, w)
    want = stored(w, precision)
    missing = np.arange(10**6, 10**6 + 50, dtype=np.uint64)
    asked = rng.permutation(np.concatenate([keys, missing]))
    rows, found, _ = engine.lookup("t", asked)
    present = asked < 10**6
    np.testing.assert_array_equal(found, present)
    np.testing.assert_array_equal(rows[present], want[asked[present].astype(np.int64) - 1])
    assert not rows[~present].any()  # missing="zeros"
    np.testing.assert_array_equal(engine.pull("t", asked, train=False), rows)
    out = np.empty((len(asked), dim), np.float32)
    engine.pull_many([PullPart("t", asked, out)], train=False)
    np.testing.assert_array_equal(out, rows)
    np.testing.assert_array_equal(engine.contains("t", asked), present)
    whole, whole_found = engine.read_rows("t", asked)  # every column, weights decoded
    np.testing.assert_array_equal(whole_found, present)
    np.testing.assert_array_equal(whole.keys, asked[present])
    assert whole.weights.dtype == np.float32
    np.testing.assert_array_equal(whole.weights, rows[present])
    got_keys, got_weights = exported(engine, "t")
    np.testing.assert_array_equal(got_keys, keys)
    assert got_weights.dtype == np.float32
    np.testing.assert_array_equal(got_weights, want)
    # An export loads into a float32 table as the rows it read.
    engine.create_table(spec("copy", dim, "fp32"))
    engine.load("copy", got_keys, got_weights)
    np.testing.assert_array_equal(engine.lookup("copy", keys).rows, want)
    # Deltas since a version, and erase, work as on float32 tables.
    v = engine.advance_version()
    changed = keys[:100]
    engine.load("t", changed, w[:100] * 2)
    assert engine.erase("t", keys[-10:]) == 10
    delta_keys, delta_weights = exported(engine, "t", since=v - 1)
    np.testing.assert_array_equal(delta_keys, changed)
    np.testing.assert_array_equal(delta_weights, stored(w[:100] * 2, precision))
    assert engine.stats("t")["rows"] == n - 10


@pytest.mark.parametrize("precision", COMPRESSED)
def test_missing_keys_read_their_float32_initial_vector(make_engine, precision: str) -> None:
    engine = make_engine(2)
    init = TruncatedNormal(stddev=0.3)
    engine.create_table(spec("c", 16, precision, initializer=init, seed=9))
    engine.create_table(spec("f", 16, "fp32", initializer=init, seed=9))
    keys = np.arange(100, 200, dtype=np.uint64)
    rows, found, _ = engine.lookup("c", keys, missing="initial")
    assert not found.any()
    np.testing.assert_array_equal(rows, engine.lookup("f", keys, missing="initial").rows)
    np.testing.assert_array_equal(engine.pull("c", keys, train=False), rows)
    assert engine.stats("c")["rows"] == 0  # never stored


# --- versions applied ----------------------------------------------------------


@pytest.mark.parametrize("precision", COMPRESSED)
def test_full_and_delta_versions_apply(make_engine, precision: str) -> None:
    rng = np.random.default_rng(4)
    dim = 8
    table = spec("t", dim, precision)
    keys = np.arange(1, 3001, dtype=np.uint64)
    w1 = rng.normal(size=(len(keys), dim)).astype(np.float32)
    ps = make_engine(2)
    ps.apply_update({"t": TableUpdate(table, full=True, rows=[version_rows(keys, w1)])}, label=1)
    assert ps.spec("t").precision == precision
    expect = dict(zip(keys.tolist(), stored(w1, precision), strict=True))

    def check(label: int) -> None:
        asked = np.arange(1, 3101, dtype=np.uint64)
        rows, found, got_label = ps.lookup("t", asked)
        assert got_label == label
        want_found = np.array([int(k) in expect for k in asked])
        np.testing.assert_array_equal(found, want_found)
        want = np.array([expect.get(int(k), np.zeros(dim, np.float32)) for k in asked])
        np.testing.assert_array_equal(rows, want)

    check(1)
    # A delta: rewrites, new keys, removals (twice, merged into the table).
    for label in (2, 3):
        changed = np.sort(rng.choice(np.arange(1, 3101, dtype=np.uint64), 300, replace=False))
        gone = np.setdiff1d(rng.choice(np.array(sorted(expect), np.uint64), 30), changed)
        w = rng.normal(size=(len(changed), dim)).astype(np.float32)
        update = TableUpdate(
            table, full=False, rows=[version_rows(changed, w, label)], removed=gone
        )
        ps.apply_update({"t": update}, label=label)
        expect.update(zip(changed.tolist(), stored(w, precision), strict=True))
        for key in gone.tolist():
            expect.pop(key, None)
        check(label)
    # A full version replaces everything.
    w4 = rng.normal(size=(500, dim)).astype(np.float32)
    ps.apply_update(
        {"t": TableUpdate(table, full=True, rows=[version_rows(keys[:500], w4, 4)])}, label=4
    )
    expect = dict(zip(keys[:500].tolist(), stored(w4, precision), strict=True))
    check(4)
    assert ps.spec("t").precision == precision


def test_serving_apply_creates_tables_with_the_precision(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    keys = np.arange(1, 201, dtype=np.uint64)
    w = rng.normal(size=(len(keys), 16)).astype(np.float32)
    with VersionWriter(tmp_path, "1", "full") as writer:
        writer.write_table(
            TableSpec("emb", 16, optimizer=SGD()), [version_rows(keys, w)], state=False
        )
        writer.commit(number=1, engine_version=1, step=0, source="test")
    for precision in PRECISIONS:
        with Engine(2) as ps:
            apply_chain(ps, tmp_path, precision=precision)
            assert ps.spec("emb").precision == precision
            rows, found, label = ps.lookup("emb", keys)
            assert found.all() and label == 1
            np.testing.assert_array_equal(rows, stored(w, precision))


# --- training on fp16 ------------------------------------------------------------


def test_fp16_training_keeps_updates_smaller_than_half_a_step(make_engine) -> None:
    """SGD steps of 1e-4 on weights of 1.0 (a half's step there is 2^-10,
    about 1e-3): rounding to nearest would keep 1.0 for ever; stochastic
    rounding moves the weights by the updates' sum on average. The rows
    stay halves, the state float32, and ``updated`` is what is stored."""
    engine = make_engine(2)
    engine.create_table(spec("w", 8, "fp16", optimizer=SGD(learning_rate=1.0)))
    keys = np.arange(1, 201, dtype=np.uint64)
    engine.load("w", keys, np.ones((200, 8), np.float32))
    grads = np.full((200, 8), 1e-4, np.float32)
    out = np.empty((200, 8), np.float32)
    for step in range(1, 501):
        engine.push("w", keys, grads, step=step, updated=out)
    rows = engine.lookup("w", keys).rows
    np.testing.assert_array_equal(out, rows)
    np.testing.assert_array_equal(rows, rows.astype(np.float16).astype(np.float32))
    assert abs(float(rows.mean()) - 0.95) < 0.002  # 1 - 500 * 1e-4, over 1600 weights
    assert float(np.abs(rows - 0.95).max()) < 0.02


def test_fp16_training_follows_fp32_and_is_deterministic(make_engine) -> None:
    """Adagrad on an fp16 table against the same pushes on an fp32 table:
    the weights agree to within a few of a half's steps, the optimizer
    state is float32 in both (close, from the slightly different weights'
    gradients being the same here: equal), a second fp16 engine gives the
    same bits, and the table takes fewer bytes a row."""
    engines = [make_engine(2) for _ in range(3)]
    precisions = ("fp32", "fp16", "fp16")
    for engine, precision in zip(engines, precisions, strict=True):
        engine.create_table(spec("t", 16, precision, optimizer=Adagrad(learning_rate=0.05),
                                 initializer=TruncatedNormal(stddev=0.1), seed=3))  # fmt: skip
    rng = np.random.default_rng(0)
    for step in range(1, 61):
        keys = rng.integers(0, 500, 300).astype(np.uint64)
        grads = rng.standard_normal((300, 16)).astype(np.float32) * 0.1
        for engine in engines:
            out = np.empty((300, 16), np.float32)
            engine.pull("t", keys, out=out, step=step)
            engine.push("t", keys, grads, step=step)
    every = np.arange(500, dtype=np.uint64)
    full, half, again = (e.read_rows("t", every)[0] for e in engines)
    np.testing.assert_array_equal(half.weights, again.weights)
    np.testing.assert_allclose(half.weights, full.weights, atol=0.01)
    np.testing.assert_allclose(half.state, full.state, rtol=1e-6)
    many = np.arange(200_000, dtype=np.uint64)  # whole pool chunks: the rows' bytes
    for engine in engines[:2]:
        engine.load("t", many, np.zeros((len(many), 16), np.float32))
    ratio = engines[1].stats("t")["row_bytes"] / engines[0].stats("t")["row_bytes"]
    assert 0.75 < ratio < 0.9  # a dim-16 Adagrad row: 32 + 96 bytes against 64 + 96 (0.8),
    # up to a 2 MiB chunk a shard more


# --- training refused ------------------------------------------------------------


@pytest.mark.parametrize("precision", ["int8"])
def test_training_calls_are_refused_by_name(make_engine, precision: str) -> None:
    engine = make_engine(2)
    dim = 4
    keys = np.arange(1, 11, dtype=np.uint64)
    w = np.ones((10, dim), np.float32)
    engine.create_table(spec("served", dim, precision, optimizer=Adagrad()))
    engine.load("served", keys, w)
    engine.create_table(spec("trained", dim, "fp32"))
    engine.load("trained", keys, w)
    message = rf"table 'served' has precision '{precision}' .*need precision 'fp32' or 'fp16'"
    grads = np.ones((10, dim), np.float32)
    out = np.empty((10, dim), np.float32)
    calls = {
        "pull": lambda: engine.pull("served", keys),  # train=True by default
        "pull new keys": lambda: engine.pull("served", keys + 100, train=True),
        "push": lambda: engine.push("served", keys, grads),
        "push updated": lambda: engine.push("served", keys, grads, updated=out),
        "pull_many": lambda: engine.pull_many(
            [PullPart("trained", keys, out), PullPart("served", keys, out)]
        ),
        "push_many": lambda: engine.push_many(
            [PushPart("trained", keys, grads), PushPart("served", keys, grads)], step=3
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call()
        assert engine.stats("served")["rows"] == 10, name
    # Nothing happened, to either table of a refused multi-table call.
    for table in ("served", "trained"):
        stats = engine.stats(table)
        assert stats["pushed_keys"] == 0 and stats["pulled_keys"] == 0, table
    np.testing.assert_array_equal(engine.lookup("trained", keys).rows, w)
    np.testing.assert_array_equal(engine.lookup("served", keys).rows, w)  # exact in both
    handle = engine.push_many_async([PushPart("served", keys, grads)])
    with pytest.raises(ValueError, match=message):
        handle.wait()


# --- memory ------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [16, 64])
def test_rows_take_fewer_bytes(dim: int) -> None:
    """Bytes per row from stats after loading n rows: hot part (weights) +
    cold part (a 24-byte RowMeta in 32 bytes, SGD: no state), as
    row_layout.h lays them out, within the pool's overhead (a header and
    line padding per 2 MiB chunk, and the last chunk's unused rows)."""
    n = 400_000
    hot = {16: {"fp32": 64, "fp16": 32, "int8": 32}, 64: {"fp32": 256, "fp16": 128, "int8": 68}}
    w = np.random.default_rng(6).normal(size=(n, dim)).astype(np.float32)
    keys = np.arange(1, n + 1, dtype=np.uint64)
    per_row: dict[str, float] = {}
    with Engine(1) as engine:
        for precision in PRECISIONS:
            engine.create_table(spec(precision, dim, precision))
            engine.load(precision, keys, w)
            stats = engine.stats(precision)
            assert stats["rows"] == n
            per_row[precision] = stats["row_bytes"] / n
            engine.drop_table(precision)
    overhead = CHUNK_BYTES / n  # the last chunk, at most
    for precision in PRECISIONS:
        want = hot[dim][precision] + 32
        assert want <= per_row[precision] <= want * (1 + 192 / CHUNK_BYTES) + overhead, (
            precision,
            per_row,
        )
    for precision in COMPRESSED:
        factor = (hot[dim]["fp32"] + 32) / (hot[dim][precision] + 32)
        measured = per_row["fp32"] / per_row[precision]
        assert factor / (1 + overhead / per_row[precision]) <= measured, (precision, per_row)
        assert measured <= factor * (1 + overhead / per_row["fp32"]), (precision, per_row)
