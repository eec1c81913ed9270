"""Supported vLLM by what it has, not by its version string.

Every vLLM name the plugin relies on is data: the patch registry's records (`compat.registry.PATCHES`: what it
changes and what it reads) and the family declarations (`families.FAMILIES`: classes, replaced builders, what they
set and read). `requirements()` lists them; `missing()` checks each against vLLM's sources (`sources.py`) and names
every one that is not there. The plugin runs this at activation on the installed vLLM and refuses to patch
anything if a name is missing; `make compat` runs it on the vLLM 0.33.0 wheel.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from ...errors import UnsupportedVLLMError
from ..compat import sources
from ..compat.records import SWAPS_CLASS, WRITES, Patch
from ..compat.registry import PATCHES
from ..compat.sources import Reader, SourceIndex
from ..compat.version import check_vllm_version, installed_version
from ..drafts.families import FAMILIES, VLLMDraftFamily

__all__ = ["DISABLE_HINT", "Requirement", "active_families", "check", "check_vllm", "missing", "requirements",
           "series_tuple"]

DISABLE_HINT = ("disable the plugin with VLLM_PLUGINS set to the comma-separated plugins you want without "
                "`reload_lifecycle` (an empty value loads none), or uninstall reload-lifecycle")

# kinds of requirement
MODULE, NAME, METHOD, ATTRIBUTE, SETS, READS, SETS_ONLY, RAISES, MENTIONS, CALLS = (
    "module", "name", "method", "attribute", "builder sets", "builder reads", "builder sets only", "raises",
    "mentions", "calls")


@dataclass(frozen=True)
class Requirement:
    """One vLLM name the plugin relies on, and who relies on it."""

    kind: str
    module: str
    name: str  # "function", "Class", "Class.attribute"
    user: str
    builders: tuple[str, ...] = ()  # for the builder kinds: the methods whose effects are checked
    text: str = ""  # RAISES: the message the method's source must hold

    def __str__(self) -> str:
        where = f"{self.module}.{self.name}" if self.name else self.module
        via = f" (in {', '.join(self.builders)})" if self.builders else ""
        what = f" {self.text!r}" if self.text else ""
        return f"{where}: {self.kind}{what}{via}, used by {self.user}"


def series_tuple(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def active_families(version: str | None) -> tuple[VLLMDraftFamily, ...]:
    """The families a vLLM release has: those from its series or earlier (all of them for an unparsable one)."""
    have = series_tuple(version) if version else None
    # every family's `since` is a series ("0.32"): never None
    return tuple(f for f in FAMILIES if have is None or cast("tuple[int, int]", series_tuple(f.since)) <= have)


def requirements(version: str | None = None) -> list[Requirement]:
    """Every vLLM name the plugin uses on `version` (None: every family)."""
    reqs = [_patch_requirement(p) for p in PATCHES if _has_series(version, p.since)]
    for fam in active_families(version):
        who = f"family {fam.name}"
        reqs.append(Requirement(MODULE, fam.module, "", who))
        reqs += [Requirement(NAME, fam.module, c, who) for c in (fam.causal_lm, fam.inner)]
        reqs += [Requirement(METHOD, fam.module, f"{fam.causal_lm}.load_weights", who),
                 Requirement(ATTRIBUTE, fam.module, f"{fam.causal_lm}.{fam.inner_model_attr}", who),
                 Requirement(METHOD, fam.module, f"{fam.inner}.precompute_and_store_context_kv", who),
                 Requirement(ATTRIBUTE, fam.module, f"{fam.inner}.layers", who)]
        reqs += [Requirement(METHOD, fam.module, f"{fam.inner}.{b}", who) for b in fam.builders]
        reqs += [Requirement(SETS, fam.module, f"{fam.inner}.{a}", who, fam.builders) for a in sorted(fam.sets)]
        reqs += [Requirement(READS, fam.module, f"{fam.inner}.{a}", who, fam.builders) for a in sorted(fam.reads)]
        reqs.append(Requirement(SETS_ONLY, fam.module, fam.inner, who, fam.builders))
        reqs += _structure_requirements(fam, who)
        reqs += _found_requirements(fam, who)
    return reqs


def _has_series(version: str | None, since: str) -> bool:
    have = series_tuple(version) if version else None
    return have is None or cast("tuple[int, int]", series_tuple(since)) <= have


def _patch_requirement(patch: Patch) -> Requirement:
    """What vLLM's sources must hold for a registry record: the name (a class for a class swap), or, for a
    private attribute written on an object no class of the module declares, a mention of it in the module."""
    who = f"{patch.user} ({patch.kind})"
    if patch.kind == SWAPS_CLASS:  # each family's class is required with the family
        return Requirement(MODULE, patch.module, "", who)
    owner = patch.target.partition(".")[0]
    if patch.kind == WRITES and not owner[:1].isupper():
        return Requirement(MENTIONS, patch.module, patch.target, who)
    if patch.calls:
        return Requirement(CALLS, patch.module, patch.target, who, text=patch.calls)
    return Requirement(ATTRIBUTE if "." in patch.target else NAME, patch.module, patch.target, who)


def _structure_requirements(fam: VLLMDraftFamily, who: str) -> list[Requirement]:
    """What the frozen structure (`structure.py`) relies on: each optional submodule's attribute, each per-call
    check's message in the ForCausalLM's `load_weights`, and the attributes that load_weights reads for them."""
    inner_prefix = f"{fam.inner_model_attr}."
    reqs = [Requirement(ATTRIBUTE, fam.module, f"{fam.inner}.{m.path.removeprefix(inner_prefix)}"
                        if m.path.startswith(inner_prefix) else f"{fam.causal_lm}.{m.path}", who)
            for m in fam.optional]
    load = f"{fam.causal_lm}.load_weights"
    reqs += [Requirement(RAISES, fam.module, load, who, text=c.message) for c in fam.checks]
    reqs += [Requirement(READS, fam.module, f"{fam.causal_lm}.{a}", who, ("load_weights",)) for a in fam.check_reads]
    return reqs


def _found_requirements(fam: VLLMDraftFamily, who: str) -> list[Requirement]:
    """What the family's other declarations name: the package vLLM's registry dispatches through, each loader
    copy's generator and module, each submodule's class, builder (setting only what the family binds) and the
    methods its buffers call."""
    reqs: list[Requirement] = []
    if fam.dispatched_by:
        reqs.append(Requirement(NAME, fam.dispatched_by, fam.causal_lm, who))
    for c in fam.duplicated:
        reqs += [Requirement(NAME, fam.module, c.function, who),
                 Requirement(ATTRIBUTE, fam.module, f"{fam.inner}.{c.module}", who)]
    for b in fam.submodule_buffers:
        reqs += [Requirement(METHOD, fam.module, f"{b.cls}.{m}", who) for m in (b.builder, *b.uses)]
        reqs += [Requirement(SETS, fam.module, f"{b.cls}.{a}", who, (b.builder,)) for a in sorted(b.binds)]
        reqs += [Requirement(ATTRIBUTE, fam.module, f"{b.cls}.{linear}", who) for linear in b.keep_layout]
        reqs.append(Requirement(SETS_ONLY, fam.module, b.cls, who, (b.builder,)))
    return reqs


def missing(read: Reader, reqs: Iterable[Requirement]) -> list[str]:
    """One line per requirement the sources do not meet, naming the full dotted name and who needs it."""
    index = SourceIndex(read)
    families = {f"family {f.name}": f for f in FAMILIES}
    out: list[str] = []
    said: set[tuple[str, str]] = set()  # a missing module or class is named once, not once per name inside it
    for r in reqs:
        problem = _problem(index, r, families.get(r.user))
        if not problem:
            continue
        if problem == "module not found" or problem.startswith("class "):
            key = (r.module, problem)
            if key in said:
                continue
            said.add(key)
            where = r.module if problem == "module not found" else f"{r.module}.{r.name.partition('.')[0]}"
        else:
            where = f"{r.module}.{r.name}" if r.name else r.module
        out.append(f"{where}: {problem} (used by {r.user})")
    return out


def _problem(index: SourceIndex, r: Requirement, fam: VLLMDraftFamily | None) -> str | None:
    if not index.has_module(r.module):
        return "module not found"
    if r.kind == MODULE:
        return None
    if r.kind == MENTIONS:
        attr = r.name.rpartition(".")[2]
        tree = index.tree(r.module)
        named = index.attribute_names(r.module) | (index.strings(tree) if tree is not None else set())
        return None if attr in named else f"{attr} no longer set or read there"  # `x.attr` or getattr(x, "attr")
    if r.kind == CALLS:
        fn = index.binding(r.module, r.name)
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return "name not found"
        called = {n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        return None if r.text in called else f"no longer calls {r.text}"
    cls_name, _, attr = r.name.partition(".")
    if r.kind == NAME and not attr and index.binding(r.module, cls_name) is None:
        return f"class {cls_name} not found" if cls_name[:1].isupper() else "name not found"
    if r.kind == NAME and not attr:
        return None
    cls = index.find_class(r.module, cls_name)
    if cls is None:
        return f"class {cls_name} not found"
    if r.kind == METHOD:
        return None if index.method(cls, attr) is not None else "method not found"
    if r.kind == RAISES:
        found = index.method(cls, attr)
        if found is None:
            return "method not found"
        return None if r.text in index.strings(found[1]) else f"no longer says {r.text!r}"
    if r.kind in (ATTRIBUTE, NAME):
        return None if index.has_attribute(cls, attr) else "attribute not found"
    if any(index.method(cls, b) is None for b in r.builders):
        return None  # the builder itself is missing: its METHOD requirement says so, once
    assigned, accessed = index.builder_effects(cls, r.builders)
    if r.kind == SETS:
        return None if attr in assigned else "no longer set by vLLM's builder"
    if r.kind == READS:
        return None if attr in accessed else "no longer read by vLLM's builder"
    if fam is None:
        return None
    declared = fam.sets if cls_name == fam.inner else frozenset(
        a for b in fam.submodule_buffers if b.cls == cls_name for a in b.binds)
    extra = sorted(assigned - declared)
    return f"vLLM's builder also sets {', '.join(extra)}, which the declaration lacks" if extra else None


def check(version: str, read: Reader) -> None:
    """Raise UnsupportedVLLMError naming every missing name (and how to disable the plugin), or return."""
    problems = missing(read, requirements(version))
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise UnsupportedVLLMError(
            f"reload-lifecycle's vLLM plugin cannot run on vLLM {version}: {len(problems)} name(s) it relies on "
            f"are missing or changed:\n{lines}\nNothing was patched. To run vLLM without it, {DISABLE_HINT}.")


def check_vllm(version: str | None = None, read: Reader | None = None) -> str:
    """The activation check: every name the plugin relies on exists in `read`'s sources (the installed vLLM by
    default), else UnsupportedVLLMError naming each; then the untested-series warning. Returns the version."""
    version = version or installed_version()
    check(version, read or sources.installed_reader())
    return check_vllm_version(version)
