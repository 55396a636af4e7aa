"""Versions applied atomically for concurrent readers.

Reader threads look keys up while full and delta versions are applied. Every
row of version v carries v's signature (weights[0] = the version that last
wrote it, the rest a function of key and that version), exact in every
storage precision (``TableSpec.precision``), and the state after
each version is known: a reader's answer for a table must equal exactly the
state after one version (never a mix of two, never a torn row, never an
empty table).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from row_chunks import version_rows

from wuliang.ps_server import (
    SGD,
    Engine,
    ParameterServer,
    RowChunk,
    TableSpec,
    TableUpdate,
    Zeros,
)

DIM = 8
KEYS = np.arange(1, 4001, dtype=np.uint64)


def signed(keys: np.ndarray, version: int) -> np.ndarray:
    """Rows of version ``version``: [v, 127, f(key, v), ...], integers in
    [0, 127] led by the largest: float32, fp16 and int8 (scale 1) all store
    them exactly."""
    rows = np.empty((len(keys), DIM), np.float32)
    rows[:, 0] = version
    rows[:, 1] = 127
    for j in range(2, DIM):
        rows[:, j] = ((keys.astype(np.float64) * (j + 3) + version * 7) % 127).astype(np.float32)
    return rows


def chunk(keys: np.ndarray, version: int) -> RowChunk:
    return version_rows(keys, signed(keys, version), version)


SPEC = TableSpec("t", DIM, optimizer=SGD(), initializer=Zeros())


def plan(
    versions: int, seed: int = 0, spec: TableSpec = SPEC
) -> list[tuple[TableUpdate, dict[int, np.ndarray]]]:
    """Updates to apply in turn (a full version every 5th, deltas between),
    each with the expected rows of every key that has one after it."""
    rng = np.random.default_rng(seed)
    state: dict[int, np.ndarray] = {}
    out = []
    for v in range(1, versions + 1):
        if v % 5 == 1:  # a full version: a random 90% of the keys
            keys = np.sort(rng.choice(KEYS, int(len(KEYS) * 0.9), replace=False))
            update = TableUpdate(spec, full=True, rows=[chunk(keys, v)])
            state = {}
        else:  # a delta: 10% rewritten, 1% removed
            changed = np.sort(rng.choice(KEYS, len(KEYS) // 10, replace=False))
            present = np.array(sorted(state), np.uint64)
            gone = np.sort(rng.choice(present, len(present) // 100, replace=False))
            gone = np.setdiff1d(gone, changed)
            update = TableUpdate(
                spec,
                full=False,
                rows=[
                    chunk(changed[: len(changed) // 2], v),
                    chunk(changed[len(changed) // 2 :], v),
                ],
                removed=gone,
            )
            keys = changed
            for key in gone:
                state.pop(int(key), None)
        for key, row in zip(keys, signed(keys, v), strict=True):
            state[int(key)] = row
        out.append((update, dict(state)))
    return out


def expected_rows(state: dict[int, np.ndarray], keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = np.zeros((len(keys), DIM), np.float32)
    found = np.zeros(len(keys), bool)
    for i, key in enumerate(keys):
        row = state.get(int(key))
        if row is not None:
            rows[i], found[i] = row, True
    return rows, found


@pytest.mark.parametrize(
    ("num_shards", "precision", "serving"),
    [
        (1, "fp32", False),
        (3, "fp32", False),
        (1, "fp32", True),
        (3, "fp32", True),
        (3, "fp16", True),
        (3, "int8", True),
    ],
)
def test_readers_see_each_table_wholly_at_one_version(
    num_shards: int, precision: str, serving: bool
) -> None:
    """Plain tables are read by the shard workers; serving tables on the
    readers' own threads; compressed ones decode."""
    steps = plan(25, spec=replace(SPEC, precision=precision, serving=serving))
    with Engine(num_shards) as ps:
        ps.apply_update({"t": steps[0][0]}, label=1)
        assert ps.spec("t").precision == precision
        states = [expected_rows(state, KEYS) for _, state in steps]
        applied = threading.Event()
        errors: list[str] = []
        seen: set[int] = set()
        reads = [0]

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not applied.is_set() and not errors:
                keys = KEYS if rng.random() < 0.3 else np.sort(rng.choice(KEYS, 500, replace=False))
                rows, found, label = ps.lookup("t", keys)
                # The version is the newest signature read; the whole answer
                # must be that version's state, and the label must name it.
                version = int(rows[found, 0].max()) if found.any() else 0
                if label != version:
                    errors.append(f"rows of version {version} labelled {label}")
                    return
                if version < 1:
                    errors.append("an empty table")
                    return
                index = np.searchsorted(KEYS, keys)
                want_rows, want_found = states[version - 1]
                if not np.array_equal(found, want_found[index]) or not np.array_equal(
                    rows, want_rows[index]
                ):
                    bad = np.flatnonzero(
                        (found != want_found[index]) | (rows != want_rows[index]).any(axis=1)
                    )
                    errors.append(f"not version {version}'s state at keys {keys[bad[:5]]}")
                    return
                seen.add(version)
                reads[0] += 1

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            for v, (update, _) in enumerate(steps[1:], start=2):
                ps.apply_update({"t": update}, label=v)
                time.sleep(0.005)
        finally:
            applied.set()
            for t in threads:
                t.join(timeout=60)
        assert not errors, errors[:3]
        assert reads[0] > 50 and len(seen) > 5, (reads[0], sorted(seen))
        rows, found, label = ps.lookup("t", KEYS)
        assert label == len(steps)
        want_rows, want_found = states[-1]
        np.testing.assert_array_equal(found, want_found)
        np.testing.assert_array_equal(rows, want_rows)


def test_a_delta_costs_memory_in_proportion_to_it() -> None:
    with Engine(2) as ps:
        big = np.arange(1, 200_001, dtype=np.uint64)
        ps.apply_update({"t": TableUpdate(SPEC, full=True, rows=[chunk(big, 1)])})
        before = ps.stats("t")["bytes"]
        small = big[:1000]
        ps.apply_update({"t": TableUpdate(SPEC, full=False, rows=[chunk(small, 2)])})
        assert ps.stats("t")["rows"] == 200_000
        assert ps.stats("t")["bytes"] == before  # merged in place, staging freed
        rows, found, _ = ps.lookup("t", small)
        assert found.all() and (rows[:, 0] == 2).all()


def test_a_failed_apply_changes_nothing() -> None:
    with Engine(2) as ps:
        ps.apply_update({"t": TableUpdate(SPEC, full=True, rows=[chunk(KEYS, 1)])})

        def broken() -> list[RowChunk]:
            yield chunk(KEYS[:10], 2)
            raise OSError("disk gone")

        other = TableSpec("u", DIM, optimizer=SGD(), initializer=Zeros())
        with pytest.raises(OSError, match="disk gone"):
            ps.apply_update(
                {
                    "u": TableUpdate(other, full=True, rows=[chunk(KEYS, 2)]),
                    "t": TableUpdate(SPEC, full=False, rows=broken()),
                }
            )
        rows, found, _ = ps.lookup("t", KEYS)
        assert found.all() and (rows[:, 0] == 1).all()
        assert "u" not in ps.tables()  # nothing of the failed version is visible


def test_writes_while_a_version_stages_land_before_it() -> None:
    with Engine(1) as ps:
        ps.apply_update({"t": TableUpdate(SPEC, full=True, rows=[chunk(KEYS, 1)])})
        release = threading.Event()

        def slow() -> list[RowChunk]:
            yield chunk(KEYS[:10], 2)
            release.wait(10)

        applying = threading.Thread(
            target=ps.apply_update, args=({"t": TableUpdate(SPEC, full=False, rows=slow())},)
        )
        applying.start()
        time.sleep(0.2)  # staging: the table is live and writable at version 1
        ps.push("t", KEYS[:5], np.ones((5, DIM), np.float32))
        release.set()
        applying.join()
        rows = ps.lookup("t", KEYS[:10]).rows
        assert (rows[:, 0] == 2).all()


def test_table_ids_survive_many_full_applies(ps_count: int = 300) -> None:
    ps: ParameterServer
    with Engine(2) as ps:
        for v in range(1, ps_count + 1):
            ps.apply_update({"t": TableUpdate(SPEC, full=True, rows=[chunk(KEYS[:100], v)])})
        rows, found, _ = ps.lookup("t", KEYS[:100])
        assert found.all() and (rows[:, 0] == ps_count).all()


def test_a_serving_table_changes_only_by_applies() -> None:
    spec = replace(SPEC, serving=True)
    with Engine(2) as ps:
        ps.apply_update({"t": TableUpdate(spec, full=True, rows=[chunk(KEYS, 1)])}, label=1)
        keys = KEYS[:5]
        for call in (
            lambda: ps.push("t", keys, np.ones((5, DIM), np.float32)),
            lambda: ps.pull("t", keys),  # a training pull creates rows
            lambda: ps.load("t", keys, np.ones((5, DIM), np.float32)),
            lambda: ps.erase("t", keys),
            lambda: ps.evict("t"),
        ):
            with pytest.raises(ValueError, match="'t' is a serving table"):
                call()
        rows, found, label = ps.lookup("t", np.concatenate([keys, [10**9]]).astype(np.uint64))
        assert label == 1 and found[:5].all() and not found[5]
        np.testing.assert_array_equal(rows[:5], signed(keys, 1))
        np.testing.assert_array_equal(ps.pull("t", keys, train=False), signed(keys, 1))
        assert ps.stats("t")["rows"] == len(KEYS)
