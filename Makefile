# The two commands a new user runs:
#   make demo   set up .venv, build and install wuliang, run the demo
#   make test   set up .venv, build and install, run lint and every test
# Needs only Python >= 3.10 and a C++20 compiler; CMake, ninja, pybind11 and
# the rest come from PyPI into .venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CPP_SOURCES := $(shell find ps_server/csrc reader/csrc embedding/csrc benchmarks/csrc -name '*.cc' -o -name '*.h')
PY_SOURCES := $(shell find src ps_server reader embedding hooks serving -name '*.py' -o -name '*.pyi')
SANITIZERS := thread address

.PHONY: demo test install dev lint format cpp-test py-test bench bench-quick protos constraints clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# A regular (not editable) install, so tests run what users get; the CMake
# build directory (build/<wheel tag>) is kept, so reinstalls are incremental.
# Reinstalls when any source changes. `make dev` installs editable instead.
# The tests also call the server through TensorFlow Serving's own Python
# client (tensorflow-serving-api): installed without its dependencies, as
# it declares `tensorflow` and would pull a second TensorFlow over the
# tensorflow-cpu of the tf extra, whose framework protos are all it needs.
$(VENV)/.installed: $(BIN)/python pyproject.toml $(shell find . -name CMakeLists.txt -not -path './build/*' -not -path './.venv/*') $(CPP_SOURCES) $(PY_SOURCES)
	$(BIN)/python -m pip install '.[test]'
	$(BIN)/python -m pip install --no-deps 'tensorflow-serving-api==2.21.*'
	touch $@

install: $(VENV)/.installed

dev: $(BIN)/python
	$(BIN)/python -m pip install -e '.[test]'
	touch $(VENV)/.installed

demo: install
	$(BIN)/python examples/movielens.py

test: install lint cpp-test py-test

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/clang-format --dry-run --Werror $(CPP_SOURCES)

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i $(CPP_SOURCES)

# The C++ tests (engine, reader, embedding kernels, the benchmark's naive
# engine), built and run under ThreadSanitizer and AddressSanitizer (+UBSan).
cpp-test: install
	@set -e; for san in $(SANITIZERS); do \
	  $(BIN)/cmake -S . -B build/$$san -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(BIN))/ninja \
	    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWULIANG_PYTHON=OFF -DWULIANG_TESTS=ON \
	    -DWULIANG_SANITIZE=$$san > /dev/null; \
	  $(BIN)/cmake --build build/$$san; \
	  echo "== C++ tests under $$san sanitizer"; \
	  (cd build/$$san && TSAN_OPTIONS=halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 \
	    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 $(abspath $(BIN))/ctest --output-on-failure); \
	done

# The pytest script (not `python -m pytest`) keeps the source tree off
# sys.path, so tests import the installed package.
py-test: install
	$(BIN)/pytest -q

# The benchmarks' baselines are not needed by tests: the reader benchmark's
# TensorFlow and pandas (the `bench` extra) and ps_bench.py's naive engine,
# a C++ module (wuliang_bench, benchmarks/csrc) that only a build with the
# CMake option WULIANG_BENCH=ON installs, hence the config setting. A later
# `make install` (sources changed) reinstalls without it, and the next
# `make bench` puts it back.
$(VENV)/.bench: $(VENV)/.installed
	$(BIN)/python -m pip install '.[bench]' -Ccmake.define.WULIANG_BENCH=ON
	touch $@

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/ps_bench.py
	$(BIN)/python benchmarks/reader_bench.py
	$(BIN)/python benchmarks/export_bench.py
	$(BIN)/python benchmarks/train_bench.py
	$(BIN)/python benchmarks/serving_bench.py
	$(BIN)/python benchmarks/gpu_cache_bench.py

bench-quick: $(VENV)/.bench
	$(BIN)/python benchmarks/ps_bench.py --quick
	$(BIN)/python benchmarks/reader_bench.py --quick
	$(BIN)/python benchmarks/export_bench.py --quick
	$(BIN)/python benchmarks/train_bench.py --quick
	$(BIN)/python benchmarks/gpu_cache_bench.py --quick
	$(BIN)/python benchmarks/serving_bench.py --quick

# After changing dependencies: the exact versions the image installs
# (deploy/constraints.txt, read by the Dockerfile). Needs Python 3.11.
constraints: $(BIN)/python
	$(BIN)/python tools/pin_image.py

# After editing serving/grpc/serving.proto: rebuilds the descriptor in serving/grpc/proto.py.
protos: install
	$(BIN)/python tools/regen_proto.py

clean:
	rm -rf build $(VENV)
