"""Rebuilds the descriptors kept in Python beside each ``.proto``:
serving/grpc/proto.py from serving/grpc/serving.proto, ps_server/remote/proto.py from
ps_server/remote/ps.proto, serving/tfs/proto.py from serving/tfs/*.proto
(TensorFlow Serving's API, several files importing each other and
protobuf's own).

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
PROTO = REPO / "serving" / "grpc" / "serving.proto"
# .proto -> (the module keeping its descriptor, the name it is compiled under)
PROTOS = {
    PROTO: (REPO / "serving" / "grpc" / "proto.py", "wuliang/serving/grpc/serving.proto"),
    REPO / "ps_server" / "remote" / "ps.proto": (
        REPO / "ps_server" / "remote" / "proto.py",
        "wuliang/ps_server/remote/ps.proto",
    ),
}


# TensorFlow Serving's API: its files in the order they import each other
TFS = REPO / "serving" / "tfs"
TFS_MODULE = TFS / "proto.py"
TFS_FILES = ("error_codes", "tensorflow", "apis", "config")


def compiled_tfs_descriptors() -> dict[str, bytes]:
    """The serialized FileDescriptorProtos of serving/tfs/*.proto, by file
    stem, each named as it is imported (``wuliang/serving/tfs/apis.proto``),
    without source info."""
    import grpc_tools
    from google.protobuf import descriptor_pb2

    includes = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = root / "wuliang" / "serving" / "tfs"
        folder.mkdir(parents=True)
        names = []
        for stem in TFS_FILES:
            (folder / f"{stem}.proto").write_bytes((TFS / f"{stem}.proto").read_bytes())
            names.append(f"wuliang/serving/tfs/{stem}.proto")
        out = root / "set.pb"
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"-I{includes}",
             f"--descriptor_set_out={out}", *names],
            check=True,
            cwd=root,
        )  # fmt: skip
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    compiled = {}
    for file in files.file:
        file.ClearField("source_code_info")
        compiled[Path(file.name).stem] = file.SerializeToString(deterministic=True)
    return {stem: compiled[stem] for stem in TFS_FILES}


def _wrapped(encoded: str, indent: str = "    ") -> str:
    return "\n".join(f'{indent}"{line}"' for line in textwrap.wrap(encoded, 76))


def compiled_descriptor(proto: Path = PROTO) -> bytes:
    """The serialized FileDescriptorProto of a .proto, named as it is imported
    (``wuliang/serving/grpc/serving.proto``), without source info."""
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
        lines = _wrapped(encoded)
        text = module.read_text()
        text = re.sub(
            r"_DESCRIPTOR = \(\n.*?\n\)", f"_DESCRIPTOR = (\n{lines}\n)", text, flags=re.S
        )
        module.write_text(text)
        print(f"updated {module.relative_to(REPO)}")
    entries = "".join(
        f'    "{stem}": (\n{_wrapped(base64.b64encode(data).decode(), " " * 8)}\n    ),\n'
        for stem, data in compiled_tfs_descriptors().items()
    )
    text = TFS_MODULE.read_text()
    pattern = r"_DESCRIPTORS = \{\n.*?\n\}"
    text = re.sub(pattern, f"_DESCRIPTORS = {{\n{entries}}}", text, flags=re.S)
    TFS_MODULE.write_text(text)
    print(f"updated {TFS_MODULE.relative_to(REPO)}")


if __name__ == "__main__":
    main()
