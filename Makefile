# `make demo` and `make test` set everything up themselves (scripts/setup.sh, idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench docs clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) samples/polynomial.py

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
