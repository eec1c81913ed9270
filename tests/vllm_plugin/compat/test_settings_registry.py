"""One settings registry (lifecycle/vllm/settings.py `SETTINGS`, issue 31 item 5): every `RELOAD_LIFECYCLE_*` setting is
one record, the plugin checks every one when it activates, and nothing else of the package names one.

Before: `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S` (documented, read by the session wrappers) was missing from
`KNOWN_ENV`, so `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S=5 vllm serve ...` stopped at start ("is not a
reload-lifecycle setting"); the test set it only after activation. The canary's thresholds were read only when the
front process built its view, and the docs listed 4 of the 9 settings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle.env import EnvSettingError
from lifecycle.vllm import settings
from lifecycle.vllm.plugin import activation as plugin
from support.needs import needs

ROOT = Path(__file__).resolve().parents[3]

#: A valid value of every setting, none its default, and what it reads as (`{tmp}`: the test's folder).
VALID: dict[str, tuple[str, Any]] = {
    settings.PARTIAL_ENV: (" Keep ", "keep"),
    settings.PATH_ROOT_ENV: ("{tmp}", "the test's folder"),
    settings.AUDIT_DIR_ENV: ("{tmp}/audit", "its audit folder"),
    settings.AUDIT_CONSOLE_ENV: ("on", True),
    settings.AUDIT_MAX_BYTES_ENV: (" 8M ", 8 * 2**20),
    settings.ACCEPTANCE_FLOOR_ENV: ("0.1", 0.1),
    settings.ACCEPTANCE_HEALTHY_ENV: ("0.4", 0.4),
    settings.ACCEPTANCE_MIN_TOKENS_ENV: ("40", 40),
    settings.ACCEPTANCE_EVERY_STEPS_ENV: ("0", 0),
    settings.TAKEOVER_IDLE_ENV: ("5", 5.0),
}
#: A value each setting refuses, and what its error says.
INVALID: dict[str, tuple[str, str]] = {
    settings.PARTIAL_ENV: ("sometimes", "is not one of: refuse, keep"),
    settings.PATH_ROOT_ENV: ("relative/root", "must be an absolute path"),
    settings.AUDIT_DIR_ENV: ("audit", "must be an absolute path"),
    settings.AUDIT_CONSOLE_ENV: ("loud", "is not a switch value"),
    settings.AUDIT_MAX_BYTES_ENV: ("1000", "must be 0 (no rotation) or at least 65536 bytes"),
    settings.ACCEPTANCE_FLOOR_ENV: ("-0.1", "must be from 0.0 to 1.0"),
    settings.ACCEPTANCE_HEALTHY_ENV: ("high", "is not a number"),
    settings.ACCEPTANCE_MIN_TOKENS_ENV: ("0", "must be >= 1"),
    settings.ACCEPTANCE_EVERY_STEPS_ENV: ("1.5", "is not an integer"),
    settings.TAKEOVER_IDLE_ENV: ("inf", "is not a number of seconds >= 0"),
}


@pytest.fixture
def inactive(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plugin.activate()` runs as in a fresh vLLM process, no setting set (the tests using it expect it to stop
    before it changes anything: a full activation runs in a process of its own, `activate_in_a_fresh_process`)."""
    monkeypatch.setattr(plugin, "_active", False)
    for name in settings.KNOWN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(plugin.RAY_COPY_PREFIXES_ENV, raising=False)


def test_the_registry_is_known_env_and_every_record_is_complete() -> None:
    assert tuple(s.name for s in settings.SETTINGS) == settings.KNOWN_ENV
    assert len(settings.KNOWN_ENV) == len(set(settings.KNOWN_ENV)) == 10
    assert set(VALID) == set(INVALID) == set(settings.KNOWN_ENV), "a new setting needs its values here"
    for s in settings.SETTINGS:
        assert re.fullmatch(r"RELOAD_LIFECYCLE_[A-Z0-9_]+", s.name), s.name
        assert s.scope in ("engine-wide", "per-call default") and s.read_in in ("every process", "workers",
                                                                                  "front process")
        assert s.doc and "\n" not in s.doc and s.accepts, s.name


def test_an_unset_or_blank_setting_reads_as_its_registered_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in settings.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
        assert s.read() == s.default, s.name
        monkeypatch.setenv(s.name, "  ")
        assert s.read() == s.default, s.name
    assert settings.acceptance_thresholds() == settings.AcceptanceThresholds()


#: What vLLM does at the start of each of its processes (the `vllm.general_plugins` entry point), then what each
#: setting reads there.
ACTIVATE = """
import json
import lifecycle.vllm
from lifecycle.vllm import settings
from lifecycle.vllm.plugin import activation
lifecycle.vllm.register()
read = {s.name: s.read() for s in settings.SETTINGS}
print("ACTIVATED " + json.dumps({"active": activation._active, "read": read}, default=str))
"""


@needs("vllm", "slow")
def activate_in_a_fresh_process(settings_env: dict[str, str]) -> dict[str, Any]:
    """The plugin started in a process of its own, as `vllm serve` starts it (it imports and patches vLLM there,
    never in the test process), with `settings_env` as its only settings; what it read, or the error it stopped on."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(settings.ENV_PREFIX)}
    proc = subprocess.run([sys.executable, "-c", ACTIVATE], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**base, **settings_env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    for line in proc.stdout.splitlines():
        if line.startswith("ACTIVATED "):
            result: dict[str, Any] = json.loads(line.removeprefix("ACTIVATED "))
            return result
    raise AssertionError(f"the plugin did not activate (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def test_the_plugin_activates_with_every_setting_set_and_reads_each(tmp_path: Path) -> None:
    (tmp_path / "audit").mkdir()
    result = activate_in_a_fresh_process({name: raw.format(tmp=tmp_path) for name, (raw, _) in VALID.items()})
    assert result["active"] is True
    wanted = {name: read for name, (_, read) in VALID.items()}
    wanted[settings.PATH_ROOT_ENV] = str(tmp_path.resolve())  # the root resolved, links followed
    wanted[settings.AUDIT_DIR_ENV] = str(tmp_path / "audit")
    assert result["read"] == wanted
    assert len(list((tmp_path / "audit").glob("audit-*.jsonl"))) == 1  # that process routed its audit there


def test_the_takeover_idle_setting_set_before_activation_activates() -> None:
    """The regression: `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S=5 vllm serve ...` stopped at start."""
    result = activate_in_a_fresh_process({settings.TAKEOVER_IDLE_ENV: "5"})
    assert result["active"] is True and result["read"][settings.TAKEOVER_IDLE_ENV] == 5.0
    from lifecycle.vllm.online import sessions

    assert sessions.TAKEOVER_IDLE_ENV == settings.TAKEOVER_IDLE_ENV  # the session wrappers read the same record


@pytest.mark.parametrize("name", list(INVALID))
def test_a_bad_value_of_any_setting_stops_the_plugin_naming_the_variable_before_it_changes_anything(
        name: str, inactive: None, monkeypatch: pytest.MonkeyPatch) -> None:
    raw, why = INVALID[name]
    monkeypatch.setenv(name, raw)
    with pytest.raises(EnvSettingError) as ei:
        plugin.activate()
    assert ei.value.variable == name and str(ei.value).startswith(f"{name}={raw!r} {why}"), str(ei.value)
    assert plugin._active is False
    assert plugin.RAY_COPY_PREFIXES_ENV not in os.environ  # stopped before the plugin's first change


def test_the_canary_floor_above_its_healthy_share_stops_the_plugin(inactive: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.ACCEPTANCE_FLOOR_ENV, "0.2")
    monkeypatch.setenv(settings.ACCEPTANCE_HEALTHY_ENV, "0.2")
    with pytest.raises(EnvSettingError, match=rf"^{settings.ACCEPTANCE_FLOOR_ENV}='0.2' must lie below "
                                              rf"{settings.ACCEPTANCE_HEALTHY_ENV} \(0.2\)"):
        plugin.activate()
    assert plugin._active is False


# ---- nothing of the package names a setting the registry does not hold ---------------------------------------------
#: What may name a `RELOAD_LIFECYCLE_*` variable that is not a setting: the example of `lifecycle.env`'s doctest.
EXAMPLES = {"RELOAD_LIFECYCLE_EXAMPLE": {"lifecycle/env.py"}}
MENTION = re.compile(r"(?<![A-Za-z0-9_])RELOAD_LIFECYCLE_[A-Z0-9_]*(?:\{[A-Z0-9_,]+\})?\*?")


def mentions(text: str) -> set[str]:
    """Every setting name `text` gives, a family (`RELOAD_LIFECYCLE_ACCEPTANCE_*`, the bare prefix) as `NAME*` and
    `..._{A,B}` as each name."""
    found = set()
    for m in MENTION.finditer(text):
        token = m.group()
        braces = re.search(r"\{(.+)\}", token)
        names = [token[:braces.start()] + part for part in braces.group(1).split(",")] if braces else [token]
        found |= {n if not (n.endswith(("_", "*"))) else n.rstrip("*") + "*" for n in names}
    return found


def package_files() -> list[Path]:
    return sorted([*(ROOT / "lifecycle").rglob("*.py"), *(ROOT / "models").rglob("*.py"),
                   *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs").rglob("*.py"), ROOT / "README.md"])


def test_every_setting_the_package_names_is_registered() -> None:
    unknown = []
    for path in package_files():
        rel = path.relative_to(ROOT).as_posix()
        for name in mentions(path.read_text(encoding="utf-8")):
            family = name.endswith("*")
            known = (any(k.startswith(name[:-1]) for k in settings.KNOWN_ENV) if family
                     else name in settings.KNOWN_ENV or rel in EXAMPLES.get(name, ()))
            if not known:
                unknown.append(f"{rel}: {name}")
    assert not unknown, f"names no setting of lifecycle/vllm/settings.py SETTINGS: {unknown}"


def test_the_mention_scan_finds_a_stray_name_a_family_and_braces() -> None:
    text = ("`RELOAD_LIFECYCLE_PATH_ROT` and RELOAD_LIFECYCLE_ACCEPTANCE_* and RELOAD_LIFECYCLE_ and "
            "`RELOAD_LIFECYCLE_ACCEPTANCE_{FLOOR,HEALTHY}` and another program's PRELOAD_LIFECYCLE_HOOKS")
    assert mentions(text) == {"RELOAD_LIFECYCLE_PATH_ROT", "RELOAD_LIFECYCLE_ACCEPTANCE_*", "RELOAD_LIFECYCLE_*",
                              "RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR", "RELOAD_LIFECYCLE_ACCEPTANCE_HEALTHY"}
    assert {"lifecycle/vllm/settings.py", "docs/vllm.md", "README.md"} <= {
        p.relative_to(ROOT).as_posix() for p in package_files()}
