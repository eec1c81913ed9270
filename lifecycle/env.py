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

import os
import re
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["FALSE_SPELLINGS", "NEAR_MISS", "TRUE_SPELLINGS", "EnvSettingError", "check_names", "choice",
           "edit_distance", "flag", "fold", "path"]

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


#: Latin capitals that Cyrillic and Greek capitals look like (after NFKD and `str.upper`, which fold fullwidth forms,
#: accents and lower case): `fold` reads a setting's name with a Cyrillic `О` for its `O` as the name it imitates.
_LOOK_ALIKES = str.maketrans({
    **dict.fromkeys("АΑ", "A"), **dict.fromkeys("ВΒ", "B"), **dict.fromkeys("СϹ", "C"), "Ԁ": "D",
    **dict.fromkeys("ЕΕ", "E"), **dict.fromkeys("НΗҺ", "H"), **dict.fromkeys("ІΙӀ", "I"), **dict.fromkeys("ЈͿ", "J"),
    **dict.fromkeys("КΚ", "K"), **dict.fromkeys("МΜ", "M"), "Ν": "N", **dict.fromkeys("ОΟ", "O"),
    **dict.fromkeys("РΡ", "P"), "Ԛ": "Q", "Ѕ": "S", **dict.fromkeys("ТΤ", "T"), **dict.fromkeys("УΥҮ", "Y"),
    **dict.fromkeys("ХΧ", "X"), "Ԝ": "W", "Ζ": "Z"})
#: A name at most this many edits (a letter inserted, deleted, replaced, or two neighbours swapped), once folded,
#: from a setting, or whose beginning is this close to the prefix, is taken for one of ours (`check_names`).
NEAR_MISS = 2


def fold(name: str) -> str:
    """A variable name as `check_names` compares it: NFKD (NFKC's compatibility folding, fullwidth `Ｒ` is `R`, with
    accents set apart: `É` is `E`), upper case, Cyrillic and Greek look-alikes as the Latin letters they imitate, and
    only `A-Z0-9` kept.

    >>> fold("reload_lifecycle-path_root"), fold("ＲＥＬＯＡＤ_LIFECYCLE"), fold("RELOAD_LIFЕCYCLE")  # Cyrillic Е
    ('RELOADLIFECYCLEPATHROOT', 'RELOADLIFECYCLE', 'RELOADLIFECYCLE')
    """
    return re.sub(r"[^A-Z0-9]", "", unicodedata.normalize("NFKD", name).upper().translate(_LOOK_ALIKES))


def edit_distance(a: str, b: str, limit: int, *, prefix: bool = False) -> int:
    """The optimal-string-alignment distance between `a` and `b` (insertions, deletions, replacements and swaps of
    two neighbours, one edit each), or `limit + 1` for anything above `limit`. `prefix`: between `a` and the
    closest beginning of `b` (what the rest of `b` holds does not count).

    >>> edit_distance("RELOAD", "RELAOD", 2), edit_distance("RELOAD", "RELOADED", 2, prefix=True)
    (1, 0)
    """
    if prefix:
        b = b[:len(a) + limit]
    elif abs(len(a) - len(b)) > limit:
        return limit + 1
    far = limit + 1
    before, row = [far] * (len(b) + 1), list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        now = [i] + [far] * len(b)
        for j in range(max(1, i - limit), min(len(b), i + limit) + 1):  # the band: outside it, more than `limit`
            now[j] = min(row[j] + 1, now[j - 1] + 1, row[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                now[j] = min(now[j], before[j - 2] + 1)
        if min(now) > limit:
            return far
        before, row = row, now
    return min(min(row) if prefix else row[-1], far)


def check_names(prefix: str, known: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """Every variable that looks like one of this package's must be one of `known`, else `EnvSettingError` naming
    it and the setting it is closest to: a misspelled switch is never silently ignored (a misspelled
    `RELOAD_LIFECYCLE_PATH_ROOT` would fail open). Every name is compared `fold`ed (case, `_`/`-`, fullwidth and
    Cyrillic or Greek look-alike letters do not count) and looks like ours when it is at most `NEAR_MISS` edits from
    a known name, or its beginning at most `NEAR_MISS` edits from `prefix`'s. Other names (PATH, CUDA_*, VLLM_*)
    are many more edits away: see docs/vllm.md, "Settings"."""
    env = os.environ if environ is None else environ
    head = fold(prefix)
    folded = {fold(k): k for k in known}
    unknown = sorted(n for n in env if n not in known and _looks_known(fold(n), head, folded))
    if not unknown:
        return
    name = unknown[0]
    close = _closest(fold(name), head, folded)
    hint = f"did you mean {close}?" if close else f"the settings are {', '.join(known)}"
    odd = list(dict.fromkeys(c for c in name if not (c.isascii() and c.isprintable())))
    if odd:  # a look-alike letter is invisible in the message: name it
        hint += " (it holds non-ASCII characters: " + ", ".join(
            f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in odd[:4]) + (", ..." if odd[4:] else "") + ")"
    elif close and close == name.upper():
        hint += " (names are case-sensitive)"
    elif not fold(name).startswith(head):
        hint += f" (a name within {NEAR_MISS} edits of a setting's or of {prefix} is refused, not ignored)"
    more = f"; and {len(unknown) - 1} more unknown {prefix}* name(s)" if len(unknown) > 1 else ""
    raise EnvSettingError(name[:_SHOWN], env[name], f"is not a reload-lifecycle setting: {hint}{more}")


def _looks_known(name: str, head: str, folded: Mapping[str, str]) -> bool:
    return bool(name) and (edit_distance(head, name, NEAR_MISS, prefix=True) <= NEAR_MISS
                           or any(edit_distance(name, k, NEAR_MISS) <= NEAR_MISS for k in folded))


def _closest(name: str, head: str, folded: Mapping[str, str]) -> str | None:
    """The known name closest to `name` (both folded): within `NEAR_MISS` edits; else, past the prefix, the one whose
    rest is within half its length of `name`'s rest, or holds it or is held in it (4 letters at least:
    `..._TAKEOVER_IDLE_S`, `..._PARTIAL_POLICY`), the fewest edits away; None when none is."""
    near = min(folded, key=lambda k: edit_distance(name, k, len(k)))
    if edit_distance(name, near, NEAR_MISS) <= NEAR_MISS:
        return folded[near]
    cut = min(range(max(0, len(head) - NEAR_MISS), len(head) + NEAR_MISS + 1),
              key=lambda n: (edit_distance(head, name[:n], NEAR_MISS), abs(n - len(head))))
    if edit_distance(head, name[:cut], NEAR_MISS) > NEAR_MISS:
        return None
    rest = name[cut:]
    scored = []
    for known, own in ((k, k[len(head):] if k.startswith(head) else k) for k in folded):
        edits = edit_distance(rest, own, len(rest) + len(own))
        if edits <= len(own) // 2 or (min(len(rest), len(own)) >= 4 and (own in rest or rest in own)):
            scored.append((edits, known))
    return folded[min(scored)[1]] if scored else None


def choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    """One of `allowed` (any case, surrounding blanks ignored); unset or blank gives `default`; anything else
    raises `EnvSettingError` naming the variable and what it accepts."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or default
    if value not in allowed:
        raise EnvSettingError(name, raw, f"is not one of: {', '.join(allowed)}")
    return value
