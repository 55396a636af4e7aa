"""serving/grpc/proto.py holds the compiled descriptor of serving/grpc/serving.proto."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from repo_data import REPO

from wuliang.serving.grpc import proto


def test_the_descriptor_is_serving_proto_compiled() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from regen_proto import compiled_descriptor
    finally:
        sys.path.remove(str(REPO / "tools"))
    source = REPO / "serving" / "grpc" / "serving.proto"
    assert compiled_descriptor(source) == proto.descriptor_bytes(), (
        "serving.proto changed: run `make protos`"
    )


def test_messages_round_trip_raw_bytes() -> None:
    request = proto.LookupRequest(model="m", table="t", keys=b"\x01" * 16)
    again = proto.LookupRequest.FromString(request.SerializeToString())
    assert (again.model, again.table, again.keys) == ("m", "t", b"\x01" * 16)
    assert proto.method_path("Lookup") == "/wuliang.serving.Serving/Lookup"


@pytest.mark.parametrize(
    ("n", "dim", "version"),
    [(3, 4, 7), (1000, 16, 2**40 + 3), (0, 16, 1), (5, 8, 0), (200, 1, 127), (1, 300, 128)],
)
def test_lookup_response_bytes_equal_the_message_s(n: int, dim: int, version: int) -> None:
    """The handler's hand-written LookupResponse is what protobuf writes."""
    rng = np.random.default_rng(n + dim)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    found = rng.random(n) < 0.5
    wire = proto.lookup_response(rows, found, version)
    message = proto.LookupResponse(
        vectors=rows.tobytes(), found=found.view(np.uint8).tobytes(), dim=dim, version=version
    )
    assert wire == message.SerializeToString()
    parsed = proto.LookupResponse.FromString(wire)
    np.testing.assert_array_equal(np.frombuffer(parsed.vectors, "<f4").reshape(n, dim), rows)
    assert (parsed.dim, parsed.version) == (dim, version)
