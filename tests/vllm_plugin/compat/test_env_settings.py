"""The plugin's environment settings fail closed and say what was wrong (lifecycle/env.py,
lifecycle/vllm/settings.py, lifecycle/vllm/plugin.py; issue 25, items 4 and 5).

Before: a misspelled `RELOAD_LIFECYCLE_PATH_ROOT` was ignored, so the root failed OPEN; a 5,000-character root was
a raw `OSError` with a 5 kB message that did not name the variable; `RELOAD_LIFECYCLE_AUDIT_DIR` was not stripped
(`" x"`, `"x "`, `"x\\n"` made folders of those names), `~` was taken literally and a relative folder was
accepted silently (relative to each worker's current folder, which Ray sets to its own session folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle.env import EnvSettingError
from lifecycle.vllm import settings
from lifecycle.vllm.plugin import activation as plugin


@pytest.fixture
def inactive(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plugin.activate()` runs as in a fresh vLLM process (and whatever it did is undone afterwards)."""
    monkeypatch.setattr(plugin, "_active", False)
    for name in settings.KNOWN_ENV if hasattr(settings, "KNOWN_ENV") else ():
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", ["RELOAD_LIFECYCLE_PATH_ROT", "RELOAD_LIFECYCLE_PATHROOT",
                                  "RELOAD_LIFECYCLE_PATH_ROOT_", "reload_lifecycle_path_root",
                                  "RELOADLIFECYCLE_PATH_ROOT"])
def test_a_misspelled_switch_stops_the_plugin_naming_it_and_the_closest_known_one(
        name: str, inactive: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.PATH_ROOT_ENV, raising=False)
    monkeypatch.setenv(name, str(tmp_path))
    with pytest.raises(EnvSettingError, match=rf"^{name}=.* is not a reload-lifecycle setting: did you mean "
                                              r"RELOAD_LIFECYCLE_PATH_ROOT\?") as ei:
        plugin.activate()
    assert ei.value.variable == name
    assert plugin._active is False  # nothing patched, the engine does not start


def test_every_known_switch_is_accepted(inactive: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELOAD_LIFECYCLE_PARTIAL", "keep")
    monkeypatch.setenv("RELOAD_LIFECYCLE_PATH_ROOT", str(tmp_path))
    monkeypatch.setenv("RELOAD_LIFECYCLE_AUDIT_DIR", str(tmp_path / "audit"))
    monkeypatch.setenv("RELOAD_LIFECYCLE_AUDIT_CONSOLE", "0")
    settings.check_names()  # what activate() runs first


def test_a_very_long_root_is_an_error_naming_the_variable_with_a_bounded_message(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    monkeypatch.setenv(settings.PATH_ROOT_ENV, "/" + "x" * 5000)
    with pytest.raises(EnvSettingError, match=rf"^{settings.PATH_ROOT_ENV}='/xxx.*File name too long") as ei:
        settings.allowed_root()
    assert len(str(ei.value)) < 300, len(str(ei.value))


@pytest.mark.parametrize("spelled", ["{d} ", " {d}", "{d}\n", "\t{d}\r\n"])
def test_the_audit_folder_is_stripped(spelled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    wanted = tmp_path / "audit"
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, spelled.format(d=wanted))
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "0")
    plugin._configure_audit_from_env()
    assert [p.name for p in tmp_path.iterdir()] == ["audit"]  # no "audit ", " ", "audit\n" folder
    assert [p.name for p in wanted.iterdir()] == [plugin.audit_file_name()]


def test_the_audit_folder_expands_a_leading_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, "~/audit")
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "0")
    plugin._configure_audit_from_env()
    assert (tmp_path / "home" / "audit" / plugin.audit_file_name()).is_file()
    assert not list((tmp_path / "cwd").iterdir())  # no folder named "~"


@pytest.mark.parametrize("value", ["audit", "./audit", "~nosuchuser-reload-lifecycle/audit"])
def test_a_relative_or_unexpandable_audit_folder_is_refused_naming_the_variable(
        value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, value)
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "0")
    with pytest.raises(EnvSettingError, match=rf"^{plugin.AUDIT_DIR_ENV}='{value}' must be an absolute path"):
        plugin._configure_audit_from_env()
    assert not list(tmp_path.iterdir())  # nothing created


def test_a_control_character_inside_a_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, f"{tmp_path}/a\nb")
    with pytest.raises(EnvSettingError, match=rf"^{plugin.AUDIT_DIR_ENV}=.* holds a control character"):
        plugin._configure_audit_from_env()
    assert not list(tmp_path.iterdir())
