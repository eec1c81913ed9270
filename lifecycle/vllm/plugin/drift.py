"""The drift check: every draft in vLLM's speculative-decoding registry is accounted for, from its sources.

Each architecture of vLLM's registry (`compat.derived_scan.speculative_registry`) must be served by a declared family
(`drafts.families`) or listed as deriving nothing (`drafts.underived`), and what the scan finds in its class's sources
(`derived_scan.scan`: non-persistent buffers, attributes built with `torch.cat` / `torch.stack` or from views of
parameters outside `forward`, weights a loader duplicates into another module, bare writes into parameters) must
each be declared: a family's builders set it (`sets`, on its inner class or a base), it is a `LoaderCopy` or a
`HandWrite` of the family, or an `Accounted` finding of the family or the listing. A new architecture, a new derived
attribute in a known class, or a declaration vLLM no longer matches is one line naming the file, the class (or the
function) and the attribute. `make compat` runs it on the installed vLLM (0.32) and on the 0.33 wheel; the plugin
does not run it at activation (a draft vLLM adds is served by vLLM's own class, never refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from ..compat.derived_scan import BARE_WRITE, DUPLICATED, REGISTRY_MODULE, Finding, scan, speculative_registry
from ..compat.sources import Reader, SourceIndex
from ..drafts.declarations import Accounted
from ..drafts.families import VLLMDraftFamily
from ..drafts.underived import UNDERIVED, UnderivedDraft
from .capabilities import active_families, series_tuple

__all__ = ["drift", "listed_drafts"]

_FAMILIES_FILE = "lifecycle/vllm/drafts/families.py"
_LISTING_FILE = "lifecycle/vllm/drafts/underived.py"


def listed_drafts(version: str | None) -> tuple[UnderivedDraft, ...]:
    """The listed drafts a release has (every one for None or an unparsable version)."""
    have = series_tuple(version) if version else None
    return tuple(u for u in UNDERIVED if have is None or (
        cast("tuple[int, int]", series_tuple(u.since)) <= have
        and (not u.until or have <= cast("tuple[int, int]", series_tuple(u.until)))))


def drift(read: Reader, version: str) -> list[str]:
    """One line per problem: an architecture nobody accounts for, a finding its declaration lacks, a declaration
    vLLM's registry or sources no longer match. Empty: every draft of this vLLM is accounted for."""
    index = SourceIndex(read)
    registry = speculative_registry(index)
    if not registry:
        return [f"{index.file_of(REGISTRY_MODULE) or REGISTRY_MODULE}: no _SPECULATIVE_DECODING_MODELS dict found"]
    declared: dict[str, VLLMDraftFamily | UnderivedDraft] = {}
    problems: list[str] = []
    declarations: list[VLLMDraftFamily | UnderivedDraft] = [*active_families(version), *listed_drafts(version)]
    for decl in declarations:
        for arch in decl.architectures:
            declared[arch] = decl
            problems += _mapping_problem(index, registry, arch, decl)
    scanned: dict[tuple[str, str], list[Finding] | None] = {}
    lacking: dict[Finding, list[str]] = {}  # a finding -> the declarations (and their architectures) lacking it
    for arch, (module, cls) in registry.items():
        key = (module, cls)
        if key not in scanned:
            scanned[key] = scan(index, module, cls)
        findings = scanned[key]
        found = declared.get(arch)
        if findings is None:
            problems.append(f"vLLM's registry maps {arch} to {module}.{cls}, which its sources do not define")
        elif found is None:
            ref = index.find_class(module, cls)
            where = index.file_of(ref.module) if ref is not None else module
            shown = "; ".join(str(f) for f in findings) or "nothing derived: list it, with why"
            problems.append(f"{where}: class {cls} (vLLM's registry: {arch}) is neither a family ({_FAMILIES_FILE}) "
                            f"nor listed as deriving nothing ({_LISTING_FILE}); its sources show: {shown}")
        else:
            for f in findings:
                if not _accounts(index, found, f, series_tuple(version)):
                    lacking.setdefault(f, []).append(f"{_label(found)} ({arch})")
            if isinstance(found, VLLMDraftFamily):
                problems += _duplications_gone(found, findings)
    problems += [_unaccounted(f, who) for f, who in lacking.items()]
    return list(dict.fromkeys(problems))  # several architectures of one class: each problem once


def _label(decl: VLLMDraftFamily | UnderivedDraft) -> str:
    return f"family {decl.name}" if isinstance(decl, VLLMDraftFamily) else f"the listed draft {decl.name}"


def _mapping_problem(index: SourceIndex, registry: dict[str, tuple[str, str]], arch: str,
                     decl: VLLMDraftFamily | UnderivedDraft) -> list[str]:
    """A declared architecture vLLM's registry lacks, or maps to another class than the declaration's."""
    if arch not in registry:
        return [f"{_label(decl)} declares architecture {arch}, which vLLM's speculative-decoding registry lacks"]
    module, cls = registry[arch]
    mine = (decl.module, decl.causal_lm) if isinstance(decl, VLLMDraftFamily) else (decl.module, decl.cls)
    theirs, ours = index.find_class(module, cls), index.find_class(*mine)
    if theirs is None or ours is None or theirs.name != ours.name:
        return [f"{_label(decl)} declares {arch} as {'.'.join(mine)}; vLLM's registry maps it to {module}.{cls}"]
    return []


def _accounts(index: SourceIndex, decl: VLLMDraftFamily | UnderivedDraft, f: Finding,
              series: tuple[int, int] | None) -> bool:
    if any(_matches(a, f) for a in decl.accounted):
        return True
    if not isinstance(decl, VLLMDraftFamily):
        return False
    if f.rule == DUPLICATED:
        return any(c.function == f.owner and c.module == f.attribute for c in decl.duplicated)
    if f.rule == BARE_WRITE:
        return any(f.attribute in (w.name, w.tensor.rpartition(".")[2]) and w.applies(series)
                   for w in decl.written_by_hand)
    if any(f.owner == b.cls and f.attribute in b.binds for b in decl.submodule_buffers):
        return True
    return f.attribute in decl.sets and f.owner in _inner_classes(index, decl)


def _matches(a: Accounted, f: Finding) -> bool:
    return (a.owner, a.attribute, a.rule) == f.key


def _inner_classes(index: SourceIndex, fam: VLLMDraftFamily) -> set[str]:
    """The family's inner class and its bases: where the builders that set its declared attributes live."""
    ref = index.find_class(fam.module, fam.inner)
    return {c.node.name for c in index.mro(ref)} if ref is not None else set()


def _unaccounted(f: Finding, lacking: list[str]) -> str:
    kind = "class" if f.owner[:1].isupper() else "function"
    return (f"{f.file}: {kind} {f.owner}, attribute {f.attribute}: {f.rule} in {f.where} (line {f.line}), which "
            f"{', '.join(dict.fromkeys(lacking))} does not declare ({_FAMILIES_FILE} or {_LISTING_FILE})")


def _duplications_gone(fam: VLLMDraftFamily, findings: Iterable[Finding]) -> list[str]:
    """A declared loader copy vLLM's sources no longer make (the family would track a module nothing fills)."""
    made = {(f.owner, f.attribute) for f in findings if f.rule == DUPLICATED}
    return [f"family {fam.name} declares that {c.function} fills {c.module} from every layer; vLLM's sources no "
            f"longer do" for c in fam.duplicated if (c.function, c.module) not in made]
