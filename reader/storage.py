"""Where the reader's files are: local paths, URIs of object stores
(``s3://``, ``gs://``, ``hdfs://``: anything ``pyarrow.fs.FileSystem.from_uri``
takes) or paths in a given ``pyarrow.fs.FileSystem``; and the read-ahead of
remote row groups.

A remote file is named by its URI without the query (``s3://bucket/key``) or,
in a given filesystem, by its path there. The names are what positions hold
(``ReaderPosition.file``), so the same URIs name the same files after a restart.
"""

from __future__ import annotations

import fnmatch
import glob as globlib
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from wuliang.ps_server.storage.location import Roots, from_uri, is_uri


@dataclass(frozen=True)
class RemoteFile:
    """A file in a pyarrow filesystem."""

    filesystem: pafs.FileSystem
    path: str

    def open(self) -> pa.NativeFile:
        return self.filesystem.open_input_file(self.path)

    def read_schema(self) -> pa.Schema:
        with self.open() as f:
            return pq.read_schema(f)


Located = dict[str, RemoteFile | None]  # file name -> where it is (None: a local path)


def locate(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    filesystem: pafs.FileSystem | None = None,
) -> Located:
    """The files named by a path, a directory (its *.parquet, recursively), a glob
    or a list of them, each once, sorted by name. Local paths, URIs, or (with
    ``filesystem``) paths in that filesystem."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not items:
        raise ValueError("no paths given")
    if filesystem is not None and not isinstance(filesystem, pafs.FileSystem):
        raise TypeError(f"filesystem must be a pyarrow.fs.FileSystem, got {filesystem!r}")
    found: dict[str, tuple[str, RemoteFile | None]] = {}  # key -> (name, where)
    roots: Roots = {}
    for item in items:
        text = os.fspath(item)
        if filesystem is not None:
            if is_uri(text):
                raise ValueError(f"{_strip_query(text)!r}: give a URI or filesystem=, not both")
            root, pattern = _split_glob(text, "*?[")
            for name in _remote_files(filesystem, root, pattern, _shown_in(filesystem, text)):
                found[name] = (name, RemoteFile(filesystem, name))
        elif is_uri(text):
            for name, remote in _uri_files(text, roots):
                found[name] = (name, remote)
        else:
            for name in _local_files(text):  # a file named twice is read once
                found[os.path.realpath(name)] = (name, None)
    return dict(sorted(found.values(), key=lambda entry: entry[0]))


def _local_files(text: str) -> list[str]:
    if any(ch in text for ch in "*?["):
        matched = sorted(globlib.glob(text, recursive=True))
        if not matched:
            raise FileNotFoundError(f"no files match {text!r}")
        return matched
    if Path(text).is_dir():
        matched = sorted(str(p) for p in Path(text).rglob("*.parquet"))
        if not matched:
            raise FileNotFoundError(f"directory {text!r} has no .parquet files")
        return matched
    if Path(text).is_file():
        return [text]
    raise FileNotFoundError(f"no such file or directory: {text!r}")


# -- remote ----------------------------------------------------------------------------


def _strip_query(uri: str) -> str:
    return uri.partition("?")[0]


def _shown_in(filesystem: pafs.FileSystem, path: str) -> str:
    return f"{path!r} in {type(filesystem).__name__}"


def _uri_files(uri: str, roots: Roots) -> list[tuple[str, RemoteFile]]:
    """(name, file) of the files a URI names; ``?`` starts the URI's query, so
    only ``*``, ``[...]`` and ``**`` are glob patterns in a URI."""
    base, _, query = uri.partition("?")
    shown = repr(base)
    root, pattern = _split_glob(base, "*[")
    if pattern and len(root) < len(urlsplit(base).scheme) + 3:
        raise ValueError(f"{shown}: a glob must come after the bucket or host")
    filesystem, prefix, path = from_uri(root, query, roots)
    names = _remote_files(filesystem, path, pattern, shown)
    return [(prefix + name, RemoteFile(filesystem, name)) for name in names]


def _split_glob(path: str, chars: str) -> tuple[str, str]:
    """(the folder before the first glob character, the glob after it), or (path, "")."""
    at = min((i for i in map(path.find, chars) if i >= 0), default=-1)
    if at < 0:
        return path, ""
    cut = path.rfind("/", 0, at)
    return (path[:cut], path[cut + 1 :]) if cut >= 0 else ("", path)


def _remote_files(filesystem: pafs.FileSystem, path: str, pattern: str, shown: str) -> list[str]:
    """Paths of the files named by path (a file, or a directory: its *.parquet
    below it) or, with a pattern, by the glob path/pattern."""
    if pattern:
        parts = pattern.split("/")
        deep = len(parts) > 1 or "**" in pattern
        infos = _list(filesystem, path, deep, shown)
        matched = sorted(p for p in infos if glob_match(parts, _relative(p, path).split("/")))
        if not matched:
            raise FileNotFoundError(f"no files match {shown}")
        return matched
    info = _call(shown, filesystem.get_file_info, path)
    if info.type == pafs.FileType.File:
        return [path]
    if info.type == pafs.FileType.Directory:
        matched = sorted(p for p in _list(filesystem, path, True, shown) if p.endswith(".parquet"))
        if not matched:
            raise FileNotFoundError(f"directory {shown} has no .parquet files")
        return matched
    raise FileNotFoundError(f"no such file or directory: {shown}")


def _list(filesystem: pafs.FileSystem, path: str, recursive: bool, shown: str) -> list[str]:
    """Paths of the files below path."""
    selector = pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
    infos = _call(shown, filesystem.get_file_info, selector)
    return [i.path for i in infos if i.type == pafs.FileType.File]


def _relative(path: str, root: str) -> str:
    root = root.rstrip("/")
    return path[len(root) + 1 :] if root and path.startswith(root + "/") else path.lstrip("/")


def _call(shown: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args); a filesystem error names what was asked for."""
    try:
        return fn(*args)
    except (OSError, pa.ArrowException) as e:
        raise OSError(f"cannot read {shown}: {e}") from e


def glob_match(pattern: Sequence[str], parts: Sequence[str]) -> bool:
    """Whether a path (its components) matches a glob (its components), as
    ``glob.glob(recursive=True)`` matches: fnmatch per component, ``**`` any
    number of components, names that begin with a dot only matched by a
    pattern component that does."""
    if not pattern:
        return not parts
    head = pattern[0]
    if head == "**":
        for taken in range(len(parts) + 1):
            if glob_match(pattern[1:], parts[taken:]):
                return True
            if taken < len(parts) and parts[taken].startswith("."):
                return False
        return False
    if not parts or (parts[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and glob_match(pattern[1:], parts[1:])


# -- read-ahead --------------------------------------------------------------------------


class RowGroupFetcher:
    """Reads the row groups of remote files for one reader thread, ``depth``
    row groups ahead of the one the thread converts, on ``depth`` threads of
    its own (made on first use), in order. A row group's column chunks are
    read whole, adjacent ones in one request (``pre_buffer``)."""

    def __init__(
        self, depth: int, name: str, initializer: Callable[..., None], initargs: tuple
    ) -> None:
        self.depth = depth
        self._name = name
        self._initializer = initializer
        self._initargs = initargs
        self._pool: ThreadPoolExecutor | None = None

    def batches(
        self,
        source: pa.NativeFile,
        metadata: pq.FileMetaData,
        groups: Sequence[int],
        columns: list[str],
        chunk_rows: int,
    ) -> Iterator[pa.RecordBatch]:
        """The rows of the row groups as record batches of chunk_rows rows across
        row-group boundaries (the last one smaller), as ``iter_batches`` cuts
        them: the shuffle's draws depend on the cuts."""
        return rechunk(self._tables(source, metadata, groups, columns), chunk_rows)

    def _tables(
        self,
        source: pa.NativeFile,
        metadata: pq.FileMetaData,
        groups: Sequence[int],
        columns: list[str],
    ) -> Iterator[pa.Table]:
        def read(group: int) -> pa.Table:
            pf = pq.ParquetFile(source, metadata=metadata, pre_buffer=True)
            return pf.read_row_group(group, columns=columns, use_threads=False)

        if self.depth == 0:
            yield from map(read, groups)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.depth, self._name, initializer=self._initializer, initargs=self._initargs
            )
        todo = iter(groups)
        pending: deque[Future[pa.Table]] = deque()
        try:
            for group in todo:
                pending.append(self._pool.submit(read, group))
                if len(pending) == self.depth:
                    break
            while pending:
                table = pending.popleft().result()
                group = next(todo, None)
                if group is not None:
                    pending.append(self._pool.submit(read, group))
                yield table
        finally:  # stopped early or failed: no read left using the source
            for future in pending:
                future.cancel()
            wait(pending)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def rechunk(tables: Iterator[pa.Table], rows: int) -> Iterator[pa.RecordBatch]:
    """The tables' rows as record batches of ``rows`` rows (the last: the rest);
    only a batch that straddles two tables is copied."""
    held: list[pa.Table] = []
    have = 0
    try:
        for table in tables:
            held.append(table)
            have += table.num_rows
            while have >= rows:
                joined = pa.concat_tables(held)
                yield _one_batch(joined.slice(0, rows))
                held, have = [joined.slice(rows)], have - rows
        if have:
            yield _one_batch(pa.concat_tables(held))
    finally:
        close = getattr(tables, "close", None)
        if close is not None:
            close()


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    return table.combine_chunks().to_batches()[0]
