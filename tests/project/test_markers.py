"""The markers a test gets by what it uses (tests/support/marking.py) and the guards behind them
(tests/support/needs.py): a helper's declared needs reach every test that calls it, through fixtures and other
helpers; a test not marked `engine` cannot start a vLLM engine, here or in a scenario process; a missing Chromium
fails with how to install it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.testing import cold_load
from support import browser
from support.marking import needs_in
from support.needs import (
    NO_ENGINE_ENV,
    EngineRefused,
    needs,
    needs_of,
    refuse_engines,
    refusing_engines,
    running_test,
)
from support.vllm_basic_scenarios import run_scenario
from support.vllm_runs import ROOT, run_inprocess


def _starts_an_engine_two_calls_down() -> None:
    _through_a_helper()


def _through_a_helper() -> None:
    run_scenario("cold", Path("/nowhere"))


def _imports_vllm_inside() -> None:
    from vllm.inputs import TokensPrompt  # noqa: F401


def _renders() -> None:
    browser.chromium("--version", cwd=Path("."))


def _plain() -> None:
    cold_load  # noqa: B018  (the core's helpers need nothing)


# What these tests inspect, looked up by name: a test that names a helper is marked with what it needs, and these
# tests examine the helpers (and call them under guard) without running a scenario or Chromium.
INSPECTED = {f.__name__: f for f in (run_scenario, run_inprocess, browser.chromium, _starts_an_engine_two_calls_down,
                                     _imports_vllm_inside, _renders, _plain)}


def test_the_declared_needs_reach_every_caller_and_imply_what_they_need() -> None:
    assert needs_of(INSPECTED["run_scenario"]) == {"engine", "vllm", "slow"}
    assert needs_in(INSPECTED["_starts_an_engine_two_calls_down"]) == {"engine", "vllm", "slow"}
    assert needs_in(INSPECTED["run_inprocess"]) == {"vllm", "slow"}
    assert needs_in(INSPECTED["_imports_vllm_inside"]) == {"vllm"}
    assert needs_in(INSPECTED["_renders"]) == {"browser", "slow"}
    assert needs_in(INSPECTED["_plain"]) == set()
    with pytest.raises(ValueError, match=r"unknown test markers \['gpu'\]"):
        needs("gpu")


COLLECT = """
import json, sys
import pytest

class Marks:
    def pytest_collection_finish(self, session):
        print("MARKS " + json.dumps({i.nodeid: sorted(m.name for m in i.iter_markers()) for i in session.items}))

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Marks()]))
"""


def test_the_fixtures_and_helpers_a_test_reaches_bring_their_markers() -> None:
    """On the real suite, collected as pytest collects it: the failure tests start their engines in module
    fixtures (through `run_scenario`), the hostile-report tests reach Chromium through a helper of their own
    module, and a core test file reaches neither."""
    files = ["tests/vllm_plugin/reload/test_vllm_failures.py", "tests/audit/test_report_hostile.py",
             "tests/core/test_guards.py"]
    proc = subprocess.run([sys.executable, "-c", COLLECT, *files], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("MARKS ")]
    marks = {nodeid.partition("[")[0]: frozenset(names) & {"engine", "vllm", "browser", "slow"}
             for nodeid, names in json.loads(line.removeprefix("MARKS ")).items()}
    by_file: dict[str, set[frozenset[str]]] = {}
    for nodeid, names in marks.items():
        by_file.setdefault(nodeid.partition("::")[0], set()).add(names)
    settings_test = "test_a_bad_engine_wide_setting_stops_the_plugin_before_it_patches_anything"
    failures = "tests/vllm_plugin/reload/test_vllm_failures.py"
    assert marks.pop(f"{failures}::{settings_test}") == {"vllm"}  # the one starting no engine
    assert {names for nodeid, names in marks.items() if nodeid.startswith(failures)} == {
        frozenset({"engine", "vllm", "slow"})}
    assert marks["tests/audit/test_report_hostile.py::test_no_payload_in_any_field_runs"] == {"browser", "slow"}
    assert marks["tests/audit/test_report_hostile.py::test_what_held_before_still_holds"] == set()
    assert by_file["tests/core/test_guards.py"] == {frozenset()}


def test_a_declared_helper_fails_a_test_without_its_markers() -> None:
    with running_test("tests/x.py::test_y", []), pytest.raises(pytest.fail.Exception) as failed:
        INSPECTED["run_scenario"]("cold", Path("/nowhere"))
    assert "tests/x.py::test_y calls run_scenario, which needs the markers ['engine', 'slow', 'vllm']" in str(
        failed.value)


def test_a_test_not_marked_engine_cannot_start_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's real engine-core client factories (every LLM, AsyncLLM and `vllm serve` gets its engine there)
    refuse, here and in a scenario process this test starts: each script's `main` calls `refuse_engines`,
    which reads the test's id from the environment."""
    me = "tests/project/test_markers.py::test_a_test_not_marked_engine_cannot_start_one"
    assert os.environ[NO_ENGINE_ENV] == me
    from vllm.v1.engine.core_client import EngineCoreClient  # patched as it is imported

    refused = rf"{me} started a vLLM engine but is not marked `engine`"
    with pytest.raises(EngineRefused, match=refused):
        EngineCoreClient.make_client(multiprocess_mode=False, asyncio_mode=False, vllm_config=None,
                                     executor_class=None, log_stats=False)
    with refusing_engines(None):  # as in a test marked `engine`: the real factories
        assert EngineCoreClient.make_client is EngineCoreClient.__dict__["make_client"].__func__
        monkeypatch.setenv(NO_ENGINE_ENV, "tests/test_other.py::test_scenario")
        refuse_engines()  # what a scenario process does first
        with pytest.raises(EngineRefused, match=r"tests/test_other\.py::test_scenario started a vLLM engine"):
            EngineCoreClient.make_async_mp_client(vllm_config=None, executor_class=None, log_stats=False)


def test_a_missing_chromium_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    absent = str(tmp_path / "chromium")
    assert browser.missing_chromium(absent) == (
        f"Chromium not found at {absent}: install it with `apt-get install -y chromium` (make test does it), "
        "or set CHROMIUM to its path")
    monkeypatch.setattr(browser, "CHROMIUM", absent)
    with pytest.raises(pytest.fail.Exception, match=r"Chromium not found at .*: install it with "
                                                    r"`apt-get install -y chromium` \(make test does it\)"):
        INSPECTED["chromium"].__wrapped__("--version", cwd=tmp_path)  # a failure, not a skip
