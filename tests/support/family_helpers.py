"""What the family tests share (`test_oracle.py`, `test_families.py`, `test_family_*.py`): a family under test with
its tiny config and checkpoints A and B (`Fam`), cold loads and reloads, snapshots and bit equality.

Every helper works on any `DraftBackbone` registered in `models.FAMILIES`; the family-specific checks stay in the
`test_family_*.py` files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lifecycle import DraftBackbone, LifecycleState, testing
from lifecycle.derived import DerivedSpec, current_buffer
from lifecycle.loading import write_checkpoint
from lifecycle.storage import StorageIdentity
from models import FAMILIES, DraftFamily

S = LifecycleState
L = 3  # layers in every tiny config

Snapshot = dict[str, tuple[torch.Tensor, torch.Tensor, StorageIdentity]]


@dataclass
class Fam:
    """One family under test: its tiny config (L layers), random checkpoints A and B, and a scratch folder."""

    family: DraftFamily
    cfg: Any
    weights: dict[str, dict[str, torch.Tensor]]
    ckpt: dict[str, Path]
    tmp: Path

    @classmethod
    def make(cls, name: str, tmp: Path, **config: Any) -> Fam:
        family = FAMILIES[name]
        cfg = family.config(**({"num_hidden_layers": L} | config))
        weights = {"a": family.random_weights(cfg, 0), "b": family.random_weights(cfg, 1)}
        ckpt = {k: write_checkpoint(w, tmp / f"{k}.safetensors") for k, w in weights.items()}
        return cls(family, cfg, weights, ckpt, tmp)

    def build(self, cfg: Any = None) -> DraftBackbone:
        return self.family.build(cfg if cfg is not None else self.cfg, device="meta")

    def cold(self, which: str | Path) -> Any:
        """A backbone cold-loaded from checkpoint `which` ("a", "b" or a path), finalized and refreshed."""
        m = testing.cold_load(self.build, self.ckpt[which] if isinstance(which, str) else which)
        assert m.lifecycle.state is S.DERIVED_REFRESHED
        return m

    def outputs(self, m: DraftBackbone, *, reference: bool = False, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """The fused path's outputs (or the per-layer reference path's) on the family's example inputs."""
        x = self.family.example_inputs(self.cfg, seed, "cpu")
        with torch.no_grad():
            return (self.family.reference if reference else self.family.fused)(m, x)

    def mixed(self, take: str | Callable[[str], bool], label: str = "") -> Path:
        """A with the tensors `take` selects (a name prefix, or a predicate) taken from B: B' = A with layers.1
        from B, say. `label` names the file (default: the prefix)."""
        pick = take if callable(take) else lambda n: n.startswith(take)
        a, b = self.weights["a"], self.weights["b"]
        path = self.tmp / f"mixed-{label or str(take).strip('.')}.safetensors"
        return write_checkpoint({n: b[n] if pick(n) else t for n, t in a.items()}, path)


def reload(m: DraftBackbone, path: Path, **kw: Any) -> list[str]:
    """begin_reload, load (any strategy), finalize, no refresh (`lifecycle.testing.reload`); a `subset` reload keeps
    untouched layers. Returns the hooks that ran."""
    return testing.reload(m, path, refresh=False, **kw)


def specs(m: DraftBackbone, *kinds: str) -> list[DerivedSpec]:
    return [s for s in m.derived_buffers if not kinds or s.kind in kinds]


def derived(m: DraftBackbone) -> dict[str, torch.Tensor]:
    out = {}
    for name in m.derived_buffer_names():
        t = current_buffer(m, name)
        assert t is not None, f"derived buffer {name} was never built"
        out[name] = t
    return out


def everything(m: DraftBackbone) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones included) and every derived buffer, by name."""
    out: dict[str, torch.Tensor] = dict(m.named_parameters(remove_duplicate=False))
    out.update(m.named_buffers(remove_duplicate=False))
    out.update(derived(m))
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def identities(m: DraftBackbone) -> dict[str, StorageIdentity]:
    return {n: StorageIdentity.of(t) for n, t in derived(m).items()}


def snapshot(m: DraftBackbone) -> Snapshot:
    """name -> (the buffer object, a clone of its values, its storage identity), every built derived buffer."""
    return {n: (t, t.detach().clone(), StorageIdentity.of(t)) for n, t in derived(m).items()}


def assert_unchanged(m: DraftBackbone, snap: Snapshot, *, sources_rewritten: bool = True) -> None:
    """Same object, same storage identity, same bits. An alias IS its source: a loader writing the source in
    place changes its values without any refresh, so with `sources_rewritten` aliases are compared by identity."""
    kinds = {s.name: s.kind for s in m.derived_buffers}
    for name, (obj, values, ident) in snap.items():
        live = m._buffers[name]
        assert live is obj, f"{name}: re-registered"
        assert StorageIdentity.of(live) == ident, f"{name}: storage moved"
        if not (sources_rewritten and kinds[name] == "alias"):
            assert bit_equal(live, values), f"{name}: values written"


def assert_same_model(fam: Fam, warm: DraftBackbone, cold: DraftBackbone) -> None:
    """Bit for bit: every tensor the models hold, and the fused path's outputs."""
    w, c = everything(warm), everything(cold)
    assert w.keys() == c.keys()
    for name in c:
        assert bit_equal(w[name], c[name]), f"{name}: warm reload differs from a cold load"
    for i, (x, y) in enumerate(zip(fam.outputs(warm), fam.outputs(cold), strict=True)):
        assert bit_equal(x, y), f"fused output {i}: warm reload differs from a cold load"


def layer_slices(m: DraftBackbone, spec: DerivedSpec, buf: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's slice of a concat/stack buffer (views: writing one writes the buffer)."""
    layers = m.get_submodule(spec.layers_attr)
    if spec.kind == "stack":
        return [buf[i] for i in range(len(layers))]
    out, start = [], 0
    for layer in layers:
        n = spec.per_layer(layer).shape[spec.dim]  # type: ignore[misc]
        out.append(buf.narrow(spec.dim, start, n))
        start += n
    return out


def slice_bytes(m: DraftBackbone, spec: DerivedSpec) -> int:
    """Bytes of one layer's slice of a concat/stack buffer (the whole buffer for any other kind)."""
    t = getattr(m, spec.name)
    whole = t.numel() * t.element_size()
    return whole // len(m.get_submodule(spec.layers_attr)) if spec.kind in ("concat", "stack") else whole
