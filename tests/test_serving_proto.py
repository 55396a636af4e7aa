"""serving/proto.py holds the compiled descriptor of serving/serving.proto."""

from __future__ import annotations

import sys

from repo_data import REPO

from wuliang.serving import proto


def test_the_descriptor_is_serving_proto_compiled() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from regen_proto import compiled_descriptor
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert compiled_descriptor(REPO / "serving" / "serving.proto") == proto.descriptor_bytes(), (
        "serving.proto changed: run `make protos`"
    )


def test_messages_round_trip_raw_bytes() -> None:
    request = proto.LookupRequest(model="m", table="t", keys=b"\x01" * 16)
    again = proto.LookupRequest.FromString(request.SerializeToString())
    assert (again.model, again.table, again.keys) == ("m", "t", b"\x01" * 16)
    assert proto.method_path("Lookup") == "/wuliang.serving.Serving/Lookup"
