"""A served model larger than the replica's memory: ``ModelStore(disk_dir=,
memory_gb=)`` keeps the rows beyond the budget in the engine's row files
and reads them on the request's thread. Its lookups and prediction rows
equal a store holding everything in RAM, across a full version, deltas
that change, add and remove rows, and a new full version, in fp32, fp16
and int8."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from test_serving_device_cache import PROBE, Versions, keys_of, saved_model

from wuliang.serving.store import ModelStore

BUDGET_GB = 4e-6  # 4 KB: nearly every row on disk


def store(root: Path, precision: str, disk: Path | None = None) -> ModelStore:
    tier = {} if disk is None else {"disk_dir": disk, "memory_gb": BUDGET_GB}
    return ModelStore(root, "m", poll_secs=0, load_towers=False, precision=precision, **tier)


def assert_same(tiered: ModelStore, plain: ModelStore, version: int) -> None:
    for table in ("t", "u"):
        for keys in (PROBE, PROBE[::-1].astype(np.int64), PROBE[:7], np.zeros(0, np.uint64)):
            want, got = plain.lookup(table, keys), tiered.lookup(table, keys)
            assert got.version == want.version == version
            np.testing.assert_array_equal(got.rows, want.rows)
            want, got = plain.predict_rows(table, keys), tiered.predict_rows(table, keys)
            np.testing.assert_array_equal(got.found, want.found)
            np.testing.assert_array_equal(got.rows, want.rows)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_a_model_beyond_the_budget_serves_what_one_in_ram_serves(
    tmp_path: Path, precision: str
) -> None:
    versions = Versions(tmp_path / "m")
    versions.write(True, keys_of((1, 201)), u_keys=keys_of((1, 21)))
    disk = tmp_path / "disk"
    with store(versions.root, precision, disk) as tiered, store(versions.root, precision) as plain:
        assert_same(tiered, plain, 1)
        stats = tiered.ps.stats("t")
        assert stats["cold_rows"] > 100 and stats["cold_reads"] > 0, stats  # most on disk
        assert any(disk.rglob("*.rows"))
        steps = [
            (keys_of((1, 60), (250, 270)), keys_of((150, 152))),
            (keys_of((100, 140), (270, 300)), keys_of((10, 12), (275, 276))),
            (np.zeros(0, np.uint64), keys_of((30, 40))),
        ]
        for t_keys, t_removed in steps:
            v = versions.write(False, t_keys, t_removed, keys_of((5, 10)), keys_of((15, 17)))
            assert tiered.refresh() == plain.refresh() == [v]
            assert_same(tiered, plain, v)
        v = versions.write(True, keys_of((100, 390)), u_keys=keys_of((1, 10)))
        assert tiered.refresh() == plain.refresh() == [v]
        assert_same(tiered, plain, v)
        assert tiered.ps.stats("t")["cold_rows"] > 200
    assert not any(disk.rglob("*.rows"))  # the row files go with the store


def test_a_budget_needs_a_disk_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs disk_dir"):
        ModelStore(tmp_path, "m", memory_gb=1.0)


def test_wuliang_serve_with_a_disk_tier(tmp_path: Path) -> None:
    """``wuliang serve --disk-dir D --memory-gb G``: lookups through the
    client read rows on disk as the trainer wrote them, and a delta is
    served; the row files go with the server."""
    from serve_cli import running

    from wuliang.serving.client import Client

    versions = Versions(tmp_path / "m", seed=5, tower=saved_model(tmp_path / "tower"))
    versions.write(True, keys_of((1, 201)), u_keys=keys_of((1, 21)))
    disk = tmp_path / "disk"
    args = ["--exports", str(versions.root), "--model", "m", "--disk-dir", str(disk)]
    with running(tmp_path, *args, "--memory-gb", str(BUDGET_GB), "--poll-secs", "0.1") as server:
        client = Client(f"127.0.0.1:{server.grpc}")
        try:
            keys = keys_of((1, 201))
            deadline = time.monotonic() + 60
            while not loaded(client):
                assert time.monotonic() < deadline, server.log.read_text()[-3000:]
                time.sleep(0.05)
            got = client.lookup("t", keys)
            assert got.version == 1 and got.found.all()
            want = np.stack([versions.tables["t"][int(k)][0] for k in keys])
            np.testing.assert_array_equal(got.rows, want)
            assert any(disk.rglob("*.rows"))
            v = versions.write(False, keys_of((1, 20)), keys_of((20, 30)))
            deadline = time.monotonic() + 60
            while client.lookup("t", keys[:1]).version != v:
                assert time.monotonic() < deadline, server.log.read_text()[-3000:]
                time.sleep(0.05)
            got = client.lookup("t", keys_of((1, 40)))
            np.testing.assert_array_equal(got.found, [True] * 19 + [False] * 10 + [True] * 10)
            want = np.stack([versions.tables["t"][int(k)][0] for k in keys_of((1, 20), (30, 40))])
            np.testing.assert_array_equal(got.rows[got.found], want)
        finally:
            client.close()
    assert not any(disk.rglob("*.rows"))


def loaded(client: object) -> bool:
    """Whether the server answers lookups (it loads the model after binding)."""
    from wuliang.serving.client import ServingClientError

    try:
        client.lookup("t", keys_of((1, 2)))  # type: ignore[attr-defined]
    except ServingClientError as error:
        if error.code != "UNAVAILABLE":
            raise
        return False
    return True


def test_wuliang_serve_refuses_a_budget_without_a_disk(tmp_path: Path) -> None:
    from serve_cli import serve_fails

    for args, named in (
        (["--exports", str(tmp_path), "--memory-gb", "1"], "goes with --disk-dir"),
        (["--exports", str(tmp_path), "--disk-dir", str(tmp_path), "--memory-gb", "0"],
         "--memory-gb must be > 0"),
        (["--redis", "redis://127.0.0.1:1/0", "--model", "m", "--disk-dir", str(tmp_path)],
         "with --redis the rows stay in Redis"),
    ):  # fmt: skip
        done = serve_fails(*args)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert named in done.stderr.strip().splitlines()[-1], done.stderr
