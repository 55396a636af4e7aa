"""What the converters share: part files, stale-file cleanup, byte progress, CSV errors."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from wuliang.reader.io import AnyPath, as_path, named, write_parquet

PART_NAME = re.compile(r"part-\d{5,}\.parquet")
_COLUMN_NUMBER = re.compile(r"In CSV column #(\d+): ")
_REMOTE_READ = 8 << 20  # bytes per read of a compressed remote input


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def remove_stale(out_dir: AnyPath, written: Iterable[AnyPath], pattern: re.Pattern[str]) -> None:
    """Removes files of out_dir named like pattern that this run did not write,
    so a re-run with fewer files leaves no file of the previous run behind."""
    keep = {p.name for p in written}
    for path in out_dir.iterdir():
        if pattern.fullmatch(path.name) and path.name not in keep and path.is_file():
            path.unlink()


class PartWriter:
    """Writes record batches as ``part-00000.parquet`` … of exactly
    ``rows_per_file`` rows each (the last may be smaller), atomically."""

    def __init__(self, out_dir: AnyPath, rows_per_file: int, schema: pa.Schema) -> None:
        if rows_per_file < 1:
            raise ValueError(f"rows_per_file must be >= 1, got {rows_per_file}")
        self.out_dir = out_dir
        self.rows_per_file = rows_per_file
        self.schema = schema
        self.files: list[AnyPath] = []
        self._pending: list[pa.RecordBatch] = []
        self._rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._rows += batch.num_rows
        while self._rows >= self.rows_per_file:
            table = pa.Table.from_batches(self._pending, schema=self.schema)
            self._write(table.slice(0, self.rows_per_file))
            rest = table.slice(self.rows_per_file)
            self._pending = rest.to_batches()
            self._rows = rest.num_rows

    def close(self) -> list[Path | str]:
        """Writes the remaining rows (an empty file if there were no rows at all),
        removes part files of earlier runs beyond the ones written; returns the
        files (URIs for a remote folder)."""
        if self._rows or not self.files:
            self._write(pa.Table.from_batches(self._pending, schema=self.schema))
        self._pending, self._rows = [], 0
        remove_stale(self.out_dir, self.files, PART_NAME)
        return named(self.files)

    def _write(self, table: pa.Table) -> None:
        path = self.out_dir / part_name(len(self.files))
        write_parquet(table, path)
        self.files.append(path)


def make_out_dir(out_dir: str | os.PathLike) -> AnyPath:
    """The output folder, created if missing: a Path, or a RemotePath for a URI."""
    out = as_path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def progress_bar(total: int | None, desc: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar, or None when disabled."""
    if not enabled:
        return None
    from tqdm import tqdm

    scale = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024)


def open_input(path: AnyPath) -> tuple[pa.NativeFile, pa.NativeFile]:
    """(stream to read, raw file whose tell() is the bytes consumed); .gz, .bz2,
    .zst and .lz4 files are decompressed on the fly. A remote file is read in
    large ranges (the CSV reader's blocks, or _REMOTE_READ bytes when compressed)."""
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    raw = pa.OSFile(str(path), "rb") if isinstance(path, Path) else path.open_input_file()
    codec = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}.get(path.suffix)
    if codec is None:
        return raw, raw
    source = raw if isinstance(path, Path) else pa.BufferedInputStream(raw, _REMOTE_READ)
    return pa.CompressedInputStream(source, codec), raw


class InvalidRows:
    """An ``invalid_row_handler`` that keeps the first bad row and errors."""

    def __init__(self) -> None:
        self.first: pacsv.InvalidRow | None = None

    def __call__(self, row: pacsv.InvalidRow) -> str:
        if self.first is None:
            self.first = row
        return "error"


def iter_csv(
    path: AnyPath,
    read_options: pacsv.ReadOptions,
    parse_options: pacsv.ParseOptions,
    convert_options: pacsv.ConvertOptions,
    on_batch: Callable[[int], None] | None = None,
    names: list[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Record batches of a delimited text file, streamed. Arrow errors become
    ValueErrors naming the file, and the line of a row with a wrong number of
    fields or the column (from names, the file's columns) of a bad value.
    on_batch(bytes_read) is called after each batch."""
    invalid = InvalidRows()
    parse_options.invalid_row_handler = invalid  # the options are the caller's, made per call
    stream, raw = open_input(path)
    reader = None
    try:
        try:
            reader = pacsv.open_csv(
                stream,
                read_options=read_options,
                parse_options=parse_options,
                convert_options=convert_options,
            )
            for batch in reader:
                if on_batch is not None:
                    on_batch(raw.tell())
                yield batch
        except (pa.ArrowInvalid, pa.ArrowKeyError) as error:
            raise _csv_error(path, error, invalid.first, parse_options, names) from None
    finally:
        # Closed now, not at garbage collection: an Arrow reader whose
        # read-ahead thread outlives the interpreter aborts the process.
        if reader is not None:
            reader.close()
        stream.close()
        raw.close()


def _csv_error(
    path: AnyPath,
    error: Exception,
    row: pacsv.InvalidRow | None,
    parse_options: pacsv.ParseOptions,
    names: list[str] | None,
) -> ValueError:
    if row is None:
        message = str(error).removeprefix("CSV parse error: ")
        column = _COLUMN_NUMBER.match(message)
        if column and names and int(column[1]) < len(names):
            message = f"column {names[int(column[1])]!r}: {message[column.end() :]}"
        return ValueError(f"{path}: {message}")
    line = row.number
    if line is None:  # parsed in parallel: find the line ourselves
        line = _find_line(path, row.text)
    where = f"line {line}" if line is not None else "a line"
    text = row.text if len(row.text) <= 200 else row.text[:200] + "…"
    return ValueError(
        f"{path}: {where} has {row.actual_columns} fields, expected {row.expected_columns} "
        f"(delimiter {parse_options.delimiter!r}): {text!r}"
    )


def _find_line(path: AnyPath, text: str) -> int | None:
    """The number (from 1) of the first line of path equal to text, if any."""
    stream, raw = open_input(path)
    target = text.encode()
    lines_before = 0  # in the data dropped from buf
    buf = b""
    try:
        while True:
            block = stream.read(1 << 24)
            buf += block if block else b"\n"  # at the end, the last line is complete too
            whole = buf.rfind(b"\n") + 1  # buf[:whole]: complete lines
            i = buf.find(target, 0, whole)
            while i >= 0:
                end = i + len(target)
                ends = buf.startswith(b"\n", end) or buf.startswith(b"\r\n", end)
                if ends and (i == 0 or buf[i - 1] == 10):  # 10: "\n"
                    return lines_before + buf.count(b"\n", 0, i) + 1
                i = buf.find(target, i + 1, whole)
            if not block:
                return None
            lines_before += buf.count(b"\n", 0, whole)
            buf = buf[whole:]
    finally:
        stream.close()
        raw.close()


def byte_progress(bar: Any) -> Callable[[int], None]:
    """The iter_csv callback that moves a bytes progress bar (or does nothing)."""

    def on_batch(bytes_read: int) -> None:
        if bar is not None:
            bar.update(bytes_read - bar.n)

    return on_batch


def write_converted(
    batches: Iterable[pa.RecordBatch],
    convert: Callable[[pa.RecordBatch, int], pa.RecordBatch],
    writer: PartWriter,
    bar: Any,
) -> list[Path | str]:
    """Writes convert(batch, rows before it) of every batch; returns the files.
    Closes the progress bar whatever happens."""
    done = 0
    try:
        for batch in batches:
            writer.add(convert(batch, done))
            done += batch.num_rows
        return writer.close()
    finally:
        if bar is not None:
            bar.close()
