# Set-up and everyday commands. `make demo` and `make test` do all set-up on a fresh machine.
# Elsewhere than this project's machines, torch==2.13.0 must come from PyTorch's CPU wheel index:
#   make test TORCH_INDEX="--extra-index-url https://download.pytorch.org/whl/cpu"
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/reload-lifecycle demo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

# Every benchmark: prints its tables, writes benchmarks/results/NAME.json and NAME.txt (a few minutes on 2 cores).
# BENCH_ARGS="--quick" for a smoke run of seconds; the GPU check skips (exit 0) without CUDA.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m benchmarks.tracking_overhead $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.refresh $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.selective $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.audit_overhead $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.gpu_check
	$(BIN)/python -m benchmarks.gpu_check --device cpu --json benchmarks/results/gpu_check_cpu.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
