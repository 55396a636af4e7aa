"""Writes deploy/constraints.txt: the exact versions the image installs.

The image (``Dockerfile``) builds wuliang's wheel in one stage and installs
it with the ``tf`` and ``serving`` extras in the next; both stages install
under this file (``PIP_CONSTRAINT``), so two builds of the same commit get
the same packages, and the image keeps the file (``/etc/wuliang``) to say
what it holds. It pins what pip resolves today for this interpreter (the
image's Python, 3.11) on Linux x86-64: the runtime's dependencies and the
build's (scikit-build-core, pybind11, CMake, ninja).

    make constraints        # after changing dependencies, then commit the file
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "deploy" / "constraints.txt"
BUILD = ["scikit-build-core", "pybind11", "cmake", "ninja"]


def resolve(*requirements: str) -> dict[str, str]:
    """{name: version} of everything pip would install for the requirements."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
        subprocess.run(
            [*pip, "--quiet", "--report", str(report), *requirements],
            check=True,
            cwd=REPO,
        )
        installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}


def main() -> None:
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"run with Python 3.11, the image's (this is {sys.version.split()[0]})")
    pins = resolve(".[tf,serving]") | resolve(*BUILD)
    pins.pop("wuliang", None)
    lines = [
        "# The versions the image installs (Dockerfile), for Python 3.11 on Linux x86-64.",
        "# Written by tools/pin_image.py (make constraints); do not edit by hand.",
        *(f"{name}=={version}" for name, version in sorted(pins.items())),
    ]
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(OUT)
    print(f"wrote {OUT.relative_to(REPO)}: {len(pins)} packages")


if __name__ == "__main__":
    main()
