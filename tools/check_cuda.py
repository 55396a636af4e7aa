"""Compiles the GPU cache's CUDA sources with nvcc, without a GPU: the
optimizer and statistics kernels (``wuliang.ps_server.cache.kernels``) and
the index kernels (``ps_server/csrc/details/cache_index.h``), as cupy would
compile them at run time. Catches what a machine with a GPU would only find
at its first cached step.

    python tools/check_cuda.py            # needs nvcc on PATH
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("check_cuda: nvcc not found", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    source = (ROOT / "ps_server/cache/kernels.py").read_text()
    start = source.index('_CUDA_SOURCE = r"""') + len('_CUDA_SOURCE = r"""')
    kernels = source[start : source.index('"""', start)]
    index = (ROOT / "ps_server/csrc/details/cache_index.h").read_text()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, code, options in (
            ("kernels", kernels, ["--fmad=false"]),
            ("index", index, []),
        ):
            path = Path(tmp) / f"{name}.cu"
            path.write_text(code)
            done = subprocess.run(
                [nvcc, "-arch=sm_90", "-c", str(path), "-o", str(path.with_suffix(".o")),
                 *options],
                capture_output=True, text=True,
            )  # fmt: skip
            print(f"{name}: {'ok' if done.returncode == 0 else 'FAILED'}")
            if done.returncode:
                print(done.stderr, file=sys.stderr)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
