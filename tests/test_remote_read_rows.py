"""``ReadRows`` over gRPC with a small message limit: a server answers in
several messages, each under its limit, a client splits its keys into
several requests, and the rows still come back whole, in the order of the
keys, as the embedded engine reads them (the conformance suite checks the
rest of ``read_rows`` on every implementation)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from wuliang.ps_server import Adam, Engine, RowChunk, TableSpec
from wuliang.ps_server.remote import proto
from wuliang.ps_server.remote.client import RemoteServer
from wuliang.ps_server.remote.server import PsServer

M = proto.M
SPEC = TableSpec("wide", dim=64, optimizer=Adam(0.01), stats_half_life=8.0)  # 553 B a row
LIMIT_MB = 1


@pytest.fixture
def servers() -> Iterator[list[PsServer]]:
    running = [
        PsServer(Engine(2), "127.0.0.1", 0, threads=4, max_message_mb=LIMIT_MB) for _ in range(2)
    ]
    yield running
    for server in running:
        server.stop(grace=None)


def test_large_reads_are_split_under_the_message_limit(servers: list[PsServer]) -> None:
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 2**63, 20_000).astype(np.uint64)
    with RemoteServer(
        [f"127.0.0.1:{s.port}" for s in servers], timeout=30.0, max_message_mb=LIMIT_MB
    ) as remote:
        remote.create_table(SPEC)
        remote.pull("wide", keys, step=1)
        grads = rng.standard_normal((len(keys), 64)).astype(np.float32)
        remote.push("wide", keys, grads, step=2, shows=np.ones(len(keys), np.float32))
        remote._batches = lambda sizes, widths: [  # type: ignore[method-assign]
            [(0, start, min(start + 3000, sizes[0]))] for start in range(0, max(sizes[0], 1), 3000)
        ]  # requests of at most 3000 keys
        asked = np.concatenate([rng.permutation(keys), np.array([5, 6], np.uint64), keys[:10]])
        rows, found = remote.read_rows("wide", asked)
        assert found.tolist() == [True] * len(keys) + [False, False] + [True] * 10
        want_rows = RowChunk(
            **{
                name: np.concatenate([getattr(c, name) for c in remote.export("wide")])
                for name in RowChunk.__dataclass_fields__
            }
        )
        order = np.argsort(want_rows.keys)
        at = order[np.searchsorted(want_rows.keys[order], asked[found])]
        for name in RowChunk.__dataclass_fields__:
            np.testing.assert_array_equal(
                getattr(rows, name), getattr(want_rows, name)[at], err_msg=name
            )
    # One server's answer to 10,000 keys comes in messages under the limit.
    with grpc.insecure_channel(f"127.0.0.1:{servers[0].port}") as channel:
        read = channel.unary_stream(proto.method_path("ReadRows"))
        request = M["KeysRequest"](table="wide", keys=keys[:10_000].tobytes()).SerializeToString()
        answers = list(read(request, timeout=30.0))
    sizes = [len(a) for a in answers]
    assert len(answers) > 2 and max(sizes) <= LIMIT_MB << 20, sizes
    masks = [np.frombuffer(M["ReadRowsResponse"].FromString(a).found, np.uint8) for a in answers]
    assert sum(len(m) for m in masks) == 10_000
