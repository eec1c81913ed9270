"""How values read from a log are shown to people: cut to a bounded length, control characters escaped.

A log is input from other machines: a backbone name holding a newline or a terminal escape must not be able to
print a line of its own (a fake "RESULT: CLEAN") or restyle the terminal. `printable` escapes every C0 and C1
control character, DEL, and the Unicode line separators and direction overrides; `clip` cuts a value to a
length, saying how much was cut.

>>> print(printable("draft\\nRESULT: CLEAN \\x1b[8m"))
draft\\nRESULT: CLEAN \\x1b[8m
>>> clip("x" * 100, 10), abbreviate("layers." + "x" * 100 + ".17", 20)
('xxxxxxxxxx…(+90)', 'layers.xxxxxx…xxx.17')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["VALUE_CAP", "abbreviate", "clip", "collapse_detail", "printable", "shown"]

#: Characters of one log value quoted in a message, at most.
VALUE_CAP = 120

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(text: str) -> str:
    """`text` with every control character written as an escape (`\\n`, `\\x1b`, `\\u202e`)."""
    return _CONTROL.sub(_escape, text)


def clip(value: object, cap: int = VALUE_CAP) -> str:
    """`value` as text, at most `cap` characters of it, then how many were cut."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= cap else f"{text[:cap]}…(+{len(text) - cap})"


def abbreviate(name: str, cap: int) -> str:
    """A name cut in the middle to at most `cap` characters: names of one log tend to differ at their end
    (`...layers.17`), so the head and the tail are kept."""
    if len(name) <= cap:
        return name
    tail = cap // 3
    return f"{name[:cap - tail - 1]}…{name[len(name) - tail:]}"


def shown(value: object, cap: int = VALUE_CAP) -> str:
    """`value` for a message: clipped and quoted (`repr`) if it is a string, clipped otherwise."""
    return repr(clip(value, cap)) if isinstance(value, str) else clip(value, cap)


def collapse_detail(f: Mapping[str, Any]) -> str:
    """An `acceptance_collapse` event, for the warning list (the pushes named as the plugin names them, and the
    trainer's versions; an event that arrived over RPC says so)."""
    def which(push: str, version: str) -> str:
        named = [clip(f[push])] if push in f else []
        named += [f"weight_version {clip(f[version])}"] if version in f else []
        return f" ({', '.join(named)})" if named else ""

    before = f"period {f['previous_period']}" if "previous_period" in f else "the period before"
    over = " [over RPC from the engine's front process]" if f.get("origin") == "rpc" else ""
    return (f"accepted share {f['accepted_share']:.3f} over {f['draft_tokens']} draft tokens in serving period "
            f"{f['period']}{which('push', 'weight_version')}, after {f['previous_share']:.3f} in {before}"
            f"{which('previous_push', 'previous_weight_version')}{over}")
