"""Writing Parquet files the way every wuliang writer does: atomically; and the
paths of object stores the writers and converters take (``RemotePath``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from wuliang.reader.storage import from_uri, is_uri


class RemotePath:
    """A file or folder of a pyarrow filesystem, named by a URI
    (``s3://bucket/prefix``), with the few ``pathlib.Path`` methods the writers
    and converters use. ``str()`` is the URI without its query (for messages);
    ``uri`` keeps the query (it opens the file again)."""

    def __init__(self, filesystem: pafs.FileSystem, prefix: str, path: str, query: str) -> None:
        self.filesystem = filesystem
        self.path = path  # in the filesystem
        self._prefix = prefix  # prefix + path: the URI without its query
        self._query = query

    @staticmethod
    def of(uri: str) -> RemotePath:
        base, _, query = uri.partition("?")
        filesystem, prefix, path = from_uri(base, query)
        return RemotePath(filesystem, prefix, path, query)

    def __str__(self) -> str:
        return self._prefix + self.path

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    @property
    def uri(self) -> str:
        return f"{self}?{self._query}" if self._query else str(self)

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.path).suffix

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(
            self.filesystem, self._prefix, f"{self.path.rstrip('/')}/{name}", self._query
        )

    def _info(self) -> pafs.FileInfo:
        return self._call(self.filesystem.get_file_info, self.path)

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._info().type == pafs.FileType.Directory

    def stat(self) -> os.stat_result:
        size = self._info().size or 0
        return os.stat_result((0, 0, 0, 0, 0, 0, size, 0, 0, 0))

    def iterdir(self) -> Iterator[RemotePath]:
        selector = pafs.FileSelector(self.path, recursive=False, allow_not_found=True)
        for info in self._call(self.filesystem.get_file_info, selector):
            yield RemotePath(self.filesystem, self._prefix, info.path, self._query)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self._call(self.filesystem.create_dir, self.path, recursive=parents)

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self._call(self.filesystem.delete_file, self.path)

    def open_input_file(self) -> pa.NativeFile:
        """The file, read by ranges (each read of it: one request to an object store)."""
        return self._call(self.filesystem.open_input_file, self.path)

    def write_bytes(self, data: pa.Buffer | bytes) -> None:
        """Writes the object whole: an S3 object appears once its upload is complete."""
        with self._call(self.filesystem.open_output_stream, self.path) as out:
            out.write(data)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (OSError, pa.ArrowException) as e:
            raise OSError(f"{self}: {e}") from e


AnyPath = Path | RemotePath


def as_path(path: str | os.PathLike) -> AnyPath:
    """A URI as a RemotePath, anything else as a Path."""
    text = os.fspath(path)
    return RemotePath.of(text) if is_uri(text) else Path(text)


def named(files: list[AnyPath]) -> list[Path | str]:
    """Files as writers return them: Paths, and remote files as URIs."""
    return [f.uri if isinstance(f, RemotePath) else f for f in files]


def write_parquet(table: pa.Table, path: AnyPath | str, row_group_rows: int = 65_536) -> None:
    """Writes table to path atomically: to a temporary name in the same folder,
    renamed into place last, so a crash never leaves a partial file under
    path. A remote file (a RemotePath) is written to memory and uploaded
    whole to its final name (object stores have no rename; S3 shows an
    object only once its upload is complete).

    Key columns (integers and lists of integers) are stored plain and
    uncompressed: hashed keys are high-entropy, so compression saves little
    and decoding them is the reader's main cost (snappy made it 1.6x slower);
    other columns are snappy-compressed.
    """
    compression = {f.name: "none" if _is_key(f.type) else "snappy" for f in table.schema}
    options: dict[str, Any] = {
        "row_group_size": row_group_rows,
        "compression": compression,
        "use_dictionary": False,
    }
    if isinstance(path, RemotePath):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **options)
        path.write_bytes(sink.getvalue())
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, **options)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _is_key(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_integer(t)
