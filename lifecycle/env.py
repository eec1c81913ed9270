"""Environment switches (`RELOAD_LIFECYCLE_*`): one parser, so every switch takes the same spellings and every
error names the variable.

>>> import os
>>> os.environ["RELOAD_LIFECYCLE_EXAMPLE"] = " Yes "
>>> flag("RELOAD_LIFECYCLE_EXAMPLE")
True
>>> os.environ["RELOAD_LIFECYCLE_EXAMPLE"] = "maybe"
>>> try:
...     flag("RELOAD_LIFECYCLE_EXAMPLE")
... except EnvSettingError as e:
...     print(e)
RELOAD_LIFECYCLE_EXAMPLE='maybe' is not a switch value: use one of 1, true, yes, on (or 0, false, no, off, empty)
>>> del os.environ["RELOAD_LIFECYCLE_EXAMPLE"]
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["FALSE_SPELLINGS", "TRUE_SPELLINGS", "EnvSettingError", "check_names", "choice", "flag", "path"]

#: Case-insensitive, surrounding blanks ignored.
TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off", "")
#: A value longer than this is cut in error messages.
_SHOWN = 80


class EnvSettingError(ValueError):
    """An environment variable holds a value its switch does not accept. `variable` names it."""

    def __init__(self, variable: str, value: str, problem: str) -> None:
        shown = value if len(value) <= _SHOWN else value[:_SHOWN] + f"...(+{len(value) - _SHOWN} characters)"
        super().__init__(f"{variable}={shown!r} {problem}")
        self.variable = variable


def flag(name: str, default: bool = False) -> bool:
    """An on/off switch: unset gives `default`; 1/true/yes/on and 0/false/no/off/empty in any case; anything else
    raises `EnvSettingError` naming the variable (a typo must not silently mean "off")."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE_SPELLINGS:
        return True
    if value in FALSE_SPELLINGS:
        return False
    raise EnvSettingError(name, raw, f"is not a switch value: use one of {', '.join(TRUE_SPELLINGS)} "
                                     f"(or {', '.join(s or 'empty' for s in FALSE_SPELLINGS)})")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def path(name: str) -> Path | None:
    """An absolute filesystem path: unset or blank gives None; surrounding blanks (a trailing newline) are
    stripped and a leading `~` or `~user` is expanded. Refused, naming the variable: a relative path (it would be
    taken from each process's current folder, and Ray starts its workers in a session folder of its own), a `~`
    that does not expand, a control character inside. Whoever uses the path names the variable when it cannot
    (raise `EnvSettingError(name, value, problem)`)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip()
    if _CONTROL.search(value):
        raise EnvSettingError(name, raw, "holds a control character; give the folder's plain absolute path")
    expanded = os.path.expanduser(value)
    if not os.path.isabs(expanded):
        why = ("its ~ does not expand (no such user, or HOME unset)" if expanded.startswith("~") else
               "a relative path would be taken from each process's current folder (Ray starts its workers in a "
               "session folder of its own)")
        raise EnvSettingError(name, raw, f"must be an absolute path: {why}")
    return Path(expanded)


def check_names(prefix: str, known: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """Every variable that looks like one of this package's (its name, in any case and without `_`/`-`, starts
    with `prefix`'s) must be one of `known`: a misspelled switch is an `EnvSettingError` naming it and the
    closest known name, never silently ignored (a misspelled `RELOAD_LIFECYCLE_PATH_ROOT` would fail open)."""
    env = os.environ if environ is None else environ
    squeezed = re.sub(r"[^A-Z0-9]", "", prefix.upper())
    unknown = sorted(n for n in env if n not in known and re.sub(r"[^A-Z0-9]", "", n.upper()).startswith(squeezed))
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}?" if close else f"the settings are {', '.join(known)}"
    if close and close[0] == name.upper():
        hint += " (names are case-sensitive)"
    more = f"; and {len(unknown) - 1} more unknown {prefix}* name(s)" if len(unknown) > 1 else ""
    raise EnvSettingError(name[:_SHOWN], env[name], f"is not a reload-lifecycle setting: {hint}{more}")


def choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    """One of `allowed` (any case, surrounding blanks ignored); unset or blank gives `default`; anything else
    raises `EnvSettingError` naming the variable and what it accepts."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or default
    if value not in allowed:
        raise EnvSettingError(name, raw, f"is not one of: {', '.join(allowed)}")
    return value
