"""Where versions (and the reader's files) are: a local path, or a path in an
object store named by a URI (``s3://bucket/prefix``, ``gs://...``,
``hdfs://...``: anything ``pyarrow.fs.FileSystem.from_uri`` opens).

``location(text)`` gives a ``pathlib.Path`` for a local path and a
``RemotePath`` for a URI; a ``RemotePath`` has the few ``Path`` methods the
writers and readers of versions use (``/``, ``name``, ``is_file``,
``iterdir``, ``read_bytes``, ``write_bytes``, ...) plus whole-file transfers
(``upload``, ``download``). ``str()`` of a ``RemotePath`` is its URI without
the query (the query may hold credentials: messages never show it); ``uri``
keeps the query, to open it again (another process, a parameter server).

Object stores have no rename and no folders: a file appears once its upload
is complete, under its final name, and a folder is the prefix of the files
below it. The version writer builds on that (``version``).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["Location", "RemotePath", "from_uri", "is_uri", "location"]

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_BLOCK = 1 << 24  # bytes per read or write of a whole-file transfer


def is_uri(text: str) -> bool:
    """True for ``scheme://...`` (a path in a remote filesystem)."""
    return _SCHEME.match(text) is not None


Roots = dict[tuple[str, str, str], tuple[pafs.FileSystem, str]]


def from_uri(
    base: str, query: str = "", roots: Roots | None = None
) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, prefix, path) of a URI without its query, ``prefix + path``
    naming it; with ``roots``, one filesystem per scheme, host (or bucket) and
    query. ValueError (without the query) for a URI pyarrow cannot open."""
    parts = urlsplit(base)
    key = (parts.scheme, parts.netloc, query)
    roots = {} if roots is None else roots
    known = roots.get(key)
    plain = "%" not in base and "//" not in base[len(parts.scheme) + 3 :]
    if known is not None and plain and base.startswith(known[1]):
        return known[0], known[1], base[len(known[1]) :].rstrip("/") or "/"
    try:
        filesystem, path = pafs.FileSystem.from_uri(f"{base}?{query}" if query else base)
    except (ValueError, pa.ArrowException) as e:
        raise ValueError(f"{base!r} is not a URI pyarrow can open: {_hide(e, query)}") from None
    except OSError as e:  # e.g. a bucket's region not found
        raise OSError(f"{base}: {_hide(e, query)}") from None
    trimmed = base.rstrip("/")
    if path and trimmed.endswith(path):
        prefix = trimmed[: len(trimmed) - len(path)]
    else:  # e.g. percent-encoded: the name is the decoded path
        prefix = f"{parts.scheme}://" + (parts.netloc if path.startswith("/") else "")
    if plain:
        roots[key] = (filesystem, prefix)
    return filesystem, prefix, path


def _hide(error: BaseException, query: str) -> str:
    """An error's message without the URI's query (it may hold keys)."""
    return str(error).replace(query, "...") if query else str(error)


class RemotePath:
    """A file or folder of a pyarrow filesystem, named by a URI (see the
    module docstring). Errors are ``OSError`` s naming the URI without its
    query (``FileNotFoundError`` for what is not there)."""

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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (str(self), self._query) == (
            str(other),
            other._query,
        )

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def uri(self) -> str:
        return f"{self}?{self._query}" if self._query else str(self)

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.path).suffix

    @property
    def parent(self) -> RemotePath:
        return self._at(str(PurePosixPath(self.path).parent))

    def __truediv__(self, name: str) -> RemotePath:
        return self._at(f"{self.path.rstrip('/')}/{name}")

    def _at(self, path: str) -> RemotePath:
        return RemotePath(self.filesystem, self._prefix, path, self._query)

    def resolve(self) -> RemotePath:
        return self

    def relative_to(self, other: RemotePath) -> str:
        root = other.path.rstrip("/") + "/"
        if not self.path.startswith(root):
            raise ValueError(f"{self} is not under {other}")
        return self.path[len(root) :]

    # -- what is there -----------------------------------------------------------

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
            yield self._at(info.path)

    def files(self) -> list[str]:
        """The files below this folder, recursively (paths relative to it), sorted."""
        selector = pafs.FileSelector(self.path, recursive=True, allow_not_found=True)
        infos = self._call(self.filesystem.get_file_info, selector)
        root = self.path.rstrip("/") + "/"
        return sorted(i.path[len(root) :] for i in infos if i.type == pafs.FileType.File)

    # -- changing it -------------------------------------------------------------

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self._call(self.filesystem.create_dir, self.path, recursive=parents)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self._call(self.filesystem.delete_file, self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self, missing_ok: bool = True) -> None:
        """Removes the folder and everything below it."""
        try:
            self._call(self.filesystem.delete_dir, self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    # -- contents ----------------------------------------------------------------

    def open_input_file(self) -> pa.NativeFile:
        """The file, read by ranges (each read of it: one request to an object store)."""
        return self._call(self.filesystem.open_input_file, self.path)

    def read_bytes(self) -> bytes:
        with self._call(self.filesystem.open_input_stream, self.path) as f:
            return self._call(f.read)

    def read_buffer(self) -> pa.Buffer:
        """The whole file in memory, in one request."""
        with self._call(self.filesystem.open_input_stream, self.path) as f:
            return self._call(f.read_buffer)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: pa.Buffer | bytes) -> None:
        """Writes the object whole: an S3 object appears once its upload is complete."""
        with self._call(self.filesystem.open_output_stream, self.path) as out:
            self._call(out.write, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def upload(self, local: Path) -> None:
        """Writes a local file here, whole (it appears once complete)."""
        with (
            open(local, "rb") as source,
            self._call(self.filesystem.open_output_stream, self.path) as out,
        ):
            while block := source.read(_BLOCK):
                self._call(out.write, block)

    def digest(self) -> tuple[int, str]:
        """The file's size and sha256, read through (not kept)."""
        digest = hashlib.sha256()
        size = 0
        with self._call(self.filesystem.open_input_stream, self.path) as source:
            while block := self._call(source.read, _BLOCK):
                digest.update(block)
                size += len(block)
        return size, digest.hexdigest()

    def download(self, local: Path) -> tuple[int, str]:
        """Copies the file to a local path; returns its size and sha256."""
        digest = hashlib.sha256()
        size = 0
        with (
            self._call(self.filesystem.open_input_stream, self.path) as source,
            open(local, "wb") as out,
        ):
            while block := self._call(source.read, _BLOCK):
                digest.update(block)
                out.write(block)
                size += len(block)
        return size, digest.hexdigest()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self}: {e}") from e
        except (OSError, pa.ArrowException) as e:
            raise OSError(f"{self}: {e}") from e


Location = Path | RemotePath


def location(path: str | os.PathLike | RemotePath) -> Location:
    """A URI as a ``RemotePath``, anything else as a ``Path``."""
    if isinstance(path, RemotePath | Path):
        return path
    text = os.fspath(path)
    return RemotePath.of(text) if is_uri(text) else Path(text)
