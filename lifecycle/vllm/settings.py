"""Every setting of the vLLM plugin, one record each (`SETTINGS`), read from the environment of each vLLM process.

A record (`Setting`) holds the variable's name, its parser, its default, what it accepts, one line of doc, its scope
(`engine-wide`, or `per-call default`: what a call that does not say uses) and the process that reads it. From the
records come `KNOWN_ENV`, the plugin's check at activation (`check_all`: every name, every value) and the settings
table of docs/vllm.md and docs/operating.md (`python docs/generate.py`); the functions below read them.

A name that looks like a setting's and is none (`RELOAD_LIFECYLE_PATH_ROOT`, `reload_lifecycle_path_root`,
`RELAOD_LIFECYCLE_PATH_ROOT`, a Cyrillic `О` in it) is an error naming it and the setting it is closest to
(`check_names`, `env.check_names`): a misspelled root must not fail open.

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

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

from .. import env
from ..env import EnvSettingError, choice

__all__ = ["ACCEPTANCE_EVERY_STEPS_ENV", "ACCEPTANCE_FLOOR_ENV", "ACCEPTANCE_HEALTHY_ENV", "ACCEPTANCE_MIN_TOKENS_ENV",
           "AUDIT_CONSOLE_ENV", "AUDIT_DIR_ENV", "AUDIT_MAX_BYTES_ENV", "AUDIT_MIN_BYTES", "ENV_PREFIX", "KNOWN_ENV",
           "PARTIAL_ENV", "PARTIAL_POLICIES", "PATH_ROOT_ENV", "SETTINGS", "TAKEOVER_IDLE_ENV", "AcceptanceThresholds",
           "PartialPolicy", "Setting", "acceptance_thresholds", "allowed_root", "audit_console", "audit_dir",
           "audit_max_bytes", "check_all", "check_names", "check_partial", "partial_policy", "takeover_idle_s"]

#: The prefix of every switch of this package.
ENV_PREFIX = "RELOAD_LIFECYCLE_"
PARTIAL_ENV = "RELOAD_LIFECYCLE_PARTIAL"
PATH_ROOT_ENV = "RELOAD_LIFECYCLE_PATH_ROOT"
AUDIT_DIR_ENV = "RELOAD_LIFECYCLE_AUDIT_DIR"
AUDIT_CONSOLE_ENV = "RELOAD_LIFECYCLE_AUDIT_CONSOLE"
AUDIT_MAX_BYTES_ENV = "RELOAD_LIFECYCLE_AUDIT_MAX_BYTES"
ACCEPTANCE_FLOOR_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR"
ACCEPTANCE_HEALTHY_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_HEALTHY"
ACCEPTANCE_MIN_TOKENS_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS"
ACCEPTANCE_EVERY_STEPS_ENV = "RELOAD_LIFECYCLE_ACCEPTANCE_EVERY_STEPS"
TAKEOVER_IDLE_ENV = "RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S"

T = TypeVar("T")
Scope = Literal["engine-wide", "per-call default"]
#: Which vLLM process acts on it (the plugin checks every setting in every process it activates in).
Reader = Literal["every process", "workers", "front process"]


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment setting: `parse(name, default)` reads it from `os.environ` (unset or blank: `default`) and
    raises `EnvSettingError` naming the variable for a value it does not accept."""

    name: str
    parse: Callable[[str, T], T]
    default: T
    accepts: str  # what values it takes, as the docs' table says it
    doc: str  # one line
    scope: Scope
    read_in: Reader

    def read(self) -> T:
        return self.parse(self.name, self.default)


# ---- parsers: (name, default) -> value ---------------------------------------------------------------------------
PartialPolicy = Literal["refuse", "keep"]
PARTIAL_POLICIES: tuple[PartialPolicy, ...] = ("refuse", "keep")


def _partial(name: str, default: PartialPolicy) -> PartialPolicy:
    return cast(PartialPolicy, choice(name, PARTIAL_POLICIES, default))


def _folder(name: str, default: Path | None) -> Path | None:
    return env.path(name) or default


def _existing_folder(name: str, default: Path | None) -> Path | None:
    """A folder that exists (resolved, symlinks followed)."""
    raw = os.environ.get(name, "")
    root = env.path(name)  # stripped, ~ expanded; a relative one refused, naming the variable
    if root is None:
        return default
    try:
        is_dir = root.is_dir()
    except OSError as e:  # a name too long, a loop of links: bounded, naming the variable
        raise EnvSettingError(name, raw, f"cannot be used as a folder: {e.strerror or e}") from None
    if not is_dir:
        raise EnvSettingError(name, raw, "must be an absolute path to an existing folder")
    return root.resolve()


def _real(low: float, high: float) -> Callable[[str, float], float]:
    def parse(name: str, default: float) -> float:
        raw = os.environ.get(name, "")
        if not raw.strip():
            return default
        try:
            value = float(raw.strip())
        except ValueError:
            raise EnvSettingError(name, raw, "is not a number") from None
        if not low <= value <= high:  # NaN included
            raise EnvSettingError(name, raw, f"must be from {low} to {high}")
        return value
    return parse


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise EnvSettingError(name, raw, "is not a number of seconds >= 0")
    return value


#: the smallest audit file a rotation leaves (a full held batch of events is about 30 KB)
AUDIT_MIN_BYTES = 65536


def _file_size(name: str, default: int) -> int:
    """Bytes: 0 (off) or at least `AUDIT_MIN_BYTES`; a K, M or G suffix multiplies by 1024 each."""
    raw = os.environ.get(name, "")
    text = raw.strip().upper().removesuffix("B")
    if not text:
        return default
    scale = 1024 ** (" KMG".index(text[-1]) if text[-1] in "KMG" else 0)
    try:
        value: int = int(text[:-1] if text[-1] in "KMG" else text) * scale
    except ValueError:
        raise EnvSettingError(name, raw, "is not a number of bytes (an integer, or with K, M or G)") from None
    if value != 0 and value < AUDIT_MIN_BYTES:
        raise EnvSettingError(name, raw, f"must be 0 (no rotation) or at least {AUDIT_MIN_BYTES} bytes")
    return value


def _integer(low: int) -> Callable[[str, int], int]:
    def parse(name: str, default: int) -> int:
        raw = os.environ.get(name, "")
        if not raw.strip():
            return default
        try:
            value = int(raw.strip())
        except ValueError:
            raise EnvSettingError(name, raw, "is not an integer") from None
        if value < low:
            raise EnvSettingError(name, raw, f"must be >= {low}")
        return value
    return parse


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


_CANARY = AcceptanceThresholds()

# ---- the registry ------------------------------------------------------------------------------------------------
PARTIAL: Setting[PartialPolicy] = Setting(
    PARTIAL_ENV, _partial, "refuse", accepts="`refuse` or `keep`", scope="per-call default", read_in="workers",
    doc="what a draft reload that did not send every tensor does: `refuse` quarantines the draft, `keep` keeps the "
        "unsent tensors' last values (per call: `partial=`)")
PATH_ROOT: Setting[Path | None] = Setting(
    PATH_ROOT_ENV, _existing_folder, None, accepts="an absolute path to an existing folder", scope="engine-wide",
    read_in="workers", doc="RPC and transfer-engine paths must lie inside it, and every file they lead to (unset: "
                           "any path the worker process can read)")
AUDIT_DIR: Setting[Path | None] = Setting(
    AUDIT_DIR_ENV, _folder, None, accepts="an absolute folder path", scope="engine-wide", read_in="every process",
    doc="each process writes its audit events to `audit-<host>-<pid>.jsonl` there (unset: each lifecycle keeps "
        "them in its memory ring)")
AUDIT_CONSOLE: Setting[bool] = Setting(
    AUDIT_CONSOLE_ENV, env.flag, False, accepts="1/true/yes/on or 0/false/no/off/empty", scope="engine-wide",
    read_in="every process", doc="also print readable audit events to stderr")
AUDIT_MAX_BYTES: Setting[int] = Setting(
    AUDIT_MAX_BYTES_ENV, _file_size, 64 * 2**20, accepts="bytes (K, M, G: 1024s), 0 or at least 64K",
    scope="engine-wide", read_in="every process",
    doc="an audit file about to grow past it is renamed `<file>.1`, `.2`, ... (oldest first) and a new one begun; "
        "`reload-lifecycle audit` reads the set in order and names a missing file (0: never rotated)")
ACCEPTANCE_FLOOR: Setting[float] = Setting(
    ACCEPTANCE_FLOOR_ENV, _real(0.0, 1.0), _CANARY.floor, accepts="a number from 0 to 1, below `_HEALTHY`",
    scope="engine-wide", read_in="front process",
    doc="the acceptance canary: an accepted share at or below it after a push is a collapse")
ACCEPTANCE_HEALTHY: Setting[float] = Setting(
    ACCEPTANCE_HEALTHY_ENV, _real(0.0, 1.0), _CANARY.healthy, accepts="a number from 0 to 1", scope="engine-wide",
    read_in="front process", doc="the acceptance canary: the period before the push must have been at or above it")
ACCEPTANCE_MIN_TOKENS: Setting[int] = Setting(
    ACCEPTANCE_MIN_TOKENS_ENV, _integer(1), _CANARY.min_tokens, accepts="an integer >= 1", scope="engine-wide",
    read_in="front process",
    doc="the acceptance canary: neither share counts before its period verified this many draft tokens")
ACCEPTANCE_EVERY_STEPS: Setting[int] = Setting(
    ACCEPTANCE_EVERY_STEPS_ENV, _integer(0), _CANARY.every_steps, accepts="an integer >= 0", scope="engine-wide",
    read_in="front process",
    doc="an `acceptance` audit event every that many engine steps with draft tokens (0: only at pushes)")
TAKEOVER_IDLE: Setting[float] = Setting(
    TAKEOVER_IDLE_ENV, _seconds, 60.0, accepts="seconds, a finite number >= 0", scope="engine-wide",
    read_in="workers", doc="a start while a draft push is open and had a call less than this many seconds ago is "
                           "refused (409, naming the push and how to take it over); an idle push is taken over (0: "
                           "every start takes the open push over, as before 0.2.0)")

#: Every setting, in the docs' order; any other name like theirs is refused (`check_names`).
SETTINGS: tuple[Setting[Any], ...] = (PARTIAL, PATH_ROOT, AUDIT_DIR, AUDIT_CONSOLE, AUDIT_MAX_BYTES,
                                      ACCEPTANCE_FLOOR, ACCEPTANCE_HEALTHY, ACCEPTANCE_MIN_TOKENS,
                                      ACCEPTANCE_EVERY_STEPS, TAKEOVER_IDLE)
KNOWN_ENV: tuple[str, ...] = tuple(s.name for s in SETTINGS)


def check_names() -> None:
    """Refuse a variable named like a setting that is none (`env.check_names`), naming the closest one."""
    env.check_names(ENV_PREFIX, KNOWN_ENV)


def check_all() -> None:
    """What the plugin runs first when it activates, in every vLLM process: every variable's name (`check_names`),
    every setting's value, and what holds between them (the canary's floor below its healthy share). The first
    problem raises `EnvSettingError` naming the variable; nothing is changed."""
    check_names()
    for setting in SETTINGS:
        setting.read()
    acceptance_thresholds()


# ---- what the rest of the plugin calls ---------------------------------------------------------------------------
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
    return PARTIAL.read()


def allowed_root() -> Path | None:
    """The folder RPC paths must lie in (resolved, symlinks followed), or None: any path the worker can read."""
    return PATH_ROOT.read()


def audit_dir() -> Path | None:
    """The folder each process writes its audit file to, or None: events stay in each lifecycle's memory ring."""
    return AUDIT_DIR.read()


def audit_console() -> bool:
    """Whether readable audit events are also printed to stderr."""
    return AUDIT_CONSOLE.read()


def audit_max_bytes() -> int | None:
    """The size past which an audit file is rotated, or None: never."""
    return AUDIT_MAX_BYTES.read() or None


def takeover_idle_s() -> float:
    """`RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S`: seconds (>= 0; unset or blank: 60): an open draft push that had a
    call more recently than this is not taken over by a new start (`online.sessions`). Why 60: longer than any pause
    between the calls of one live push (a trainer writes or gathers the next chunk in seconds), shorter than a
    crashed trainer's restart, whose first start then takes its abandoned push over without an operator."""
    return TAKEOVER_IDLE.read()


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
    floor, healthy = ACCEPTANCE_FLOOR.read(), ACCEPTANCE_HEALTHY.read()
    if floor >= healthy:
        raw = os.environ.get(ACCEPTANCE_FLOOR_ENV, str(floor))
        raise EnvSettingError(ACCEPTANCE_FLOOR_ENV, raw, f"must lie below {ACCEPTANCE_HEALTHY_ENV} ({healthy})")
    return AcceptanceThresholds(floor, healthy, ACCEPTANCE_MIN_TOKENS.read(), ACCEPTANCE_EVERY_STEPS.read())
