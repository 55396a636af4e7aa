"""ParquetReader over S3: a moto server process is the object store, reached
through pyarrow's S3 client, and every read is compared with the same files
read from local disk, bit for bit."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml
from repo_data import MOVIELENS
from s3_server import moto_s3

from wuliang.reader import CsrBatch, ParquetReader, ReaderPosition, resolve_paths
from wuliang.reader.convert import CsvSchema, convert_criteo, convert_csv, convert_movielens
from wuliang.reader.convert.csv import EXAMPLE_CSV, EXAMPLE_SCHEMA
from wuliang.reader.datagen import DENSE, LABEL, SPARSE, DatagenConfig, generate
from wuliang.reader.storage import RowGroupFetcher, glob_match

BUCKET = "wuliang-test"
FEATURES = [*SPARSE[:6], *SPARSE[-2:], *DENSE[:4]]


@dataclass
class S3:
    endpoint: str
    fs: pafs.S3FileSystem
    local: Path  # mirrors s3://BUCKET/: local / "data" is s3://BUCKET/data

    def uri(self, relative: str) -> str:
        return f"s3://{BUCKET}/{relative}"

    def path(self, relative: str) -> str:
        return str(self.local / relative)


def write_data(root: Path) -> None:
    """data/day=1/part-0000[0-2].parquet, data/day=2/part-0000[0-1].parquet (row
    groups of 128 rows), a hidden Parquet file and a _SUCCESS marker."""
    generate(root / "data" / "day=1", DatagenConfig(1500, rows_per_file=500, row_group_rows=128))
    cfg = DatagenConfig(900, rows_per_file=450, row_group_rows=128, seed=1)
    generate(root / "data" / "day=2", cfg)
    hidden = pq.read_table(root / "data" / "day=2" / "part-00001.parquet").slice(0, 100)
    pq.write_table(hidden, root / "data" / "day=1" / ".hidden.parquet")
    (root / "data" / "_SUCCESS").write_bytes(b"")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    root = tmp_path_factory.mktemp("s3")
    with moto_s3(root, (BUCKET,)) as (endpoint, fs):
        local = root / "local"
        write_data(local)
        pafs.copy_files(
            str(local / "data"),
            f"{BUCKET}/data",
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=fs,
        )
        yield S3(endpoint, fs, local)


# -- helpers ------------------------------------------------------------------------


def content(batches: Iterator[CsrBatch]) -> list[tuple[Any, ...]]:
    """Every array of every batch as bytes (with dtypes and shapes), and the
    position less its file name."""
    out = []
    for b in batches:
        sparse = {
            name: (
                csr.values.dtype.str,
                csr.values.tobytes(),
                csr.offsets.tobytes(),
                None if csr.weights is None else csr.weights.tobytes(),
            )
            for name, csr in b.sparse.items()
        }
        labels = b.labels
        assert isinstance(labels, np.ndarray)
        p = b.position
        out.append(
            (
                b.size,
                sparse,
                b.dense.dtype.str,
                b.dense.shape,
                b.dense.tobytes(),
                labels.dtype.str,
                labels.tobytes(),
                (p.batches, p.unit, p.row, p.finished_epochs),
            )
        )
    return out


def reader(paths: Any, **kw: Any) -> ParquetReader:
    kw.setdefault("num_threads", 3)
    return ParquetReader(paths, kw.pop("batch_size", 300), FEATURES, LABEL, **kw)


def relative(names: list[str], s3: S3) -> list[str]:
    """Names of remote or local files, relative to the bucket or the mirror."""
    out = []
    for name in names:
        for root in (f"s3://{BUCKET}/", f"{BUCKET}/", f"{s3.local}/"):
            if name.startswith(root):
                out.append(name[len(root) :])
                break
        else:
            raise AssertionError(name)
    return out


def wuliang_threads() -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("wuliang-") and not t.name.startswith("wuliang-ps-call")
    )


# -- the same batches as from local disk --------------------------------------------------

FORMS = {
    "file": "data/day=1/part-00001.parquet",
    "prefix": "data",
    "prefix/": "data/",
    "glob": "data/day=*/part-*.parquet",
    "glob**": "data/**/*.parquet",
    "glob[]": "data/day=[2]/part-0000[01].parquet",
    "list": ["data/day=2/part-00001.parquet", "data/day=1/*.parquet", "data/day=2"],
}


@pytest.mark.parametrize("form", list(FORMS))
def test_uri_forms_read_what_local_paths_read(s3: S3, form: str) -> None:
    spec = FORMS[form]
    items = spec if isinstance(spec, list) else [spec]
    local = reader([s3.path(p) for p in items])
    remote = reader([s3.uri(p) for p in items])
    assert relative(remote.files, s3) == relative(local.files, s3)
    assert all(f.startswith(f"s3://{BUCKET}/data/") for f in remote.files)
    expected = content(iter(local))
    assert expected and content(iter(remote)) == expected


def test_glob_forms_match_as_the_local_glob(s3: S3) -> None:
    day1 = [f"data/day=1/part-0000{i}.parquet" for i in range(3)]
    day2 = [f"data/day=2/part-0000{i}.parquet" for i in range(2)]
    cases = {
        "data": [*day1, "data/day=1/.hidden.parquet", *day2],  # as Path.rglob: hidden too
        "data/**/*.parquet": [*day1, *day2],  # as glob.glob: no hidden names
        "data/**/.*.parquet": ["data/day=1/.hidden.parquet"],
        "data/*/part-0000[1-2].parquet": [day1[1], day1[2], day2[1]],
    }
    for spec, names in cases.items():
        assert relative(resolve_paths(s3.path(spec)), s3) == sorted(names), spec
        assert relative(resolve_paths(s3.uri(spec)), s3) == sorted(names), spec
    # a remote glob matches files only (a local one may match folders too)
    assert relative(resolve_paths(s3.uri("data/day=2/**")), s3) == day2
    every = [*day1, *day2, "data/_SUCCESS"]
    assert relative(resolve_paths(s3.uri("data/**")), s3) == sorted(every)


def test_glob_match() -> None:
    def match(pattern: str, path: str) -> bool:
        return glob_match(pattern.split("/"), path.split("/"))

    assert match("a/*/c.parquet", "a/b/c.parquet")
    assert not match("a/*/c.parquet", "a/b/x/c.parquet")
    assert match("a/**/c.parquet", "a/c.parquet")
    assert match("a/**/c.parquet", "a/b/x/c.parquet")
    assert not match("a/**/c.parquet", "a/.b/c.parquet")
    assert not match("a/*", "a/.c")
    assert match("a/.*", "a/.c")
    assert match("a/[bc]?", "a/cd")
    assert not match("a/*", "a/b/c")


def test_explicit_filesystem(s3: S3) -> None:
    fs = pafs.S3FileSystem(
        endpoint_override=s3.endpoint,
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )
    remote = reader(f"{BUCKET}/data/day=*/part-*.parquet", filesystem=fs)
    assert remote.files[0] == f"{BUCKET}/data/day=1/part-00000.parquet"
    local = reader(s3.path("data/day=*/part-*.parquet"))
    assert content(iter(remote)) == content(iter(local))
    assert remote.stats.files_read == 5
    with pytest.raises(ValueError, match="not both"):
        reader(s3.uri("data"), filesystem=fs)
    with pytest.raises(TypeError, match=r"pyarrow\.fs\.FileSystem"):
        reader(f"{BUCKET}/data", filesystem="s3")


def test_uri_query_is_not_part_of_the_names(s3: S3) -> None:
    host = s3.endpoint.removeprefix("http://")
    uri = s3.uri(f"data/day=2?scheme=http&endpoint_override={host}&region=us-east-1")
    remote = reader(uri)
    assert remote.files == [s3.uri(f"data/day=2/part-0000{i}.parquet") for i in range(2)]
    assert content(iter(remote)) == content(iter(reader(s3.path("data/day=2"))))


@pytest.mark.parametrize("read_ahead", [0, 1, 5])
def test_shuffle_epochs_and_read_ahead(s3: S3, read_ahead: int) -> None:
    kw: dict[str, Any] = {"shuffle_buffer": 700, "seed": 5, "epochs": 2, "batch_size": 256}
    local = content(iter(reader(s3.path("data/day=*/part-*"), **kw)))
    remote = content(iter(reader(s3.uri("data/day=*/part-*"), read_ahead=read_ahead, **kw)))
    assert remote == local
    assert sum(b[0] for b in remote) == 2 * 2400


def test_worker_shards_are_disjoint_and_cover_all_files(s3: S3) -> None:
    glob = "data/**/part-*.parquet"
    every = reader(s3.uri(glob)).files
    shards = [reader(s3.uri(glob), worker_index=i, num_workers=3) for i in range(3)]
    files = [f for shard in shards for f in shard.files]
    assert sorted(files) == every and len(set(files)) == len(files) == 5
    for i, shard in enumerate(shards):
        local = reader(s3.path(glob), worker_index=i, num_workers=3)
        assert relative(shard.files, s3) == relative(local.files, s3)
        assert content(iter(shard)) == content(iter(local))


@pytest.mark.parametrize("shuffle", [0, 500])
def test_resume_mid_epoch(s3: S3, shuffle: int) -> None:
    def make(start: ReaderPosition | None = None) -> ParquetReader:
        kw = {"shuffle_buffer": shuffle, "seed": 2, "epochs": 2, "batch_size": 333}
        return reader(s3.uri("data/day=*/part-*.parquet"), start=start, **kw)

    full = list(make())
    for k in (3, len(full) // 2 + 1, len(full) - 2):
        position = ReaderPosition.from_dict(json.loads(json.dumps(full[k].position.to_dict())))
        assert position.file.startswith(f"s3://{BUCKET}/data/day=")
        assert content(iter(make(position))) == content(iter(full[k + 1 :]))


RESUME_SCRIPT = """
import hashlib, json, sys
from wuliang.reader import ParquetReader
start, uri, features, label = json.loads(sys.stdin.read())
digest = hashlib.sha256()
for b in ParquetReader(uri, 333, features, label, epochs=2, num_threads=2, start=start):
    for name in features[:-4]:
        digest.update(b.sparse[name].values.tobytes() + b.sparse[name].offsets.tobytes())
    digest.update(b.dense.tobytes() + b.labels.tobytes())
print(digest.hexdigest())
"""


def test_position_resumes_in_a_new_process(s3: S3) -> None:
    uri = s3.uri("data/day=*/part-*.parquet")
    full = list(ParquetReader(uri, 333, FEATURES, LABEL, epochs=2, num_threads=2))
    k = len(full) // 3
    digest = hashlib.sha256()
    for b in full[k + 1 :]:
        for name in FEATURES[:-4]:
            digest.update(b.sparse[name].values.tobytes() + b.sparse[name].offsets.tobytes())
        digest.update(b.dense.tobytes() + b.labels.tobytes())
    done = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT],
        input=json.dumps([full[k].position.to_dict(), uri, FEATURES, LABEL]),
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == digest.hexdigest()


# -- errors --------------------------------------------------------------------------


def test_missing_key_and_empty_glob_name_the_uri(s3: S3) -> None:
    def raises(error: type[Exception], message: str) -> Any:
        return pytest.raises(error, match=re.escape(message))

    missing = s3.uri("data/day=1/part-00009.parquet")
    with raises(FileNotFoundError, f"no such file or directory: '{missing}'"):
        reader([s3.uri("data/day=2"), missing])
    empty = s3.uri("data/day=*/nothing-*.parquet")
    with raises(FileNotFoundError, f"no files match '{empty}'"):
        reader(empty)
    with raises(FileNotFoundError, "no such file or directory: 's3://no-such-bucket/x'"):
        reader("s3://no-such-bucket/x")
    with s3.fs.open_output_stream(f"{BUCKET}/notes/readme.txt") as out:
        out.write(b"no data here")
    with raises(FileNotFoundError, f"directory '{s3.uri('notes/')}' has no .parquet files"):
        reader(s3.uri("notes/"))
    with raises(FileNotFoundError, f"no such file or directory: '{BUCKET}/nothing' in S3"):
        reader(f"{BUCKET}/nothing", filesystem=s3.fs)
    with raises(ValueError, "'s3://wuliang-*/data': a glob must come after the bucket"):
        reader("s3://wuliang-*/data")
    with raises(ValueError, "'nosuchscheme://bucket/data' is not a URI pyarrow can open"):
        reader("nosuchscheme://bucket/data")


def test_corrupt_object_names_the_uri_or_is_skipped(s3: S3) -> None:
    good = s3.uri("data/day=2/part-00000.parquet")
    data = Path(s3.path("data/day=2/part-00001.parquet")).read_bytes()
    with s3.fs.open_output_stream(f"{BUCKET}/bad/part-00001.parquet") as out:
        out.write(data[: len(data) // 2])
    bad = s3.uri("bad/part-00001.parquet")
    with pytest.raises(ValueError, match=f"corrupt or truncated Parquet file {bad}"):
        list(reader([good, bad]))
    skipping = reader([good, bad], on_bad_file="skip")
    assert sum(b.size for b in skipping) == 450
    assert skipping.stats.skipped_files == 1 and skipping.stats.files_read == 1


def test_no_threads_left_after_break_and_close(s3: S3) -> None:
    assert wuliang_threads() == []
    r = reader(s3.uri("data"), read_ahead=3, batch_size=64)
    for _ in r:
        break
    r.close()
    assert wuliang_threads() == []


# -- read-ahead --------------------------------------------------------------------------


class Recorded:
    """A file object that records the offsets it is read at (pa.PythonFile reads it)."""

    def __init__(self, f: pa.NativeFile) -> None:
        self.f = f
        self.offsets: list[int] = []
        self.lock = threading.Lock()
        self.closed = False

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def read(self, n: int = -1) -> bytes:
        at = self.f.tell()
        with self.lock:
            self.offsets.append(at)
        data = self.f.read(n)
        for _ in range(3):  # moto's server has answered a ranged GET empty under load
            if n < 0 or len(data) >= n or at + len(data) >= self.f.size():
                break
            self.f.seek(at + len(data))
            data += self.f.read(n - len(data))
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def test_fetcher_reads_depth_row_groups_ahead(s3: S3) -> None:
    key = f"{BUCKET}/data/day=1/part-00000.parquet"  # 500 rows: 4 row groups
    metadata = pq.read_metadata(s3.fs.open_input_file(key))
    starts = sorted(
        min(
            c.dictionary_page_offset or c.data_page_offset
            for c in (metadata.row_group(g).column(i) for i in range(metadata.num_columns))
        )
        for g in range(metadata.num_row_groups)
    )
    assert len(starts) == 4

    def groups_read(recorded: Recorded) -> set[int]:
        with recorded.lock:
            return {int(np.searchsorted(starts, o, side="right")) - 1 for o in recorded.offsets}

    depth = 2
    recorded = Recorded(s3.fs.open_input_file(key))
    source = pa.PythonFile(recorded, mode="r")
    fetcher = RowGroupFetcher(depth, "wuliang-fetch-test", lambda: None, ())
    try:
        batches = fetcher.batches(source, metadata, range(4), ["C1", LABEL], 128)
        first = next(batches)  # row group 0 taken: 1 and 2 are being read
        assert first.num_rows == 128
        deadline = time.monotonic() + 10
        while groups_read(recorded) != {0, 1, 2} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert groups_read(recorded) == {0, 1, 2}
        time.sleep(0.2)
        assert 3 not in groups_read(recorded)  # not before the consumer takes another
        rest = list(batches)
        assert [b.num_rows for b in rest] == [128, 128, 116]
        assert groups_read(recorded) == {0, 1, 2, 3}
    finally:
        fetcher.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("wuliang-fetch-test")]


# -- writers: wuliang datagen and convert to (and from) s3:// -------------------------------

WULIANG = Path(sys.executable).parent / "wuliang"


def wuliang(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed command line, in the environment the fixture set (bounded)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(WULIANG), *args], capture_output=True, text=True, timeout=120, env=env
    )


def assert_same_objects(s3: S3, remote: list[Any], local: list[Any], key: str) -> None:
    """The remote files are the local ones, byte for byte, under BUCKET/key."""
    assert [str(f) for f in remote] == [s3.uri(f"{key}/{Path(f).name}") for f in local]
    for r, f in zip(remote, local, strict=True):
        with s3.fs.open_input_file(str(r).removeprefix("s3://")) as obj:
            assert obj.read() == Path(f).read_bytes(), r


def test_datagen_to_s3_equals_a_local_run(s3: S3, tmp_path: Path) -> None:
    args = ["--rows", "1300", "--rows-per-file", "500", "--seed", "3", "--quiet"]
    done = wuliang("datagen", s3.uri("gen"), *args)
    assert done.returncode == 0, done.stderr
    assert f"to {s3.uri('gen')}" in done.stdout
    assert wuliang("datagen", str(tmp_path / "gen"), *args).returncode == 0
    local = sorted((tmp_path / "gen").iterdir())
    remote = resolve_paths(s3.uri("gen"))
    assert_same_objects(s3, remote, local, "gen")
    assert content(iter(reader(remote))) == content(iter(reader(local)))

    # a smaller re-run replaces the parts and removes the extra one; other objects stay
    with s3.fs.open_output_stream(f"{BUCKET}/gen/notes.txt") as out:
        out.write(b"kept")
    files = generate(s3.uri("gen"), DatagenConfig(900, rows_per_file=500, seed=3))
    assert files == [s3.uri(f"gen/part-0000{i}.parquet") for i in range(2)]
    listed = s3.fs.get_file_info(pafs.FileSelector(f"{BUCKET}/gen"))
    names = sorted(i.base_name for i in listed if i.type == pafs.FileType.File)
    assert names == ["notes.txt", "part-00000.parquet", "part-00001.parquet"]


def write_criteo_tsv(path: Path, rows: int) -> None:
    rng = np.random.default_rng(4)
    lines = []
    for _ in range(rows):
        fields = [str(int(rng.integers(2)))]
        fields += [
            "" if rng.random() < 0.1 else str(int(rng.integers(-5, 5000))) for _ in range(13)
        ]
        fields += [
            "" if rng.random() < 0.1 else f"{int(rng.integers(2**32)):08x}" for _ in range(26)
        ]
        lines.append("\t".join(fields) + "\n")
    path.write_bytes(gzip.compress("".join(lines).encode()))


def test_convert_criteo_from_and_to_s3_equals_a_local_run(s3: S3, tmp_path: Path) -> None:
    tsv = tmp_path / "day.tsv.gz"
    write_criteo_tsv(tsv, 2500)
    pafs.copy_files(str(tsv), f"{BUCKET}/raw/day.tsv.gz", destination_filesystem=s3.fs)
    args = ["--rows-per-file", "1000", "--bucketize", "--quiet"]
    done = wuliang("convert", "criteo", s3.uri("raw/day.tsv.gz"), s3.uri("criteo"), *args)
    assert done.returncode == 0, done.stderr
    assert f"wrote 2,500 rows in 3 files to {s3.uri('criteo')}" in done.stdout
    assert wuliang("convert", "criteo", str(tsv), str(tmp_path / "out"), *args).returncode == 0
    local = sorted((tmp_path / "out").iterdir())
    remote = resolve_paths(s3.uri("criteo"))
    assert_same_objects(s3, remote, local, "criteo")
    features = [f"C{i}" for i in range(1, 27)] + [f"I{i}" for i in range(1, 14)]
    read = [ParquetReader(f, 512, features, "label", num_threads=2) for f in (remote, local)]
    assert content(iter(read[0])) == content(iter(read[1]))


def test_convert_movielens_and_csv_from_and_to_s3(s3: S3, tmp_path: Path) -> None:
    src = tmp_path / "ml"
    src.mkdir()
    (src / "movies.csv.gz").write_bytes((MOVIELENS / "movies.csv.gz").read_bytes())
    (src / "tags.csv.gz").write_bytes((MOVIELENS / "tags.csv.gz").read_bytes())
    with gzip.open(MOVIELENS / "ratings.csv.gz", "rt") as f:
        (src / "ratings.csv").write_text(
            "".join(line for _, line in zip(range(301), f, strict=False))
        )
    pafs.copy_files(str(src), f"{BUCKET}/ml-raw", destination_filesystem=s3.fs)
    remote = convert_movielens(s3.uri("ml-raw"), s3.uri("ml"), progress=False)
    local = convert_movielens(src, tmp_path / "ml-out", progress=False)
    assert len(local) > 3
    assert_same_objects(s3, remote, local, "ml")

    (tmp_path / "in.csv").write_text(EXAMPLE_CSV)
    pafs.copy_files(str(tmp_path / "in.csv"), f"{BUCKET}/in.csv", destination_filesystem=s3.fs)
    schema = CsvSchema.from_dict(yaml.safe_load(EXAMPLE_SCHEMA))
    remote_csv = convert_csv(s3.uri("in.csv"), s3.uri("csv"), schema, progress=False)
    local_csv = convert_csv(tmp_path / "in.csv", tmp_path / "csv", schema, progress=False)
    assert (
        remote_csv.summary()
        == local_csv.summary()
        == ("wrote 3 rows in 1 files; dropped 1 row (dwell: 1 missing)")
    )
    assert_same_objects(s3, remote_csv, local_csv, "csv")


def test_writer_errors_name_the_uri(s3: S3, tmp_path: Path) -> None:
    done = wuliang("datagen", "s3://no-such-bucket/gen", "--rows", "10", "--quiet")
    assert done.returncode == 1
    assert "error: s3://no-such-bucket/gen" in done.stderr, done.stderr
    with pytest.raises(FileNotFoundError, match=re.escape(f"{s3.uri('raw/nothing.tsv')}")):
        convert_criteo(s3.uri("raw/nothing.tsv"), s3.uri("never"), progress=False)
    with s3.fs.open_output_stream(f"{BUCKET}/a-file") as out:
        out.write(b"x")
    with pytest.raises(NotADirectoryError, match=re.escape(s3.uri("a-file"))):
        generate(s3.uri("a-file"), DatagenConfig(10))
    # a conversion that fails before a part is complete leaves no object behind
    (tmp_path / "bad.csv").write_text(EXAMPLE_CSV.replace("9.5", "nine"))
    schema = CsvSchema.from_dict(yaml.safe_load(EXAMPLE_SCHEMA))
    with pytest.raises(ValueError, match="'nine' is not a number"):
        convert_csv(tmp_path / "bad.csv", s3.uri("bad-csv"), schema, progress=False)
    listed = s3.fs.get_file_info(pafs.FileSelector(f"{BUCKET}/bad-csv", allow_not_found=True))
    assert [i.path for i in listed if i.type == pafs.FileType.File] == []
