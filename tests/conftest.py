"""Shared fixtures of the engine tests: seeding, engines and export helpers;
the session's safety net for child processes (``processes.py``)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import numpy as np
import processes
import pytest
import redis

from wuliang.ps_server import Engine, RowChunk
from wuliang.ps_server.chunk import concat_rows, take_rows

SEED = 20240611

ExportAll = Callable[..., RowChunk]
MakeEngine = Callable[[int], Engine]


def pytest_configure(config: pytest.Config) -> None:
    """Child processes a test leaves running are stopped at the session's end
    (``processes.pytest_sessionfinish``, and at exit)."""
    if not config.pluginmanager.is_registered(processes):
        config.pluginmanager.register(processes, "wuliang-child-processes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``needs_gpu`` are skipped where cupy finds no GPU."""
    gpu_tests = [item for item in items if item.get_closest_marker("needs_gpu")]
    if not gpu_tests:
        return
    from wuliang.ps_server.cache import gpu_available

    if not gpu_available():
        skip = pytest.mark.skip(reason="needs cupy and a GPU")
        for item in gpu_tests:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Legacy global generators are seeded too, in case anything uses them."""
    random.seed(SEED)
    np.random.seed(SEED)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


@pytest.fixture
def make_engine() -> Iterator[MakeEngine]:
    """Creates engines (by shard count) and closes them after the test."""
    engines: list[Engine] = []

    def make(num_shards: int = 2) -> Engine:
        engine = Engine(num_shards=num_shards)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def concat_chunks(chunks: list[RowChunk], dim: int, state_dim: int) -> RowChunk:
    """One RowChunk of all chunks, sorted by key."""
    rows = concat_rows(chunks, dim, state_dim)
    return take_rows(rows, np.argsort(rows.keys, kind="stable"))


@pytest.fixture
def export_all() -> ExportAll:
    """export_all(engine, table, since=0, chunk_rows=...) -> one RowChunk sorted by key."""

    def run(engine: Engine, table: str, since: int = 0, chunk_rows: int = 65536) -> RowChunk:
        spec = engine.spec(table)
        chunks = list(engine.export(table, since=since, chunk_rows=chunk_rows))
        for chunk in chunks:
            assert 0 < len(chunk) <= chunk_rows
        return concat_chunks(chunks, spec.dim, spec.state_dim)

    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of our own on a free loopback port, no persistence."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    log = tmp_path_factory.mktemp("redis") / "redis.log"
    for _ in range(3):  # the free port may be taken between the probe and the start
        port = free_port()
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with open(log, "w") as out:
            proc = subprocess.Popen([server, *args], stdout=out, stderr=subprocess.STDOUT)
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            proc.kill()
            proc.wait(timeout=10)
            continue
        client.close()
        try:
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return
    pytest.fail(f"redis-server did not start: {log.read_text()[-2000:]}")
