# One entry point for a fresh machine: each target sets up what it needs (.venv, pinned packages).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-0.1

.PHONY: setup demo test bench-matching clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: an open range resolves to a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q triton==3.6.0 'numpy<2.4' transformers==5.24.0 pytest networkx sympy
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python examples/train_llama.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench-matching: $(STAMP)
	cd benchmarks && TRITON_INTERPRET=1 ../$(BIN)/python bench_matching.py

clean:
	rm -rf $(VENV) *.egg-info
