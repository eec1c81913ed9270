"""What an operator installs (issue 35, item 9): the Prometheus alert rules in lifecycle/monitoring/ pass
`promtool check rules` and their unit tests (`promtool test rules`), the tests catch a broken rule, and the rules and
the Grafana dashboard name only series the plugin exposes, with their labels; the dashboard shows every one.

promtool is Debian's `prometheus` package (`make test` installs it); where it is missing the test fails saying how
to install it (the project skips no test for a missing tool)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MONITORING = ROOT / "lifecycle" / "monitoring"
RULES = MONITORING / "reload-lifecycle.rules.yml"
RULE_TESTS = MONITORING / "reload-lifecycle.rules.test.yml"
DASHBOARD = MONITORING / "reload-lifecycle.dashboard.json"
PROMTOOL = os.environ.get("PROMTOOL", "/usr/bin/promtool")
#: labels Prometheus adds to every scraped series, and a histogram bucket's
SCRAPE_LABELS = {"job", "instance", "le"}

# Every metric of the plugin with one child each, exposed as `vllm serve` exposes them; in a child process, so that
# this test's registry (which the in-process vLLM tests read) is left alone.
EXPOSE = """
import json
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from lifecycle.vllm.observability.metrics import metrics

for metric in vars(metrics()).values():
    names = getattr(metric, "_labelnames", None)
    if names is None:
        continue
    child = metric.labels(*("x" for _ in names))
    for act in ("set", "inc", "observe"):  # set first: a gauge merged by its latest value refuses inc
        if hasattr(child, act):
            getattr(child, act)(1)
            break
series = {}
for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
    for sample in family.samples:
        if sample.name.startswith("reload_lifecycle_") and not sample.name.endswith("_created"):
            series.setdefault(sample.name, set()).update(sample.labels)
print(json.dumps({name: sorted(labels) for name, labels in series.items()}))
"""


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    if not (os.access(PROMTOOL, os.X_OK) and Path(PROMTOOL).is_file()):
        pytest.fail(f"promtool not found at {PROMTOOL}: install Debian's prometheus (`apt-get install -y "
                    "prometheus`; make test does it as root), or set PROMTOOL to its path", pytrace=False)
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def exposed() -> dict[str, set[str]]:
    """Every `reload_lifecycle_*` series the plugin exposes -> its labels."""
    proc = subprocess.run([sys.executable, "-c", EXPOSE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return {name: set(labels) for name, labels in json.loads(proc.stdout).items()}


def rule_expressions() -> dict[str, str]:
    """alert name -> its PromQL, read from the rules file (YAML: folded `>-` blocks or one line)."""
    text = RULES.read_text(encoding="utf-8")
    out = {}
    for block in re.split(r"^      - alert: ", text, flags=re.M)[1:]:
        name = block.split("\n", 1)[0].strip()
        m = re.search(r"^        expr: (?:>-\n((?:          .*\n)+)|(.*)\n)", block, flags=re.M)
        assert m, name
        out[name] = " ".join((m.group(1) or m.group(2)).split())
    return out


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


def check_names(expr: str, exposed: dict[str, set[str]]) -> list[str]:
    """What in `expr` the plugin does not expose: a series name, a label selected on it, a label grouped by."""
    problems = []
    used = set(re.findall(r"\b(reload_lifecycle_\w+)", expr))
    problems += [f"no series {n}" for n in sorted(used - exposed.keys())]
    for name, selector in re.findall(r"\b(reload_lifecycle_\w+)\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector):
            if label not in exposed.get(name, set()) | SCRAPE_LABELS:
                problems.append(f"{name} has no label {label}")
    known = set().union(*(exposed.get(n, set()) for n in used)) | SCRAPE_LABELS
    for group in re.findall(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)", expr):
        problems += [f"no label {label} on {sorted(used)}" for label in re.findall(r"\w+", group)
                     if label not in known]
    return problems


def test_the_rules_pass_promtool_check_and_their_unit_tests() -> None:
    check = promtool("check", "rules", RULES.name)
    assert check.returncode == 0 and "SUCCESS: 5 rules found" in check.stdout, check.stdout + check.stderr
    tests = promtool("test", "rules", RULE_TESTS.name)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


def test_the_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The same unit tests against rules with a threshold and a `for:` changed: both are caught."""
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    text = RULES.read_text(encoding="utf-8")
    broken = text.replace("(reload_lifecycle_draft_quarantined) == 1", "(reload_lifecycle_draft_quarantined) == 2")
    broken = broken.replace("for: 15m", "for: 5m", 1)
    assert broken.count("== 2") == 1 and broken != text
    (tmp_path / RULES.name).write_text(broken, encoding="utf-8")
    assert promtool("check", "rules", RULES.name, cwd=tmp_path).returncode == 0  # still valid rules...
    run = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert run.returncode != 0  # ... that the unit tests refuse, naming both
    assert "alertname: ReloadLifecycleDraftQuarantined" in run.stdout + run.stderr
    assert "alertname: ReloadLifecycleDraftNotUsable" in run.stdout + run.stderr


def test_the_rules_alert_on_what_an_operator_acts_on(exposed: dict[str, set[str]]) -> None:
    rules = rule_expressions()
    on = {"ReloadLifecycleDraftQuarantined": "reload_lifecycle_draft_quarantined",
          "ReloadLifecycleDraftNotUsable": "reload_lifecycle_draft_usable",
          "ReloadLifecyclePushRefused": "reload_lifecycle_pushes_total",
          "ReloadLifecycleServingWithoutDraft": "reload_lifecycle_steps_without_draft_total",
          "ReloadLifecycleAcceptanceCollapsed": "reload_lifecycle_acceptance_collapsed"}
    assert set(rules) == set(on)
    for alert, expr in rules.items():
        assert on[alert] in expr, alert
        assert not check_names(expr, exposed), (alert, check_names(expr, exposed))
    assert 'outcome=~"refused|abandoned"' in rules["ReloadLifecyclePushRefused"]


def test_the_metrics_table_of_operating_md_is_what_is_exposed(exposed: dict[str, set[str]]) -> None:
    """docs/operating.md's table is generated from the plugin's source; here it meets what a scrape shows."""
    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    table = text.split("<!-- generated:metrics:begin -->")[1].split("<!-- generated:metrics:end -->")[0]
    rows = {m.group(1): set(re.findall(r"`(\w+)`", m.group(2)))
            for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| ([^|]*) \|", table, re.M)}
    families = {re.sub(r"_(bucket|sum|count)$", "", n): labels - {"le"} for n, labels in exposed.items()}
    assert rows == families


def test_the_dashboard_shows_every_series_and_names_only_what_exists(exposed: dict[str, set[str]],
                                                                     tmp_path: Path) -> None:
    exprs = dashboard_expressions()
    problems = [p for e in exprs for p in check_names(e, exposed)]
    assert not problems, problems
    shown = {n for e in exprs for n in re.findall(r"\b(reload_lifecycle_\w+)", e)}
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exposed}
    missing = {f for f in families if not any(s == f or s.startswith(f + "_") for s in shown)}
    assert not missing, f"series the dashboard does not show: {sorted(missing)}"
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and {v["name"] for v in board["templating"]["list"]} == {"datasource",
                                                                                             "instance"}
    # every expression is PromQL promtool parses (as recording rules, Grafana's variables given values)
    given = [e.replace("$__rate_interval", "5m").replace("$instance", ".*") for e in exprs]
    rules = "groups:\n  - name: dashboard\n    rules:\n" + "".join(
        f"      - record: dashboard:panel_{i}\n        expr: {json.dumps(e)}\n" for i, e in enumerate(given))
    (tmp_path / "dashboard.rules.yml").write_text(rules, encoding="utf-8")
    check = promtool("check", "rules", "dashboard.rules.yml", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
