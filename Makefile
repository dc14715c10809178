# `make demo` and `make test` set everything up themselves (scripts/setup.sh, idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-generated cuda-compile-check lint bench docs clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) samples/polynomial.py

# Tests run on one pytest-xdist worker per CPU as far as memory allows (scripts/test_workers.py;
# `make test TEST_WORKERS=0` runs them in one process).
TEST_WORKERS ?= $(shell python3 scripts/test_workers.py 2>/dev/null || echo 0)
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# Every call the generated kernels cover through them, whatever its size (CI: the suites that
# exercise covered calls; `GENERATED_TESTS=tests` runs the whole suite that way).
GENERATED_TESTS ?= tests/test_generated.py tests/test_generated_paths.py tests/test_bwds.py \
	tests/test_tape.py tests/test_forward.py tests/test_broadcast_coverage.py \
	tests/test_determinism.py tests/test_policy.py tests/test_repeated_backward.py \
	tests/test_s33_plain_call.py tests/test_s33_grid_forward.py tests/test_seeds.py \
	tests/test_s34_grid2d.py tests/test_s34_vec34.py
test-generated: setup
	$(PY) -m pytest -q --pydiff-generated=force $(GENERATED_TESTS) $(PYTEST_ARGS)

# Every kernel pydiff compiles (shaders/ entry points, generated kernels, SlangPy's call
# kernels) compiled for CUDA (sm_90 PTX) without a GPU: needs nvcc; fetches slangc once
# (docs/devices.md#compiling-for-cuda-without-a-gpu).
cuda-compile-check: setup
	$(PY) scripts/cuda_compile_check.py $(CUDA_CHECK_ARGS)

# Style and structure (CI runs it): ruff at 100 columns, formatting included.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# PyTorch-CPU is an optional comparison; the benchmark skips it when missing.
bench: setup
	$(PY) -m pip install -q -e ".[bench]" || echo "(PyTorch not installed: benchmark runs without it)"
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_tape.py
	$(PY) benchmarks/bench_forward.py
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_determinism.py
	$(PY) benchmarks/bench_startup.py

# The docs site (mkdocs.yml, docs/): strict, so broken links and references fail the build.
docs: setup
	$(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache build dist site *.egg-info
