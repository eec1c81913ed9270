"""One push owns the draft from its start to its finish: the plugin's record of a worker's open weight-update session
(`Push`, kept in `WORKER.sessions`), its identity, and the rules that keep a second trainer's calls out of it.

vLLM's RL routes carry no identity of their caller: two trainers (or one that retries) reach one worker session. The
plugin tells pushes apart by what it can see, and refuses where it cannot:

- its own identity: the draft's reload epoch the push writes ("epoch 12"; a policy push: "a policy push"), shown
  beside the trainer's `weight_version` or push id wherever the push is named (audit, refusals, the report);
- an optional push id the trainer sends in `update_info` (`PUSH_ID_KEY`): the first chunk decides whether the push
  has one, and then every chunk must carry the same (`check_chunk`), and the finish must carry it as its
  `weight_version` (`check_finish`: vLLM's finish carries nothing else). A call of another push is refused with
  `CONFLICT` (409), before anything is written, and the open push goes on untouched;
- timing: a start while a draft push is open and had a call less than `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S`
  ago is refused (`sessions.py`); only an idle push is taken over, or one named to `take_over`;
- bytes: a tensor re-sent in one push is compared with what the push wrote (`chunks.py`): the same bytes are
  skipped (a retry), other bytes refuse the push.

`weight_version` and the push id are bounded (`check_label`): at most `LABEL_CAP` characters of `LABEL_CHARS`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONFLICT", "LABEL_CAP", "LABEL_CHARS", "PUSH_ID_KEY", "REFUSED", "Push", "WeightUpdateRefused",
           "check_chunk", "check_finish", "check_label", "push_name", "take_push_id"]

#: The start of every refusal message: the API server process finds it in vLLM's wrapped error.
REFUSED = "reload-lifecycle refused"
#: The start of a refusal of a call that is not the open push's (answered 409, the open push untouched).
CONFLICT = f"{REFUSED} (another push)"
#: The key of `update_info` that carries the trainer's push id (taken out before vLLM parses `update_info`).
PUSH_ID_KEY = "push_id"
#: A `weight_version` or push id: at most this many characters ...
LABEL_CAP = 128
#: ... each one of these (no blank, quote, backslash or control character: it is a label of /metrics and a field of
#: the audit, and a line of the server's log)
LABEL_CHARS = "A-Z a-z 0-9 . _ - : + / @ = #"
_LABEL = re.compile(rf"[A-Za-z0-9._:+/@=#-]{{1,{LABEL_CAP}}}")


def push_name(epoch: int, weight_version: str | None = None) -> str:
    """A draft push as the plugin names it: the reload epoch it wrote, beside the trainer's version when it gave
    one (pushes without one are told apart all the same).

    >>> push_name(12), push_name(12, "step-1200")
    ('epoch 12', 'epoch 12 (weight_version step-1200)')
    """
    return f"epoch {epoch}" if weight_version is None else f"epoch {epoch} (weight_version {weight_version})"


class WeightUpdateRefused(RuntimeError):
    """A weight-update call the plugin refused or ended; the message names what and says what state it left."""


def check_label(value: object, what: str) -> str | None:
    """`value` when it is None or a bounded label (`LABEL_CAP` characters of `LABEL_CHARS`); else a ValueError
    (TypeError for a value that is not a string) naming `what`, the limit and what it got (never the value itself
    when it is long).

    >>> check_label("step-1200", "weight_version")
    'step-1200'
    >>> try:
    ...     check_label("x" * 200, "weight_version")
    ... except ValueError as e:
    ...     print(str(e).replace(LABEL_CHARS, "..."))
    weight_version must be 1 to 128 characters of ..., got a string of 200 characters; nothing was changed
    """
    if value is None:
        return None
    if type(value) is not str:
        raise TypeError(f"{what} must be a string or null, got {type(value).__name__}; nothing was changed")
    if _LABEL.fullmatch(value) is None:
        got = f"{value!r}" if len(value) <= 40 and value.isprintable() else f"a string of {len(value):,} characters"
        raise ValueError(f"{what} must be 1 to {LABEL_CAP} characters of {LABEL_CHARS}, got {got}; nothing was "
                         "changed")
    return value


def take_push_id(update_info: object) -> tuple[Any, str | None]:
    """`update_info` without the push id, and the push id (None: none sent). A list (one `update_info` per global
    rank, as vLLM takes it) must carry one id in all its items or in none. Copies: the caller's dict is left as
    it is. Anything that is not a dict or list is returned as it is (vLLM refuses it)."""
    if isinstance(update_info, Mapping):
        rest = {k: v for k, v in update_info.items() if k != PUSH_ID_KEY}
        return rest, check_label(update_info.get(PUSH_ID_KEY), f"update_info[{PUSH_ID_KEY!r}]")
    if isinstance(update_info, list) and all(isinstance(item, Mapping) for item in update_info):
        taken = [take_push_id(item) for item in update_info]
        ids = {push_id for _, push_id in taken}
        if len(ids) > 1:
            raise ValueError(f"update_info: every rank's item must carry the same {PUSH_ID_KEY!r} (or none), got "
                             f"{len(ids)} different ones; nothing was changed")
        return [rest for rest, _ in taken], next(iter(ids), None)
    return update_info, None


@dataclass(frozen=True)
class Source:
    """Where a tensor a push wrote came from: its file as it was when read, and its byte range (`chunks.py`)."""

    path: str
    identity: Any  # lifecycle.checkpoint.FileIdentity
    start: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Push:
    """The plugin's record of a worker's open weight-update session: one push, from its start to its finish."""

    draft: bool
    started: float
    last_call: float
    #: the draft's reload epoch this push writes (None: a policy push, or no lifecycle draft)
    epoch: int | None = None
    chunks: int = 0
    #: the trainer's, at the finish (or the push id, which the finish must repeat)
    weight_version: str | None = None
    push_id: str | None = None
    #: the first chunk decided whether the push has an id
    bound: bool = False
    #: the push this one ended when it started (its identity), if any: its trainer may still be calling
    took_over: str | None = None
    #: checkpoint tensor name -> where this push's bytes for it came from (the safetensors_file backend)
    written: dict[str, Source] = field(default_factory=dict)
    #: tensors re-sent with the same bytes, skipped
    resent: int = 0

    @property
    def identity(self) -> str:
        """The plugin's own name of the push: `epoch N`, the draft reload epoch it writes."""
        if not self.draft:
            return "a policy push"
        return push_name(self.epoch) if self.epoch is not None else "a draft push"

    def shown(self, now: float | None = None) -> str:
        """The push for a message: identity, push id, age, chunks and idle time."""
        now = time.monotonic() if now is None else now
        named = f" (push_id {self.push_id})" if self.push_id is not None else ""
        return (f"{self.identity}{named}, opened {now - self.started:.1f} s ago, {self.chunks} update_weights "
                f"chunk(s), its last call {now - self.last_call:.1f} s ago")

    def fields(self, now: float | None = None) -> dict[str, Any]:
        """The push's fields in its audit events."""
        now = time.monotonic() if now is None else now
        out: dict[str, Any] = {"push": self.identity, "chunks": self.chunks, "open_s": round(now - self.started, 3),
                               "idle_s": round(now - self.last_call, 3), "weight_version": self.weight_version}
        if self.push_id is not None:
            out["push_id"] = self.push_id
        if self.resent:
            out["resent_tensors"] = self.resent
        if self.took_over is not None:
            out["took_over"] = self.took_over
        return out


def check_chunk(push: Push, push_id: str | None) -> None:
    """A chunk is the open push's, or refused (`CONFLICT`) before anything is written. The first chunk decides
    whether the push has an id."""
    if not push.bound:
        push.bound, push.push_id = True, push_id
        return
    if push_id == push.push_id:
        return
    sent = f"push_id {push_id}" if push_id is not None else f"no {PUSH_ID_KEY}"
    raise WeightUpdateRefused(
        f"{CONFLICT} update_weights: this chunk carries {sent}, but the open push is {push.shown()}"
        f"{' and sent no push id' if push.push_id is None else ''}: it is another push's chunk. Nothing of it was "
        "written; the open push goes on.")


def check_finish(push: Push, weight_version: str | None) -> None:
    """A finish of a push with a push id must carry it as `weight_version`, or it is refused (`CONFLICT`) and the
    open push goes on untouched."""
    if push.push_id is None or weight_version == push.push_id:
        return
    sent = f"weight_version {weight_version}" if weight_version is not None else "no weight_version"
    raise WeightUpdateRefused(
        f"{CONFLICT} finish_weight_update: it carries {sent}, but the open push is {push.shown()}, whose finish "
        f"carries its push id as weight_version: it is another push's finish. Nothing was changed; the open push "
        "goes on.")
