"""Rebuilds the descriptors kept in Python beside each ``.proto``:
serving/proto.py from serving/serving.proto, ps_server/remote/proto.py from
ps_server/remote/ps.proto.

Run as ``make protos`` after editing a .proto (needs grpcio-tools, a test
dependency).
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "serving" / "serving.proto"
# .proto -> (the module keeping its descriptor, the name it is compiled under)
PROTOS = {
    PROTO: (REPO / "serving" / "proto.py", "wuliang/serving/serving.proto"),
    REPO / "ps_server" / "remote" / "ps.proto": (
        REPO / "ps_server" / "remote" / "proto.py",
        "wuliang/ps_server/remote/ps.proto",
    ),
}


def compiled_descriptor(proto: Path = PROTO) -> bytes:
    """The serialized FileDescriptorProto of a .proto, named as it is imported
    (``wuliang/serving/serving.proto``), without source info."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = root / PROTOS[proto][1]
        target.parent.mkdir(parents=True)
        target.write_bytes(proto.read_bytes())
        out = root / "set.pb"
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"--descriptor_set_out={out}",
             str(target.relative_to(root))],
            check=True,
            cwd=root,
        )  # fmt: skip
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    file = files.file[0]
    file.ClearField("source_code_info")
    return file.SerializeToString(deterministic=True)


def main() -> None:
    for proto, (module, _) in PROTOS.items():
        encoded = base64.b64encode(compiled_descriptor(proto)).decode()
        lines = "\n".join(f'    "{line}"' for line in textwrap.wrap(encoded, 76))
        text = module.read_text()
        text = re.sub(
            r"_DESCRIPTOR = \(\n.*?\n\)", f"_DESCRIPTOR = (\n{lines}\n)", text, flags=re.S
        )
        module.write_text(text)
        print(f"updated {module.relative_to(REPO)}")


if __name__ == "__main__":
    main()
