"""KeyPreparer against a numpy reference, and the string / int key hashing."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pytest

from wuliang.ps_server import shard_of
from wuliang.reader import Csr, CsrBatch, KeyPreparer, PreparedKeys
from wuliang.reader.hashing import field_seed, hash_ints, hash_strings

SHARD_COUNTS = [1, 2, 3, 8]

# feature -> table: "a", "b" and "single" share a table, the others are alone
TABLES = {"a": "shared", "b": "shared", "single": "shared", "neg": "signed", "big": "alone"}


def random_csr(rng: np.random.Generator, rows: int, pool: np.ndarray, max_len: int = 6) -> Csr:
    """Rows of 0..max_len values drawn with repetition from pool."""
    lengths = rng.integers(0, max_len + 1, rows)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Csr(rng.choice(pool, offsets[-1]), offsets)


def random_batch(rng: np.random.Generator, rows: int) -> CsrBatch:
    small = np.arange(1, 40, dtype=np.uint64)
    big = np.array([2**64 - 1, 2**63, 2**63 + 1, 0, 1, 2**32], dtype=np.uint64)
    big = np.concatenate([big, rng.integers(0, 2**63, 30, dtype=np.uint64) * np.uint64(2)])
    signed = np.array([-1, -2, -(2**63), 2**63 - 1, 0, 5, -5], dtype=np.int64)
    single_values = rng.choice(np.arange(20, 60, dtype=np.uint64), rows)
    sparse = {
        "a": random_csr(rng, rows, small),
        "b": random_csr(rng, rows, np.arange(30, 80, dtype=np.uint64)),  # overlaps "a"
        "single": Csr(single_values, np.arange(rows + 1, dtype=np.int64)),
        "neg": random_csr(rng, rows, signed),
        "big": random_csr(rng, rows, big),
        "unused": random_csr(rng, rows, small),
    }
    return CsrBatch(sparse, np.zeros((rows, 0), np.float32), None, rows)


def check_prepared(
    batch: CsrBatch, prepared: PreparedKeys, tables: Mapping[str, str], num_shards: int
) -> None:
    """Every property of prepared keys, against np.unique."""
    assert prepared.num_shards == num_shards
    assert set(prepared.features) == set(tables)
    assert set(prepared.tables) == set(tables.values())
    for table, keys in prepared.tables.items():
        members = [f for f, t in tables.items() if t == table]
        values = [batch.sparse[f].values.view(np.uint64) for f in members]
        inverses = [prepared.features[f].inverse for f in members]
        uniques, off = keys.uniques, keys.shard_offsets
        assert uniques.dtype == np.uint64 and uniques.ndim == 1
        assert off.dtype == np.int64 and off.shape == (num_shards + 1,)
        for f, v, inv in zip(members, values, inverses, strict=True):
            assert inv.dtype == np.int32 and inv.shape == v.shape, f
            assert prepared.features[f].table == table
            np.testing.assert_array_equal(uniques[inv], v, err_msg=f)  # reproduces the values
            np.testing.assert_array_equal(prepared.features[f].offsets, batch.sparse[f].offsets)
        all_values = np.concatenate(values)
        ref_uniques, ref_inverse = np.unique(all_values, return_inverse=True)
        assert len(uniques) == len(ref_uniques), table  # unique, and every one appears
        order = np.argsort(uniques)
        np.testing.assert_array_equal(uniques[order], ref_uniques)
        # the same partition of the values as numpy's (inverse maps agree)
        np.testing.assert_array_equal(np.concatenate(inverses), order[ref_inverse.reshape(-1)])
        # grouped by shard, with the engine's sharding
        assert off[0] == 0 and off[-1] == len(uniques)
        assert (np.diff(off) >= 0).all()
        expected_shard = np.repeat(np.arange(num_shards), np.diff(off))
        np.testing.assert_array_equal(shard_of(uniques, num_shards), expected_shard)
        for s in range(num_shards):
            assert (shard_of(keys.shard(s), num_shards) == s).all()


def same_prepared(x: PreparedKeys, y: PreparedKeys) -> None:
    assert x.tables.keys() == y.tables.keys() and x.features.keys() == y.features.keys()
    for t in x.tables:
        np.testing.assert_array_equal(x.tables[t].uniques, y.tables[t].uniques)
        np.testing.assert_array_equal(x.tables[t].shard_offsets, y.tables[t].shard_offsets)
    for f in x.features:
        np.testing.assert_array_equal(x.features[f].inverse, y.features[f].inverse)


# -- KeyPreparer ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", SHARD_COUNTS)
def test_prepare_matches_numpy(rng: np.random.Generator, num_shards: int) -> None:
    preparer = KeyPreparer(TABLES, num_shards=num_shards)
    for rows in (1, 7, 64, 500, 3, 2000, 10):  # sizes up and down: scratch tables are reused
        batch = random_batch(rng, rows)
        check_prepared(batch, preparer(batch), TABLES, num_shards)


@pytest.mark.parametrize("num_shards", SHARD_COUNTS)
def test_prepare_every_feature_alone_or_all_shared(
    rng: np.random.Generator, num_shards: int
) -> None:
    batch = random_batch(rng, 100)
    alone = {f: f"t_{f}" for f in batch.sparse}
    shared = {f: "one" for f in batch.sparse}
    for tables in (alone, shared):
        check_prepared(batch, KeyPreparer(tables, num_shards)(batch), tables, num_shards)


@pytest.mark.parametrize("num_shards", SHARD_COUNTS)
def test_prepare_many_unique_keys(rng: np.random.Generator, num_shards: int) -> None:
    """More keys than any starting scratch capacity; few repeats."""
    values = rng.integers(0, 2**64, 50_000, dtype=np.uint64)
    values = np.concatenate([values, values[:1000]])
    batch = CsrBatch(
        {"x": Csr(values, np.array([0, len(values)], np.int64))},
        np.zeros((1, 0), np.float32),
        None,
        1,
    )
    check_prepared(batch, KeyPreparer({"x": "t"}, num_shards)(batch), {"x": "t"}, num_shards)


@pytest.mark.parametrize("num_shards", SHARD_COUNTS)
def test_prepare_empty_features(num_shards: int) -> None:
    empty = Csr(np.zeros(0, np.uint64), np.zeros(4, np.int64))
    some = Csr(np.array([5, 5, 6], np.uint64), np.array([0, 2, 2, 3], np.int64))
    batch = CsrBatch(
        {"e1": empty, "e2": Csr(np.zeros(0, np.int64), np.zeros(4, np.int64)), "s": some},
        np.zeros((3, 0), np.float32),
        None,
        3,
    )
    tables = {"e1": "empty_table", "e2": "mixed", "s": "mixed"}
    prepared = KeyPreparer(tables, num_shards)(batch)
    check_prepared(batch, prepared, tables, num_shards)
    assert len(prepared.tables["empty_table"].uniques) == 0
    np.testing.assert_array_equal(
        prepared.tables["empty_table"].shard_offsets, [0] * (num_shards + 1)
    )
    assert prepared.features["e1"].inverse.shape == (0,)
    assert sorted(prepared.tables["mixed"].uniques.tolist()) == [5, 6]
    # a batch of zero rows
    zero = CsrBatch(
        {"e1": Csr(np.zeros(0, np.uint64), np.zeros(1, np.int64))},
        np.zeros((0, 0), np.float32),
        None,
        0,
    )
    check_prepared(zero, KeyPreparer({"e1": "t"}, num_shards)(zero), {"e1": "t"}, num_shards)


@pytest.mark.parametrize("num_shards", SHARD_COUNTS)
def test_prepare_negative_int64_keys(rng: np.random.Generator, num_shards: int) -> None:
    values = rng.choice(np.array([-1, -(2**63), 2**63 - 1, 0, 3, -3, -1000], np.int64), 200)
    batch = CsrBatch(
        {"n": Csr(values, np.array([0, 120, 200], np.int64))}, np.zeros((2, 0), np.float32), None, 2
    )
    prepared = KeyPreparer({"n": "t"}, num_shards)(batch)
    check_prepared(batch, prepared, {"n": "t"}, num_shards)
    keys = prepared.tables["t"]
    # Uniques are uint64 (the engine's key type): int64 keys are their bit patterns.
    # Note: `uniques[inverse] == values` compares by value and is False for
    # negative keys; compare bit patterns (.view) instead.
    np.testing.assert_array_equal(
        keys.uniques[prepared.features["n"].inverse].view(np.int64), values
    )
    assert sorted(keys.uniques.view(np.int64).tolist()) == sorted(set(values.tolist()))
    # the engine shards an int64 key like its uint64 bit pattern
    np.testing.assert_array_equal(
        shard_of(keys.uniques.view(np.int64), num_shards), shard_of(keys.uniques, num_shards)
    )


def test_prepare_non_contiguous_values(rng: np.random.Generator) -> None:
    base = rng.integers(0, 10, 40).astype(np.uint64)
    values = base[::2]  # a strided view
    assert not values.flags.c_contiguous
    batch = CsrBatch(
        {"s": Csr(values, np.array([0, 5, 20], np.int64))}, np.zeros((2, 0), np.float32), None, 2
    )
    check_prepared(batch, KeyPreparer({"s": "t"}, 3)(batch), {"s": "t"}, 3)


def test_prepare_is_deterministic(rng: np.random.Generator) -> None:
    batch = random_batch(rng, 300)
    preparer = KeyPreparer(TABLES, num_shards=3)
    first = preparer(batch)
    preparer(random_batch(rng, 1000))  # other work in between
    same_prepared(first, preparer(batch))
    same_prepared(first, KeyPreparer(TABLES, num_shards=3)(batch))


def test_prepare_known_example() -> None:
    """The module docstring's example, one shard: uniques in first-seen order."""
    batch = CsrBatch(
        {
            "genres": Csr(np.array([7, 9, 7, 3], np.uint64), np.array([0, 3, 3, 4], np.int64)),
            "tags": Csr(np.array([9, 4], np.uint64), np.array([0, 1, 1, 2], np.int64)),
        },
        np.zeros((3, 0), np.float32),
        None,
        3,
    )
    prepared = KeyPreparer({"genres": "item_attr", "tags": "item_attr"}, 1)(batch)
    keys = prepared.tables["item_attr"]
    assert keys.uniques.tolist() == [7, 9, 3, 4]
    assert keys.shard_offsets.tolist() == [0, 4]
    assert prepared.features["genres"].inverse.tolist() == [0, 1, 0, 2]
    assert prepared.features["tags"].inverse.tolist() == [1, 3]


def test_prepare_keeps_weights_and_offsets(rng: np.random.Generator) -> None:
    csr = random_csr(rng, 10, np.arange(5, dtype=np.uint64))
    csr = Csr(csr.values, csr.offsets, rng.random(csr.nnz).astype(np.float32))
    batch = CsrBatch({"w": csr}, np.zeros((10, 0), np.float32), None, 10)
    index = KeyPreparer({"w": "t"})(batch).features["w"]
    assert index.weights is csr.weights
    assert index.offsets is csr.offsets


def test_prepare_keeps_the_first_max_len_values() -> None:
    """A feature with a max_len keeps each row's first values (weights with
    them); its other keys are not among the table's uniques unless another
    feature has them."""
    rows = [[1, 2, 3, 4], [], [5], [6, 7, 8], [9, 1]]
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    values = np.array([k for r in rows for k in r], np.uint64)
    weights = np.arange(len(values), dtype=np.float32)
    other = Csr(np.array([8, 20], np.uint64), np.array([0, 1, 1, 1, 1, 2], np.int64))
    batch = CsrBatch(
        {"seq": Csr(values, offsets, weights), "other": other},
        np.zeros((5, 0), np.float32),
        None,
        5,
    )
    prepared = KeyPreparer({"seq": "t", "other": "t"}, 2, max_lens={"seq": 2})(batch)
    index = prepared.features["seq"]
    uniques = prepared.tables["t"].uniques
    assert index.offsets.tolist() == [0, 2, 2, 3, 5, 7]
    assert uniques[index.inverse].tolist() == [1, 2, 5, 6, 7, 9, 1]
    assert index.weights is not None
    assert index.weights.tolist() == [0, 1, 4, 5, 6, 8, 9]
    assert sorted(uniques.tolist()) == [1, 2, 5, 6, 7, 8, 9, 20]  # 8: from "other"
    assert prepared.max_lens == {"seq": 2}
    # rows within max_len: the feature's arrays are kept as they are
    short = KeyPreparer({"seq": "t"}, max_lens={"seq": 4})(batch).features["seq"]
    assert short.offsets is offsets and short.weights is weights


def test_prepare_unknown_feature(rng: np.random.Generator) -> None:
    batch = random_batch(rng, 5)
    with pytest.raises(KeyError, match="'missing'"):
        KeyPreparer({"a": "t", "missing": "t"})(batch)


def test_prepare_bad_arguments() -> None:
    with pytest.raises(ValueError, match="feature_tables"):
        KeyPreparer({})
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_shards"):
            KeyPreparer({"a": "t"}, num_shards=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_lens\['a'\]"):
        KeyPreparer({"a": "t"}, max_lens={"a": 0})
    with pytest.raises(KeyError, match="'b'"):
        KeyPreparer({"a": "t"}, max_lens={"b": 3})


def test_prepare_rejects_non_integer_values() -> None:
    batch = CsrBatch(
        {"f": Csr(np.zeros(3, np.float64), np.array([0, 3], np.int64))},  # type: ignore[arg-type]
        np.zeros((1, 0), np.float32),
        None,
        1,
    )
    with pytest.raises(TypeError, match="int64 or uint64"):
        KeyPreparer({"f": "t"})(batch)


def test_prepare_from_several_threads(rng: np.random.Generator) -> None:
    batches = [random_batch(rng, int(n)) for n in rng.integers(1, 800, 24)]
    preparers = {s: KeyPreparer(TABLES, num_shards=s) for s in SHARD_COUNTS}
    jobs = [(b, s) for b in batches for s in SHARD_COUNTS]
    sequential = [preparers[s](b) for b, s in jobs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            parallel = list(pool.map(lambda job: preparers[job[1]](job[0]), jobs))
            for x, y in zip(sequential, parallel, strict=True):
                same_prepared(x, y)
    for (b, s), p in zip(jobs[:8], sequential[:8], strict=True):
        check_prepared(b, p, TABLES, s)


# -- hashing -------------------------------------------------------------------------------


def keys_of(array: pa.Array | np.ndarray) -> list[int | None]:
    """Keys as a list: numpy uint64 (Python and numpy input) or Arrow uint64 (Arrow input)."""
    if isinstance(array, np.ndarray):
        assert array.dtype == np.uint64
        return array.tolist()
    assert array.type == pa.uint64()
    return array.to_pylist()


def test_hash_strings_pinned_key() -> None:
    # Keys are part of the data format ("v1"): this value must never change.
    assert keys_of(hash_strings(["apple"], "fruit")) == [9069760335543976440]


def test_hash_ints_pinned_key() -> None:
    # datagen keys (and any salted integer ids) depend on this value too.
    assert hash_ints(np.array([42, -1]), "C1").tolist() == [
        2121332443692090872,
        5471080352676122571,
    ]


def test_hash_strings_deterministic() -> None:
    words = [f"word-{i}" * (i % 5) for i in range(300)]
    assert keys_of(hash_strings(words, "f")) == keys_of(hash_strings(list(words), "f"))
    assert field_seed("f") == field_seed("f")


def test_hash_strings_field_salted() -> None:
    a = keys_of(hash_strings(["apple", "pear", ""], "fruit"))
    b = keys_of(hash_strings(["apple", "pear", ""], "veg"))
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert field_seed("fruit") != field_seed("veg")


def test_hash_strings_distinct_values_distinct_keys() -> None:
    # every length from 0 to 40 (so every tail size), and near-identical strings
    words = ["x" * n for n in range(41)] + [f"{i:08d}" for i in range(5000)]
    words += ["apple", "apple ", " apple", "Apple", "é", "e\u0301"]
    keys = keys_of(hash_strings(words, "f"))
    assert len(set(keys)) == len(words)


def test_hash_strings_keeps_nulls() -> None:
    out = hash_strings(pa.array(["a", None, "b", None]), "f")
    assert out.null_count == 2
    assert keys_of(out)[1] is None and keys_of(out)[3] is None
    assert [keys_of(out)[0], keys_of(out)[2]] == keys_of(hash_strings(["a", "b"], "f"))
    assert keys_of(hash_strings(pa.array([None, None], pa.string()), "f")) == [None, None]
    with pytest.raises(TypeError, match=r"element 0 is None"):  # numpy keys have no null
        hash_strings([None, None], "f")  # type: ignore[list-item]


@pytest.mark.parametrize("string_type", [pa.string(), pa.large_string()])
def test_hash_strings_arrow_types_agree(string_type: pa.DataType) -> None:
    words = ["apple", None, "", "banana split", "日本語", "x" * 100]
    expected = keys_of(hash_strings(pa.array(words, pa.string()), "f"))
    array = pa.array(words, string_type)
    assert keys_of(hash_strings(array, "f")) == expected
    # a slice (non-zero offset into the buffers)
    assert keys_of(hash_strings(array.slice(2, 3), "f")) == expected[2:5]
    # a chunked array
    chunked = pa.chunked_array([array.slice(0, 2), array.slice(2)])
    assert keys_of(hash_strings(chunked, "f")) == expected
    assert keys_of(hash_strings(pa.array([], string_type), "f")) == []


def test_hash_strings_from_generator_and_tuple() -> None:
    words = ("a", "b", "c")
    expected = keys_of(hash_strings(list(words), "f"))
    assert keys_of(hash_strings(words, "f")) == expected
    assert keys_of(hash_strings((w for w in words), "f")) == expected
    assert keys_of(hash_strings([], "f")) == []


def test_hash_strings_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match="'f'"):
        hash_strings(pa.array([1, 2, 3]), "f")


def test_hash_ints() -> None:
    ids = np.array([0, 1, -1, 2**63 - 1, -(2**63), 42], np.int64)
    a = hash_ints(ids, "C1")
    assert a.dtype == np.uint64 and a.shape == ids.shape
    np.testing.assert_array_equal(a, hash_ints(ids.copy(), "C1"))
    assert len(set(a.tolist())) == len(ids)
    b = hash_ints(ids, "C2")
    assert not (a == b).any()  # salted by the field
    np.testing.assert_array_equal(hash_ints([1, 2, 3], "C1"), hash_ints(np.array([1, 2, 3]), "C1"))
