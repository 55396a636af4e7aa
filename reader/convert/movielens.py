"""MovieLens CSVs → one Parquet file per day, in time order (``wuliang convert movielens``).

Input: a MovieLens directory (``ml-latest-small``, ``ml-25m``, …) with
``ratings.csv`` (userId, movieId, rating, timestamp) and ``movies.csv``
(movieId, title, genres); ``tags.csv`` (userId, movieId, tag, timestamp) is
optional. Each file may be gzip-compressed (``ratings.csv.gz``), as the copy of
``ml-latest-small`` in the repository's ``datasets/`` is.

Output: ``OUT_DIR/YYYY-MM-DD.parquet``, one file per UTC day that has ratings,
written atomically (day files of an earlier run that this one did not write are
removed), so the sorted file names replay the ratings in time order. One row
per rating, sorted by (timestamp, user_id, movie_id), with columns

* ``user_id``, ``movie_id``: int64 ids (single-valued keys, used as they are);
* ``genres``: list<uint64>, ``hash_strings(genre, "genres")`` of each genre of
  the movie, as written (``(no genres listed)`` → empty list); tagged
  ``hashing.hash_tag("genres")`` in the field metadata;
* ``year``: int64, the release year from the title's trailing ``(YYYY)`` (the
  first year of a ``(YYYY–YYYY)`` range); null when the title has none;
* ``tags``: list<uint64>, ``hash_strings(tag, "tags")`` of the distinct tags
  (lower-cased, surrounding spaces trimmed) that any user applied to the movie
  at or before the rating's timestamp — never a tag from the future — in the
  order they were first applied; tagged ``hashing.hash_tag("tags")`` (the
  hash of the normalised text);
* ``timestamp``: int64 seconds since the epoch (UTC);
* ``rating``: float32 (0.5 … 5.0);
* ``label``: float32, 1 if ``rating >= 4`` else 0.

A movie missing from movies.csv has no genres and a null year.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from wuliang.reader.convert._common import make_out_dir, open_input, progress_bar, remove_stale
from wuliang.reader.hashing import hash_strings, tag_hashed
from wuliang.reader.io import AnyPath, as_path, named, write_parquet

NO_GENRES = "(no genres listed)"
LIKED = 4.0  # label = rating >= LIKED
DAY_NAME = re.compile(r"\d{4}-\d{2}-\d{2}\.parquet")
_YEAR = r"\((?P<year>\d{4})(?:\s*[-–]\s*(?:\d{4})?)?\)\s*$"
_SECONDS_PER_DAY = 86_400
_CHUNK_SIZE = 1 << 22  # rows + list values converted at a time

SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("movie_id", pa.int64(), nullable=False),
        tag_hashed(pa.field("genres", pa.list_(pa.uint64()))),
        pa.field("year", pa.int64()),
        tag_hashed(pa.field("tags", pa.list_(pa.uint64()))),
        pa.field("timestamp", pa.int64(), nullable=False),
        pa.field("rating", pa.float32(), nullable=False),
        pa.field("label", pa.float32(), nullable=False),
    ]
)

_RATINGS = {"userId": pa.int64(), "movieId": pa.int64(), "rating": pa.float32()}
_RATINGS["timestamp"] = pa.int64()
_MOVIES = {"movieId": pa.int64(), "title": pa.string(), "genres": pa.string()}
_TAGS = {"movieId": pa.int64(), "tag": pa.string(), "timestamp": pa.int64()}


def find_csv(directory: AnyPath, name: str) -> AnyPath | None:
    """``directory/name.csv``, else ``name.csv.gz``, else None."""
    for path in (directory / f"{name}.csv", directory / f"{name}.csv.gz"):
        if path.is_file():
            return path
    return None


def _read_csv(path: AnyPath, types: dict[str, pa.DataType]) -> pa.Table:
    """The columns named in types, checked: present, of that type, no nulls in numbers."""
    options = pacsv.ConvertOptions(column_types=types)
    try:
        if isinstance(path, Path):
            table = pacsv.read_csv(path, convert_options=options)
        else:
            stream, raw = open_input(path)
            with stream, raw:
                table = pacsv.read_csv(stream, convert_options=options)
    except pa.ArrowInvalid as error:
        raise ValueError(f"{path}: {error}") from None
    for name, t in types.items():
        if name not in table.column_names:
            raise ValueError(
                f"{path}: no column {name!r} (columns: {', '.join(table.column_names)})"
            )
        column = table.column(name)
        if column.null_count:
            row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"{path}: column {name!r} is empty in row {row + 1}")
        if column.type != t:  # e.g. an all-empty column read as null
            raise ValueError(f"{path}: column {name!r} is {column.type}, expected {t}")
    return table.select(list(types))


def _lists(values: np.ndarray, offsets: np.ndarray) -> pa.ListArray:
    if offsets[-1] >= 2**31:
        raise ValueError(f"{offsets[-1]:,} list values in one day: more than a Parquet list holds")
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(values, type=pa.uint64())
    )


def _gather(
    values: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of the lists values[starts[i] : starts[i] + lengths[i]]."""
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    return values[index], offsets


class _Movies:
    """Genre keys (CSR) and year of each movie, looked up by movie id."""

    def __init__(self, movies: pa.Table, path: AnyPath) -> None:
        ids = movies.column("movieId").to_numpy()
        order = np.argsort(ids, kind="stable")
        self.ids = ids[order]
        repeated = np.flatnonzero(self.ids[1:] == self.ids[:-1])
        if len(repeated):
            raise ValueError(f"{path}: movieId {self.ids[repeated[0]]} appears more than once")
        titles = movies.column("title").take(pa.array(order))
        year = pc.struct_field(pc.extract_regex(titles, _YEAR), "year")
        self.year = pc.cast(year, pa.int64()).combine_chunks()
        genres = pc.split_pattern(movies.column("genres").take(pa.array(order)), "|")
        genres = genres.combine_chunks()
        flat = genres.flatten()
        keep = pc.and_(pc.not_equal(flat, NO_GENRES), pc.not_equal(flat, "")).to_numpy(
            zero_copy_only=False
        )
        kept_before = np.concatenate([[0], np.cumsum(keep)])
        self.genre_offsets = kept_before[genres.offsets.to_numpy()]
        self.genre_keys = hash_strings(flat.filter(pa.array(keep)), "genres").to_numpy()

    def index(self, movie_ids: np.ndarray) -> np.ndarray:
        """Row of each movie id in this table, -1 if absent."""
        pos = np.searchsorted(self.ids, movie_ids).clip(0, max(len(self.ids) - 1, 0))
        found = self.ids[pos] == movie_ids if len(self.ids) else np.zeros(len(movie_ids), bool)
        return np.where(found, pos, -1)


class _Tags:
    """Distinct tags per movie, sorted by (movie, time first applied)."""

    def __init__(self, tags: pa.Table | None) -> None:
        if tags is None or tags.num_rows == 0:
            self.movie = self.time = np.zeros(0, np.int64)
            self.keys = np.zeros(0, np.uint64)
            return
        text = pc.utf8_trim_whitespace(pc.utf8_lower(tags.column("tag")))
        nonempty = pc.not_equal(text, "")
        movie = tags.column("movieId").filter(nonempty).to_numpy()
        time = tags.column("timestamp").filter(nonempty).to_numpy()
        keys = hash_strings(text.filter(nonempty), "tags").to_numpy()
        order = np.lexsort((time, keys, movie))  # first application of (movie, tag) first
        movie, time, keys = movie[order], time[order], keys[order]
        first = np.ones(len(keys), dtype=bool)
        first[1:] = (movie[1:] != movie[:-1]) | (keys[1:] != keys[:-1])
        movie, time, keys = movie[first], time[first], keys[first]
        order = np.lexsort((keys, time, movie))
        self.movie, self.time, self.keys = movie[order], time[order], keys[order]

    def known_at(self, movie: np.ndarray, time: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, count): the tags of movie[i] applied at or before time[i] are
        keys[start[i] : start[i] + count[i]] (a prefix of the movie's tags)."""
        # Search (movie, time) pairs as one int64: dense ranks of both, combined.
        _, movie_code = np.unique(np.concatenate([self.movie, movie]), return_inverse=True)
        times, time_rank = np.unique(np.concatenate([self.time, time]), return_inverse=True)
        span = np.int64(len(times) + 1)
        combined = movie_code.astype(np.int64) * span + time_rank.astype(np.int64)
        mine, theirs = combined[: len(self.movie)], combined[len(self.movie) :]
        movie_base = movie_code[len(self.movie) :].astype(np.int64) * span
        start = np.searchsorted(mine, movie_base, side="left")
        stop = np.searchsorted(mine, theirs, side="right")
        return start, stop - start


def convert_movielens(
    in_dir: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True
) -> list[Path | str]:
    """Converts a MovieLens directory into day files in out_dir; returns them in
    order. in_dir and out_dir may be URIs (``s3://bucket/prefix``); the files
    are then returned as URIs.

    Raises:
        FileNotFoundError: in_dir, its ratings.csv or its movies.csv is missing.
        ValueError: a required column is missing or has an empty or bad value
            (naming the file and column).
    """
    src = as_path(in_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"MovieLens directory {src} does not exist")
    paths = {name: find_csv(src, name) for name in ("ratings", "movies", "tags")}
    for name in ("ratings", "movies"):
        if paths[name] is None:
            raise FileNotFoundError(f"MovieLens directory {src} has no {name}.csv (or .csv.gz)")
    ratings = _read_csv(paths["ratings"], _RATINGS)
    movies = _Movies(_read_csv(paths["movies"], _MOVIES), paths["movies"])
    tags_path = paths["tags"]
    tags = _Tags(_read_csv(tags_path, _TAGS) if tags_path is not None else None)

    user = ratings.column("userId").to_numpy()
    movie = ratings.column("movieId").to_numpy()
    time = ratings.column("timestamp").to_numpy()
    order = np.lexsort((movie, user, time))
    user, movie, time = user[order], movie[order], time[order]
    rating = ratings.column("rating").to_numpy()[order]
    row = movies.index(movie)
    has_movie = row >= 0
    genre_start = np.where(has_movie, movies.genre_offsets[row], 0)
    genre_count = np.where(has_movie, movies.genre_offsets[row + 1] - genre_start, 0)
    year = movies.year.take(pa.array(row, mask=~has_movie))
    tag_start, tag_count = tags.known_at(movie, time)

    out = make_out_dir(out_dir)
    day = time // _SECONDS_PER_DAY
    bounds = np.concatenate([[0], np.flatnonzero(day[1:] != day[:-1]) + 1, [len(day)]])
    if len(day) == 0:
        bounds = bounds[:1]
    # Converted a chunk of whole days at a time, each chunk sliced into days
    # (no copy); a chunk holds about _CHUNK_SIZE rows and list values.
    size = np.concatenate([[0], np.cumsum(1 + genre_count + tag_count)])[bounds]
    bar = progress_bar(len(bounds) - 1, "movielens", "days", progress)
    files: list[AnyPath] = []
    first_day = 0
    while first_day < len(bounds) - 1:
        a = bounds[first_day]
        last_day = int(np.searchsorted(size, size[first_day] + _CHUNK_SIZE, side="right")) - 1
        last_day = max(last_day, first_day + 1)
        b = bounds[last_day]
        table = pa.Table.from_arrays(
            [
                pa.array(user[a:b]),
                pa.array(movie[a:b]),
                _lists(*_gather(movies.genre_keys, genre_start[a:b], genre_count[a:b])),
                year.slice(a, b - a),
                _lists(*_gather(tags.keys, tag_start[a:b], tag_count[a:b])),
                pa.array(time[a:b]),
                pa.array(rating[a:b]),
                pa.array((rating[a:b] >= LIKED).astype(np.float32)),
            ],
            schema=SCHEMA,
        )
        for d in range(first_day, last_day):
            path = out / f"{np.datetime64(int(day[bounds[d]]), 'D')}.parquet"
            write_parquet(table.slice(bounds[d] - a, bounds[d + 1] - bounds[d]), path)
            files.append(path)
        if bar is not None:
            bar.update(last_day - first_day)
        first_day = last_day
    if bar is not None:
        bar.close()
    remove_stale(out, files, DAY_NAME)
    return named(files)
