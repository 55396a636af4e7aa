"""``wire.Encoded`` writes what protobuf writes: a message built from small
fields and appended arrays parses to the message protobuf itself builds,
with repeated entries (empty ones too) in order."""

from __future__ import annotations

import numpy as np
import pytest

from wuliang.ps_server.remote.proto import M
from wuliang.ps_server.remote.wire import Encoded


def test_an_encoded_push_parses_as_the_protobuf_message() -> None:
    keys = np.arange(5, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    grads = np.linspace(-1, 1, 5 * 3, dtype=np.float32).reshape(5, 3)
    offsets = np.array([0, 2, 5], np.int64)
    request = Encoded(M["PushRequest"], unique=True, only="updated", client="c1")
    for table in ("a", "b"):
        part = Encoded(M["PushPart"], table=table)
        part.add_array("keys", keys).add_array("grads", grads)
        part.add_array("shard_offsets", offsets)
        request.add_message("parts", part)
    request.add_fields(seq=7, has_step=True, step=2**40)
    got = M["DataRequest"].FromString(Encoded(M["DataRequest"]).add_message("push", request).join())

    want = M["PushRequest"](unique=True, only="updated", client="c1", seq=7, has_step=True)
    want.step = 2**40
    for table in ("a", "b"):
        want.parts.add(
            table=table,
            keys=keys.tobytes(),
            grads=grads.tobytes(),
            shard_offsets=offsets.tobytes(),
        )
    assert got == M["DataRequest"](push=want)


def test_repeated_arrays_keep_their_order_and_empty_entries() -> None:
    rows = [np.ones((2, 4), np.float32), np.zeros((0, 4), np.float32), np.full((1, 4), 3, "f4")]
    inner = Encoded(M["PullResponse"])
    for r in rows:
        inner.add_array("rows", r)
    got = M["DataResponse"].FromString(Encoded(M["DataResponse"]).add_message("pull", inner).join())
    assert got.WhichOneof("answer") == "pull"
    assert list(got.pull.rows) == [r.tobytes() for r in rows]
    empty = M["DataResponse"].FromString(
        Encoded(M["DataResponse"]).add_message("pull", Encoded(M["PullResponse"])).join()
    )
    assert empty.WhichOneof("answer") == "pull" and len(empty.pull.rows) == 0


def test_a_strided_array_is_refused() -> None:
    with pytest.raises(ValueError, match="keys: an array on the wire must be C-contiguous"):
        Encoded(M["PullPart"]).add_array("keys", np.arange(10, dtype=np.uint64)[::2])
