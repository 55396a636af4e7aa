"""StreamReader: a partitioned dataset's batches, partition after partition,
oldest first; a position after every batch that resumes exactly after it
(no row read twice, none skipped), across partitions landing meanwhile;
trainers splitting each partition's files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wuliang.reader import PartitionSource, StreamPosition, StreamReader

FILES = {"dt=2026-11-27": [40, 25], "dt=2026-11-28": [33], "dt=2026-11-29": [18, 50, 7]}


def write_partition(root: Path, name: str, sizes: list[int], first: int) -> int:
    """Files of ``sizes`` rows (ids from ``first``) and the marker; the next id."""
    folder = root / name
    folder.mkdir(parents=True)
    for i, n in enumerate(sizes):
        ids = np.arange(first, first + n, dtype=np.int64)
        table = pa.table({"id": ids, "label": (ids % 2).astype(np.float32)})
        pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=16)
        first += n
    (folder / "_SUCCESS").write_bytes(b"")
    return first


def write_all(root: Path, names: list[str] | None = None) -> dict[str, set[int]]:
    """The partitions (all, or ``names``); each one's ids."""
    ids: dict[str, set[int]] = {}
    first = 0
    for name, sizes in FILES.items():
        if names is None or name in names:
            end = write_partition(root, name, sizes, first)
            ids[name] = set(range(first, end))
        first += sum(sizes)
    return ids


def stream(root: Path, start: object = None, **kwargs: object) -> StreamReader:
    return StreamReader(
        PartitionSource(root), 16, ["id"], "label", timeout=0, start=start, **kwargs
    )


def read(reader: StreamReader) -> list[tuple[str, list[int], StreamPosition]]:
    return [(b.partition.name, b.sparse["id"].values.tolist(), b.position) for b in reader]


def test_partitions_are_read_one_after_another_oldest_first(tmp_path: Path) -> None:
    ids = write_all(tmp_path)
    got = read(stream(tmp_path))
    by_partition: dict[str, list[int]] = {}
    for name, batch_ids, _ in got:
        by_partition.setdefault(name, []).extend(batch_ids)
    assert list(by_partition) == list(FILES)  # in time order, never mixed in a batch
    assert {k: set(v) for k, v in by_partition.items()} == ids
    assert all(len(v) == len(set(v)) for v in by_partition.values())
    last = got[-1][2]
    assert last.partition is None and last.partitions["done"] == sorted(FILES)


def test_every_position_resumes_exactly_after_its_batch(tmp_path: Path) -> None:
    write_all(tmp_path)
    full = read(stream(tmp_path))
    for k, (_, _, position) in enumerate(full):
        saved = json.loads(json.dumps(position.to_dict()))  # as a checkpoint keeps it
        resumed = read(stream(tmp_path, start=saved))
        assert [(n, i) for n, i, _ in resumed] == [(n, i) for n, i, _ in full[k + 1 :]], k


def test_a_partition_landing_later_is_read_after_a_restart(tmp_path: Path) -> None:
    ids = write_all(tmp_path, ["dt=2026-11-27"])
    first = read(stream(tmp_path))
    rows = Counter(i for _, batch, _ in first for i in batch)
    # the trainer stops mid-way through the next partition, which lands meanwhile
    write_partition(tmp_path, "dt=2026-11-28", FILES["dt=2026-11-28"], 65)
    ids["dt=2026-11-28"] = set(range(65, 98))
    second = read(stream(tmp_path, start=first[-1][2]))
    rows.update(i for _, batch, _ in second[:1] for i in batch)
    third = read(stream(tmp_path, start=second[0][2]))
    rows.update(i for _, batch, _ in third for i in batch)
    assert set(rows) == ids["dt=2026-11-27"] | ids["dt=2026-11-28"]
    assert max(rows.values()) == 1  # none twice


def test_trainers_split_each_partition(tmp_path: Path) -> None:
    ids = write_all(tmp_path)
    seen: Counter[int] = Counter()
    for index in range(2):
        for _, batch, _ in read(stream(tmp_path, worker_index=index, num_workers=2)):
            seen.update(batch)
    assert set(seen) == set().union(*ids.values()) and max(seen.values()) == 1


def test_a_vanished_partition_is_named(tmp_path: Path) -> None:
    write_all(tmp_path)
    position = read(stream(tmp_path))[0][2]
    (tmp_path / "dt=2026-11-27" / "_SUCCESS").unlink()
    with pytest.raises(ValueError, match="inside partition 'dt=2026-11-27'"):
        read(stream(tmp_path, start=position))
    with pytest.raises(ValueError, match="no epochs="):
        StreamReader(PartitionSource(tmp_path), 16, epochs=2)


def test_a_session_resumes_a_stream_from_its_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    """Training stopped at a checkpoint mid-partition and resumed gives the
    losses of a run never stopped: every row trained once, in order."""
    import shutil

    from small_model import BATCH, Losses, make_session, write_data

    import wuliang as wl

    data = tmp_path / "data"
    for k, path in enumerate(write_data(tmp_path)):  # two files, a partition each
        folder = data / f"dt=2026-11-2{k}"
        folder.mkdir(parents=True)
        shutil.copy(path, folder / "part-0.parquet")
        (folder / "_SUCCESS").write_bytes(b"")

    def train(steps: int | None, hooks: list) -> list[float]:
        losses = Losses()
        session = make_session()
        reader = StreamReader(PartitionSource(data), BATCH, label="label", timeout=0)
        try:
            session.train(reader, steps=steps, hooks=[*hooks, losses])
        finally:
            session.close()
            session.context.close()
        return losses.values

    whole = train(None, [])
    assert len(whole) == 2 * -(-700 // BATCH)  # each partition's rows, once
    model_dir = tmp_path / "model"
    first = train(7, [wl.hooks.Checkpoint(model_dir, every_steps=1000)])  # mid-partition
    second = train(None, [wl.hooks.Checkpoint(model_dir, every_steps=1000)])
    assert first + second == whole
