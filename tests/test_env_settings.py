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
from lifecycle.vllm import plugin, settings


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
