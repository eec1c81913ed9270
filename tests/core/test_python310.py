"""The package works on Python 3.10 (`requires-python >= 3.10`): nothing it runs at import may need a newer stdlib.

The suite runs on a newer Python, so 3.10 is played by taking away what 3.11 added before the package is
imported, in a fresh interpreter (mypy, run with `python_version = "3.10"`, finds such names in lifecycle/ and
models/; this shows the one it found fixed).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_audit_levels_without_python_311_logging(tmp_path: Path) -> None:
    # `logging.getLevelNamesMapping` is new in 3.11: `lifecycle.events` used it at import
    script = textwrap.dedent("""
        import logging, sys
        del logging.getLevelNamesMapping
        import lifecycle
        from lifecycle import events
        events.configure_audit(sys.argv[1], console=False, level="WARNING")
        assert not events.enabled("info") and events.enabled("warning") and events.enabled("critical")
        events.emit("hello", level="error")
        events.emit("dropped", level="info")
        events.configure_audit(console=False)
        assert [e["event"] for e in events.read_events(sys.argv[1])] == ["hello"]
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "audit.jsonl")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
