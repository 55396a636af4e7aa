"""The disk tier's parts as Python sees them (``_engine``'s measuring
functions over ``details/row_file.h`` and ``details/cold_index.h``); their
C++ tests are ``ps_server/csrc/tests/disk_tier_test.cc``."""

from __future__ import annotations

from pathlib import Path

import pytest

from wuliang.ps_server import _engine


def test_row_files_read_back_at_depth(tmp_path: Path) -> None:
    rate, _direct, per_row = _engine.row_file_reads(
        str(tmp_path / "rows"), 168, 20_000, 4096, 8, 512
    )
    assert rate > 0
    assert 168 <= per_row <= 4096 / (4096 // 168) + 1  # 24 records a 4 KiB block
    assert not list((tmp_path / "rows").glob("*.rows"))  # deleted on close


def test_the_disk_probe_and_its_arguments(tmp_path: Path) -> None:
    rate, _direct = _engine.disk_random_reads(str(tmp_path), 4 << 20, 4096, 2, 0.05)
    assert rate > 0
    assert not list(tmp_path.iterdir())  # the probe file is deleted
    with pytest.raises(ValueError, match="multiple of 512"):
        _engine.disk_random_reads(str(tmp_path), 4 << 20, 100, 2, 0.05)
    with pytest.raises(ValueError, match="1 to 4096 bytes, got 5000"):
        _engine.row_file_reads(str(tmp_path / "r"), 5000, 10, 10, 2, 5)


def test_cold_index_ram_per_key() -> None:
    assert _engine.cold_index_bytes_per_key(200_000) <= 24
