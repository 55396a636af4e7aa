"""Rebuilds the descriptor in serving/proto.py from serving/serving.proto.

Run as ``make protos`` after editing serving.proto (needs grpcio-tools, a
test dependency).
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
MODULE = REPO / "serving" / "proto.py"


def compiled_descriptor(proto: Path = PROTO) -> bytes:
    """The serialized FileDescriptorProto of a .proto, named as it is imported
    (``wuliang/serving/serving.proto``), without source info."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = root / "wuliang" / "serving" / "serving.proto"
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
    encoded = base64.b64encode(compiled_descriptor()).decode()
    lines = "\n".join(f'    "{line}"' for line in textwrap.wrap(encoded, 76))
    text = MODULE.read_text()
    text = re.sub(r"_DESCRIPTOR = \(\n.*?\n\)", f"_DESCRIPTOR = (\n{lines}\n)", text, flags=re.S)
    MODULE.write_text(text)
    print(f"updated {MODULE.relative_to(REPO)}")


if __name__ == "__main__":
    main()
