"""Shared fixtures (a quiet audit configuration, a tiny DFlash config, two checkpoints and a loaded model) and the
markers every test gets by what it uses.

Markers (pyproject.toml registers them): `engine` (starts a vLLM engine), `vllm` (imports vLLM, here or in a process
it starts), `browser` (renders in headless Chromium), `slow` (over about 5 s alone on two cores: every engine or
browser test, vLLM's in-process runs, and the tests marked so where they are defined), `compat`, `ray`. They are
added at collection from what each test reaches (`support/marking.py`); the helpers say what they need
(`support.needs.needs`). While a test runs, a helper it reaches checks the test carries the markers, and a vLLM
engine started by a test not marked `engine`, here or in a scenario process, raises. The quick core run:
    pytest -m "not engine and not browser"          (make test-quick)
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from lifecycle.events import configure_audit
from lifecycle.loading import write_checkpoint
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.marking import imports_vllm_at_import, markers_for
from support.needs import running_test
from support.scenarios import debug_level, mixed_backbones, multi_rank
from support.vllm_basic_scenarios import run_scenario

# Tiny tensors gain nothing from intra-op threads, and on a shared machine OpenMP's barriers cost tens of ms per
# op (a 4x8x32 attention: ~30 ms with 2 threads under load, ~0.03 ms with 1). Results do not depend on it.
torch.set_num_threads(1)


#: markers whose tests run only where -m names them (`make compat`, `make test-ray`)
OPT_IN = ("compat", "ray")
ROOT = Path(__file__).resolve().parent.parent


class WithoutVLLM:
    """Where vLLM is not installed (the core alone: `make test-core`), the package's modules that import vLLM when
    imported are not collected for their doctests (they cannot be imported; every test of them is a `vllm` one),
    and the summary names them. A plugin, not this conftest's own hook: the hook of a conftest in tests/ is not
    asked about lifecycle/."""

    def __init__(self) -> None:
        self.left: list[str] = []

    def pytest_ignore_collect(self, collection_path: Path) -> bool | None:
        if collection_path.suffix == ".py" and collection_path.is_relative_to(ROOT) and \
                collection_path.relative_to(ROOT).parts[0] in ("lifecycle", "models") and \
                imports_vllm_at_import(collection_path):
            self.left.append(collection_path.relative_to(ROOT).as_posix())
            return True
        return None

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.left:
            terminalreporter.write_line(f"not collected, vLLM is not installed (they import it): "
                                        f"{', '.join(sorted(set(self.left)))}")


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("vllm") is None:
        config.pluginmanager.register(WithoutVLLM(), "reload-lifecycle-without-vllm")


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        present = {m.name for m in item.iter_markers()}
        for name in sorted(markers_for(item) - present):
            item.add_marker(name)
    named = set(re.findall(r"\w+", config.getoption("markexpr") or ""))
    left_out = [i for i in items if any(i.get_closest_marker(m) for m in OPT_IN if m not in named)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        gone = set(map(id, left_out))
        items[:] = [i for i in items if id(i) not in gone]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    # around setup, call and teardown (a module's fixtures start in its first test's setup): the declared helpers
    # check against this test's markers, and no vLLM engine starts unless it is marked `engine`
    with running_test(item.nodeid, [m.name for m in item.iter_markers()]):
        return (yield)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # the crash-consistency sweeps of this session (support/crash.py), added up: points tried, outcomes by kind
    from support.crash import RESULTS, summarize

    if RESULTS:
        terminalreporter.write_line(summarize(RESULTS))


@pytest.fixture(autouse=True)
def audit_quiet():
    """No console output from audit events; any JSON-lines sink a test opened is closed afterwards."""
    configure_audit(console=False)
    yield
    configure_audit(console=False)


@pytest.fixture
def tiny_cfg() -> DFlashConfig:
    return DFlashConfig(num_hidden_layers=3)


@pytest.fixture
def ckpt_a(tiny_cfg: DFlashConfig, tmp_path: Path) -> Path:
    return write_checkpoint(random_weights(tiny_cfg, 0), tmp_path / "a.safetensors")


@pytest.fixture
def ckpt_b(tiny_cfg: DFlashConfig, tmp_path: Path) -> Path:
    return write_checkpoint(random_weights(tiny_cfg, 1), tmp_path / "b.safetensors")


@pytest.fixture
def loaded(tiny_cfg: DFlashConfig, ckpt_a: Path) -> DFlashQwen3Draft:
    """A DFlash draft cold-loaded from checkpoint A, finalized and refreshed (state DERIVED_REFRESHED)."""
    return cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a)


@pytest.fixture(scope="session")
def real_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of audit logs written by real lifecycles (tests/support/scenarios.py): three ranks of one backbone in
    three files (cold load, capture, two bucketed reloads with a refused early refresh), several backbones in
    one file (refusals, abort and recovery, a quarantined end, release and rebuild, a selective reload) and a
    debug-level log. Tests copy it before editing it."""

    root = tmp_path_factory.mktemp("real-logs")
    cfg = DFlashConfig(num_hidden_layers=3)
    a = write_checkpoint(random_weights(cfg, 0), root / "a.safetensors")
    b = write_checkpoint(random_weights(cfg, 1), root / "b.safetensors")
    logs = root / "logs"
    logs.mkdir()
    multi_rank(logs, cfg, a, b)
    mixed_backbones(logs / "mixed.jsonl", cfg, a, b)
    debug_level(logs / "debug.jsonl", cfg, a, b)
    configure_audit(console=False)
    return logs


# ---- real vLLM engines (tests/test_vllm_*.py): each scenario is one engine in its own process -----------------------


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 target and DFlash drafts A (seed 1) and B (seed 2), made here."""
    from lifecycle.vllm.demo.tiny import make_dflash_draft, make_target

    work = tmp_path_factory.mktemp("vllm")
    make_target(work / "target")
    make_dflash_draft(work / "draftA", seed=1)
    make_dflash_draft(work / "draftB", seed=2)
    return work


@pytest.fixture(scope="session")
def cold_b(vllm_workdir: Path) -> dict:
    """A cold engine on draft B: what every reload to B is compared with."""
    return run_scenario("cold", vllm_workdir)


# ---- hypothesis profiles ------------------------------------------------------------------------------------------
# "ci" (the default): derandomized, so every run checks the same examples and a failure reproduces; sized to keep
# tests/core/test_properties.py near 30 s on two shared cores. "nightly": random, far more and longer runs:
#   HYPOTHESIS_PROFILE=nightly make test      (or .venv/bin/python -m pytest tests/core/test_properties.py)
# "dev": a quick smoke run while editing.

import os  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=300, stateful_step_count=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("nightly", max_examples=2500, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", max_examples=20, stateful_step_count=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


from support.vllm_runs import vllm_work  # noqa: E402, F401  (session fixture: vLLM checkpoints and in-process runs)
