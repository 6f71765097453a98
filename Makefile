# One entry point for a fresh machine: each target sets up what it needs (.venv, pinned packages).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-0.2

.PHONY: setup demo test bench-matching clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: an open range resolves to a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q triton==3.6.0 'numpy<2.4' transformers==5.24.0 pytest pytest-xdist networkx sympy
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python examples/train_llama.py

test: $(STAMP)
	# up to 4 worker processes (pytest-xdist); they share the run's seed (tests/conftest.py)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 tests

bench-matching: $(STAMP)
	cd benchmarks && TRITON_INTERPRET=1 ../$(BIN)/python bench_matching.py

clean:
	rm -rf $(VENV) *.egg-info
