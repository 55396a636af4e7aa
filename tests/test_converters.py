"""The data converters (``wuliang.reader.convert``, ``wuliang convert``) on small real files."""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from repo_data import MOVIELENS, REPO, open_movielens

from wuliang.reader import ParquetReader, hash_ints, hash_strings
from wuliang.reader.convert import CsvSchema, convert_criteo, convert_csv, convert_movielens
from wuliang.reader.convert import csv as csv_module
from wuliang.reader.convert._common import PartWriter
from wuliang.reader.convert.criteo import MISSING_BUCKET, NEGATIVE_BUCKET, bucket_ids
from wuliang.reader.hashing import HASH_METADATA, hash_tag, hashed_field

SCRIPT = Path(sys.executable).parent / "wuliang"
ML_FEATURES = ["user_id", "movie_id", "genres", "year", "tags"]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def key(value: str, field: str) -> int:
    return int(hash_strings([value], field)[0])


def keys(values: list[str], field: str) -> list[int]:
    return hash_strings(values, field).tolist()


# -- MovieLens -----------------------------------------------------------------


@pytest.fixture(scope="module")
def movielens(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], pa.Table]:
    """All of MovieLens-small converted once: (files, their rows in file order)."""
    files = convert_movielens(MOVIELENS, tmp_path_factory.mktemp("ml"), progress=False)
    return files, read_all(files)


def read_all(files: list[Path]) -> pa.Table:
    """The rows of files, in order (ParquetFile: much faster than read_table per file)."""
    return pa.concat_tables(pq.ParquetFile(f).read() for f in files)


def read_csv_rows(name: str) -> list[dict[str, str]]:
    with open_movielens(name) as f:
        return list(csv.DictReader(f))


def test_movielens_rows_time_order_and_label(movielens: tuple[list[Path], pa.Table]) -> None:
    files, table = movielens
    ratings = read_csv_rows("ratings.csv")
    assert table.num_rows == len(ratings) == 100_836
    assert files == sorted(files) and files[0].name == "1996-03-29.parquet"
    times = table.column("timestamp").to_numpy()
    assert np.all(np.diff(times) >= 0)  # sorted file names = time order
    # each file holds exactly the ratings of the UTC day it is named after
    counts = [pq.read_metadata(f).num_rows for f in files]
    days = np.repeat([np.datetime64(f.stem) for f in files], counts)
    assert np.array_equal(times.astype("datetime64[s]").astype("datetime64[D]"), days)
    rating = table.column("rating").to_numpy()
    assert np.array_equal(table.column("label").to_numpy(), (rating >= 4).astype(np.float32))
    expected = sorted((int(r["timestamp"]), int(r["userId"]), int(r["movieId"])) for r in ratings)
    got = zip(
        times.tolist(),
        table.column("user_id").to_pylist(),
        table.column("movie_id").to_pylist(),
        strict=True,
    )
    assert list(got) == expected
    assert table.schema.field("genres").type == pa.list_(pa.uint64())
    assert table.schema.field("year").type == pa.int64()


def find(table: pa.Table, user: int, movie: int) -> dict:
    users = table.column("user_id").to_numpy()
    movies = table.column("movie_id").to_numpy()
    (index,) = np.flatnonzero((users == user) & (movies == movie))
    return table.slice(int(index), 1).to_pylist()[0]


def test_movielens_hand_checked_rows(movielens: tuple[list[Path], pa.Table]) -> None:
    _, table = movielens
    toy_story = find(table, 1, 1)
    genres = ["Adventure", "Animation", "Children", "Comedy", "Fantasy"]
    assert toy_story["genres"] == keys(genres, "genres")
    assert (toy_story["year"], toy_story["rating"], toy_story["label"]) == (1995, 4.0, 1.0)
    assert toy_story["timestamp"] == 964982703
    assert find(table, 448, 143410)["genres"] == []  # "(no genres listed)"
    assert find(table, 448, 143410)["label"] == 0.0  # rated 2.0
    assert find(table, 210, 40697)["year"] is None  # "Babylon 5": no year
    assert find(table, 599, 27008)["year"] == 1999  # "… (1999) " with a trailing space
    assert find(table, 105, 171749)["year"] == 2006  # "(2006–2007)"
    # Step Brothers: user 2 rated it at 1445714980, then tagged it 12-16 s later
    # ("will ferrell" 992, "funny" 994, "Highly quotable" 996); users 424 and 62
    # tagged it again later (no duplicates), 62 added "comedy" in 2018.
    assert find(table, 2, 60756)["tags"] == []
    later = ["will ferrell", "funny", "highly quotable"]
    assert find(table, 298, 60756)["tags"] == keys(later, "tags")  # rated 1447517068
    assert find(table, 424, 60756)["tags"] == keys(later, "tags")  # rated before tagging
    assert find(table, 2, 89774)["tags"] == []  # rated 1445715189, tagged 1445715200+


def test_movielens_tags_are_the_past_tags_of_the_movie(
    movielens: tuple[list[Path], pa.Table],
) -> None:
    """Every row against a plain-Python reference: the distinct lower-cased tags
    applied to the movie at or before the rating, in order of first use."""
    _, table = movielens
    first_use: dict[int, dict[str, int]] = defaultdict(dict)
    for r in read_csv_rows("tags.csv"):
        tag, t = r["tag"].strip().lower(), int(r["timestamp"])
        uses = first_use[int(r["movieId"])]
        uses[tag] = min(t, uses.get(tag, t))
    tag_key = {tag: key(tag, "tags") for uses in first_use.values() for tag in uses}
    rows_with_tags = 0
    for movie, t, got in zip(
        table.column("movie_id").to_pylist(),
        table.column("timestamp").to_pylist(),
        table.column("tags").to_pylist(),
        strict=True,
    ):
        past = sorted((u, tag_key[tag]) for tag, u in first_use.get(movie, {}).items() if u <= t)
        assert got == [k for _, k in past]
        rows_with_tags += bool(got)
    assert rows_with_tags > 1000


def test_movielens_reads_with_parquet_reader(movielens: tuple[list[Path], pa.Table]) -> None:
    files, table = movielens
    rows = 0
    tags = 0
    with ParquetReader(
        files[0].parent, batch_size=8192, features=ML_FEATURES, label="label"
    ) as reader:
        for batch in reader:
            rows += batch.size
            tags += batch.sparse["tags"].nnz
            assert set(batch.sparse) == set(ML_FEATURES)
            assert batch.sparse["year"].values.dtype == np.int64
            assert batch.sparse["genres"].values.dtype == np.uint64
    assert rows == table.num_rows
    assert tags == sum(len(t) for t in table.column("tags").to_pylist())


def small_movielens(dest: Path, ratings: int, with_tags: bool = True) -> Path:
    dest.mkdir()
    shutil.copy(MOVIELENS / "movies.csv.gz", dest)  # compressed or not, both read
    if with_tags:
        with open_movielens("tags.csv") as src, open(dest / "tags.csv", "w") as out:
            shutil.copyfileobj(src, out)
    with open_movielens("ratings.csv") as src, open(dest / "ratings.csv", "w") as out:
        for _, line in zip(range(ratings + 1), src, strict=False):
            out.write(line)
    return dest


def test_movielens_errors_and_optional_tags(tmp_path: Path) -> None:
    src = small_movielens(tmp_path / "ml", 300, with_tags=False)
    files = convert_movielens(src, tmp_path / "out", progress=False)
    table = read_all(files)
    assert table.num_rows == 300
    assert table.column("tags").to_pylist() == [[]] * 300
    (src / "ratings.csv").write_text("userId,movieId,rating\n1,1,4.0\n")
    with pytest.raises(ValueError, match=r"ratings\.csv: no column 'timestamp'"):
        convert_movielens(src, tmp_path / "out", progress=False)
    (src / "ratings.csv").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no ratings\.csv"):
        convert_movielens(src, tmp_path / "out", progress=False)


# -- Criteo --------------------------------------------------------------------

# label, I1..I13 (None: missing), C1..C26 (None: missing); one negative integer.
CRITEO_INTS = [
    [0, 1, 5, None, 7, 100, 2**40, 3, None, 0, 1, 2, 3],
    [-3, None, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [None] * 13,
    [1023, 1024, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 65535],
]
CRITEO_LABELS = [1, 0, 0, 1]


def criteo_cats(row: int) -> list[str | None]:
    return [None if (row + k) % 5 == 0 else f"{(row * 31 + k) * 2654435761 % 2**32:08x}"
            for k in range(26)]  # fmt: skip


def write_criteo(path: Path) -> None:
    lines = []
    for r, (label, ints) in enumerate(zip(CRITEO_LABELS, CRITEO_INTS, strict=True)):
        fields = [str(label)] + ["" if x is None else str(x) for x in ints]
        fields += ["" if c is None else c for c in criteo_cats(r)]
        lines.append("\t".join(fields) + "\n")
    data = "".join(lines).encode()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)


def bucket_of(x: int | None) -> int:
    if x is None:
        return MISSING_BUCKET
    return NEGATIVE_BUCKET if x < 0 else (x + 1).bit_length() - 1


@pytest.mark.parametrize("file_name", ["day.tsv", "day.tsv.gz"])
def test_criteo_round_trip(tmp_path: Path, file_name: str) -> None:
    write_criteo(tmp_path / file_name)
    files = convert_criteo(
        tmp_path / file_name, tmp_path / "out", rows_per_file=3, bucketize=True, progress=False
    )
    assert [f.name for f in files] == ["part-00000.parquet", "part-00001.parquet"]
    table = read_all(files)
    assert table.num_rows == 4
    assert table.column("label").type == pa.float32()
    assert table.column("label").to_pylist() == CRITEO_LABELS
    for k in range(13):
        name = f"I{k + 1}"
        column = [row[k] for row in CRITEO_INTS]
        expected = np.array([math.log1p(max(x or 0, 0)) for x in column], dtype=np.float32)
        assert table.column(name).type == pa.float32()
        assert np.array_equal(table.column(name).to_numpy(), expected)
        buckets = hash_ints(np.array([bucket_of(x) for x in column]), f"{name}_bucket")
        assert table.column(f"{name}_bucket").to_pylist() == buckets.tolist()
    for k in range(26):
        name = f"C{k + 1}"
        expected = [
            None if c is None else key(c, name) for c in (criteo_cats(r)[k] for r in range(4))
        ]
        assert table.column(name).to_pylist() == expected
    assert table.column("C1").null_count == 1  # rows 0 (k=0) missing
    with ParquetReader(
        files, batch_size=4, features=[f"C{k}" for k in range(1, 27)] + ["I1"], label="label"
    ) as reader:
        (batch,) = list(reader)
        assert batch.sparse["C1"].lengths().tolist() == [0, 1, 1, 1]


def test_part_files_cut_across_batches(tmp_path: Path) -> None:
    schema = pa.schema([pa.field("x", pa.int64())])
    writer = PartWriter(tmp_path, 4, schema)
    start = 0
    for size in [3, 5, 1, 7, 0, 2]:
        writer.add(pa.record_batch([pa.array(np.arange(start, start + size))], schema=schema))
        start += size
    files = writer.close()
    assert [f.name for f in files] == [f"part-0000{i}.parquet" for i in range(5)]
    tables = [pq.read_table(f) for f in files]
    assert [t.num_rows for t in tables] == [4, 4, 4, 4, 2]
    assert pa.concat_tables(tables).column("x").to_pylist() == list(range(18))
    (empty,) = PartWriter(tmp_path, 4, schema).close()  # no rows: one empty file
    assert pq.read_table(empty).schema == schema and pq.read_table(empty).num_rows == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00000.parquet"]


def test_criteo_buckets_are_exact() -> None:
    values = np.array([0, 1, 2, 3, 6, 7, 2**53 - 1, 2**53, 2**62, 2**63 - 1, -1, 5])
    valid = np.array([True] * 11 + [False])
    expected = [0, 1, 1, 2, 2, 3, 53, 53, 62, 63, NEGATIVE_BUCKET, MISSING_BUCKET]
    assert bucket_ids(values, valid).tolist() == expected


def test_criteo_rerun_overwrites_and_errors(tmp_path: Path) -> None:
    write_criteo(tmp_path / "day.tsv")
    out = tmp_path / "out"
    assert len(convert_criteo(tmp_path / "day.tsv", out, rows_per_file=1, progress=False)) == 4
    (out / "notes.txt").write_text("kept")
    convert_criteo(tmp_path / "day.tsv", out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "part-00000.parquet"]
    assert pq.read_table(out / "part-00000.parquet").num_rows == 4
    assert "I1_bucket" not in pq.read_schema(out / "part-00000.parquet").names

    lines = (tmp_path / "day.tsv").read_text().splitlines(keepends=True)
    lines[2] = "\t".join(lines[2].split("\t")[:-1]) + "\n"  # 39 fields on line 3
    (tmp_path / "bad.tsv").write_text("".join(lines))
    with pytest.raises(ValueError, match=r"bad\.tsv: line 3 has 39 fields, expected 40"):
        convert_criteo(tmp_path / "bad.tsv", tmp_path / "bad", progress=False)
    (tmp_path / "bad.tsv").write_text(lines[0].replace("\t5\t", "\tfive\t", 1))
    with pytest.raises(ValueError, match=r"column 'I3'.*invalid value 'five'"):
        convert_criteo(tmp_path / "bad.tsv", tmp_path / "bad", progress=False)
    with pytest.raises(FileNotFoundError, match=r"missing\.tsv"):
        convert_criteo(tmp_path / "missing.tsv", tmp_path / "bad", progress=False)


# -- CSV with a schema ---------------------------------------------------------

SCHEMA_YAML = """\
columns:
  - {name: user, kind: sparse}
  - {name: tags, kind: sparse_list, separator: "|"}
  - {name: age, kind: dense, missing: zero, na_values: [nan]}
  - {name: click, kind: label}
  - {name: note, kind: skip}
"""

CSV_DATA = """\
note,click,user,age,tags,extra
hello,1,alice,31,a|b| c,x
,0,42,,,y
"a, b",1,-7,2.5,x||9,
q,0,,nan,007|123456789012345678901,z
"""


def test_csv_with_schema(tmp_path: Path) -> None:
    (tmp_path / "schema.yaml").write_text(SCHEMA_YAML)
    (tmp_path / "data.csv").write_text(CSV_DATA)
    files = convert_csv(tmp_path / "data.csv", tmp_path / "out", tmp_path / "schema.yaml",
                        rows_per_file=3, progress=False)  # fmt: skip
    assert len(files) == 2
    table = read_all(files)
    assert table.column_names == ["user", "tags", "age", "click"]
    assert table.schema.field("user").type == pa.uint64()
    assert table.schema.field("tags").type == pa.list_(pa.uint64())
    # strings hashed by column name, canonical integers kept (negatives as two's complement)
    assert table.column("user").to_pylist() == [key("alice", "user"), 42, 2**64 - 7, None]
    assert table.column("tags").to_pylist() == [
        keys(["a", "b", "c"], "tags"),
        [],
        [key("x", "tags"), 9],
        keys(["007", "123456789012345678901"], "tags"),  # not canonical / beyond int64
    ]
    assert table.column("age").to_pylist() == [31.0, 0.0, 2.5, 0.0]
    assert table.column("click").to_pylist() == [1.0, 0.0, 1.0, 0.0]


def test_csv_positional_tab_separated(tmp_path: Path) -> None:
    (tmp_path / "data.tsv").write_text("9223372036854775807\t0.5\tskip me\t1\n-1\t\t\t0\n")
    schema = CsvSchema.from_dict(
        {
            "header": False,
            "columns": [
                {"name": "id", "kind": "sparse", "type": "int"},
                {"name": "score", "kind": "dense", "missing": "zero"},
                {"name": "comment", "kind": "skip"},
                {"name": "y", "kind": "label"},
            ],
        }
    )
    (f,) = convert_csv(tmp_path / "data.tsv", tmp_path / "out", schema, delimiter="\t",
                       progress=False)  # fmt: skip
    assert pq.read_table(f).to_pydict() == {
        "id": [2**63 - 1, 2**64 - 1],
        "score": [0.5, 0.0],
        "y": [1.0, 0.0],
    }
    (tmp_path / "data.tsv").write_text("12\t0.5\tok\t1\nabc\t1\tok\t0\n")
    with pytest.raises(
        ValueError, match=r"column 'id' \(sparse\), row 2 .*'abc' is not an integer"
    ):
        convert_csv(tmp_path / "data.tsv", tmp_path / "out", schema, delimiter="\t",
                    progress=False)  # fmt: skip
    (tmp_path / "data.tsv").write_text("12\t0.5\tok\t1\n13\t0.5\t1\n")
    with pytest.raises(ValueError, match=r"line 2 has 3 fields, expected 4"):
        convert_csv(tmp_path / "data.tsv", tmp_path / "out", schema, delimiter="\t",
                    progress=False)  # fmt: skip
    (tmp_path / "data.tsv").write_text("12\t0.5\tok\t\n")
    with pytest.raises(ValueError, match=r"column 'y' \(label\), row 1 .*an empty value"):
        convert_csv(tmp_path / "data.tsv", tmp_path / "out", schema, delimiter="\t",
                    progress=False)  # fmt: skip


@pytest.mark.parametrize(
    ("schema", "error"),
    [
        ({"columns": [{"name": "a", "kind": "sprase"}]}, r"column 'a': unknown kind 'sprase'"),
        ({"columns": [{"kind": "dense"}]}, r"column #1: missing 'name'"),
        ({"columns": [{"name": "a"}]}, r"column 'a': missing 'kind'"),
        ({"columns": [{"name": "a", "kind": "dense", "separator": ","}]}, r"key.*'separator'"),
        ({"columns": [{"name": "a", "kind": "dense"}] * 2}, r"'a' is listed twice"),
        ({"columns": []}, r"'columns' must be a non-empty list"),
        ({"cols": []}, r"unknown key\(s\) 'cols'"),
        ({"columns": [{"name": "a", "kind": "dense"}], "header": "yes"}, r"'header' must be"),
        ({"columns": [{"name": "a", "kind": "skip"}]}, r"every column is skipped"),
        ({"columns": [{"name": "a", "kind": "sparse", "type": "float"}]}, r"unknown type"),
        ([1, 2], r"expected a mapping"),
        ({"columns": [{"name": "a", "kind": "dense"}], "delimiter": ";"},
         r"unknown key\(s\) 'delimiter'.*options of the command"),
        ({"columns": [{"name": "a", "kind": "dense"}], "rows_per_file": 5, "x": 1},
         r"unknown key\(s\) 'rows_per_file', 'x'"),
        ({"columns": [{"name": "a", "kind": "dense", "missing": "skip"}]},
         r"column 'a': missing must be one of error, zero, drop_row, got 'skip'"),
        ({"columns": [{"name": "a", "kind": "label", "invalid": "zero"}]},
         r"column 'a': invalid must be one of error, drop_row"),
        ({"columns": [{"name": "t", "kind": "timestamp", "missing": "zero"}]},
         r"column 't': missing must be one of error, drop_row"),
        ({"columns": [{"name": "t", "kind": "timestamp", "unit": "ns"}]},
         r"column 't': unit must be one of s, ms, us"),
        ({"columns": [{"name": "t", "kind": "timestamp", "format": "YYYY"}]},
         r"column 't': 'format' must be a strptime format"),
        ({"columns": [{"name": "a", "kind": "dense", "na_values": "N/A"}]},
         r"column 'a': 'na_values' must be a list of strings"),
        ({"columns": [{"name": "a", "kind": "dense", "na_values": [-1]}]},
         r"'na_values' must be a list of strings \(quote numbers"),
        ({"columns": [{"name": "a", "kind": "dense", "allow_rounding": "yes"}]},
         r"'allow_rounding' must be true or false"),
        ({"columns": [{"name": "a", "kind": "int64", "allow_rounding": True}]},
         r"column 'a': unknown key\(s\) 'allow_rounding' for kind 'int64'"),
        ({"columns": [{"name": "a", "kind": "sparse", "missing": "zero"}]},
         r"column 'a': unknown key\(s\) 'missing' for kind 'sparse'"),
        ({"columns": [{"name": "a", "kind": "dense", "unit": "s"}]},
         r"unknown key\(s\) 'unit' for kind 'dense'"),
    ],
)  # fmt: skip
def test_csv_bad_schema(schema: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        CsvSchema.from_dict(schema, "schema.yaml")


def test_csv_schema_column_missing_from_header(tmp_path: Path) -> None:
    (tmp_path / "schema.yaml").write_text(SCHEMA_YAML + "  - {name: country, kind: sparse}\n")
    (tmp_path / "data.csv").write_text(CSV_DATA)
    with pytest.raises(ValueError, match=r"schema column\(s\) 'country' not in the header"):
        convert_csv(tmp_path / "data.csv", tmp_path / "out", tmp_path / "schema.yaml",
                    progress=False)  # fmt: skip
    (tmp_path / "schema.yaml").write_text("columns: [{name: a, kind: dense}\n")
    with pytest.raises(ValueError, match=r"schema\.yaml: not valid YAML"):
        convert_csv(tmp_path / "data.csv", tmp_path / "out", tmp_path / "schema.yaml",
                    progress=False)  # fmt: skip


def convert_text(tmp_path: Path, text: str, columns: list[dict[str, Any]], **options: Any) -> Any:
    """convert_csv of text (a file data.csv with a header) by a schema of these columns."""
    (tmp_path / "data.csv").write_text(text)
    schema = CsvSchema.from_dict({"columns": columns})
    return convert_csv(tmp_path / "data.csv", tmp_path / "out", schema, progress=False, **options)


def where(column: str, kind: str, row: int) -> str:
    """The start of a converter error about a value (a regex)."""
    return (
        rf"data\.csv: column '{column}' \({kind}\), row {row} "
        r"\(rows count from 1, the header not counted\): "
    )


@pytest.mark.parametrize("kind", ["dense", "label"])
@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("nan", r"'nan' is not finite"),
        ("NaN", r"'NaN' is not finite"),
        ("inf", r"'inf' is not finite"),
        ("-inf", r"'-inf' is not finite"),
        ("", r"an empty value; missing: zero or drop_row"),
        ("N/A", r"'N/A' is not a number \(na_values: \['N/A'\] makes it missing\)"),
        ("12abc", r"'12abc' is not a number"),
        ("1e39", r"'1e39' is beyond float32's range"),
    ],
)
def test_csv_bad_numbers_fail_naming_file_column_row_and_value(
    tmp_path: Path, kind: str, value: str, error: str
) -> None:
    columns = [{"name": "id", "kind": "sparse"}, {"name": "x", "kind": kind}]
    with pytest.raises(ValueError, match=where("x", kind, 3) + error):
        convert_text(tmp_path, f"id,x\n1,0.5\n2, 1 \n3,{value}\n4,2\n", columns)


def test_csv_missing_and_invalid_policies(tmp_path: Path) -> None:
    text = "id,a,b,c,y\n1,1,1,1,1\n2,,N/A,2,0\n3,nan,2,,1\n4,3,inf,3,\n5,4,5,x,0\n6,5,6,7,1\n"
    columns = [
        {"name": "id", "kind": "int64"},
        {"name": "a", "kind": "dense", "missing": "zero", "invalid": "drop_row"},
        {"name": "b", "kind": "dense", "na_values": ["N/A"], "missing": "zero",
         "invalid": "drop_row"},
        {"name": "c", "kind": "int64", "missing": "drop_row", "invalid": "drop_row"},
        {"name": "y", "kind": "label", "missing": "drop_row"},
    ]  # fmt: skip
    result = convert_text(tmp_path, text, columns)
    assert pq.read_table(result[0]).to_pydict() == {
        "id": [1, 2, 6],
        "a": [1.0, 0.0, 5.0],
        "b": [1.0, 0.0, 6.0],
        "c": [1, 2, 7],
        "y": [1.0, 0.0, 1.0],
    }
    assert result.rows == 3 and result.dropped.rows == 3  # rows 3, 4, 5
    assert result.dropped.by_column == {
        "a": {"invalid": 1},
        "b": {"invalid": 1},
        "c": {"missing": 1, "invalid": 1},
        "y": {"missing": 1},
    }
    assert result.summary() == (
        "wrote 3 rows in 1 files; dropped 3 rows "
        "(a: 1 invalid; b: 1 invalid; c: 1 missing, 1 invalid; y: 1 missing)"
    )
    # The first bad value of a kept row raises; rows another column drops raise nothing.
    columns[1] = {"name": "a", "kind": "dense"}
    with pytest.raises(ValueError, match=where("a", "dense", 2) + "an empty value"):
        convert_text(tmp_path, text, columns)
    columns[1] = {"name": "a", "kind": "dense", "missing": "zero"}  # row 3's nan: c drops it
    result = convert_text(tmp_path, text, columns)
    assert result.rows == 3 and "a" not in result.dropped.by_column
    columns[2] = {"name": "b", "kind": "dense", "missing": "zero"}
    with pytest.raises(ValueError, match=where("b", "dense", 2) + r"'N/A' is not a number"):
        convert_text(tmp_path, text, columns)


def test_csv_row_numbers_count_input_rows_across_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(csv_module, "_BLOCK_BYTES", 256)  # many record batches
    rows = [f"{i},{i % 7}.5,{'' if i % 10 == 3 else i},u{i}" for i in range(1, 301)]
    rows[249] = "250,oops,250,u250"
    text = "id,x,k,u\n" + "\n".join(rows) + "\n"
    columns = [
        {"name": "id", "kind": "int64"},
        {"name": "x", "kind": "dense"},
        {"name": "k", "kind": "sparse", "type": "int"},
        {"name": "u", "kind": "sparse", "type": "string"},
    ]
    with pytest.raises(ValueError, match=where("x", "dense", 250) + "'oops' is not a number"):
        convert_text(tmp_path, text, columns)
    columns[1] = {"name": "x", "kind": "dense", "invalid": "drop_row"}
    rows[279] = "280,1,k280,u280"  # rows before it were dropped: still row 280
    text = "id,x,k,u\n" + "\n".join(rows) + "\n"
    with pytest.raises(ValueError, match=where("k", "sparse", 280) + "'k280' is not an integer"):
        convert_text(tmp_path, text, columns)
    rows[279] = "280,1,280,u280"
    text = "id,x,k,u\n" + "\n".join(rows) + "\n"
    result = convert_text(tmp_path, text, columns, rows_per_file=100)
    table = read_all(result)
    assert result.rows == table.num_rows == 299 and result.summary().endswith("(x: 1 invalid)")
    assert table.column("id").to_pylist() == [i for i in range(1, 301) if i != 250]
    assert table.column("u").to_pylist() == keys([f"u{i}" for i in range(1, 301) if i != 250], "u")
    assert table.column("k").to_pylist() == [
        None if i % 10 == 3 else i for i in range(1, 301) if i != 250
    ]


def test_csv_errors_name_the_row_of_invalid_utf8(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_bytes(b"u,y\nab,1\ncd,0\n\xffe,1\n")
    schema = CsvSchema.from_dict({"columns": [{"name": "u", "kind": "sparse"},
                                              {"name": "y", "kind": "label"}]})  # fmt: skip
    with pytest.raises(ValueError, match=where("u", "sparse", 3) + r"b'\\xffe' is not valid UTF-8"):
        convert_csv(tmp_path / "data.csv", tmp_path / "out", schema, progress=False)


TIMES = list(range(1_700_000_000, 1_700_020_001, 5_000))


def test_csv_int64_and_timestamp_keep_integers_exact(tmp_path: Path) -> None:
    lines = [f"{t},{t},{t * 1000 + 7},{t % 1000}" for t in TIMES]
    text = "ts,tid,ms,small\n" + "\n".join(lines) + "\n"
    columns = [
        {"name": "ts", "kind": "timestamp"},
        {"name": "tid", "kind": "int64"},
        {"name": "ms", "kind": "timestamp", "unit": "ms"},
        {"name": "small", "kind": "dense"},  # integers float32 holds exactly
    ]
    (f,) = convert_text(tmp_path, text, columns)
    table = pq.read_table(f)
    assert table.schema.field("ts").type == pa.timestamp("ms", "UTC")
    assert table.schema.field("ms").type == pa.timestamp("ms", "UTC")
    assert table.schema.field("tid").type == pa.int64()
    assert table.column("tid").to_pylist() == TIMES
    seconds = pc.cast(table.column("ts"), pa.int64()).to_pylist()
    assert seconds == [t * 1000 for t in TIMES]  # milliseconds: Parquet has no seconds
    assert pc.cast(table.column("ms"), pa.int64()).to_pylist() == [t * 1000 + 7 for t in TIMES]
    assert table.column("small").to_pylist() == [float(t % 1000) for t in TIMES]
    with ParquetReader(f, 4, ["tid"]) as reader:  # an int column: exact ids
        assert np.concatenate([b.sparse["tid"].values for b in reader]).tolist() == TIMES


def test_csv_timestamps_from_iso_strings_units_and_formats(tmp_path: Path) -> None:
    utc = dt.timezone.utc
    text = (
        "t,f\n"
        "2023-11-14T22:13:20Z,14/11/2023 22:13\n"
        "2023-11-14T22:13:20+08:00,01/01/2024 00:00\n"
        "2023-11-14 22:13:20,31/12/1999 23:59\n"
        "2023-11-14,01/02/2024 03:04\n"
        " 1700000000 ,01/02/2024 03:04\n"
    )
    columns = [
        {"name": "t", "kind": "timestamp"},
        {"name": "f", "kind": "timestamp", "format": "%d/%m/%Y %H:%M"},
    ]
    (f,) = convert_text(tmp_path, text, columns)
    assert pq.read_table(f).to_pydict() == {
        "t": [
            dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=utc),
            dt.datetime(2023, 11, 14, 14, 13, 20, tzinfo=utc),
            dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=utc),
            dt.datetime(2023, 11, 14, tzinfo=utc),
            dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=utc),
        ],
        "f": [
            dt.datetime(2023, 11, 14, 22, 13, tzinfo=utc),
            dt.datetime(2024, 1, 1, tzinfo=utc),
            dt.datetime(1999, 12, 31, 23, 59, tzinfo=utc),
            dt.datetime(2024, 2, 1, 3, 4, tzinfo=utc),
            dt.datetime(2024, 2, 1, 3, 4, tzinfo=utc),
        ],
    }
    bad = text + "2023-11-14T22:13:20.250Z,2023-11-14\n"
    with pytest.raises(ValueError, match=where("t", "timestamp", 6) + r"'2023-11-14T22:13:20"
                       r"\.250Z' is neither a unix time in seconds nor an ISO-8601"):  # fmt: skip
        convert_text(tmp_path, bad, columns)
    columns[0] = {"name": "t", "kind": "timestamp", "unit": "us"}
    with pytest.raises(ValueError, match=where("f", "timestamp", 6) + r"'2023-11-14' does not "
                       r"match format '%d/%m/%Y %H:%M'"):  # fmt: skip
        convert_text(tmp_path, bad, columns)
    columns[1] = {"name": "f", "kind": "timestamp", "format": "%d/%m/%Y %H:%M",
                  "invalid": "drop_row"}  # fmt: skip
    result = convert_text(tmp_path, bad, columns)
    (f,) = result
    table = pq.read_table(f)
    assert table.schema.field("t").type == pa.timestamp("us", "UTC")
    assert table.num_rows == 5 and result.summary().endswith("dropped 1 row (f: 1 invalid)")
    with pytest.raises(ValueError, match=where("t", "timestamp", 2) + "an empty value; "
                       "missing: drop_row in the column's schema accepts it"):  # fmt: skip
        convert_text(tmp_path, 't\n1700000000\n""\n', [{"name": "t", "kind": "timestamp"}])


def test_csv_dense_refuses_integers_float32_rounds(tmp_path: Path) -> None:
    text = "ts,y\n" + "\n".join(f"{t},1" for t in TIMES) + "\n"
    columns = [{"name": "ts", "kind": "dense"}, {"name": "y", "kind": "label"}]
    with pytest.raises(
        ValueError,
        match=where("ts", "dense", 2) + r"'1700005000' is an integer that float32 cannot hold "
        r"exactly \(it would read 1700004992\.0\): .*kind: int64 or kind: timestamp",
    ):  # 1700000000 is a float32: the first row passes
        convert_text(tmp_path, text, columns)
    with pytest.raises(ValueError, match=where("ts", "dense", 1) + r"'16777217' is an integer"):
        convert_text(tmp_path, "ts,y\n16777217,1\n", columns)
    columns[0] = {"name": "ts", "kind": "dense", "allow_rounding": True}
    (f,) = convert_text(tmp_path, text, columns)
    assert pq.read_table(f).column("ts").to_pylist() == [float(np.float32(t)) for t in TIMES]
    # fractions, and integers float32 holds exactly, convert as they are
    columns[0] = {"name": "ts", "kind": "dense"}
    values = ["16777216", "-16777216", "1e10", "2.5e9", "123456789.5", "-3.25", "1e30"]
    (f,) = convert_text(tmp_path, "ts,y\n" + "".join(f"{v},0\n" for v in values), columns)
    assert pq.read_table(f).column("ts").to_pylist() == [float(np.float32(v)) for v in values]


# -- The schema reference ------------------------------------------------------------


def doc_section(title: str) -> str:
    text = (REPO / "docs" / "reader.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_schema_help_and_docs_name_every_key_and_kind() -> None:
    docs = doc_section("Converting CSV")
    names = {*csv_module.SCHEMA_KEYS, *csv_module.KINDS, *csv_module.KEY_TYPES,
             *csv_module.MISSING, *csv_module.UNITS}  # fmt: skip
    names |= set().union(*csv_module.COLUMN_KEYS.values())
    for name in sorted(names):
        assert re.search(rf"\b{name}\b", csv_module.SCHEMA_HELP), name
        assert f"`{name}`" in docs, name
    assert "--delimiter" in csv_module.SCHEMA_HELP and "--rows-per-file" in csv_module.SCHEMA_HELP


def test_documented_example_converts_as_described(tmp_path: Path) -> None:
    docs = doc_section("Converting CSV")
    help_text = csv_module.SCHEMA_HELP
    schema_text, csv_text = csv_module.EXAMPLE_SCHEMA, csv_module.EXAMPLE_CSV
    assert fenced_blocks(docs, "yaml") == [schema_text]
    assert textwrap.indent(schema_text, "    ") in help_text
    assert textwrap.indent(csv_text, "    ") in help_text
    csv_block, types_block, status_block = fenced_blocks(docs, "text")
    assert csv_block == csv_text
    (tmp_path / "schema.yaml").write_text(schema_text)
    (tmp_path / "data.csv").write_text(csv_text)
    result = convert_csv(tmp_path / "data.csv", tmp_path / "out", tmp_path / "schema.yaml",
                         progress=False)  # fmt: skip
    assert [f.name for f in result] == ["part-00000.parquet"]
    assert result.summary() == status_block.strip()
    table = pq.read_table(result[0])
    written = {
        "uint64": pa.uint64(),
        "list<uint64>": pa.list_(pa.uint64()),
        "float32": pa.float32(),
        "int64": pa.int64(),
        "timestamp[ms, tz=UTC]": pa.timestamp("ms", "UTC"),
    }
    documented = [line.split(maxsplit=1) for line in types_block.splitlines()]
    assert [name for name, _ in documented] == table.column_names
    for name, kind in documented:
        hashed = kind.endswith(" (hashed strings)")
        assert table.schema.field(name).type == written[kind.removesuffix(" (hashed strings)")]
        assert hashed_field(table.schema.field(name)) == (name if hashed else None), name
    (rows_block,) = fenced_blocks(docs, "python")[-1:]
    rows = eval(rows_block, {"key": lambda c, v: key(v, c), "datetime": dt.datetime,
                             "UTC": dt.timezone.utc})  # fmt: skip
    assert table.to_pydict() == rows
    # the same example through the command line
    done = run(["convert", "csv", "data.csv", "cli_out", "--schema", "schema.yaml", "--quiet"],
               tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / "cli_out" / "part-00000.parquet").to_pydict() == rows
    # without drop_row, dave's N/A stops the conversion as the docs say
    strict = schema_text.replace(", missing: drop_row", "")
    (tmp_path / "schema.yaml").write_text(strict)
    with pytest.raises(ValueError, match=where("dwell", "dense", 4) + r"missing value 'N/A'"):
        convert_csv(tmp_path / "data.csv", tmp_path / "out", tmp_path / "schema.yaml",
                    progress=False)  # fmt: skip


# -- Hash tags in the field metadata ---------------------------------------------


def hash_tags(path: Path) -> dict[str, bytes]:
    """Column -> its HASH_METADATA value, for the columns that have one."""
    fields = pq.read_schema(path)
    return {f.name: f.metadata[HASH_METADATA] for f in fields if hashed_field(f) is not None}


def test_criteo_tags_hashed_columns_only(tmp_path: Path) -> None:
    write_criteo(tmp_path / "day.tsv")
    (first, *_) = convert_criteo(
        tmp_path / "day.tsv", tmp_path / "out", rows_per_file=3, bucketize=True, progress=False
    )
    categorical = [f"C{k}" for k in range(1, 27)]
    assert hash_tags(first) == {name: hash_tag(name) for name in categorical}
    assert all(f.metadata is None for f in pq.read_schema(first) if f.name not in categorical)
    with ParquetReader(
        tmp_path / "out", 4, ["C1", "C26", "I1", "I1_bucket"], label="label"
    ) as reader:
        assert reader.hashed_features == {"C1": "C1", "C26": "C26"}  # buckets: hash_ints


def test_movielens_tags_hashed_columns_only(movielens: tuple[list[Path], pa.Table]) -> None:
    files, _ = movielens
    assert hash_tags(files[0]) == {"genres": b"strings/v1:genres", "tags": b"strings/v1:tags"}
    with ParquetReader(files[:2], 64, ML_FEATURES, label="label") as reader:
        assert reader.hashed_features == {"genres": "genres", "tags": "tags"}


def test_csv_tags_string_typed_columns_only(tmp_path: Path) -> None:
    schema = CsvSchema.from_dict(
        {
            "columns": [
                {"name": "user", "kind": "sparse", "type": "string"},
                {"name": "tags", "kind": "sparse_list", "type": "string"},
                {"name": "city", "kind": "sparse"},  # auto: integers kept, not all hashes
                {"name": "item", "kind": "sparse_list", "type": "int"},
                {"name": "age", "kind": "dense"},
                {"name": "click", "kind": "label"},
            ]
        }
    )
    (tmp_path / "data.csv").write_text("user,tags,city,item,age,click\nal,a|b,7,1|2,3,1\n")
    (f,) = convert_csv(tmp_path / "data.csv", tmp_path / "out", schema, progress=False)
    assert hash_tags(f) == {"user": hash_tag("user"), "tags": hash_tag("tags")}
    assert pq.read_table(f).column("user").to_pylist() == [key("al", "user")]
    features = ["user", "tags", "city", "item", "age"]
    with ParquetReader(f, 4, features, label="click") as reader:
        assert reader.hashed_features == {"user": "user", "tags": "tags"}


# -- The command line ----------------------------------------------------------


def test_cli_convert_criteo_and_csv(tmp_path: Path) -> None:
    write_criteo(tmp_path / "day.tsv")
    done = run(["convert", "criteo", "day.tsv", "out", "--rows-per-file", "2", "--bucketize"],
               tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "wrote 4 rows in 2 files to out"
    assert "criteo" in done.stderr  # the progress bar
    assert "I13_bucket" in pq.read_schema(tmp_path / "out" / "part-00001.parquet").names
    (tmp_path / "bad.tsv").write_text("1\t2\n")
    done = run(["convert", "criteo", "bad.tsv", "bad", "--quiet"], tmp_path)
    assert done.returncode == 1
    assert "bad.tsv: line 1 has 2 fields, expected 40" in done.stderr
    assert "Traceback" not in done.stderr

    (tmp_path / "schema.yaml").write_text(SCHEMA_YAML)
    (tmp_path / "data.csv").write_text(CSV_DATA.replace(",", ";").replace('"a; b"', "ab"))
    done = run(["convert", "csv", "data.csv", "csv_out", "--schema", "schema.yaml",
                "--delimiter", ";", "--quiet"], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "wrote 4 rows in 1 files to csv_out" and not done.stderr
    (tmp_path / "schema.yaml").write_text("columns: [{name: user, kind: id}]\n")
    done = run(["convert", "csv", "data.csv", "csv_out", "--schema", "schema.yaml"], tmp_path)
    assert done.returncode == 1 and "column 'user': unknown kind 'id'" in done.stderr


def test_cli_convert_movielens(tmp_path: Path) -> None:
    small_movielens(tmp_path / "ml", 2000)
    out = tmp_path / "out"
    out.mkdir()
    (out / "1990-01-01.parquet").write_text("stale day file of an earlier run")
    (out / "README").write_text("kept")
    done = run(["convert", "movielens", "ml", "out", "--quiet"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote 2,000 rows in ")
    days = sorted(p.name for p in out.glob("*.parquet"))
    assert "1990-01-01.parquet" not in days and (out / "README").exists()
    with ParquetReader(out, batch_size=512, features=ML_FEATURES, label="label") as reader:
        assert sum(b.size for b in reader) == 2000
    (tmp_path / "ml" / "movies.csv.gz").unlink()
    done = run(["convert", "movielens", "ml", "out", "--quiet"], tmp_path)
    assert done.returncode == 1 and "has no movies.csv" in done.stderr
