"""Headless Chromium for the report's tests (`tests/audit/test_report.py`, `tests/audit/test_report_hostile.py`).

Debian's `chromium` at `/usr/bin/chromium` (`CHROMIUM` elsewhere); `make test` installs it. Where it is missing the
test fails (the project does not skip a test for a missing tool) and says how to install it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from support.needs import needs

__all__ = ["CHROMIUM", "FLAGS", "chromium", "missing_chromium"]

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing_chromium(path: str | None = None) -> str | None:
    """Why Chromium cannot run from `path` (`CHROMIUM` by default), with how to install it; None where it can."""
    path = path or CHROMIUM
    if os.access(path, os.X_OK) and Path(path).is_file():
        return None
    return (f"Chromium not found at {path}: install it with `apt-get install -y chromium` (make test does it), "
            "or set CHROMIUM to its path")


@needs("browser")
def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium with `args` in a fresh profile; fails the test where Chromium is missing."""
    problem = missing_chromium()
    if problem:
        import pytest

        pytest.fail(problem, pytrace=False)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=180, check=True)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
