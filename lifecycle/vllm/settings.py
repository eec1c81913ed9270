"""Engine-wide settings of the vLLM plugin, read from the environment of each vLLM process, in one place.

- `RELOAD_LIFECYCLE_PARTIAL`: `refuse` (default) or `keep`, what a draft reload that did not send every
  tensor does (`partial_policy`);
- `RELOAD_LIFECYCLE_PATH_ROOT`: an absolute folder; RPC and transfer-engine paths must lie inside it
  (`allowed_root`). Unset: any path the worker process can read;
- `RELOAD_LIFECYCLE_AUDIT_DIR`, `RELOAD_LIFECYCLE_AUDIT_CONSOLE`: where audit events go (`plugin`);
- `RELOAD_LIFECYCLE_ACCEPTANCE_*`: the acceptance canary's thresholds (`acceptance_thresholds`, below).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from .. import env
from ..env import EnvSettingError, choice

__all__ = ["ACCEPTANCE_EVERY_STEPS_ENV", "ACCEPTANCE_FLOOR_ENV", "ACCEPTANCE_HEALTHY_ENV", "ACCEPTANCE_MIN_TOKENS_ENV",
           "AUDIT_CONSOLE_ENV", "AUDIT_DIR_ENV", "ENV_PREFIX", "KNOWN_ENV", "PARTIAL_ENV", "PARTIAL_POLICIES",
           "PATH_ROOT_ENV", "AcceptanceThresholds", "PartialPolicy", "acceptance_thresholds", "allowed_root",
           "check_names", "check_partial", "partial_policy"]

#: The prefix of every switch of this package.
ENV_PREFIX = "RELOAD_LIFECYCLE_"
PARTIAL_ENV = "RELOAD_LIFECYCLE_PARTIAL"
PATH_ROOT_ENV = "RELOAD_LIFECYCLE_PATH_ROOT"
#: A folder: each process writes its audit events to `audit-<host>-<pid>.jsonl` there (`plugin`).
AUDIT_DIR_ENV = "RELOAD_LIFECYCLE_AUDIT_DIR"
#: A switch (1/true/yes/on): also print readable events to stderr.
AUDIT_CONSOLE_ENV = "RELOAD_LIFECYCLE_AUDIT_CONSOLE"


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


# ---- the acceptance canary (`canary.py`), read in the engine's front process ------------------------------------
ACCEPTANCE_FLOOR_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR"
ACCEPTANCE_HEALTHY_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_HEALTHY"
ACCEPTANCE_MIN_TOKENS_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS"
ACCEPTANCE_EVERY_STEPS_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_EVERY_STEPS"
#: Every setting; any other `RELOAD_LIFECYCLE_*` name is refused (`check_names`).
KNOWN_ENV = (PARTIAL_ENV, PATH_ROOT_ENV, AUDIT_DIR_ENV, AUDIT_CONSOLE_ENV, ACCEPTANCE_FLOOR_ENV, ACCEPTANCE_HEALTHY_ENV,
             ACCEPTANCE_MIN_TOKENS_ENV, ACCEPTANCE_EVERY_STEPS_ENV)


@dataclass(frozen=True)
class AcceptanceThresholds:
    """When the canary calls a push's acceptance a collapse, and how often it reports.

    - `floor` (0.05): an accepted share of draft tokens at or below it is a collapse. The failures users report
      fall to exactly 0 (vLLM #52487: mean acceptance length 1.685 -> 1.00; miles #1926: 2.71 -> 1.00); a draft
      this bad saves nothing and costs the verification of every draft token.
    - `healthy` (0.15): the period before the push must have been at or above it: "clearly above the floor"
      (three times it). #52487's draft (0.685 accepted per 3-token draft = 0.23) qualifies.
    - `min_tokens` (500): neither share counts before its period has verified this many draft tokens. A draft
      whose true share is 0.15 shows 0.05 or less over 500 tokens with a probability of about 1e-5 (about 170
      3-token drafts), so a healthy push is not flagged by chance; 500 tokens are seconds of serving.
    - `every_steps` (1000): an `acceptance` audit event every that many engine steps with draft tokens, besides
      the one at the next push; 0: only at pushes. At tens of steps per second that is an event every 20-50 s.
    """

    floor: float = 0.05
    healthy: float = 0.15
    min_tokens: int = 500
    every_steps: int = 1000

    def __post_init__(self) -> None:
        if not (0.0 <= self.floor < self.healthy <= 1.0):
            raise ValueError(f"acceptance thresholds: need 0 <= floor < healthy <= 1, got floor={self.floor} "
                             f"healthy={self.healthy}")
        if self.min_tokens < 1 or self.every_steps < 0:
            raise ValueError(f"acceptance thresholds: need min_tokens >= 1 and every_steps >= 0, got "
                             f"min_tokens={self.min_tokens} every_steps={self.every_steps}")


def acceptance_thresholds() -> AcceptanceThresholds:
    """The canary's thresholds from `RELOAD_LIFECYCLE_ACCEPTANCE_{FLOOR,HEALTHY,MIN_TOKENS,EVERY_STEPS}` (unset or
    blank: the defaults of `AcceptanceThresholds`). A value that is not a number in range raises `EnvSettingError`
    naming the variable.

    >>> os.environ["RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR"] = "0.5"
    >>> try:
    ...     acceptance_thresholds()
    ... except EnvSettingError as e:
    ...     print(e)
    RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR='0.5' must lie below RELOAD_LIFECYCLE_ACCEPTANCE_HEALTHY (0.15)
    >>> del os.environ["RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR"]; acceptance_thresholds().min_tokens
    500
    """
    default = AcceptanceThresholds()
    floor = _number(ACCEPTANCE_FLOOR_ENV, default.floor, float, 0.0, 1.0)
    healthy = _number(ACCEPTANCE_HEALTHY_ENV, default.healthy, float, 0.0, 1.0)
    if floor >= healthy:
        raw = os.environ.get(ACCEPTANCE_FLOOR_ENV, str(floor))
        raise EnvSettingError(ACCEPTANCE_FLOOR_ENV, raw, f"must lie below {ACCEPTANCE_HEALTHY_ENV} ({healthy})")
    return AcceptanceThresholds(floor, healthy, int(_number(ACCEPTANCE_MIN_TOKENS_ENV, default.min_tokens, int, 1)),
                                int(_number(ACCEPTANCE_EVERY_STEPS_ENV, default.every_steps, int, 0)))


def _number(name: str, default: float, kind: type[int] | type[float], low: float,
            high: float | None = None) -> float:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = kind(raw.strip())
    except ValueError:
        raise EnvSettingError(name, raw, f"is not {'an integer' if kind is int else 'a number'}") from None
    if value != value or value < low or (high is not None and value > high):  # NaN included
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise EnvSettingError(name, raw, f"must be {bound}")
    return value
