"""ParquetReader positions: a reader started at a batch's position yields
exactly the batches that followed it, seeking without shuffling and replaying
with it, across row groups, files and epochs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wuliang.reader import ParquetReader, ReaderPosition

ROWS = [70, 33, 58]  # per file; row groups of 16 rows


def write_files(folder: Path) -> list[str]:
    paths, first = [], 0
    for i, n in enumerate(ROWS):
        ids = np.arange(first, first + n, dtype=np.int64)
        table = pa.table({"id": ids, "tags": [[int(x), int(x) + 1] for x in ids]})
        path = folder / f"part-{i}.parquet"
        pq.write_table(table, path, row_group_size=16)
        paths.append(str(path))
        first += n
    return paths


def ids_of(reader: ParquetReader) -> list[tuple[list[int], ReaderPosition]]:
    return [(b.sparse["id"].values.tolist(), b.position) for b in reader]


@pytest.mark.parametrize("shuffle", [0, 40])
@pytest.mark.parametrize("batch_size", [7, 16, 50])
def test_resume_from_every_position(tmp_path: Path, shuffle: int, batch_size: int) -> None:
    files = write_files(tmp_path)

    def reader(start: ReaderPosition | None = None) -> ParquetReader:
        return ParquetReader(
            files,
            batch_size,
            ["id", "tags"],
            shuffle_buffer=shuffle,
            seed=3,
            epochs=2,
            num_threads=2,
            start=start,
        )

    full = ids_of(reader())
    assert sum(len(ids) for ids, _ in full) == 2 * sum(ROWS)
    assert [p.batches for _, p in full] == list(range(1, len(full) + 1))
    for k, (_, position) in enumerate(full):
        resumed = ids_of(reader(position))
        assert [ids for ids, _ in resumed] == [ids for ids, _ in full[k + 1 :]], k
        assert [p for _, p in resumed] == [p for _, p in full[k + 1 :]]
        # the position survives a JSON round trip (checkpoints store dicts)
        assert ReaderPosition.from_dict(position.to_dict()) == position


def test_positions_name_file_and_row(tmp_path: Path) -> None:
    files = write_files(tmp_path)
    got = ids_of(ParquetReader(files, 50, ["id"], epochs=1))
    # 50 | 20 of file 0 + 30 of file 1 | 3 of file 1 + 47 of file 2 | 11 of file 2
    assert [(p.unit, Path(p.file).name, p.row) for _, p in got] == [
        (0, "part-0.parquet", 50),
        (1, "part-1.parquet", 30),
        (2, "part-2.parquet", 47),
        (2, "part-2.parquet", 58),
    ]


def test_position_of_other_files_is_refused(tmp_path: Path) -> None:
    files = write_files(tmp_path)
    position = ReaderPosition(batches=2, unit=1, file=str(tmp_path / "other.parquet"), row=3)
    with pytest.raises(ValueError, match=r"other\.parquet"):
        ParquetReader(files, 10, ["id"], start=position)
    with pytest.raises(ValueError, match="not a reader position"):
        ParquetReader(files, 10, ["id"], start={"unit": 1})
