"""One change the plugin makes to vLLM, or one vLLM name it relies on, as data (`Patch`); the records themselves are
`registry.PATCHES`, applied by `patching.py`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "READS", "REGISTERS", "SWAPS_CLASS", "WRAPS", "WRAPS_INSTANCE", "WRITES", "Patch"]

# kinds of change
WRAPS = "wraps"  # a function or method where vLLM looks it up, replaced by a wrapper of it (process-wide)
WRAPS_INSTANCE = "wraps per instance"  # the same, on one object (a draft layer's quant method)
SWAPS_CLASS = "swaps the class of"  # an object's class replaced by a subclass (the draft's inner model)
WRITES = "writes"  # a private attribute of vLLM's object set
REGISTERS = "registers with"  # vLLM's own registry given an entry (draft classes, a transfer engine)
READS = "reads"  # a name relied on, not changed
KINDS = (WRAPS, WRAPS_INSTANCE, SWAPS_CLASS, WRITES, REGISTERS, READS)


@dataclass(frozen=True)
class Patch:
    """One change the plugin makes to vLLM, or one vLLM name it relies on (`kind` READS)."""

    kind: str
    module: str  # vLLM's module
    target: str  # "function", "Class.attribute"
    why: str
    user: str  # the plugin's module that applies it or reads it
    wrapper: str = ""  # WRAPS: "module:function" under lifecycle.vllm, the maker
    since: str = "0.32"  # the first vLLM release series that has the target
    #: READS of a function: the attribute it must call (a route of vLLM's RL layer calling the engine client's
    #: method the plugin wraps: the capability check finds the call in its source)
    calls: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"patch {self.where}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == WRAPS) != bool(self.wrapper):
            raise ValueError(f"patch {self.where}: a wrapper is named exactly for kind {WRAPS!r}")

    @property
    def where(self) -> str:
        return f"{self.module}.{self.target}"

    @property
    def key(self) -> str:
        """How code names the record: "Class.attribute" (unique in the registry; checked by the tests)."""
        return self.target
