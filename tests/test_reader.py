"""ParquetReader: Parquet files written by pyarrow, read back as CSR batches.

Every expected value comes from pyarrow reading the same files directly, turned
into batch semantics by ``expected_columns`` (see ``wuliang.reader.columns``):
null lists are empty, null list elements dropped, a null int is an empty row,
a null float / bool / fixed-size list is 0.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from wuliang.ps_server import shard_of
from wuliang.reader import CsrBatch, KeyPreparer, ParquetReader, hash_strings
from wuliang.reader.columns import Schema, chunk_from_record_batch
from wuliang.reader.convert import CsvSchema, convert_csv
from wuliang.reader.datagen import DENSE, LABEL, MULTI, SINGLE, SPARSE, DatagenConfig, generate
from wuliang.reader.hashing import HASH_METADATA, hash_tag, parse_hash_tag, tag_hashed

# -- helpers -------------------------------------------------------------------------

SPARSE_DTYPES: dict[str, type] = {
    "rid": np.int64,
    "ml": np.int64,
    "mu": np.uint64,
    "si": np.int64,
    "s32": np.int64,  # int32 keys are widened to int64
    "su": np.uint64,
}
DENSE_WIDTHS: dict[str, int] = {"f32": 1, "f64": 1, "b": 1, "v3": 3}
FEATURES = [*SPARSE_DTYPES, *DENSE_WIDTHS]
ROUND_TRIP_ROWS = [53, 47, 62]  # 162 rows in all; no batch size below divides it
ROW_GROUPS = [10, 13, 9]
BIG_U64 = [2**64 - 1, 2**63, 2**63 + 12345, 2**40 + 7]


def wuliang_threads() -> list[str]:
    """wuliang's threads, but parameter servers' call threads (their
    ``*_async`` calls), which live until the server is closed."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("wuliang-") and not t.name.startswith("wuliang-ps-call")
    )


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    """A hung reader must not hang the suite: dump every stack and exit after 120 s."""
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    assert wuliang_threads() == [], "threads left over by an earlier test"
    yield
    assert wuliang_threads() == []


def finishes(fn: Callable[[], Any], seconds: float = 5.0) -> tuple[bool, list[Any]]:
    """Runs fn in a daemon thread; (finished in time, [its result or exception])."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=target, name="test-consumer", daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out


def random_table(rng: np.random.Generator, n: int, first_id: int) -> pa.Table:
    """n rows of every column kind, with nulls of every sort."""

    def maybe(p: float) -> bool:
        return bool(rng.random() < p)

    ml: list[list[int | None] | None] = []
    mu: list[list[int | None] | None] = []
    for _ in range(n):
        ml.append(
            None
            if maybe(0.15)
            else [
                None if maybe(0.1) else int(rng.integers(-50, 50)) for _ in range(rng.integers(5))
            ]
        )
        mu.append(
            None
            if maybe(0.15)
            else [
                None
                if maybe(0.1)
                else BIG_U64[int(rng.integers(len(BIG_U64)))]
                if maybe(0.5)
                else int(rng.integers(9))
                for _ in range(rng.integers(5))
            ]
        )
    si = [None if maybe(0.2) else int(rng.integers(-(2**62), 2**62)) for _ in range(n)]
    s32 = [None if maybe(0.2) else int(rng.integers(-(2**31), 2**31 - 1)) for _ in range(n)]
    su = [None if maybe(0.2) else BIG_U64[int(rng.integers(len(BIG_U64)))] for _ in range(n)]
    f32 = [None if maybe(0.2) else float(rng.normal()) for _ in range(n)]
    f64 = [None if maybe(0.2) else float(rng.normal()) * 1e3 for _ in range(n)]
    b = [None if maybe(0.2) else bool(rng.integers(2)) for _ in range(n)]
    v3 = [None if maybe(0.2) else [float(x) for x in rng.normal(size=3)] for _ in range(n)]
    return pa.table(
        {
            "rid": pa.array(np.arange(first_id, first_id + n), pa.int64()),
            "ml": pa.array(ml, pa.list_(pa.int64())),
            "mu": pa.array(mu, pa.list_(pa.uint64())),
            "si": pa.array(si, pa.int64()),
            "s32": pa.array(s32, pa.int32()),
            "su": pa.array(su, pa.uint64()),
            "f32": pa.array(f32, pa.float32()),
            "f64": pa.array(f64, pa.float64()),
            "b": pa.array(b, pa.bool_()),
            "v3": pa.array(v3, pa.list_(pa.float32(), 3)),
            "label": pa.array(rng.integers(0, 2, n).astype(np.float32)),
            "label2": pa.array(rng.random(n), pa.float64()),
        }
    )


def write_files(
    folder: Path, tables: Sequence[pa.Table], row_groups: Sequence[int] | int = 1000
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    groups = [row_groups] * len(tables) if isinstance(row_groups, int) else list(row_groups)
    paths = []
    for i, (t, g) in enumerate(zip(tables, groups, strict=True)):
        path = folder / f"part-{i:03d}.parquet"
        pq.write_table(t, path, row_group_size=g)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def round_trip_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = np.random.default_rng(7)
    tables, first = [], 0
    for n in ROUND_TRIP_ROWS:
        tables.append(random_table(rng, n, first))
        first += n
    paths = write_files(tmp_path_factory.mktemp("round_trip"), tables, ROW_GROUPS)
    for path, groups, n in zip(paths, ROW_GROUPS, ROUND_TRIP_ROWS, strict=True):
        assert pq.ParquetFile(path).num_row_groups == -(-n // groups) > 1
    return paths


@dataclass
class Columns:
    """A whole data set (or a run of batches) as flat columns."""

    values: dict[str, np.ndarray]  # sparse feature -> all values
    lengths: dict[str, np.ndarray]  # sparse feature -> values per row
    dense: np.ndarray  # float32 [rows, k]
    labels: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return len(self.dense)

    def head(self, n: int) -> Columns:
        return Columns(
            {k: v[: self.lengths[k][:n].sum()] for k, v in self.values.items()},
            {k: v[:n] for k, v in self.lengths.items()},
            self.dense[:n],
            {k: v[:n] for k, v in self.labels.items()},
        )


def expected_columns(paths: Sequence[Path], labels: Sequence[str] = ("label",)) -> Columns:
    """What the reader should produce, from pyarrow's own reading of the files."""
    values: dict[str, list[int]] = {k: [] for k in SPARSE_DTYPES}
    lengths: dict[str, list[int]] = {k: [] for k in SPARSE_DTYPES}
    dense: list[list[float]] = []
    label_values: dict[str, list[float]] = {k: [] for k in labels}
    for path in sorted(paths):
        for row in pq.read_table(path).to_pylist():
            for name in SPARSE_DTYPES:
                cell = row[name]
                if isinstance(cell, list):
                    kept = [v for v in cell if v is not None]
                else:
                    kept = [] if cell is None else [cell]
                values[name].extend(kept)
                lengths[name].append(len(kept))
            v3 = row["v3"] if row["v3"] is not None else [0.0] * 3
            dense.append(
                [
                    np.float32(0.0 if row["f32"] is None else row["f32"]),
                    np.float32(0.0 if row["f64"] is None else row["f64"]),
                    np.float32(0.0 if row["b"] is None else float(row["b"])),
                    *v3,
                ]
            )
            for k in labels:
                label_values[k].append(row[k])
    return Columns(
        {k: np.array(v, dtype=SPARSE_DTYPES[k]) for k, v in values.items()},
        {k: np.array(v, dtype=np.int64) for k, v in lengths.items()},
        np.array(dense, dtype=np.float32).reshape(-1, 6),
        {k: np.array(v, dtype=np.float32) for k, v in label_values.items()},
    )


def batch_columns(batches: Sequence[CsrBatch], sparse: Sequence[str]) -> Columns:
    """The batches' rows, concatenated."""
    labels: dict[str, np.ndarray] = {}
    if batches and batches[0].labels is not None:
        first = batches[0].labels
        names = list(first) if isinstance(first, dict) else ["label"]

        def label_of(b: CsrBatch, k: str) -> np.ndarray:
            assert b.labels is not None
            return b.labels[k] if isinstance(b.labels, dict) else b.labels

        labels = {k: np.concatenate([label_of(b, k) for b in batches]) for k in names}
    return Columns(
        {k: np.concatenate([b.sparse[k].values for b in batches]) for k in sparse},
        {k: np.concatenate([b.sparse[k].lengths() for b in batches]) for k in sparse},
        np.concatenate([b.dense for b in batches]),
        labels,
    )


def assert_same(actual: Columns, expected: Columns) -> None:
    assert actual.rows == expected.rows
    for k, v in expected.values.items():
        assert actual.values[k].dtype == v.dtype, k
        np.testing.assert_array_equal(actual.lengths[k], expected.lengths[k], err_msg=k)
        np.testing.assert_array_equal(actual.values[k], v, err_msg=k)
    assert actual.dense.dtype == np.float32
    np.testing.assert_array_equal(actual.dense, expected.dense)
    assert actual.labels.keys() == expected.labels.keys()
    for k, v in expected.labels.items():
        assert actual.labels[k].dtype == np.float32
        np.testing.assert_array_equal(actual.labels[k], v, err_msg=k)


def simple_table(ids: Sequence[int] | np.ndarray, label: float = 0.0) -> pa.Table:
    """rid (int64, a row id), m (list<int64>, [rid, rid + 1]) and label."""
    rid = np.asarray(ids, dtype=np.int64)
    offsets = np.arange(len(rid) + 1, dtype=np.int32) * 2
    m_values = np.stack([rid, rid + 1], axis=1).reshape(-1)
    return pa.table(
        {
            "rid": pa.array(rid),
            "m": pa.ListArray.from_arrays(pa.array(offsets), pa.array(m_values)),
            "label": pa.array(np.full(len(rid), label, np.float32)),
        }
    )


def simple_files(folder: Path, sizes: Sequence[int], row_groups: int = 7) -> list[Path]:
    starts = np.cumsum([0, *sizes])
    tables = [simple_table(np.arange(a, a + n)) for a, n in zip(starts, sizes, strict=False)]
    return write_files(folder, tables, row_groups)


def read_ids(reader: ParquetReader) -> np.ndarray:
    """Row ids in the order the reader yields them."""
    parts = [b.sparse["rid"].values for b in reader]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def write_truncated(path: Path, table: pa.Table, keep: float = 0.6) -> None:
    pq.write_table(table, path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def write_garbage(path: Path, seed: int = 0) -> None:
    path.write_bytes(np.random.default_rng(seed).bytes(4096))


# -- round trip ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch_size", "drop_remainder", "num_threads"),
    [(7, False, 2), (7, True, 3), (1, False, 1), (1000, False, 2), (1000, True, 2), (64, True, 1)],
)
def test_round_trip_every_value(
    round_trip_files: list[Path], batch_size: int, drop_remainder: bool, num_threads: int
) -> None:
    reader = ParquetReader(
        round_trip_files[0].parent,
        batch_size,
        FEATURES,
        "label",
        num_threads=num_threads,
        drop_remainder=drop_remainder,
    )
    batches = list(reader)
    total = sum(ROUND_TRIP_ROWS)
    n_full, rest = divmod(total, batch_size)
    sizes = [b.size for b in batches]
    assert sizes == [batch_size] * n_full + ([] if drop_remainder or not rest else [rest])
    expected = expected_columns(round_trip_files)
    if drop_remainder:
        expected = expected.head(n_full * batch_size)
    if not batches:
        assert expected.rows == 0
        return
    for b in batches:
        assert b.dense.shape == (b.size, 6)
        assert isinstance(b.labels, np.ndarray) and b.labels.shape == (b.size,)
        for name, csr in b.sparse.items():
            assert csr.offsets.dtype == np.int64 and csr.offsets[0] == 0
            assert csr.num_rows == b.size, name
            assert csr.weights is None
        b.validate()
    assert_same(batch_columns(batches, list(SPARSE_DTYPES)), expected)
    assert reader.stats.rows == expected.rows
    assert reader.stats.batches == len(batches)


def test_round_trip_dense_columns(round_trip_files: list[Path]) -> None:
    reader = ParquetReader(round_trip_files, 50, FEATURES, "label")
    batch = next(iter(reader))
    reader.close()
    assert batch.dense_columns == {
        "f32": slice(0, 1),
        "f64": slice(1, 2),
        "b": slice(2, 3),
        "v3": slice(3, 6),
    }
    expected = expected_columns(round_trip_files).dense[:50]
    np.testing.assert_array_equal(batch.dense_feature("v3"), expected[:, 3:6])
    np.testing.assert_array_equal(batch.dense_feature("b")[:, 0], expected[:, 2])
    assert set(np.unique(batch.dense_feature("b"))) <= {0.0, 1.0}
    assert set(batch.sparse) == set(SPARSE_DTYPES)


def test_round_trip_features_subset_and_order(round_trip_files: list[Path]) -> None:
    """Dense columns follow the order of `features`, not of the file."""
    reader = ParquetReader(round_trip_files, 500, ["v3", "mu", "f64"], None)
    (batch,) = list(reader)
    assert batch.labels is None
    assert set(batch.sparse) == {"mu"}
    assert batch.dense_columns == {"v3": slice(0, 3), "f64": slice(3, 4)}
    expected = expected_columns(round_trip_files)
    np.testing.assert_array_equal(batch.dense, expected.dense[:, [3, 4, 5, 1]])
    np.testing.assert_array_equal(batch.sparse["mu"].values, expected.values["mu"])


def test_list_paths_glob_and_directory_agree(round_trip_files: list[Path]) -> None:
    folder = round_trip_files[0].parent
    by_list = read_ids(ParquetReader([str(p) for p in round_trip_files], 10, ["rid"]))
    by_glob = read_ids(ParquetReader(str(folder / "part-*.parquet"), 10, ["rid"]))
    by_dir = read_ids(ParquetReader(folder, 10, ["rid"]))
    expected = np.arange(sum(ROUND_TRIP_ROWS))
    for ids in (by_list, by_glob, by_dir):
        np.testing.assert_array_equal(ids, expected)


def test_several_arrow_record_batches_per_file(tmp_path: Path) -> None:
    """A file longer than one Arrow record batch (65536 rows): rows stay in order
    and the row of a null is counted from the start of the file."""
    n = 70_000
    ids = np.arange(n, dtype=np.int64)
    mask = np.zeros(2 * n, dtype=bool)
    mask[2 * 66_000 + 1] = True  # second value of row 66000 is null
    m = pa.ListArray.from_arrays(
        pa.array(np.arange(n + 1, dtype=np.int32) * 2),
        pa.array(np.repeat(ids, 2), mask=mask),
    )
    table = pa.table({"rid": ids, "m": m, "label": np.zeros(n, np.float32)})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=20_000)
    reader = ParquetReader(tmp_path, 9_999, ["rid", "m"], "label", num_threads=1)
    batches = list(reader)
    np.testing.assert_array_equal(np.concatenate([b.sparse["rid"].values for b in batches]), ids)
    lengths = np.concatenate([b.sparse["m"].lengths() for b in batches])
    assert lengths[66_000] == 1 and (np.delete(lengths, 66_000) == 2).all()
    with pytest.raises(ValueError, match=r"big\.parquet.*feature 'm'.*row 66000"):
        list(ParquetReader(tmp_path, 9_999, ["m"], "label", null_values="raise"))


def test_empty_file_among_others(tmp_path: Path) -> None:
    paths = simple_files(tmp_path, [5, 0, 6])
    assert pq.ParquetFile(paths[1]).metadata.num_rows == 0
    reader = ParquetReader(tmp_path, 4, ["rid", "m"], "label")
    batches = list(reader)
    assert [b.size for b in batches] == [4, 4, 3]
    np.testing.assert_array_equal(
        np.concatenate([b.sparse["rid"].values for b in batches]), range(11)
    )


def test_other_integer_list_types(tmp_path: Path) -> None:
    table = pa.table(
        {
            "l32": pa.array([[1, -2], None, [3]], pa.list_(pa.int32())),
            "lu32": pa.array([[2**32 - 1], [], [None, 5]], pa.list_(pa.uint32())),
            "large": pa.array([[7], [8, 9], None], pa.large_list(pa.int64())),
            "u8": pa.array([255, None, 1], pa.uint8()),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    (batch,) = list(ParquetReader(tmp_path, 3, ["l32", "lu32", "large", "u8"]))
    expected = {
        "l32": (np.int64, [1, -2, 3], [0, 2, 2, 3]),
        "lu32": (np.uint64, [2**32 - 1, 5], [0, 1, 1, 2]),
        "large": (np.int64, [7, 8, 9], [0, 1, 3, 3]),
        "u8": (np.uint64, [255, 1], [0, 1, 1, 2]),
    }
    for name, (dtype, values, offsets) in expected.items():
        csr = batch.sparse[name]
        assert csr.values.dtype == dtype, name
        assert csr.values.tolist() == values, name
        assert csr.offsets.tolist() == offsets, name


def test_null_element_of_fixed_size_list_is_zero(tmp_path: Path) -> None:
    # Null elements of a fixed-size list follow the dense rule (null = 0), not NaN.
    table = pa.table({"v": pa.array([[1.0, None], None, [3.0, 4.0]], pa.list_(pa.float32(), 2))})
    pq.write_table(table, tmp_path / "t.parquet")
    reader = ParquetReader(tmp_path, 3, ["v"])
    (batch,) = list(reader)
    np.testing.assert_array_equal(batch.dense, [[1.0, 0.0], [0.0, 0.0], [3.0, 4.0]])


# -- zero copy ----------------------------------------------------------------------


def test_batch_inside_one_record_batch_is_zero_copy(tmp_path: Path) -> None:
    simple_files(tmp_path, [100], row_groups=100)
    reader = ParquetReader(tmp_path, 10, ["m", "rid"], "label")
    it = iter(reader)
    first, second = next(it), next(it)
    reader.close()
    for batch in (first, second):
        values = batch.sparse["m"].values
        assert not values.flags.writeable
        assert not values.flags.owndata
        with pytest.raises(ValueError):
            values[0] = 1
    assert first.sparse["m"].values.tolist() == [v for i in range(10) for v in (i, i + 1)]
    assert second.sparse["m"].values.tolist() == [v for i in range(10, 20) for v in (i, i + 1)]


# -- sharding --------------------------------------------------------------------------


def test_sharding_is_a_partition(tmp_path: Path) -> None:
    paths = simple_files(tmp_path, [11, 9, 13, 10, 12, 8, 14])
    total = 77
    seen: list[np.ndarray] = []
    for w in range(3):
        reader = ParquetReader(tmp_path, 5, ["rid"], num_workers=3, worker_index=w)
        assert reader.files == [str(p) for p in sorted(paths)[w::3]]
        ids = read_ids(reader)
        expected = np.concatenate(
            [pq.read_table(p, columns=["rid"])["rid"].to_numpy() for p in sorted(paths)[w::3]]
        )
        np.testing.assert_array_equal(ids, expected)
        seen.append(ids)
    union = np.concatenate(seen)
    assert len(union) == total
    np.testing.assert_array_equal(np.sort(union), np.arange(total))
    for a in range(3):
        for b in range(a + 1, 3):
            assert not set(seen[a]) & set(seen[b])


def test_sharding_does_not_depend_on_the_order_of_paths(tmp_path: Path) -> None:
    # Workers must agree on the file order whatever order each was given.
    paths = [str(p) for p in simple_files(tmp_path, [3, 3, 3, 3])]
    shards = []
    for order in (paths, paths[::-1]):
        reader = ParquetReader(order, 2, ["rid"], num_workers=2, worker_index=0)
        shards.append(reader.files)
    assert shards[0] == sorted(paths)[0::2]
    assert shards[1] == sorted(paths)[0::2]


def test_worker_without_files(tmp_path: Path) -> None:
    simple_files(tmp_path, [3, 3])
    ParquetReader(tmp_path, 2, ["rid"], num_workers=3, worker_index=1)  # has one
    with pytest.raises(ValueError, match=r"worker 2 of 3 has no files"):
        ParquetReader(tmp_path, 2, ["rid"], num_workers=3, worker_index=2)
    with pytest.raises(ValueError, match="worker_index"):
        ParquetReader(tmp_path, 2, ["rid"], num_workers=3, worker_index=3)


# -- shuffle --------------------------------------------------------------------------------


@pytest.fixture
def shuffle_dir(tmp_path: Path) -> Path:
    simple_files(tmp_path, [60, 45, 70, 25], row_groups=16)
    return tmp_path


def shuffled(folder: Path, seed: int, **kw: Any) -> np.ndarray:
    kw.setdefault("shuffle_buffer", 64)
    return read_ids(ParquetReader(folder, 9, ["rid", "m"], "label", seed=seed, num_threads=2, **kw))


def test_shuffle_same_seed_same_order(shuffle_dir: Path) -> None:
    a = shuffled(shuffle_dir, 5)
    b = shuffled(shuffle_dir, 5)
    np.testing.assert_array_equal(a, b)
    reader = ParquetReader(shuffle_dir, 9, ["rid"], shuffle_buffer=64, seed=5, num_threads=2)
    np.testing.assert_array_equal(read_ids(reader), a)  # and a second iteration too
    np.testing.assert_array_equal(read_ids(reader), a)


def test_shuffle_different_seed_different_order(shuffle_dir: Path) -> None:
    a = shuffled(shuffle_dir, 5)
    b = shuffled(shuffle_dir, 6)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(np.sort(a), np.sort(b))


def test_shuffle_every_row_once_per_epoch(shuffle_dir: Path) -> None:
    total = 200
    ids = shuffled(shuffle_dir, 1)
    assert len(ids) == total
    np.testing.assert_array_equal(np.sort(ids), np.arange(total))
    assert not np.array_equal(ids, np.arange(total))  # it did shuffle
    # rows actually move far: more than a row-group apart
    assert np.abs(ids - np.arange(total)).max() > 16


def test_shuffle_batches_exact_and_rows_intact(shuffle_dir: Path) -> None:
    reader = ParquetReader(
        shuffle_dir, 9, ["rid", "m"], "label", shuffle_buffer=30, seed=3, num_threads=2
    )
    batches = list(reader)
    assert [b.size for b in batches] == [9] * 22 + [2]
    for b in batches:
        b.validate()
        rid, m = b.sparse["rid"], b.sparse["m"]
        for i in range(b.size):  # each row keeps its own values
            assert m.row(i).tolist() == [rid.values[i], rid.values[i] + 1]
    dropped = list(
        ParquetReader(shuffle_dir, 9, ["rid"], shuffle_buffer=30, seed=3, drop_remainder=True)
    )
    assert [b.size for b in dropped] == [9] * 22


def test_shuffle_epochs(shuffle_dir: Path) -> None:
    ids = shuffled(shuffle_dir, 2, epochs=3)
    assert len(ids) == 600
    np.testing.assert_array_equal(np.bincount(ids), np.full(200, 3))
    unshuffled = shuffled(shuffle_dir, 2, epochs=3, shuffle_buffer=0)
    np.testing.assert_array_equal(unshuffled, np.tile(np.arange(200), 3))


def test_shuffle_buffer_smaller_than_batch(shuffle_dir: Path) -> None:
    ids = shuffled(shuffle_dir, 4, shuffle_buffer=2)
    np.testing.assert_array_equal(np.sort(ids), np.arange(200))


# -- bad input --------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet"):
        ParquetReader(missing, 4, ["rid"])
    simple_files(tmp_path / "ok", [3])
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet"):
        ParquetReader([tmp_path / "ok", missing], 4, ["rid"])


def test_empty_glob(tmp_path: Path) -> None:
    pattern = str(tmp_path / "*.parquet")
    with pytest.raises(FileNotFoundError) as info:
        ParquetReader(pattern, 4, ["rid"])
    assert pattern in str(info.value)


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not parquet")
    for folder in ("empty", "other"):
        with pytest.raises(FileNotFoundError) as info:
            ParquetReader(tmp_path / folder, 4, ["rid"])
        assert str(tmp_path / folder) in str(info.value)


@pytest.mark.parametrize(
    "bad_arg",
    [
        {"batch_size": 0},
        {"features": []},
        {"shuffle_buffer": -1},
        {"epochs": 0},
        {"prefetch": 0},
        {"on_bad_file": "ignore"},
        {"null_values": "keep"},
    ],
)
def test_bad_arguments(tmp_path: Path, bad_arg: dict[str, Any]) -> None:
    simple_files(tmp_path, [3])
    kw: dict[str, Any] = {"batch_size": 2, "features": ["rid"], **bad_arg}
    with pytest.raises(ValueError):
        ParquetReader(tmp_path, **kw)


def test_unknown_column_in_first_file(tmp_path: Path) -> None:
    simple_files(tmp_path, [3])
    with pytest.raises(ValueError, match=r"part-000\.parquet.*'nope'"):
        ParquetReader(tmp_path, 2, ["rid", "nope"])
    with pytest.raises(ValueError, match=r"'nolabel'"):
        ParquetReader(tmp_path, 2, ["rid"], "nolabel")


@pytest.mark.parametrize("num_threads", [1, 3])
def test_schema_mismatch_missing_column(tmp_path: Path, num_threads: int) -> None:
    simple_files(tmp_path, [20, 15])
    pq.write_table(
        simple_table(np.arange(100, 110)).drop_columns(["m"]), tmp_path / "part-002.parquet"
    )
    simple_files(tmp_path / "sub", [5])  # a later, good file (directories are recursive)
    reader = ParquetReader(tmp_path, 8, ["rid", "m"], "label", num_threads=num_threads)
    got: list[int] = []
    with pytest.raises(ValueError, match=r"part-002\.parquet.*'m'"):
        for b in reader:
            got.append(b.size)
    assert sum(got) == 32  # the full batches of the 35 good rows before it


@pytest.mark.parametrize(
    ("column", "array"),
    [
        ("rid", pa.array(np.arange(4, dtype=np.int32))),
        ("m", pa.array([[1], [2], [3], [4]], pa.list_(pa.int32()))),
        ("m", pa.array([[1.0]] * 4, pa.list_(pa.float64()))),
        ("label", pa.array(np.zeros(4), pa.float64())),
        ("rid", pa.array(["a", "b", "c", "d"])),
    ],
)
def test_schema_mismatch_other_type(tmp_path: Path, column: str, array: pa.Array) -> None:
    simple_files(tmp_path, [6, 6])
    table = simple_table(np.arange(50, 54))
    table = table.set_column(table.schema.get_field_index(column), column, array)
    pq.write_table(table, tmp_path / "part-002.parquet")
    with pytest.raises(ValueError, match=rf"part-002\.parquet.*'{column}'"):
        list(ParquetReader(tmp_path, 4, ["rid", "m"], "label"))


@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_bad_file_raises_naming_it(tmp_path: Path, kind: str) -> None:
    simple_files(tmp_path, [10, 10])
    bad = tmp_path / "part-001.parquet"  # replaces the second file
    if kind == "truncated":
        write_truncated(bad, simple_table(np.arange(1000, 1500)))
    else:
        write_garbage(bad)
    with pytest.raises(ValueError, match=r"part-001\.parquet"):
        list(ParquetReader(tmp_path, 4, ["rid", "m"], "label", on_bad_file="raise"))


def test_bad_files_skipped_and_counted(tmp_path: Path) -> None:
    simple_files(tmp_path, [10, 10, 10, 10])
    write_truncated(tmp_path / "part-001.parquet", simple_table(np.arange(10, 500)))
    write_garbage(tmp_path / "part-002.parquet")
    reader = ParquetReader(tmp_path, 4, ["rid", "m"], "label", on_bad_file="skip")
    ids = read_ids(reader)
    np.testing.assert_array_equal(ids, [*range(10), *range(30, 40)])
    assert reader.stats.skipped_files == 2
    assert reader.stats.files_read == 2
    assert reader.stats.rows == 20


@pytest.mark.parametrize("on_bad_file", ["raise", "skip"])
def test_bad_first_file(tmp_path: Path, on_bad_file: str) -> None:
    # The schema comes from the first readable file; a bad first file obeys on_bad_file.
    write_garbage(tmp_path / "part-000.parquet")
    pq.write_table(simple_table(np.arange(10)), tmp_path / "part-001.parquet")
    if on_bad_file == "raise":
        with pytest.raises(ValueError, match=r"part-000\.parquet"):
            list(ParquetReader(tmp_path, 4, ["rid"], on_bad_file="raise"))
    else:
        reader = ParquetReader(tmp_path, 4, ["rid"], on_bad_file="skip")
        np.testing.assert_array_equal(read_ids(reader), np.arange(10))
        assert reader.stats.skipped_files == 1


def null_element_files(folder: Path) -> None:
    a = pa.table({"m": pa.array([[1, 2], [3]] * 5, pa.list_(pa.int64()))})
    b = pa.table({"m": pa.array([[4], None, [5, 6], [7], [None, 8], [None]], pa.list_(pa.int64()))})
    write_files(folder, [a, b], row_groups=[4, 2])


def test_null_list_elements_dropped_by_default(tmp_path: Path) -> None:
    null_element_files(tmp_path)
    (batch,) = list(ParquetReader(tmp_path, 100, ["m"]))
    csr = batch.sparse["m"]
    assert csr.values.tolist() == [1, 2, 3] * 5 + [4, 5, 6, 7, 8]
    assert csr.lengths().tolist() == [2, 1] * 5 + [1, 0, 2, 1, 1, 0]


def test_null_list_elements_raise(tmp_path: Path) -> None:
    null_element_files(tmp_path)
    # The first null is in row 4 of the second file (row groups of 2 rows).
    with pytest.raises(ValueError, match=r"part-001\.parquet.*feature 'm'.*row 4"):
        list(ParquetReader(tmp_path, 3, ["m"], null_values="raise"))


@pytest.mark.parametrize("label_type", [pa.float32(), pa.float64(), pa.int64(), pa.bool_()])
def test_null_label_names_the_row(tmp_path: Path, label_type: pa.DataType) -> None:
    good = pa.array([1, 0] * 5, pa.int64()).cast(label_type)
    bad = pa.array([1, 0, 1, 0, 1, None, 0, 1, 0, 1], pa.int64()).cast(label_type)
    for i, labels in enumerate([good, bad]):
        table = simple_table(np.arange(10 * i, 10 * i + 10)).set_column(2, "label", labels)
        pq.write_table(table, tmp_path / f"part-{i:03d}.parquet", row_group_size=3)
    good_only = ParquetReader(tmp_path / "part-000.parquet", 4, ["rid"], "label")
    labels_read = np.concatenate([b.labels for b in good_only])  # type: ignore[misc]
    assert labels_read.dtype == np.float32
    np.testing.assert_array_equal(labels_read, [1, 0] * 5)
    with pytest.raises(ValueError, match=r"part-001\.parquet.*'label'.*row 5"):
        list(ParquetReader(tmp_path, 4, ["rid"], "label"))


def test_nan_label_names_the_row(tmp_path: Path) -> None:
    table = simple_table(np.arange(8))
    labels = pa.array([0, 1, 0, np.nan, 0, 0, 0, 0], pa.float32())
    pq.write_table(table.set_column(2, "label", labels), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"'label'.*row 3"):
        list(ParquetReader(tmp_path, 3, ["rid"], "label"))


@pytest.mark.parametrize(
    "array",
    [
        pa.array([b"a", b"b", None, b"d"], pa.binary()),
        pa.array([{"x": 1}] * 4, pa.struct([("x", pa.int64())])),
        pa.array([[1.5]] * 4, pa.list_(pa.float32())),
        pa.array([[[1]]] * 4, pa.list_(pa.list_(pa.int64()))),
    ],
)
def test_unsupported_column_type_is_a_clear_error(tmp_path: Path, array: pa.Array) -> None:
    table = simple_table(np.arange(4)).append_column("odd", array)
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"column 'odd' has type .*; the reader reads int, string"):
        ParquetReader(tmp_path, 2, ["rid", "odd"], "label")


def test_string_label_is_a_clear_error(tmp_path: Path) -> None:
    table = simple_table(np.arange(4)).append_column("city", pa.array(["a", "b", None, "d"]))
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"label column 'city'"):
        ParquetReader(tmp_path, 2, ["rid"], "city")


# -- string columns, read by hashing ---------------------------------------------------------

CITIES = ["paris", "", "Zürich", "a much longer city name than eight bytes", "oslo"]
TAGS = ["x", "yy", "", "tag with spaces", "ünïcode", "0123456789abcdef01"]


def string_table(rng: np.random.Generator, first_id: int, n: int) -> dict[str, list[Any]]:
    """rid, city (string or null) and tags (list of strings, null lists and elements)."""
    city = [None if rng.random() < 0.2 else CITIES[rng.integers(len(CITIES))] for _ in range(n)]
    tags: list[list[str | None] | None] = []
    for _ in range(n):
        if rng.random() < 0.15:
            tags.append(None)
            continue
        size = int(rng.integers(5))
        tags.append([None if rng.random() < 0.1 else TAGS[rng.integers(len(TAGS))]
                     for _ in range(size)])  # fmt: skip
    return {"rid": list(range(first_id, first_id + n)), "city": city, "tags": tags}


def write_string_files(
    folder: Path, city_type: pa.DataType, tags_type: pa.DataType, sizes: Sequence[int] = (23, 31)
) -> list[dict[str, list[Any]]]:
    """Files of string_table rows (row groups of 7); returns their rows."""
    rng = np.random.default_rng(11)
    data, first = [], 0
    for n in sizes:
        data.append(string_table(rng, first, n))
        first += n
    tables = [
        pa.table(
            {
                "rid": pa.array(d["rid"], pa.int64()),
                "city": pa.array(d["city"], pa.string()).cast(city_type),
                "tags": pa.array(d["tags"], pa.list_(pa.string())).cast(tags_type),
                "label": pa.array(np.zeros(len(d["rid"]), np.float32)),
            }
        )
        for d in data
    ]
    write_files(folder, tables, row_groups=7)
    return data


def hashed_rows(cells: Sequence[Any], field: str) -> tuple[list[int], list[int]]:
    """(keys, lengths) that hash_strings gives of a column's cells (null rows and
    elements dropped)."""
    keys: list[int] = []
    lengths: list[int] = []
    for cell in cells:
        words = [w for w in (cell if isinstance(cell, list) else [cell]) if w is not None]
        keys.extend(hash_strings(words, field).tolist())
        lengths.append(len(words))
    return keys, lengths


DICT_STRING = pa.dictionary(pa.int32(), pa.string())


@pytest.mark.parametrize(
    ("city_type", "tags_type"),
    [
        (pa.string(), pa.list_(pa.string())),
        (pa.large_string(), pa.large_list(pa.large_string())),
        (DICT_STRING, pa.list_(pa.large_string())),
    ],
)
@pytest.mark.parametrize("batch_size", [5, 100])
def test_string_columns_read_as_hashed_keys(
    tmp_path: Path, city_type: pa.DataType, tags_type: pa.DataType, batch_size: int
) -> None:
    data = write_string_files(tmp_path, city_type, tags_type)
    assert pq.read_schema(tmp_path / "part-000.parquet").field("city").type == city_type
    reader = ParquetReader(tmp_path, batch_size, ["rid", "city", "tags"], "label", num_threads=2)
    assert reader.hashed_features == {"city": "city", "tags": "tags"}
    got = batch_columns(list(reader), ["rid", "city", "tags"])
    for name in ("city", "tags"):
        keys, lengths = hashed_rows([c for d in data for c in d[name]], name)
        assert got.values[name].dtype == np.uint64
        assert got.values[name].tolist() == keys, name
        assert got.lengths[name].tolist() == lengths, name
    assert got.values["rid"].tolist() == list(range(54))


def test_null_string_elements_raise_naming_the_row(tmp_path: Path) -> None:
    data = write_string_files(tmp_path, pa.string(), pa.list_(pa.string()))
    tags = data[0]["tags"]
    row = next(i for i, t in enumerate(tags) if t is not None and None in t)
    with pytest.raises(ValueError, match=rf"part-000\.parquet.*feature 'tags'.*row {row}\b"):
        list(ParquetReader(tmp_path, 4, ["tags"], null_values="raise"))
    (batch,) = list(ParquetReader(tmp_path / "part-000.parquet", 100, ["tags"]))  # drop
    keys, lengths = hashed_rows(tags, "tags")
    assert batch.sparse["tags"].values.tolist() == keys
    assert batch.sparse["tags"].lengths().tolist() == lengths


def test_string_storage_may_differ_between_files(tmp_path: Path) -> None:
    a = pa.table({"city": pa.array(["a", None]), "tags": pa.array([["x"], None])})
    b = pa.table(
        {
            "city": pa.array(["b", "a"]).dictionary_encode(),
            "tags": pa.array([["y", None], []], pa.large_list(pa.large_string())),
        }
    )
    write_files(tmp_path, [a, b])
    (batch,) = list(ParquetReader(tmp_path, 10, ["city", "tags"]))
    assert batch.sparse["city"].values.tolist() == hash_strings(["a", "b", "a"], "city").tolist()
    assert batch.sparse["city"].lengths().tolist() == [1, 0, 1, 1]
    assert batch.sparse["tags"].values.tolist() == hash_strings(["x", "y"], "tags").tolist()
    assert batch.sparse["tags"].lengths().tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize(
    ("column", "array"),
    [
        ("city", pa.array([1, 2], pa.int64())),
        ("tags", pa.array([[1], [2]], pa.list_(pa.int64()))),
        ("tags", pa.array(["x", "y"])),  # strings, but not a list of them
    ],
)
def test_string_column_turned_other_type_names_file_and_column(
    tmp_path: Path, column: str, array: pa.Array
) -> None:
    good = pa.table({"city": pa.array(["a", "b"]), "tags": pa.array([["x"], ["y"]])})
    write_files(
        tmp_path, [good, good.set_column(good.schema.get_field_index(column), column, array)]
    )
    with pytest.raises(ValueError, match=rf"part-001\.parquet: column '{column}' is"):
        list(ParquetReader(tmp_path, 10, ["city", "tags"]))


def test_int_column_turned_string_names_file_and_column(tmp_path: Path) -> None:
    ints = pa.table({"city": pa.array([1, 2], pa.int64())})
    write_files(tmp_path, [ints, pa.table({"city": pa.array(["a", "b"])})])
    with pytest.raises(
        ValueError, match=r"part-001\.parquet: column 'city' is string, expected int64"
    ):
        list(ParquetReader(tmp_path, 10, ["city"]))


def test_hashed_features_of_tagged_key_columns(tmp_path: Path) -> None:
    schema = pa.schema(
        [
            tag_hashed(pa.field("c7", pa.uint64()), "C7"),  # seeded by another name
            tag_hashed(pa.field("genres", pa.list_(pa.uint64()))),
            pa.field("ids", pa.uint64()),
            pa.field("odd", pa.uint64(), metadata={HASH_METADATA: b"other/v9:x"}),
            pa.field("city", pa.string()),
        ]
    )
    keys = hash_strings(["a", "b"], "C7")
    table = pa.table(
        [keys, pa.array([[1], []], pa.list_(pa.uint64())), pa.array([1, 2], pa.uint64()),
         pa.array([3, 4], pa.uint64()), pa.array(["p", "q"])],
        schema=schema,
    )  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    reader = ParquetReader(tmp_path, 2, ["c7", "genres", "ids", "odd", "city"])
    assert reader.hashed_features == {"c7": "C7", "genres": "genres", "city": "city"}
    reader.hashed_features["ids"] = "ids"  # a copy: the reader's stays as it is
    assert "ids" not in reader.hashed_features
    assert ParquetReader(tmp_path, 2, ["ids", "c7"]).hashed_features == {"c7": "C7"}
    (batch,) = list(reader)
    assert batch.sparse["c7"].values.tolist() == keys.tolist()


def test_list_of_dictionary_strings() -> None:
    # Arrow cannot read this type back from Parquet, but may hand it over in memory.
    words = pa.array([["b", "a"], None, [None, "c"], []], pa.list_(DICT_STRING))
    rb = pa.record_batch({"tags": words})
    schema = Schema(rb.schema, "mem", ["tags"], [], {})
    csr = chunk_from_record_batch(rb, schema, "drop", "mem", 0).sparse["tags"]
    assert csr.values.tolist() == hash_strings(["b", "a", "c"], "tags").tolist()
    assert csr.lengths().tolist() == [2, 0, 1, 0]
    with pytest.raises(ValueError, match=r"mem: feature 'tags' has a null value at row 2"):
        chunk_from_record_batch(rb, schema, "raise", "mem", 0)


def test_parse_hash_tag() -> None:
    assert hash_tag("C1") == b"strings/v1:C1"
    assert parse_hash_tag(hash_tag("ünï:code")) == "ünï:code"
    assert parse_hash_tag(b"strings/v1:") == ""
    assert parse_hash_tag(b"ints/v1:C1") is None
    assert parse_hash_tag(None) is None


def test_strings_read_train_the_keys_of_convert_csv(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    n = 300
    users = [None if rng.random() < 0.1 else f"user {rng.integers(40)}" for _ in range(n)]
    tags = [[f"t{rng.integers(30)}" for _ in range(rng.integers(4))] for _ in range(n)]
    lines = ["user,tags,click"]
    lines += [
        f"{u or ''},{'|'.join(t)},{i % 2}" for i, (u, t) in enumerate(zip(users, tags, strict=True))
    ]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    schema = CsvSchema.from_dict(
        {
            "columns": [
                {"name": "user", "kind": "sparse", "type": "string"},
                {"name": "tags", "kind": "sparse_list", "type": "string"},
                {"name": "click", "kind": "label"},
            ]
        }
    )
    convert_csv(tmp_path / "data.csv", tmp_path / "converted", schema, rows_per_file=120,
                progress=False)  # fmt: skip
    raw = pa.table(
        {
            "user": pa.array(users, pa.string()),
            "tags": pa.array(tags, pa.list_(pa.string())),
            "click": pa.array(np.arange(n) % 2, pa.float32()),
        }
    )
    write_files(tmp_path / "raw", [raw.slice(0, 170), raw.slice(170)], row_groups=50)

    def read(folder: Path) -> tuple[ParquetReader, list[CsrBatch]]:
        tables = {"user": "user", "tags": "tags"}
        reader = ParquetReader(folder, 64, ["user", "tags"], "click",
                               prepare=KeyPreparer(tables, num_shards=2))  # fmt: skip
        return reader, list(reader)

    converted, from_csv = read(tmp_path / "converted")
    strings, from_strings = read(tmp_path / "raw")
    assert strings.hashed_features == converted.hashed_features == {"user": "user", "tags": "tags"}
    assert len(from_csv) == len(from_strings) == 5
    for a, b in zip(from_csv, from_strings, strict=True):
        for name in ("user", "tags"):
            np.testing.assert_array_equal(a.sparse[name].offsets, b.sparse[name].offsets)
            np.testing.assert_array_equal(a.sparse[name].values, b.sparse[name].values)
            assert a.prepared is not None and b.prepared is not None
            np.testing.assert_array_equal(
                a.prepared.tables[name].uniques, b.prepared.tables[name].uniques
            )


# -- threads and shutdown ---------------------------------------------------------------------


@pytest.fixture
def thread_dir(tmp_path: Path) -> Path:
    simple_files(tmp_path, [300, 300, 300], row_groups=50)
    return tmp_path


def test_no_threads_after_full_iteration(thread_dir: Path, no_thread_leak: None) -> None:
    reader = ParquetReader(thread_dir, 7, ["rid", "m"], "label", num_threads=3)
    assert len(read_ids(reader)) == 900
    assert wuliang_threads() == []


def test_no_threads_after_break_and_close(thread_dir: Path, no_thread_leak: None) -> None:
    reader = ParquetReader(thread_dir, 7, ["rid", "m"], "label", num_threads=3, prefetch=1)
    it = iter(reader)
    next(it)
    assert wuliang_threads() != []  # the reader does run threads
    reader.close()
    assert wuliang_threads() == []
    reader.close()  # idempotent


def test_no_threads_after_break_in_for_loop_and_close(
    thread_dir: Path, no_thread_leak: None
) -> None:
    reader = ParquetReader(thread_dir, 7, ["rid"], num_threads=2, epochs=None)
    for n, _ in enumerate(reader):
        if n == 3:
            break
    reader.close()
    assert wuliang_threads() == []


def test_no_threads_after_del_and_gc(thread_dir: Path, no_thread_leak: None) -> None:
    reader = ParquetReader(thread_dir, 7, ["rid"], num_threads=2, epochs=None)
    for _ in reader:
        break
    del reader
    gc.collect()
    assert wuliang_threads() == []


def test_live_iterator_keeps_reading_after_del_reader(
    thread_dir: Path, no_thread_leak: None
) -> None:
    """An iterator keeps its reader alive; dropping both stops every thread."""
    reader = ParquetReader(thread_dir, 7, ["rid"], num_threads=2, epochs=None, prefetch=1)
    it = iter(reader)
    next(it)
    del reader
    gc.collect()
    assert next(it).size == 7
    del it
    gc.collect()
    assert wuliang_threads() == []


def test_no_threads_after_with_block_exits_early(thread_dir: Path, no_thread_leak: None) -> None:
    with ParquetReader(thread_dir, 7, ["rid"], num_threads=3, epochs=None) as reader:
        for n, _ in enumerate(reader):
            if n == 2:
                break
    assert wuliang_threads() == []
    with pytest.raises(RuntimeError, match="boom"), ParquetReader(thread_dir, 7, ["rid"]) as r2:
        for _ in r2:
            raise RuntimeError("boom")
    assert wuliang_threads() == []


def test_no_threads_after_producer_error(thread_dir: Path, no_thread_leak: None) -> None:
    write_garbage(thread_dir / "part-001.parquet")
    reader = ParquetReader(thread_dir, 7, ["rid"], num_threads=2)
    with pytest.raises(ValueError, match=r"part-001\.parquet"):
        list(reader)
    assert wuliang_threads() == []


def test_iterating_a_temporary_reader(thread_dir: Path, no_thread_leak: None) -> None:
    # The iterator keeps a temporary reader alive.
    done, out = finishes(lambda: sum(b.size for b in ParquetReader(thread_dir, 7, ["rid"])))
    assert done, "iterating ParquetReader(...) without keeping a reference hangs"
    assert out == [900]


def test_next_after_close_does_not_hang(thread_dir: Path, no_thread_leak: None) -> None:
    # After close() a live iterator ends instead of waiting for batches forever.
    reader = ParquetReader(thread_dir, 7, ["rid"], num_threads=2)
    it = iter(reader)
    next(it)
    reader.close()
    done, _ = finishes(lambda: list(it))
    assert done, "next() on an iterator of a closed reader hangs"


def test_second_iter_does_not_hang_the_first(thread_dir: Path, no_thread_leak: None) -> None:
    # Iterations are independent: a second one does not stop the first.
    reader = ParquetReader(thread_dir, 7, ["rid"], num_threads=2)
    it1 = iter(reader)
    next(it1)
    it2 = iter(reader)
    assert len(np.concatenate([b.sparse["rid"].values for b in it2])) == 900
    done, _ = finishes(lambda: list(it1))
    assert done, "the first iterator hangs once a second iteration starts"


PRODUCER_FRAMES = {"_read_units", "_read_file", "_bad_file", "finite_chunks", "_list_csr"}


def producer_frames(error: BaseException) -> list[str]:
    return [
        f"{Path(f.filename).name}:{f.name}"
        for f in traceback.extract_tb(error.__traceback__)
        if Path(f.filename).name in ("parquet.py", "columns.py") and f.name in PRODUCER_FRAMES
    ]


def test_corrupt_file_traceback_reaches_consumer(thread_dir: Path) -> None:
    write_truncated(thread_dir / "part-001.parquet", simple_table(np.arange(1000, 1300)))
    with pytest.raises(ValueError, match=r"part-001\.parquet") as info:
        list(ParquetReader(thread_dir, 7, ["rid"], num_threads=2))
    frames = producer_frames(info.value)
    assert "parquet.py:_read_file" in frames, frames
    assert info.value.__cause__ is not None  # the pyarrow error is kept


def test_column_error_traceback_reaches_consumer(thread_dir: Path) -> None:
    table = simple_table(np.arange(300, 600))
    labels = np.zeros(300, np.float32)
    labels[123] = np.nan
    pq.write_table(table.set_column(2, "label", pa.array(labels)), thread_dir / "part-001.parquet")
    with pytest.raises(ValueError, match=r"row 123") as info:
        list(ParquetReader(thread_dir, 7, ["rid"], "label", num_threads=2))
    assert "columns.py:finite_chunks" in producer_frames(info.value)


# -- weights, labels, validation ---------------------------------------------------------------


def test_weights_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    tables = []
    for n in (13, 8):
        lengths = rng.integers(0, 4, n)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        keys = rng.integers(0, 100, offsets[-1])
        w = rng.random(offsets[-1]).astype(np.float32)
        null_rows = rng.random(n) < 0.2
        mask = pa.array(null_rows)
        tables.append(
            pa.table(
                {
                    "m": pa.ListArray.from_arrays(pa.array(offsets), pa.array(keys), mask=mask),
                    "w": pa.ListArray.from_arrays(pa.array(offsets), pa.array(w), mask=mask),
                    "label": pa.array(np.ones(n, np.float32)),
                }
            )
        )
    paths = write_files(tmp_path, tables, row_groups=[5, 3])
    batches = list(ParquetReader(tmp_path, 4, ["m"], "label", weights={"m": "w"}))
    got_w = np.concatenate([b.sparse["m"].weights for b in batches])  # type: ignore[misc]
    got_len = np.concatenate([b.sparse["m"].lengths() for b in batches])
    exp_w = [x for p in paths for row in pq.read_table(p)["w"].to_pylist() for x in row or []]
    exp_len = [len(row or []) for p in paths for row in pq.read_table(p)["m"].to_pylist()]
    assert got_w.dtype == np.float32
    np.testing.assert_array_equal(got_w, np.array(exp_w, np.float32))
    np.testing.assert_array_equal(got_len, exp_len)
    for b in batches:
        csr = b.sparse["m"]
        assert csr.weights is not None and len(csr.weights) == csr.nnz


def test_weights_must_pair_with_multi_valued_feature(tmp_path: Path) -> None:
    table = simple_table(np.arange(4)).append_column(
        "w", pa.array([[1.0, 2.0]] * 4, pa.list_(pa.float32()))
    )
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ValueError, match="'rid'"):
        ParquetReader(tmp_path, 2, ["rid", "m"], weights={"rid": "w"})
    with pytest.raises(ValueError, match="'rid'"):
        ParquetReader(tmp_path, 2, ["rid", "m"], weights={"m": "rid"})


def test_validate_on_good_data_finds_nothing(round_trip_files: list[Path]) -> None:
    validated = list(ParquetReader(round_trip_files, 11, FEATURES, "label", validate=True))
    unvalidated = list(ParquetReader(round_trip_files, 11, FEATURES, "label", validate=False))
    assert len(validated) == len(unvalidated) == 15
    assert_same(
        batch_columns(validated, list(SPARSE_DTYPES)),
        batch_columns(unvalidated, list(SPARSE_DTYPES)),
    )


def test_several_labels(round_trip_files: list[Path]) -> None:
    batches = list(ParquetReader(round_trip_files, 20, ["rid"], ["label", "label2"]))
    for b in batches:
        assert isinstance(b.labels, dict) and list(b.labels) == ["label", "label2"]
        assert all(v.dtype == np.float32 and v.shape == (b.size,) for v in b.labels.values())
    expected = expected_columns(round_trip_files, labels=("label", "label2"))
    got = batch_columns(batches, ["rid"])
    for k in ("label", "label2"):
        np.testing.assert_array_equal(got.labels[k], expected.labels[k])
    # (the readers are bound to names: a temporary reader hangs, see
    # test_iterating_a_temporary_reader)
    one_label = ParquetReader(round_trip_files, 20, ["rid"], ["label2"])
    one = next(iter(one_label))
    one_label.close()
    assert isinstance(one.labels, dict) and list(one.labels) == ["label2"]
    single_label = ParquetReader(round_trip_files, 20, ["rid"], "label2")
    single = next(iter(single_label))
    single_label.close()
    assert isinstance(single.labels, np.ndarray)
    np.testing.assert_array_equal(single.labels, expected.labels["label2"][:20])


# -- key preparation ------------------------------------------------------------------------------


def test_prepared_keys_reproduce_the_batch(round_trip_files: list[Path]) -> None:
    tables = {"ml": "shared", "mu": "shared", "si": "shared", "su": "alone", "rid": "ids"}
    reader = ParquetReader(
        round_trip_files, 17, FEATURES, "label", prepare=KeyPreparer(tables, num_shards=3)
    )
    n = 0
    for batch in reader:
        prepared = batch.prepared
        assert prepared is not None and prepared.num_shards == 3
        assert set(prepared.tables) == {"shared", "alone", "ids"}
        assert set(prepared.features) == set(tables)
        for name, table in tables.items():
            csr, index = batch.sparse[name], prepared.features[name]
            keys = prepared.tables[table]
            assert index.table == table
            assert index.inverse.dtype == np.int32
            np.testing.assert_array_equal(index.offsets, csr.offsets)
            np.testing.assert_array_equal(keys.uniques[index.inverse], csr.values.view(np.uint64))
        for keys in prepared.tables.values():
            assert len(np.unique(keys.uniques)) == len(keys.uniques)
            off = keys.shard_offsets
            assert off[0] == 0 and off[-1] == len(keys.uniques) and len(off) == 4
            for s in range(3):
                assert (shard_of(keys.shard(s), 3) == s).all()
        shared = np.concatenate(
            [batch.sparse[f].values.view(np.uint64) for f in ("ml", "mu", "si")]
        )
        assert set(prepared.tables["shared"].uniques.tolist()) == set(shared.tolist())
        n += batch.size
    assert n == sum(ROUND_TRIP_ROWS)


def test_prepare_error_reaches_consumer(round_trip_files: list[Path], no_thread_leak: None) -> None:
    reader = ParquetReader(round_trip_files, 17, ["ml"], prepare=KeyPreparer({"nope": "t"}))
    with pytest.raises(KeyError, match="nope"):
        list(reader)


# -- datagen ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def datagen_dirs(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[Path], list[Path], list[Path]]:
    cfg = DatagenConfig(rows=2_500, rows_per_file=1_000, row_group_rows=300, seed=3)
    root = tmp_path_factory.mktemp("datagen")
    a = generate(root / "a", cfg)
    b = generate(root / "b", cfg)
    c = generate(
        root / "c", DatagenConfig(rows=2_500, rows_per_file=1_000, row_group_rows=300, seed=4)
    )
    return a, b, c


def test_datagen_is_deterministic(datagen_dirs: tuple[list[Path], list[Path], list[Path]]) -> None:
    a, b, c = datagen_dirs
    assert [p.name for p in a] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [p.name for p in b] == [p.name for p in a]
    for pa_, pb in zip(a, b, strict=True):
        assert pa_.read_bytes() == pb.read_bytes()
    assert not any(x.read_bytes() == y.read_bytes() for x, y in zip(a, c, strict=True))
    assert [pq.ParquetFile(p).metadata.num_rows for p in a] == [1000, 1000, 500]
    assert not [f for f in os.listdir(a[0].parent) if f.startswith(".")]  # no temporary files


def test_datagen_schema_and_labels(datagen_dirs: tuple[list[Path], list[Path], list[Path]]) -> None:
    table = pq.read_table(datagen_dirs[0][0].parent)
    assert table.num_rows == 2_500
    for name in SINGLE:
        assert table.schema.field(name).type == pa.uint64()
    for name in MULTI:
        assert table.schema.field(name).type.value_type == pa.uint64()
    for name in DENSE:
        assert table.schema.field(name).type == pa.float32()
    label = table[LABEL].to_numpy()
    assert set(np.unique(label)) <= {0.0, 1.0}
    assert 0.05 < label.mean() < 0.95


def test_datagen_read_by_the_reader(
    datagen_dirs: tuple[list[Path], list[Path], list[Path]],
) -> None:
    folder = datagen_dirs[0][0].parent
    reader = ParquetReader(folder, 333, SPARSE + DENSE, LABEL, validate=True)
    assert reader.hashed_features == {}  # synthetic ids, salted: no hashed strings
    batches = list(reader)
    assert [b.size for b in batches] == [333] * 7 + [169]
    table = pq.read_table(folder)
    for name in ("C1", "C26"):
        got = np.concatenate([b.sparse[name].values for b in batches])
        assert got.dtype == np.uint64
        np.testing.assert_array_equal(got, table[name].to_numpy())
    for name in MULTI:
        got = np.concatenate([b.sparse[name].values for b in batches])
        np.testing.assert_array_equal(got, table[name].combine_chunks().flatten().to_numpy())
        lengths = np.concatenate([b.sparse[name].lengths() for b in batches])
        np.testing.assert_array_equal(lengths, pc.list_value_length(table[name]).to_numpy())
    dense = np.concatenate([b.dense for b in batches])
    np.testing.assert_array_equal(dense, np.stack([table[n].to_numpy() for n in DENSE], axis=1))
    labels = np.concatenate([b.labels for b in batches])  # type: ignore[misc]
    np.testing.assert_array_equal(labels, table[LABEL].to_numpy())


# -- hash_strings: numpy for Python and numpy input, Arrow for Arrow input -----------


def test_hash_strings_returns_numpy_for_python_and_numpy_input() -> None:
    words = ["apple", "pear", "", "apple"]
    expected = [9069760335543976440]  # pinned: hash_strings(["apple"], "fruit")
    for values in (words, tuple(words), (w for w in words), np.array(words),
                   np.array(words, dtype=object)):  # fmt: skip
        keys = hash_strings(values, "fruit")
        assert isinstance(keys, np.ndarray) and keys.dtype == np.uint64 and keys.shape == (4,)
        assert keys[:1].tolist() == expected and keys[0] == keys[3]
    empty = hash_strings([], "fruit")
    assert isinstance(empty, np.ndarray) and empty.dtype == np.uint64 and len(empty) == 0


def test_hash_strings_returns_arrow_for_arrow_input() -> None:
    array = pa.array(["apple", None, "pear"])
    keys = hash_strings(array, "fruit")
    assert isinstance(keys, pa.Array) and keys.type == pa.uint64()
    assert keys.to_pylist() == [9069760335543976440, None, int(hash_strings(["pear"], "fruit")[0])]
    chunked = hash_strings(pa.chunked_array([array, array]), "fruit")
    assert isinstance(chunked, pa.Array) and chunked.null_count == 2


@pytest.mark.parametrize(
    ("values", "error"),
    [
        (["a", None, "b"], r"field 'f': element 1 is None \(NoneType\), not a string; numpy"),
        (np.array(["a", "b", np.nan], dtype=object), r"element 2 is nan \(float\)"),
        ([1, 2], r"element 0 is 1 \(int\)"),
        ("apple", r"takes a list of strings, got the single value 'apple'"),
    ],
)
def test_hash_strings_numpy_output_has_no_null(values: Any, error: str) -> None:
    with pytest.raises(TypeError, match=error):
        hash_strings(values, "f")


# -- integer and time columns ---------------------------------------------------------


def test_int64_column_reads_as_exact_ids_and_time_columns_are_refused(tmp_path: Path) -> None:
    times = list(range(1_700_000_000, 1_700_020_001, 5_000))
    table = pa.table(
        {
            "tid": pa.array(times, pa.int64()),
            "ts": pa.array([t * 1000 for t in times], pa.timestamp("ms", "UTC")),
            "day": pa.array([t // 86_400 for t in times], pa.int32()).cast(pa.date32()),
            "x": pa.array([0.5] * len(times), pa.float32()),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    with ParquetReader(tmp_path, 2, ["tid", "x"]) as reader:
        assert reader.schema.dense_columns == {"x": slice(0, 1)}  # tid: not dense
        batches = list(reader)
    values = np.concatenate([b.sparse["tid"].values for b in batches])
    assert values.dtype == np.int64 and values.tolist() == times  # not float32-rounded
    for column, type_name in (("ts", r"timestamp\[ms, tz=UTC\]"), ("day", "date32")):
        message = (
            rf"column '{column}' has type {type_name}.*: a time is not read as a feature or "
            r"label; times are for splitting and filtering files \(a time split\)"
        )
        with pytest.raises(ValueError, match=message):
            ParquetReader(tmp_path, 2, ["x", column])
        with pytest.raises(ValueError, match=message):
            ParquetReader(tmp_path, 2, ["x"], label=column)


def test_csv_timestamp_column_refused_as_a_feature(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("ts,day,y\n1700000000,19675,1\n1700000001,19675,0\n")
    schema = CsvSchema.from_dict(
        {
            "columns": [
                {"name": "ts", "kind": "timestamp"},
                {"name": "day", "kind": "int64"},
                {"name": "y", "kind": "label"},
            ]
        }
    )
    (f,) = convert_csv(tmp_path / "data.csv", tmp_path / "out", schema, progress=False)
    with pytest.raises(
        ValueError, match=r"column 'ts' has type timestamp.*splitting and filtering"
    ):
        ParquetReader(f, 2, ["day", "ts"], label="y")
    with ParquetReader(f, 2, ["day"], label="y") as reader:
        (batch,) = list(reader)
    assert batch.sparse["day"].values.tolist() == [19675, 19675]
