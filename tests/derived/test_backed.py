"""View-backed derived buffers (`backed=True`, issue 15): the sources become views of the buffer at the cold
build, so weights and buffer are one copy; a reload writes the buffer as it loads; a refresh writes nothing and
verifies. The loader, sessions (rollback, recover), pinning, drift checks and the auditor keep working."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lifecycle import (
    DraftBackbone,
    LifecycleState,
    SourceLayoutError,
    StorageDriftError,
    concat,
    configure_audit,
    load_safetensors,
    stack,
    write_checkpoint,
)
from lifecycle.audit.replay import audit_logs
from lifecycle.derived.backing import is_view_of
from lifecycle.storage import count_allocations
from lifecycle.testing import cold_load, random_checkpoint, reload

S = LifecycleState
L, HIDDEN, KV = 3, 16, 8


class KVLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.k_norm = nn.RMSNorm(KV)


def _specs(backed: bool) -> tuple:
    return (
        concat("_kv", sources=("k_proj.weight", "v_proj.weight"), backed=backed,
               per_layer=lambda layer: (layer.k_proj.weight, layer.v_proj.weight)),
        stack("_k_norms", sources=("k_norm.weight",), backed=backed, per_layer=lambda layer: layer.k_norm.weight),
    )


class KVDraft(DraftBackbone):
    def __init__(self, *, backed: bool = True, specs: tuple | None = None, name: str = "kv-backed") -> None:
        super().__init__()
        with torch.device("meta"):
            self.layers = nn.ModuleList(KVLayer() for _ in range(L))
        self.requires_grad_(False)
        self.derived_buffers = specs if specs is not None else _specs(backed)
        self.init_lifecycle(name)

    def expected(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([w for layer in self.layers for w in (layer.k_proj.weight, layer.v_proj.weight)]),
                torch.stack([layer.k_norm.weight for layer in self.layers]))


def sources_of(m: KVDraft) -> list[torch.Tensor]:
    return [t for layer in m.layers for t in (layer.k_proj.weight, layer.v_proj.weight, layer.k_norm.weight)]


def storage_bytes(m: nn.Module) -> int:
    """Bytes of the distinct storages behind every parameter and buffer (what the model holds)."""
    seen = {}
    for t in (*m.parameters(), *m.buffers()):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.fixture
def ckpts(tmp_path: Path) -> tuple[Path, Path, dict, dict]:
    model = KVDraft()
    a, b = random_checkpoint(model, 0), random_checkpoint(model, 1)
    return write_checkpoint(a, tmp_path / "a.safetensors"), write_checkpoint(b, tmp_path / "b.safetensors"), a, b


def test_the_cold_build_makes_every_source_a_view_of_its_place_and_memory_one_copy(ckpts) -> None:
    a, _, weights, _ = ckpts
    backed, plain = cold_load(KVDraft(), a, refresh=False), cold_load(KVDraft(backed=False), a, refresh=False)
    objects = sources_of(backed)
    report = backed.refresh_derived_buffers()
    plain.refresh_derived_buffers()
    kv = report["_kv"]
    assert (kv.mode, kv.backed_sources, kv.rebacked) == ("cold", 2 * L, 2 * L)
    assert sources_of(backed) == objects and all(a is b for a, b in zip(sources_of(backed), objects, strict=True))
    rows = 0
    for layer in backed.layers:
        for w in (layer.k_proj.weight, layer.v_proj.weight):
            assert is_view_of(w, backed._kv.narrow(0, rows, KV))
            rows += KV
    assert all(is_view_of(layer.k_norm.weight, backed._k_norms[i]) for i, layer in enumerate(backed.layers))
    assert all(torch.equal(x, y) for x, y in zip(backed.expected(), (backed._kv, backed._k_norms), strict=True))
    for name, w in weights.items():  # the values are the checkpoint's, wherever they live now
        assert torch.equal(backed.get_parameter(name), w)
    # one copy instead of two: the backed model holds exactly the plain one's bytes minus its two buffers
    assert storage_bytes(plain) - storage_bytes(backed) == plain._kv.nbytes + plain._k_norms.nbytes


def test_a_reload_writes_the_buffer_as_it_loads_and_the_refresh_writes_nothing(ckpts) -> None:
    a, b, _, wb = ckpts
    m = cold_load(KVDraft(), a, capture_graphs=True)
    ptrs = (m._kv.data_ptr(), m._k_norms.data_ptr())
    m.begin_reload()
    load_safetensors(m, b, bucket_by=2, shuffle=True)
    # before any refresh, the buffer holds B already: the loader's copy_ went into it
    assert torch.equal(m._kv.narrow(0, 0, KV), wb["layers.0.k_proj.weight"])
    m.finalize_loading()
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert m.lifecycle.state is S.GRAPH_CAPTURED
    assert {b.name: (b.mode, b.elements_written, b.slices_written, b.rebacked) for b in report.buffers} == {
        "_kv": ("backed", 0, 0, 0), "_k_norms": ("backed", 0, 0, 0)}
    assert log.storages_created == 0 and report.bytes_allocated == report.temporaries == 0
    assert (m._kv.data_ptr(), m._k_norms.data_ptr()) == ptrs
    oracle = cold_load(KVDraft(backed=False), b)
    assert torch.equal(m._kv, oracle._kv) and torch.equal(m._k_norms, oracle._k_norms)


def replace(m: KVDraft, i: int, proj: str, value: torch.Tensor) -> None:
    """A reload that sends one weight through a writer that allocates a new parameter (no copy_ into the old)."""
    m.begin_reload()
    getattr(m.layers[i], proj).weight = nn.Parameter(value.clone(), requires_grad=False)
    name = f"layers.{i}.{proj}.weight"
    m.lifecycle.weights_loaded([name])
    m.weights_unchanged([n for n in m.lifecycle.specs if n.startswith(f"layers.{i}.") and n != name])
    m.finalize_loading(keep_untouched=True)


def test_a_replaced_source_is_copied_in_and_made_a_view_again_but_refused_as_drift_under_graphs(ckpts) -> None:
    a, *_ = ckpts
    m = cold_load(KVDraft(), a)
    new = torch.full((KV, HIDDEN), 3.0)
    replace(m, 1, "v_proj", new)
    report = m.refresh_derived_buffers()
    assert (report["_kv"].mode, report["_kv"].rebacked, report["_kv"].slices_written) == ("in_place", 1, 1)
    assert is_view_of(m.layers[1].v_proj.weight, m._kv.narrow(0, 3 * KV, KV))
    assert torch.equal(m._kv.narrow(0, 3 * KV, KV), new)

    m.capture_graphs()
    replace(m, 2, "k_proj", torch.zeros(KV, HIDDEN))
    before = m._kv.clone()
    with pytest.raises(StorageDriftError, match=r"layers\.2\.k_proj\.weight"):
        m.refresh_derived_buffers()
    assert torch.equal(m._kv, before)


def test_rollback_restores_the_buffer_with_the_weights_and_recover_returns(ckpts) -> None:
    a, _, _, wb = ckpts
    m = cold_load(KVDraft(), a, capture_graphs=True)
    kv, norms = m._kv.clone(), m._k_norms.clone()
    with m.reload_session(rollback=True) as s:
        s.apply({"layers.1.k_proj.weight": wb["layers.1.k_proj.weight"], "layers.0.k_norm.weight":
                 wb["layers.0.k_norm.weight"]})
        assert not torch.equal(m._kv, kv)  # the buffer is the weights: it holds the reload's values now
        s.abort("trainer went away")
    assert m.lifecycle.state is S.QUARANTINED
    assert torch.equal(m._kv, kv) and torch.equal(m._k_norms, norms)  # restored with the weights
    assert m.recover() is S.GRAPH_CAPTURED
    assert all(is_view_of(layer.k_norm.weight, m._k_norms[i]) for i, layer in enumerate(m.layers))


def test_rebuild_after_release_moves_the_sources_to_the_new_buffer(ckpts) -> None:
    a, *_ = ckpts
    m = cold_load(KVDraft(), a)
    old = m._kv.data_ptr()
    m.begin_reload()
    m.finalize_loading(keep_untouched=True)
    report = m.refresh_derived_buffers(rebuild=True)
    assert report["_kv"].mode == "cold" and m._kv.data_ptr() != old
    assert is_view_of(m.layers[0].k_proj.weight, m._kv.narrow(0, 0, KV))


def test_declarations_that_cannot_be_backed_are_refused_with_the_reason(ckpts) -> None:
    a, *_ = ckpts
    slice_of_a_source = (concat("_k_rows", sources=("q_proj.weight",), backed=True,
                                per_layer=lambda layer: layer.q_proj.weight[:KV]),)
    m = cold_load(KVDraft(specs=slice_of_a_source), a, refresh=False)
    with pytest.raises(SourceLayoutError, match=r"layers\.0: part 0 is not one of the layer.s sources "
                                                r"\(q_proj\.weight\) as a whole"):
        m.refresh_derived_buffers()
    assert m.lifecycle.state is S.FINALIZED and "_k_rows" not in dict(m.named_buffers())
    with pytest.raises(ValueError, match="backed=True needs dim=0"):
        concat("_cols", sources=("k_proj.weight",), dim=1, backed=True, per_layer=lambda layer: layer.k_proj.weight)
    with pytest.raises(ValueError, match="backed=True is for concat and stack buffers of whole sources"):
        stack("_c", sources=("k_proj.weight",), computed=True, backed=True, per_layer=lambda layer: layer.k_proj.weight)
    twice = (*_specs(True), stack("_again", sources=("k_norm.weight",), backed=True,
                                  per_layer=lambda layer: layer.k_norm.weight))
    with pytest.raises(ValueError, match=r"layers\.0\.k_norm\.weight is a source of two backed buffers"):
        KVDraft(specs=twice)


def test_a_backed_model_saves_a_checkpoint_and_its_logs_audit_clean(ckpts, tmp_path: Path) -> None:
    a, b, *_ = ckpts
    log = tmp_path / "audit.jsonl"
    configure_audit(json_path=log, console=False)
    try:
        m = cold_load(KVDraft(), a, capture_graphs=True)
        reload(m, b)
    finally:
        configure_audit(console=False)
    result = audit_logs([log])
    assert result.status == 0, [v.detail for v in result.violations]
    saved = write_checkpoint(dict(m.state_dict()), tmp_path / "saved.safetensors")  # views of one storage
    again = cold_load(KVDraft(backed=False), saved, refresh=False)
    assert all(torch.equal(again.get_parameter(n), p) for n, p in m.named_parameters())
