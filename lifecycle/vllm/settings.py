"""Engine-wide settings of the vLLM plugin, read from the environment of each vLLM process, in one place.

- `RELOAD_LIFECYCLE_PARTIAL`: `refuse` (default) or `keep`, what a draft reload that did not send every
  tensor does (`partial_policy`);
- `RELOAD_LIFECYCLE_PATH_ROOT`: an absolute folder; RPC and transfer-engine paths must lie inside it
  (`allowed_root`). Unset: any path the worker process can read;
- `RELOAD_LIFECYCLE_AUDIT_DIR`, `RELOAD_LIFECYCLE_AUDIT_CONSOLE`: where audit events go (`plugin`).

Any other variable named like these (`RELOAD_LIFECYCLE_PATH_ROT`, `reload_lifecycle_path_root`) is an error
naming it and the closest known name (`check_names`): a misspelled root must not fail open.

All are parsed by `lifecycle.env`: a value that is not one of those is an error naming the variable and what it
accepts (the plugin reads every setting when it activates, so a bad one stops the engine at start), never a silent
default. A folder is stripped of surrounding blanks and a leading `~` is expanded; a relative one, a `~` that does
not expand or a control character is refused (`env.path`).

>>> import os
>>> os.environ["RELOAD_LIFECYCLE_PARTIAL"] = "Keep"; partial_policy()
'keep'
>>> os.environ["RELOAD_LIFECYCLE_PARTIAL"] = "maybe"; partial_policy()
Traceback (most recent call last):
...
lifecycle.env.EnvSettingError: RELOAD_LIFECYCLE_PARTIAL='maybe' is not one of: refuse, keep
>>> del os.environ["RELOAD_LIFECYCLE_PARTIAL"]; partial_policy()
'refuse'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, cast

from .. import env
from ..env import EnvSettingError, choice

__all__ = ["AUDIT_CONSOLE_ENV", "AUDIT_DIR_ENV", "ENV_PREFIX", "KNOWN_ENV", "PARTIAL_ENV", "PARTIAL_POLICIES",
           "PATH_ROOT_ENV", "PartialPolicy", "allowed_root", "check_names", "check_partial", "partial_policy"]

#: The prefix of every switch of this package.
ENV_PREFIX = "RELOAD_LIFECYCLE_"
PARTIAL_ENV = "RELOAD_LIFECYCLE_PARTIAL"
PATH_ROOT_ENV = "RELOAD_LIFECYCLE_PATH_ROOT"
#: A folder: each process writes its audit events to `audit-<host>-<pid>.jsonl` there (`plugin`).
AUDIT_DIR_ENV = "RELOAD_LIFECYCLE_AUDIT_DIR"
#: A switch (1/true/yes/on): also print readable events to stderr.
AUDIT_CONSOLE_ENV = "RELOAD_LIFECYCLE_AUDIT_CONSOLE"
#: Every setting; any other `RELOAD_LIFECYCLE_*` name is refused (`check_names`).
KNOWN_ENV = (PARTIAL_ENV, PATH_ROOT_ENV, AUDIT_DIR_ENV, AUDIT_CONSOLE_ENV)


def check_names() -> None:
    """Refuse a variable named like a setting that is none (`env.check_names`), naming the closest one."""
    env.check_names(ENV_PREFIX, KNOWN_ENV)


PartialPolicy = Literal["refuse", "keep"]
PARTIAL_POLICIES: tuple[PartialPolicy, ...] = ("refuse", "keep")


def check_partial(value: object, what: str = "partial") -> PartialPolicy:
    """A per-call `partial=` argument: None means the engine-wide setting."""
    if value is None:
        return partial_policy()
    if value not in PARTIAL_POLICIES:
        raise ValueError(f"{what}={value!r}: expected one of {', '.join(map(repr, PARTIAL_POLICIES))} or None "
                         f"(the engine-wide {PARTIAL_ENV}, default 'refuse')")
    return value


def partial_policy() -> PartialPolicy:
    """`refuse` (default): a draft reload that leaves a tensor unsent quarantines the draft. `keep`: tensors not
    sent keep their last values, bit for bit, and only the layers that changed are refreshed."""
    return cast(PartialPolicy, choice(PARTIAL_ENV, PARTIAL_POLICIES, "refuse"))


def allowed_root() -> Path | None:
    """The folder RPC paths must lie in (resolved, symlinks followed), or None: any path the worker can read."""
    raw = os.environ.get(PATH_ROOT_ENV, "")
    root = env.path(PATH_ROOT_ENV)  # stripped, ~ expanded; a relative one refused, naming the variable
    if root is None:
        return None
    try:
        is_dir = root.is_dir()
    except OSError as e:  # a name too long, a loop of links: bounded, naming the variable
        raise EnvSettingError(PATH_ROOT_ENV, raw, f"cannot be used as a folder: {e.strerror or e}") from None
    if not is_dir:
        raise EnvSettingError(PATH_ROOT_ENV, raw, "must be an absolute path to an existing folder")
    return root.resolve()
