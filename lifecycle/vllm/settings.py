"""Engine-wide settings of the vLLM plugin, read from the environment of each vLLM process, in one place.

- `RELOAD_LIFECYCLE_PARTIAL`: `refuse` (default) or `keep`, what a draft reload that did not send every
  tensor does (`partial_policy`);
- `RELOAD_LIFECYCLE_PATH_ROOT`: an absolute folder; RPC and transfer-engine paths must lie inside it
  (`allowed_root`). Unset: any path the worker process can read.

A value that is not one of those is an error naming the variable and what it accepts (the plugin reads every
setting when it activates, so a bad one stops the engine at start), never a silent default.

>>> import os
>>> os.environ["RELOAD_LIFECYCLE_PARTIAL"] = "Keep"; partial_policy()
'keep'
>>> os.environ["RELOAD_LIFECYCLE_PARTIAL"] = "maybe"; partial_policy()
Traceback (most recent call last):
...
ValueError: RELOAD_LIFECYCLE_PARTIAL='maybe' is not one of: refuse, keep
>>> del os.environ["RELOAD_LIFECYCLE_PARTIAL"]; partial_policy()
'refuse'
>>> flag("X_UNSET_FOR_DOCTEST"), flag("X_UNSET_FOR_DOCTEST", default=True)
(False, True)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, cast

__all__ = ["PARTIAL_ENV", "PARTIAL_POLICIES", "PATH_ROOT_ENV", "PartialPolicy", "allowed_root", "check_partial",
           "choice", "flag", "partial_policy"]

PARTIAL_ENV = "RELOAD_LIFECYCLE_PARTIAL"
PATH_ROOT_ENV = "RELOAD_LIFECYCLE_PATH_ROOT"
PartialPolicy = Literal["refuse", "keep"]
PARTIAL_POLICIES: tuple[PartialPolicy, ...] = ("refuse", "keep")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def flag(name: str, *, default: bool = False) -> bool:
    """A boolean switch: 1/true/yes/on or 0/false/no/off (any case); unset is `default`."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a switch: use one of {', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}")


def choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    """One of `allowed` (any case, surrounding blanks ignored); unset or empty is `default`."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or default
    if value not in allowed:
        raise ValueError(f"{name}={raw!r} is not one of: {', '.join(allowed)}")
    return value


def check_partial(value: object, what: str = "partial") -> PartialPolicy:
    """A per-call `partial=` argument: None means the engine-wide setting."""
    if value is None:
        return partial_policy()
    if value not in PARTIAL_POLICIES:
        raise ValueError(f"{what}={value!r}: expected one of {', '.join(map(repr, PARTIAL_POLICIES))} or None "
                         f"(the engine-wide {PARTIAL_ENV}, default 'refuse')")
    return cast(PartialPolicy, value)


def partial_policy() -> PartialPolicy:
    """`refuse` (default): a draft reload that leaves a tensor unsent quarantines the draft. `keep`: tensors not
    sent keep their last values, bit for bit, and only the layers that changed are refreshed."""
    return cast(PartialPolicy, choice(PARTIAL_ENV, PARTIAL_POLICIES, "refuse"))


def allowed_root() -> Path | None:
    """The folder RPC paths must lie in (resolved, symlinks followed), or None: any path the worker can read."""
    raw = os.environ.get(PATH_ROOT_ENV, "").strip()
    if not raw:
        return None
    root = Path(raw)
    if not root.is_absolute() or not root.is_dir():
        raise ValueError(f"{PATH_ROOT_ENV}={raw!r} must be an absolute path to an existing folder")
    return root.resolve()
