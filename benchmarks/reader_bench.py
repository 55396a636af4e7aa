"""Reader benchmark: Parquet → ready batches with wuliang vs tf.data vs pandas.

The same synthetic Criteo-shaped rows (``wuliang.reader.datagen``: C1…C26
uint64 keys, M1…M5 lists of about 10 uint64 keys, I1…I13 float32, a float32
label; about 76 keys a row) are written as Parquet by wuliang's writer (key
columns plain and uncompressed, the rest snappy; one file per 100K rows) and
as TFRecord files of ``tf.train.Example`` (one per Parquet file, same rows in
the same order; keys as int64, dense features and label as floats). Writing
either is not timed; both are kept in ``--data-dir`` and reused when they
hold ``--rows`` rows. Each contender then turns the files
into batches of ``--batch`` (4096) rows, one after the other so each has the
whole machine, the page cache warm for both formats:

* wuliang read:     ``ParquetReader`` → ``CsrBatch`` (values + offsets per
                    sparse feature, one dense matrix, labels), with 1 reader
                    thread and with the default count (min(8, cores)); the
                    reader's assembler thread comes on top of either;
* wuliang prepared: the same with ``prepare=KeyPreparer(...)`` (per batch
                    and feature: uniques grouped by 2 shards + inverse index),
                    computed on the reader's thread pool;
* tf.data:          ``TFRecordDataset(num_parallel_reads=AUTOTUNE)`` →
                    ``batch`` → ``map(parse_example, num_parallel_calls=
                    AUTOTUNE)`` → ``prefetch``, TensorFlow's default threads
                    (all cores) — what a TensorFlow user does today. Measured
                    with ``RaggedFeature`` and with ``VarLenFeature`` for the
                    list features; ``tfdata_rows_per_s`` is the faster one;
* naive:            per file ``pyarrow.parquet.read_table`` (Arrow decodes
                    the columns on all cores) → ``to_pandas``, then per batch
                    numpy arrays (``np.concatenate`` of the rows' lists +
                    offsets, ``np.asarray`` of scalar columns). Batches do not
                    cross files.

Also: key preparation alone (``KeyPreparer`` over already-read batches in
the main thread, one core), in keys/s. Each figure is the best of
``--repeats`` passes over all rows. Checked once per run: every contender
yields ``--rows`` rows and the same number of keys, the first wuliang batch's
C1 equals the first file's, the TFRecords decode to the Parquet rows. Without
TensorFlow the tf.data fields are null. The last line printed is one JSON
object.

    python benchmarks/reader_bench.py            # 2M rows
    python benchmarks/reader_bench.py --quick    # 200K rows
    python benchmarks/reader_bench.py --rows 500000 --skip-naive --data-dir /data/bench

TensorFlow and pandas: ``pip install '.[bench]'`` (tensorflow-cpu, pandas).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info lines

import argparse
import gc
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from bench_data import cores, parquet_files  # benchmarks/, the script's folder

from wuliang.reader import KeyPreparer, ParquetReader
from wuliang.reader.datagen import DENSE, LABEL, MULTI, SINGLE

SPARSE = SINGLE + MULTI
FLOATS = [*DENSE, LABEL]
TARGETS = {"read_speedup_vs_tfdata": 5.0, "prepared_speedup_vs_tfdata": 2.0}
PREPARE_TARGET_KEYS_PER_S = 20e6
WARMUP_BATCHES = 3


@dataclass
class Pass:
    rows: int
    keys: int  # sparse values (nnz) over all rows
    batches: int
    seconds: float
    first_c1: np.ndarray  # C1 of the first batch, as uint64


@dataclass
class Result:
    name: str
    best: Pass
    passes: list[float]  # rows/s of each pass

    @property
    def rows_per_s(self) -> float:
        return self.best.rows / self.best.seconds


# -- data ------------------------------------------------------------------------------


def varint_lengths(x: np.ndarray) -> np.ndarray:
    """Bytes of the protobuf varint of each x (read as uint64)."""
    x = x.astype(np.uint64, copy=False)
    lengths = np.ones(len(x), dtype=np.int64)
    top = int(x.max()) if len(x) else 0
    k = 1
    while k < 10 and top >> (7 * k):
        lengths += x >= np.uint64(1 << (7 * k))
        k += 1
    return lengths


def varints(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes of each, all bytes concatenated): the protobuf varints of x (as uint64)."""
    x = x.astype(np.uint64, copy=False)
    lengths = varint_lengths(x)
    width = int(lengths.max()) if len(x) else 1
    shifts = np.uint64(7) * np.arange(width, dtype=np.uint64)
    groups = ((x[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    groups |= (np.arange(width) < lengths[:, None] - 1).view(np.uint8) << 7  # continuation bit
    return lengths, groups[np.arange(width) < lengths[:, None]]


def binary_array(lengths: np.ndarray, data: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(data))]
    return pa.Array.from_buffers(pa.binary(), len(lengths), buffers)


def encode_examples(table: pa.Table) -> pa.Array:
    """Serialized ``tf.train.Example`` of each row (a binary array), encoded with
    numpy and Arrow: the protobuf module takes ~300 µs a row for this shape."""
    n = table.num_rows
    parts: list[Any] = []  # per row, concatenated: scalars are the same bytes in every row
    size = np.zeros(n, dtype=np.int64)  # bytes of Example.features, per row

    def const(b: bytes) -> pa.Scalar:
        return pa.scalar(b, pa.binary())

    def varint_array(x: np.ndarray) -> pa.Array:
        return binary_array(*varints(x))

    def int64_feature(name: str, payload_len: np.ndarray, payload: pa.Array) -> None:
        # map entry {1: key, 2: Feature {3: Int64List {1: packed varints}}}
        key = name.encode()
        list_len = 1 + varint_lengths(payload_len) + payload_len
        feature_len = 1 + varint_lengths(list_len) + list_len
        entry_len = 3 + len(key) + varint_lengths(feature_len) + feature_len
        parts.extend(
            [
                const(b"\x0a"),
                varint_array(entry_len),
                const(b"\x0a" + bytes([len(key)]) + key + b"\x12"),
                varint_array(feature_len),
                const(b"\x1a"),
                varint_array(list_len),
                const(b"\x0a"),
                varint_array(payload_len),
                payload,
            ]
        )
        size[:] += 1 + varint_lengths(entry_len) + entry_len

    for name in SINGLE:
        lengths, data = varints(table[name].combine_chunks().to_numpy())
        int64_feature(name, lengths, binary_array(lengths, data))
    for name in MULTI:
        column = table[name].combine_chunks()
        offsets = column.offsets.to_numpy().astype(np.int64)
        lengths, data = varints(column.values.to_numpy()[offsets[0] : offsets[-1]])
        ends = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=ends[1:])
        row_bytes = ends[offsets[1:] - offsets[0]] - ends[offsets[:-1] - offsets[0]]
        int64_feature(name, row_bytes, binary_array(row_bytes, data))
    for name in FLOATS:
        # map entry {1: key, 2: Feature {2: FloatList {1: packed float}}}: fixed size
        key = name.encode()
        head = bytes([0x0A, len(key) + 12, 0x0A, len(key)]) + key + b"\x12\x08\x12\x06\x0a\x04"
        values = table[name].combine_chunks().to_numpy().astype("<f4")
        parts.extend([const(head), binary_array(np.full(n, 4), values.view(np.uint8))])
        size += len(head) + 4
    head = [const(b"\x0a"), varint_array(size)]  # Example {1: Features}
    return pc.binary_join_element_wise(*head, *parts, const(b""))


def tfrecord_files(tf: Any, folder: Path, sources: list[Path]) -> list[Path]:
    """One TFRecord file of tf.train.Example per Parquet file, same rows in order."""
    files = [folder / f"{p.stem}.tfrecord" for p in sources]
    done = folder / "_DONE"
    if done.exists() and all(f.exists() for f in files):
        print(f"tfrecord: reusing {len(files)} files in {folder}", flush=True)
        return files
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    for source, path in zip(sources, files, strict=True):
        table = pq.read_table(source)
        tmp = path.with_name(f".{path.name}.tmp")
        with tf.io.TFRecordWriter(str(tmp)) as writer:
            for start in range(0, table.num_rows, 16384):
                for record in encode_examples(table.slice(start, 16384)).to_pylist():
                    writer.write(record)
        os.replace(tmp, path)
    done.write_text("")
    print(f"tfrecord: wrote {len(files)} files in {time.perf_counter() - t0:.1f} s", flush=True)
    return files


def check_examples(tf: Any, parquet: Path, tfrecord: Path) -> None:
    """The first and last records of a TFRecord file decode to the Parquet rows."""
    table = pq.read_table(parquet)
    dataset = tf.data.TFRecordDataset(str(tfrecord))
    last = table.num_rows - 1
    for i, ds in ((0, dataset), (last, dataset.skip(last))):
        got = tf.train.Example.FromString(next(iter(ds)).numpy()).features.feature
        for name in SPARSE:
            keys = np.asarray(table[name][i].as_py(), dtype=np.uint64).reshape(-1)
            if list(got[name].int64_list.value) != keys.view(np.int64).tolist():
                raise AssertionError(f"{tfrecord} row {i}: {name} differs from {parquet}")
        for name in FLOATS:
            if list(got[name].float_list.value) != [table[name][i].as_py()]:
                raise AssertionError(f"{tfrecord} row {i}: {name} differs from {parquet}")


def warm_page_cache(files: Iterable[Path]) -> int:
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                total += len(chunk)
    return total


# -- contenders ------------------------------------------------------------------------


def run_contender(
    name: str, one_pass: Callable[[], Pass], repeats: int, rows: int, keys: int | None
) -> Result:
    """Best of `repeats` passes; each pass must yield all rows (and the same keys)."""
    passes = []
    for _ in range(repeats):
        gc.collect()
        p = one_pass()
        if p.rows != rows:
            raise AssertionError(f"{name}: read {p.rows} rows, expected {rows}")
        if keys is not None and p.keys != keys:
            raise AssertionError(f"{name}: read {p.keys} keys, expected {keys}")
        passes.append(p)
    best = min(passes, key=lambda p: p.seconds)
    result = Result(name, best, [p.rows / p.seconds for p in passes])
    print(
        f"{name:26s} {result.rows_per_s / 1e3:8.1f}K rows/s  "
        f"({best.rows:,} rows in {best.batches} batches, {best.seconds:.2f} s"
        + (f"; passes {', '.join(f'{r / 1e3:.0f}K' for r in result.passes)}" if repeats > 1 else "")
        + ")",
        flush=True,
    )
    return result


def wuliang_pass(
    files: Sequence[Path | str], threads: int | None, prepare: bool, batch: int
) -> Pass:
    def reader() -> ParquetReader:
        return ParquetReader(
            [str(f) for f in files],
            batch,
            features=SPARSE + DENSE,
            label=LABEL,
            num_threads=threads,
            prepare=KeyPreparer({f: f for f in SPARSE}, num_shards=2) if prepare else None,
        )

    with reader() as warm:  # a few batches: imports, first allocations
        for i, _ in enumerate(warm):
            if i + 1 == WARMUP_BATCHES:
                break
    r = reader()
    rows = keys = batches = 0
    first = None
    t0 = time.perf_counter()
    for b in r:
        rows += b.size
        keys += sum(len(c.values) for c in b.sparse.values())
        batches += 1
        if prepare and b.prepared.num_shards != 2:
            raise AssertionError("batch without prepared keys")
        if first is None:
            first = b.sparse["C1"].values.copy()
    seconds = time.perf_counter() - t0
    return Pass(rows, keys, batches, seconds, first)


def s3_passes(files: list[Path], args: argparse.Namespace, local: Result) -> dict[str, Any]:
    """The same files read through s3:// URIs from a moto server on
    loopback (a Python server: its own throughput bounds this), taking
    turns with local reads; rows/s of each and their ratio."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3_server import moto_s3

    with tempfile.TemporaryDirectory() as root, moto_s3(Path(root), ("bench",)) as (_, fs):
        for f in files:
            pafs.copy_files(str(f), f"bench/data/{f.name}", destination_filesystem=fs)
        uris = [f"s3://bench/data/{f.name}" for f in files]
        remote = run_contender(
            "wuliang read from S3 (moto, loopback)",
            lambda: wuliang_pass(uris, None, False, args.batch),
            args.repeats,
            args.rows,
            None,
        )
    return {
        "s3_read_rows_per_s": round(remote.rows_per_s),
        "s3_vs_local_read": round(remote.rows_per_s / local.rows_per_s, 3),
    }


def tfdata_pass(tf: Any, files: list[Path], ragged: bool, batch: int) -> Pass:
    spec: dict[str, Any] = {name: tf.io.FixedLenFeature([], tf.int64) for name in SINGLE}
    for name in MULTI:
        spec[name] = (
            tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)
            if ragged
            else tf.io.VarLenFeature(tf.int64)
        )
    spec.update({name: tf.io.FixedLenFeature([], tf.float32) for name in FLOATS})
    autotune = tf.data.AUTOTUNE

    def dataset() -> Any:
        return (
            tf.data.TFRecordDataset([str(f) for f in files], num_parallel_reads=autotune)
            .batch(batch)
            .map(lambda records: tf.io.parse_example(records, spec), num_parallel_calls=autotune)
            .prefetch(autotune)
        )

    for _ in dataset().take(WARMUP_BATCHES):  # thread pools, first allocations
        pass
    ds = dataset()  # traces the parse function
    rows = keys = batches = 0
    first = None
    t0 = time.perf_counter()
    for b in ds:
        n = int(b[LABEL].shape[0])
        rows += n
        keys += n * len(SINGLE) + sum(int(b[name].values.shape[0]) for name in MULTI)
        batches += 1
        if first is None:
            first = b["C1"].numpy().view(np.uint64)
    seconds = time.perf_counter() - t0
    return Pass(rows, keys, batches, seconds, first)


def naive_batches(files: list[Path], batch: int) -> Iterator[tuple[dict, np.ndarray, np.ndarray]]:
    for f in files:
        df = pq.read_table(f).to_pandas()
        columns = {name: df[name].to_numpy() for name in df.columns}
        for start in range(0, len(df), batch):
            end = min(start + batch, len(df))
            sparse = {}
            for name in SINGLE:
                values = np.asarray(columns[name][start:end])
                sparse[name] = (values, np.arange(end - start + 1, dtype=np.int64))
            for name in MULTI:
                lists = columns[name][start:end]
                offsets = np.zeros(end - start + 1, dtype=np.int64)
                np.cumsum([len(x) for x in lists], out=offsets[1:])
                sparse[name] = (np.concatenate(lists).astype(np.uint64, copy=False), offsets)
            dense = np.stack([np.asarray(columns[n][start:end]) for n in DENSE], axis=1)
            yield sparse, dense, np.asarray(columns[LABEL][start:end])


def naive_pass(files: list[Path], batch: int) -> Pass:
    rows = keys = batches = 0
    first = None
    t0 = time.perf_counter()
    for sparse, _dense, labels in naive_batches(files, batch):
        rows += len(labels)
        keys += sum(len(values) for values, _ in sparse.values())
        batches += 1
        if first is None:
            first = sparse["C1"][0].copy()
    seconds = time.perf_counter() - t0
    return Pass(rows, keys, batches, seconds, first)


def prepare_keys_per_s(files: list[Path], batch: int, repeats: int, max_batches: int = 64) -> float:
    """KeyPreparer alone, in the main thread, over batches read beforehand."""
    kept = []
    with ParquetReader([str(f) for f in files], batch, SPARSE + DENSE, LABEL) as r:
        for b in r:
            kept.append(b)
            if len(kept) == max_batches:
                break
    preparer = KeyPreparer({f: f for f in SPARSE}, num_shards=2)
    keys = sum(len(c.values) for b in kept for c in b.sparse.values())
    preparer(kept[0])
    best = float("inf")
    for _ in range(max(repeats, 2)):
        t0 = time.perf_counter()
        for b in kept:
            preparer(b)
        best = min(best, time.perf_counter() - t0)
    result = keys / best
    print(
        f"{'key preparation alone':26s} {result / 1e6:8.1f}M keys/s  "
        f"({len(kept)} batches of {keys // len(kept):,} keys, 1 thread)",
        flush=True,
    )
    return result


def import_tensorflow() -> tuple[Any, str | None]:
    try:
        import tensorflow as tf
    except Exception as e:  # not installed, or a broken install
        return None, f"{type(e).__name__}: {e}"
    return tf, None


# -- main ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--quick", action="store_true", help="200K rows")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2, help="passes per contender (best)")
    parser.add_argument(
        "--data-dir", type=Path, help="where the files are kept (default: a folder in $TMPDIR)"
    )
    parser.add_argument("--skip-naive", action="store_true", help="no pandas contender")
    parser.add_argument("--skip-tfdata", action="store_true", help="no tf.data contender")
    parser.add_argument(
        "--s3",
        action="store_true",
        help="also read the files from an S3 server (moto's, started on loopback; "
        "needs the test extra): wuliang's reader over s3:// next to local files",
    )
    args = parser.parse_args()
    if args.quick:
        args.rows = 200_000
    data_dir = args.data_dir or Path(tempfile.gettempdir()) / f"wuliang-reader-bench-{args.rows}"

    files, written = parquet_files(data_dir / "parquet", args.rows)
    if written:  # the TFRecord copy is of the old files
        (data_dir / "tfrecord" / "_DONE").unlink(missing_ok=True)
    tf, tf_error = (None, "skipped (--skip-tfdata)") if args.skip_tfdata else import_tensorflow()
    records: list[Path] = []
    if tf is not None:
        records = tfrecord_files(tf, data_dir / "tfrecord", files)
        check_examples(tf, files[-1], records[-1])
    else:
        print(
            f"tf.data: TensorFlow unavailable ({tf_error}); the tfdata fields are null. "
            "Install it with: pip install tensorflow-cpu  (or: pip install '.[bench]')",
            flush=True,
        )
    naive_error = None
    if args.skip_naive:
        naive_error = "skipped (--skip-naive)"
    elif importlib.util.find_spec("pandas") is None:
        naive_error = "pandas is not installed"
        print(
            "naive: pandas unavailable; the naive fields are null. Install it with: "
            "pip install pandas  (or: pip install '.[bench]')",
            flush=True,
        )
    parquet_bytes = warm_page_cache(files)
    tfrecord_bytes = warm_page_cache(records)
    tfrecord_size = f"{tfrecord_bytes / 2**20:,.0f} MiB" if records else "none"
    print(
        f"data: {args.rows:,} rows in {len(files)} files, Parquet {parquet_bytes / 2**20:,.0f} "
        f"MiB, TFRecord {tfrecord_size}; batches of {args.batch}; {cores()} cores; "
        f"best of {args.repeats}",
        flush=True,
    )

    default_threads = ParquetReader([str(f) for f in files], args.batch, SPARSE).num_threads
    c1 = pq.read_table(files[0], columns=["C1"])["C1"].to_numpy()[: args.batch]
    run = run_contender
    read = run(
        f"wuliang read, {default_threads} threads",
        lambda: wuliang_pass(files, None, False, args.batch),
        args.repeats,
        args.rows,
        None,
    )
    if not np.array_equal(read.best.first_c1, c1):
        raise AssertionError("the first wuliang batch's C1 differs from the first file's C1")
    keys = read.best.keys
    prepared = run(
        f"wuliang prepared, {default_threads} thr.",
        lambda: wuliang_pass(files, None, True, args.batch),
        args.repeats,
        args.rows,
        keys,
    )
    read1 = run(
        "wuliang read, 1 thread",
        lambda: wuliang_pass(files, 1, False, args.batch),
        args.repeats,
        args.rows,
        keys,
    )
    prepared1 = run(
        "wuliang prepared, 1 thread",
        lambda: wuliang_pass(files, 1, True, args.batch),
        args.repeats,
        args.rows,
        keys,
    )
    prepare_rate = prepare_keys_per_s(files, args.batch, args.repeats)

    tfdata: dict[str, Result] = {}
    if tf is not None:
        all_c1 = pq.read_table(files, columns=["C1"])["C1"].to_numpy()
        for kind in ("ragged", "varlen"):
            tfdata[kind] = run(
                f"tf.data, {kind}",
                lambda kind=kind: tfdata_pass(tf, records, kind == "ragged", args.batch),
                args.repeats,
                args.rows,
                keys,
            )
            if not np.isin(tfdata[kind].best.first_c1, all_c1).all():
                raise AssertionError(f"tf.data ({kind}): first batch has C1 keys not in the data")
    naive = None
    if naive_error is None:
        naive = run(
            "naive pyarrow→pandas→numpy",
            lambda: naive_pass(files, args.batch),
            args.repeats,
            args.rows,
            keys,
        )
        if not np.array_equal(naive.best.first_c1, c1):
            raise AssertionError("the first naive batch's C1 differs from the first file's C1")

    best_tf = max(tfdata.values(), key=lambda r: r.rows_per_s) if tfdata else None

    def rate(r: Result | None) -> int | None:
        return None if r is None else round(r.rows_per_s)

    def speedup(r: Result, base: Result | None) -> float | None:
        return None if base is None else round(r.rows_per_s / base.rows_per_s, 2)

    s3 = s3_passes(files, args, read) if args.s3 else {}
    result = {
        "rows": args.rows,
        "batch": args.batch,
        "files": len(files),
        "cores": cores(),
        "nnz_per_row": round(keys / args.rows, 2),
        "parquet_bytes": parquet_bytes,
        "tfrecord_bytes": tfrecord_bytes or None,
        "repeats": args.repeats,
        "wuliang_threads": default_threads,
        "wuliang_read_rows_per_s": rate(read),
        "wuliang_prepared_rows_per_s": rate(prepared),
        "wuliang_1thread_read_rows_per_s": rate(read1),
        "wuliang_1thread_prepared_rows_per_s": rate(prepared1),
        "prepare_keys_per_s": round(prepare_rate),
        "tfdata_rows_per_s": rate(best_tf),
        "tfdata_feature": None if best_tf is None else best_tf.name.split(", ")[1],
        "tfdata_ragged_rows_per_s": rate(tfdata.get("ragged")),
        "tfdata_varlen_rows_per_s": rate(tfdata.get("varlen")),
        "tf_version": None if tf is None else tf.__version__,
        "tf_intra_op_threads": None
        if tf is None
        else tf.config.threading.get_intra_op_parallelism_threads(),  # 0: all cores
        "tf_inter_op_threads": None
        if tf is None
        else tf.config.threading.get_inter_op_parallelism_threads(),
        "tfdata_error": tf_error,
        "naive_rows_per_s": rate(naive),
        "naive_error": naive_error,
        "read_speedup_vs_tfdata": speedup(read, best_tf),
        "prepared_speedup_vs_tfdata": speedup(prepared, best_tf),
        "read_speedup_vs_naive": speedup(read, naive),
        "prepared_speedup_vs_naive": speedup(prepared, naive),
        **s3,
    }
    met = {k: None if result[k] is None else result[k] >= v for k, v in TARGETS.items()}
    met["prepare_keys_per_s"] = prepare_rate >= PREPARE_TARGET_KEYS_PER_S
    result["targets"] = {**TARGETS, "prepare_keys_per_s": PREPARE_TARGET_KEYS_PER_S}
    result["targets_met"] = met
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
