#!/usr/bin/env bash
# The GPU hot cache on a machine with a GPU, offline: builds and installs
# wuliang (no network, no build isolation, no dependencies fetched), runs the
# tests marked needs_gpu (the device index's kernels and the training
# cache's cupy kernels against the engine built here, bit for bit; serving's
# device cache against the store without it), serving's device cache
# benchmark, then benchmarks/gpu_cache_bench.py (device-resident rates,
# hit rates, an embedding step with and without the cache on 1 and 26
# tables); that benchmark's JSON is the last line, with the issue's keys
# device_hit_path_rows_per_s, step_cache_vs_host and step_vs_miss_bound.
#
#   bash benchmarks/gpu_check.sh                 # from anywhere in the checkout
#   GPU_CHECK_BENCH_ARGS="--batches 500 --warmup 500" bash benchmarks/gpu_check.sh
#
# Needs python3 (PYTHON=...) with cupy, numpy, pyarrow, pybind11,
# scikit-build-core, cmake, ninja and pytest, and a C++20 compiler; no
# TensorFlow. wuliang goes into $WULIANG_SITE (default /tmp/wuliang-gpu-site),
# not into the Python environment. About 4-5 minutes on 16 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${WULIANG_SITE:-/tmp/wuliang-gpu-site}
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---quick}
export PYTHONUNBUFFERED=1
started=$(date +%s)
say() { echo "gpu_check [$(($(date +%s) - started)) s]: $*" >&2; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 ||
  say "nvidia-smi not found"
"$PYTHON" - >&2 <<'EOF'
import sys
import cupy
count = cupy.cuda.runtime.getDeviceCount()
print(f"python {sys.version.split()[0]}, cupy {cupy.__version__}, {count} GPU(s)")
if count < 1:
    sys.exit("gpu_check: cupy sees no GPU")
EOF

say "building and installing wuliang into $SITE"
rm -rf "$SITE"
"$PYTHON" -m pip install --quiet --no-build-isolation --no-deps --no-index --no-cache-dir \
  --target "$SITE" . >&2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import wuliang.ps_server as p, sys; print('wuliang from', p.__file__)" >&2

say "tests marked needs_gpu"
# --noconftest: tests/conftest.py imports redis for other suites; these tests
# need none of its fixtures (needs_gpu is registered in pyproject.toml).
"$PYTHON" -m pytest -q -p no:cacheprovider --noconftest -m needs_gpu \
  tests/test_gpu_cache.py tests/test_serving_device_cache.py >&2

say "benchmark: benchmarks/serving_cache_bench.py --quick --xp cupy"
"$PYTHON" benchmarks/serving_cache_bench.py --quick --xp cupy >&2

say "benchmark: benchmarks/gpu_cache_bench.py --xp cupy $BENCH_ARGS"
# shellcheck disable=SC2086
"$PYTHON" benchmarks/gpu_cache_bench.py --xp cupy $BENCH_ARGS
