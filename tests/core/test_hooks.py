"""Post-load hooks: explicit phase opt-in; one-time conversions never replay on reload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle.errors import IllegalTransitionError, StorageDriftError
from lifecycle.hooks import Phase, collect_hooks, post_load_hook
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.states import LifecycleState
from lifecycle.testing import reload, undeclared_hook_writes
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

S = LifecycleState


class HookedDraft(DFlashQwen3Draft):
    """Records every hook call with the lifecycle state and whether derived buffers existed at that moment."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, int, LifecycleState, bool]] = []

    def _record(self, name: str) -> None:
        lc = self.lifecycle
        self.calls.append((name, lc.epoch, lc.state, self._buffers["_fused_kv_weight"] is not None))

    @post_load_hook(Phase.COLD_LOAD)
    def cold_only(self) -> None:
        self._record("cold_only")

    @post_load_hook(Phase.RELOAD)
    def reload_only(self) -> None:
        self._record("reload_only")

    @post_load_hook("cold_load", "reload")
    def both(self) -> None:
        self._record("both")


def test_hooks_run_in_their_phases_only(tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path) -> None:
    m = HookedDraft(tiny_cfg)
    load_safetensors(m, ckpt_a)
    with capture_logs() as logs:
        ran = m.finalize_loading()
    assert ran == ["init_rope_caches", "cold_only", "both"]  # base-class hooks first, then declaration order
    assert [(e["hook"], e["phase"]) for e in logs if e["event"] == "hook_run"] == [
        ("init_rope_caches", "cold_load"), ("cold_only", "cold_load"), ("both", "cold_load")]
    # hooks run after every layer is ready, before the derived buffers are built
    assert m.calls == [("cold_only", 0, S.FULLY_LOADED, False), ("both", 0, S.FULLY_LOADED, False)]
    m.refresh_derived_buffers()

    for epoch, ckpt in ((1, ckpt_b), (2, ckpt_a)):
        m.calls.clear()
        m.begin_reload()
        load_safetensors(m, ckpt)
        assert m.finalize_loading() == ["reload_only", "both"]
        assert m.calls == [("reload_only", epoch, S.FULLY_LOADED, True), ("both", epoch, S.FULLY_LOADED, True)]
        m.refresh_derived_buffers()


class ConvertingDraft(DFlashQwen3Draft):
    """A one-time weight conversion: the checkpoint stores k_norm weights at half the runtime scale."""

    conversions = 0

    @post_load_hook(Phase.COLD_LOAD)
    def double_k_norms(self) -> None:
        type(self).conversions += 1
        with torch.no_grad():
            for layer in self.layers:
                layer.self_attn.k_norm.weight.mul_(2)


def _k_norms(m: DFlashQwen3Draft) -> list[torch.Tensor]:
    return [layer.self_attn.k_norm.weight.detach().clone() for layer in m.layers]


def test_one_time_conversion_is_never_replayed(tiny_cfg: DFlashConfig, ckpt_a: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ConvertingDraft, "conversions", 0)
    raw = random_weights(tiny_cfg, 0)  # what ckpt_a holds
    m = ConvertingDraft(tiny_cfg)
    load_safetensors(m, ckpt_a)
    assert "double_k_norms" in m.finalize_loading()
    m.refresh_derived_buffers()
    converted = _k_norms(m)
    for i, w in enumerate(converted):
        assert torch.equal(w, raw[f"layers.{i}.self_attn.k_norm.weight"] * 2)
    assert torch.equal(m._k_norm_weights, torch.stack(converted))  # the refresh saw the converted weights
    assert torch.equal(m.layers[0].self_attn.qkv_proj.weight, raw["layers.0.self_attn.qkv_proj.weight"])

    # A reload delivers weights in the runtime layout (a trainer's state_dict): they are taken as they are.
    # A replayed conversion would double them again; untouched layers would be doubled too.
    runtime = write_checkpoint({n: t.detach() for n, t in m.state_dict().items()}, tmp_path / "runtime.safetensors")
    assert reload(m, runtime) == []
    assert all(torch.equal(w, c) for w, c in zip(_k_norms(m), converted, strict=True))
    assert torch.equal(m._k_norm_weights, torch.stack(converted))

    assert reload(m, runtime, subset=lambda n: n.startswith("layers.1.")) == []
    assert all(torch.equal(w, c) for w, c in zip(_k_norms(m), converted, strict=True))

    # Reloading the raw checkpoint therefore gives the raw values: the reload is not converted again
    reload(m, ckpt_a)
    for i, w in enumerate(_k_norms(m)):
        assert torch.equal(w, raw[f"layers.{i}.self_attn.k_norm.weight"])
    assert torch.equal(m._k_norm_weights, torch.stack(_k_norms(m)))
    assert ConvertingDraft.conversions == 1


def test_runtime_registered_hooks(tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path) -> None:
    m = DFlashQwen3Draft(tiny_cfg)
    calls: list[tuple[str, int]] = []
    m.register_post_load_hook(lambda b: calls.append(("scales", b.lifecycle.epoch)), Phase.COLD_LOAD, "reload",
                              name="recompute_scales")

    def warm_cache(b: DFlashQwen3Draft) -> None:
        calls.append(("warm_cache", b.lifecycle.epoch))

    m.register_post_load_hook(warm_cache, "cold_load")
    assert [h.name for h in m.post_load_hooks(Phase.RELOAD)] == ["recompute_scales"]
    load_safetensors(m, ckpt_a)
    assert m.finalize_loading() == ["init_rope_caches", "recompute_scales", "warm_cache"]
    m.refresh_derived_buffers()
    assert reload(m, ckpt_b, refresh=False) == ["recompute_scales"]
    assert calls == [("scales", 0), ("warm_cache", 0), ("scales", 1)]
    with pytest.raises(ValueError, match="at least one phase"):
        m.register_post_load_hook(warm_cache)
    with pytest.raises(ValueError):
        m.register_post_load_hook(warm_cache, "warmup")
    assert [h.name for h in m.post_load_hooks(Phase.COLD_LOAD)] == ["init_rope_caches", "recompute_scales",
                                                                    "warm_cache"]


def test_post_load_hook_needs_an_explicit_phase() -> None:
    with pytest.raises(ValueError, match="at least one phase"):
        post_load_hook()
    with pytest.raises(ValueError):
        post_load_hook("after_load")


def test_overriding_a_hook_without_opting_in_removes_it() -> None:
    class NoRope(DFlashQwen3Draft):
        def init_rope_caches(self) -> None:  # not decorated: no longer a hook
            pass

    assert [h.name for h in collect_hooks(DFlashQwen3Draft, Phase.COLD_LOAD)] == ["init_rope_caches"]
    assert collect_hooks(NoRope) == []


def test_failing_hook_is_audited_and_raised(tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    m = DFlashQwen3Draft(tiny_cfg)

    def broken(_: DFlashQwen3Draft) -> None:
        raise RuntimeError("scale table missing")

    m.register_post_load_hook(broken, Phase.COLD_LOAD)
    load_safetensors(m, ckpt_a)
    with capture_logs() as logs, pytest.raises(RuntimeError, match="scale table missing"):
        m.finalize_loading()
    (ev,) = [e for e in logs if e["event"] == "hook_failed"]
    assert ev["hook"] == "broken" and "scale table missing" in ev["error"]


def test_rope_init_does_not_run_on_reload(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    lc = loaded.lifecycle
    loaded.capture_graphs()
    cache = loaded.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert loaded._rope_cos_sin_cache is cache
    ptr, values = cache.data_ptr(), cache.clone()
    assert reload(loaded, ckpt_b) == []
    assert lc.state is S.GRAPH_CAPTURED
    assert loaded._rope_cos_sin_cache is cache and loaded._rope_cos_sin_cache.data_ptr() == ptr
    assert loaded.layers[0].self_attn.rotary_emb.cos_sin_cache is cache
    assert torch.equal(cache, values)


def test_replaying_rope_init_under_captured_graphs_would_be_refused(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    """Why the RoPE hook is cold-only: replaying it gives the table new storage under the captured alias."""
    lc = loaded.lifecycle
    loaded.capture_graphs()
    old_ptr = loaded._rope_cos_sin_cache.data_ptr()
    reload(loaded, ckpt_b, refresh=False)
    loaded.init_rope_caches()  # the replay a phase-less hook system would do
    # the pinned table moved: refused before any write, naming the table and its old address
    with pytest.raises(StorageDriftError, match="cos_sin_cache: data_ptr") as ei:
        loaded.refresh_derived_buffers()
    assert hex(old_ptr) in str(ei.value)
    assert lc.state is S.FINALIZED
    assert loaded._rope_cos_sin_cache.data_ptr() == old_ptr


def test_cold_hooks_run_when_an_aborted_cold_load_is_retried(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                             ckpt_b: Path) -> None:
    m = DFlashQwen3Draft(tiny_cfg)
    load_safetensors(m, ckpt_a, subset=lambda n: n.startswith("layers.0."))
    m.abort_reload("cold load interrupted")
    assert reload(m, ckpt_a) == ["init_rope_caches"]  # the one-time initialisation never ran before
    assert m.lifecycle.state is S.DERIVED_REFRESHED
    assert not m._rope_cos_sin_cache.is_meta
    ctx, pos = torch.randn(3, tiny_cfg.hidden_size), torch.arange(3)
    for fused, ref in zip(m.precompute_context_kv(ctx, pos), m.precompute_context_kv_reference(ctx, pos),
                          strict=True):
        torch.testing.assert_close(fused, ref)
    assert reload(m, ckpt_b, refresh=False) == []  # and never again


def test_a_second_finalize_runs_no_hook_twice_in_one_epoch(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                          ckpt_b: Path) -> None:
    """Issue 14, defect 1. The old code picked the phase by "cold hooks done yet?": a second `finalize_loading()`
    in epoch 0 ran the hooks that opted into `reload` (`['reload_only', 'both']`), and every repeated finalize
    of a reload ran its hooks again. Hooks are now chosen by the epoch's phase and run once per epoch."""
    m = HookedDraft(tiny_cfg)
    load_safetensors(m, ckpt_a)
    assert m.finalize_loading() == ["init_rope_caches", "cold_only", "both"]
    with capture_logs() as logs:
        assert m.finalize_loading() == []
    assert not [e for e in logs if e["event"] == "hook_run"]
    assert [name for name, *_ in m.calls] == ["cold_only", "both"]
    m.refresh_derived_buffers()

    m.begin_reload()
    load_safetensors(m, ckpt_b)
    assert m.finalize_loading() == ["reload_only", "both"]
    assert m.finalize_loading(keep_untouched=True) == []
    assert [name for name, epoch, *_ in m.calls if epoch == 1] == ["reload_only", "both"]


def test_a_failing_hook_refuses_the_finish_and_the_retry_runs_only_what_did_not_complete(
        tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    """A hook that raises refuses `finalize_loading` (the state stays, no refresh is possible); the retry runs the
    hooks that have not completed, never one that did (a one-time conversion is not applied twice)."""
    m = HookedDraft(tiny_cfg)
    failures = [RuntimeError("scale table missing")]

    def flaky(_: DFlashQwen3Draft) -> None:
        if failures:
            raise failures.pop()

    m.register_post_load_hook(flaky, Phase.COLD_LOAD)
    load_safetensors(m, ckpt_a)
    with pytest.raises(RuntimeError, match="scale table missing"):
        m.finalize_loading()
    assert m.lifecycle.state is S.FULLY_LOADED and not m.lifecycle.can("refresh_derived")
    assert m.finalize_loading() == ["flaky"]
    assert [name for name, *_ in m.calls] == ["cold_only", "both"]
    assert m.lifecycle.can("refresh_derived")


def test_skipping_finalize_is_refused_so_cold_hooks_cannot_be_skipped(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                                        ckpt_b: Path) -> None:
    """Issue 14, friction 2. The old table allowed `refresh_derived` straight from FULLY_LOADED: skipping
    `finalize_loading()` skipped the cold_load hooks (GRAPH_CAPTURED with none run), and they then ran at the next
    reload's finalize, on reloaded weights. The table now allows a refresh only from FINALIZED, which only
    `finalize_loading` reaches."""
    m = HookedDraft(tiny_cfg)
    load_safetensors(m, ckpt_a)
    with capture_logs() as logs, pytest.raises(IllegalTransitionError, match=r"finalize_loading\(\) first") as ei:
        m.refresh_derived_buffers()
    assert ei.value.allowed_from == ("FINALIZED",)
    assert [(e["trigger"], e["error"]) for e in logs if e["event"] == "refused"] == [
        ("refresh_derived", "IllegalTransitionError")]
    assert m.lifecycle.state is S.FULLY_LOADED and m.calls == [] and m._buffers["_fused_kv_weight"] is None
    m.finalize_loading()
    m.refresh_derived_buffers()
    assert [name for name, *_ in m.calls] == ["cold_only", "both"]
    # a reload too: its hooks always run before its refresh
    m.begin_reload()
    load_safetensors(m, ckpt_b)
    with pytest.raises(IllegalTransitionError, match=r"finalize_loading\(\) first"):
        m.refresh_derived_buffers()
    assert m.finalize_loading() == ["reload_only", "both"]
    m.refresh_derived_buffers()
    assert m.lifecycle.usable


def test_what_a_reload_hook_writes_is_named_and_refreshed(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    """A reload hook that scales one weight in place and replaces another: both (and only they) are audited as
    written by hooks, and the refresh after a reload of another layer rewrites what reads them."""
    m = loaded

    def rescale(b: DFlashQwen3Draft) -> None:
        with torch.no_grad():
            b.layers[1].self_attn.k_norm.weight.mul_(3)  # in place: its version counter moves
            old = b.layers[2].self_attn.k_norm.weight
            b.layers[2].self_attn.k_norm.weight = torch.nn.Parameter(old.detach() * 5)  # a new tensor

    m.register_post_load_hook(rescale, Phase.RELOAD, name="rescale")
    with capture_logs() as logs:
        assert reload(m, ckpt_b, subset=lambda n: n.startswith("layers.0.")) == ["rescale"]
    (ev,) = [e for e in logs if e["event"] == "changed_by_hooks"]
    assert sorted(ev["names"]) == ["layers.1.self_attn.k_norm.weight", "layers.2.self_attn.k_norm.weight"]
    assert ev["tensors"] == 2
    assert torch.equal(m._k_norm_weights, torch.stack([layer.self_attn.k_norm.weight for layer in m.layers]))


def test_signatures_in_bulk_are_the_per_tensor_ones() -> None:
    """The bulk read of the hooks' before/after snapshot says what the per-tensor one says, whatever is tracked:
    tensors, a META tensor, an inference tensor (no version counter), a view, a missing one (None)."""
    from lifecycle.hooks import _signature, _signatures

    plain = torch.ones(3)
    with torch.inference_mode():
        inference = torch.ones(2)
    tracked_sets = [[plain, plain[1:], torch.empty(2, device="meta")], [plain, None], [inference, plain], []]
    for tensors in tracked_sets:
        assert _signatures(tensors) == [_signature(t) for t in tensors]
    before = _signatures([plain])
    plain.add_(1)
    assert _signatures([plain]) != before  # written in place: the version counter moved


# ---- what a hook declares it writes (`writes=`) --------------------------------------------------------------


@pytest.fixture
def snapshot_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tracked tensors each read of the hooks' before/after snapshot took."""
    from lifecycle import hooks

    reads: list[int] = []
    real = hooks._signatures

    def counted(tensors: Any) -> list[Any]:
        reads.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(hooks, "_signatures", counted)
    return reads


def test_hooks_that_declare_they_write_nothing_tracked_cost_no_snapshot(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                                        snapshot_reads: list[int]) -> None:
    """A cold load whose hooks all declare `writes=()` (the RoPE tables: buffers the checkpoint does not hold) reads
    no tracked tensor around them; one undeclared hook makes the run read every one, before and after."""
    m = DFlashQwen3Draft(tiny_cfg)
    assert [(h.name, h.writes) for h in m.post_load_hooks(Phase.COLD_LOAD)] == [("init_rope_caches", ())]
    load_safetensors(m, ckpt_a)
    assert m.finalize_loading() == ["init_rope_caches"]
    assert snapshot_reads == []

    m2 = DFlashQwen3Draft(tiny_cfg)
    m2.register_post_load_hook(lambda b: None, Phase.COLD_LOAD, name="undeclared")
    load_safetensors(m2, ckpt_a)
    assert m2.finalize_loading() == ["init_rope_caches", "undeclared"]
    assert snapshot_reads == [len(m2.lifecycle.specs)] * 2


def test_a_declared_write_is_named_refreshed_and_only_it_is_read(loaded: DFlashQwen3Draft, ckpt_b: Path,
                                                                 snapshot_reads: list[int]) -> None:
    """A reload hook declaring the k_norm weights (a pattern) has those 3 read around it, not the draft's other
    tensors; what it scales in place is audited as written by hooks and refreshed."""
    m = loaded

    def rescale(b: DFlashQwen3Draft) -> None:
        with torch.no_grad():
            b.layers[1].self_attn.k_norm.weight.mul_(3)

    m.register_post_load_hook(rescale, Phase.RELOAD, writes=["layers.*.self_attn.k_norm.weight"])
    with capture_logs() as logs:
        assert reload(m, ckpt_b, subset=lambda n: n.startswith("layers.0.")) == ["rescale"]
    assert snapshot_reads == [len(m.layers)] * 2
    (ev,) = [e for e in logs if e["event"] == "changed_by_hooks"]
    assert ev["names"] == ["layers.1.self_attn.k_norm.weight"]
    assert torch.equal(m._k_norm_weights, torch.stack(_k_norms(m)))


def test_a_write_outside_the_declaration_is_what_the_check_reports(loaded: DFlashQwen3Draft) -> None:
    """The trade a declaration makes: the lifecycle reads only what a hook declares, so a write outside it goes
    unseen by the run; `undeclared_hook_writes` finds it (a family's test runs it over every hook)."""
    m = loaded

    def mislabelled(b: DFlashQwen3Draft) -> None:
        with torch.no_grad():
            b.layers[0].self_attn.k_norm.weight.mul_(2)  # declared: layer 1 only
            b.layers[1].self_attn.k_norm.weight.mul_(2)

    m.register_post_load_hook(mislabelled, Phase.RELOAD, writes=["layers.1.self_attn.k_norm.weight"])
    assert undeclared_hook_writes(m, "reload") == {"mislabelled": ["layers.0.self_attn.k_norm.weight"]}
    assert undeclared_hook_writes(m, "cold_load") == {}  # init_rope_caches: only its buffers


def test_a_bad_declaration_is_refused_naming_it_and_registers_nothing(tiny_cfg: DFlashConfig) -> None:
    m = DFlashQwen3Draft(tiny_cfg)
    before = m.post_load_hooks(Phase.RELOAD)
    with pytest.raises(TypeError, match=r"writes='norm.weight': give a list .*\(writes=\['norm.weight'\]\)"):
        m.register_post_load_hook(lambda b: None, Phase.RELOAD, writes="norm.weight")
    with pytest.raises(TypeError, match=r"non-empty string\), got \[3, ''\]"):
        m.register_post_load_hook(lambda b: None, Phase.RELOAD, writes=["norm.weight", 3, ""])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"DFlashQwen3Draft: .*scale: 'layers.\*.q_norm.bias', 'norm.wieght' "):
        m.register_post_load_hook(lambda b: None, Phase.RELOAD, name="scale",
                                  writes=["layers.*.self_attn.k_norm.weight", "layers.*.q_norm.bias", "norm.wieght"])
    assert m.post_load_hooks(Phase.RELOAD) == before

    class Typo(DFlashQwen3Draft):
        @post_load_hook(Phase.COLD_LOAD, writes=["_fused_kv_weight"])  # a derived buffer, not a checkpoint tensor
        def build_early(self) -> None:
            pass

    with pytest.raises(ValueError, match=r"Typo: post-load hooks declare writes to no tracked tensor: build_early: "
                                         r"'_fused_kv_weight'"):
        Typo(tiny_cfg)
