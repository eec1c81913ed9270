"""The reference safetensors loader: bad input is refused before anything is written; any bucketing works.

Every refusal test checks the error AND that nothing changed: lifecycle state, readiness bookkeeping, every
parameter and buffer (bit for bit, same storage), and the derived buffers.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from pathlib import Path

import pytest
import torch

from lifecycle import (
    CheckpointError,
    IllegalTransitionError,
    LayersNotReadyError,
    LifecycleState,
    UnknownWeightError,
    WeightShapeError,
)
from lifecycle.derived import current_buffer
from lifecycle.loading import (
    LoadProgress,
    apply_bucket,
    checkpoint_index,
    iter_buckets,
    load_safetensors,
    plan_buckets,
    validated_headers,
    write_checkpoint,
)
from lifecycle.readiness import layer_of
from models.qwen3_dflash import DFlashQwen3Draft, random_weights

S = LifecycleState


# ---- helpers ----------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so -0.0 vs 0.0 or NaN payloads would count as a change)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _all_tensors(model: DFlashQwen3Draft) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    for name in model.derived_buffer_names():
        t = current_buffer(model, name)
        if t is not None:
            out[name] = t
    return out


def snapshot(model: DFlashQwen3Draft) -> dict[str, object]:
    """Everything a refused load must leave alone."""
    lc = model.lifecycle
    tensors = {}
    for name, t in _all_tensors(model).items():
        if t.is_meta:
            tensors[name] = ("meta", tuple(t.shape), t.dtype)
        else:
            tensors[name] = (t.data_ptr(), tuple(t.shape), t.dtype, _bits(t))
    return {
        "state": lc.state,
        "epoch": lc.epoch,
        "layers_ready": lc.readiness.layers_ready,
        "loaded": {n: lc.readiness.is_loaded(n) for n in lc.specs},
        "dirty": lc.readiness.dirty_tensors(),
        "missing": lc.missing(),
        "derived": {n: current_buffer(model, n) is not None for n in model.derived_buffer_names()},
        "tensors": tensors,
    }


def assert_unchanged(model: DFlashQwen3Draft, before: dict[str, object]) -> None:
    after = snapshot(model)
    for key in ("state", "epoch", "layers_ready", "loaded", "dirty", "missing", "derived"):
        assert after[key] == before[key], f"{key} changed: {before[key]!r} -> {after[key]!r}"
    old, new = before["tensors"], after["tensors"]
    assert isinstance(old, dict) and isinstance(new, dict)
    assert old.keys() == new.keys()
    for name, o in old.items():
        n = new[name]
        if o[0] == "meta":
            assert n == o, f"{name} was materialised by a refused load"
            continue
        assert n[:3] == o[:3], f"{name}: storage/shape/dtype changed {o[:3]} -> {n[:3]}"
        assert torch.equal(n[3], o[3]), f"{name}: bytes changed by a refused load"


@pytest.fixture(params=["meta", "reloading"])
def target(request: pytest.FixtureRequest, tiny_cfg, loaded) -> DFlashQwen3Draft:
    """A model a load may legally write into: a fresh one on META, or a refreshed one after begin_reload()."""
    if request.param == "meta":
        model = DFlashQwen3Draft(tiny_cfg)
        assert model.lifecycle.state is S.META
        return model
    loaded.begin_reload()
    assert loaded.lifecycle.state is S.PARTIALLY_LOADED
    return loaded


def _good_b(tiny_cfg) -> dict[str, torch.Tensor]:
    # seed 1: differs from the loaded model's seed-0 weights, so any write would show
    return random_weights(tiny_cfg, 1)


def _file_order_layer_buckets(model: DFlashQwen3Draft, path: Path) -> list[list[str]]:
    lc = model.lifecycle
    return plan_buckets(list(checkpoint_index(path)), lambda n: lc.readiness.layer_of_name[n])


def _params_match(model: DFlashQwen3Draft, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert params.keys() == weights.keys()
    for name, value in weights.items():
        assert not params[name].is_meta, f"{name} still on META"
        assert torch.equal(params[name], value), f"{name} does not hold the checkpoint's value"


# ---- bad input: clear error, nothing changed -----------------------------------------------------------------


def test_unknown_tensor_name_is_named_and_changes_nothing(target, tiny_cfg, tmp_path):
    weights = _good_b(tiny_cfg)
    weights["layers.1.self_attn.bogus_proj.weight"] = torch.zeros(4, 4)
    path = write_checkpoint(weights, tmp_path / "unknown.safetensors")
    before = snapshot(target)
    with pytest.raises(UnknownWeightError) as ei:
        load_safetensors(target, path)
    assert ei.value.names == ("layers.1.self_attn.bogus_proj.weight",)
    assert "layers.1.self_attn.bogus_proj.weight" in str(ei.value)
    assert str(path) in str(ei.value)
    assert_unchanged(target, before)


def test_wrong_shape_says_expected_vs_got_and_changes_nothing(target, tiny_cfg, tmp_path):
    weights = _good_b(tiny_cfg)
    weights["layers.2.self_attn.qkv_proj.weight"] = torch.randn(127, tiny_cfg.hidden_size)
    path = write_checkpoint(weights, tmp_path / "shape.safetensors")
    before = snapshot(target)
    with pytest.raises(WeightShapeError) as ei:
        load_safetensors(target, path)
    msg = str(ei.value)
    assert "layers.2.self_attn.qkv_proj.weight" in msg
    assert "expected (128, 64) got (127, 64)" in msg
    assert len(ei.value.problems) == 1
    assert_unchanged(target, before)


def test_wrong_dtype_file_is_refused_and_changes_nothing(target, tiny_cfg, tmp_path):
    weights = {n: t.to(torch.float16) for n, t in _good_b(tiny_cfg).items()}
    path = write_checkpoint(weights, tmp_path / "fp16.safetensors")
    before = snapshot(target)
    with pytest.raises(WeightShapeError) as ei:
        load_safetensors(target, path)
    assert "dtype expected float32 got float16" in str(ei.value)
    assert len(ei.value.problems) == len(weights)  # every tensor is named, none skipped
    assert_unchanged(target, before)


def test_truncated_file_names_the_file_and_changes_nothing(target, tiny_cfg, tmp_path):
    good = write_checkpoint(_good_b(tiny_cfg), tmp_path / "good.safetensors")
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-64])  # the header is intact; the last tensor's data is cut short
    before = snapshot(target)
    with pytest.raises(CheckpointError) as ei:
        load_safetensors(target, truncated)
    assert str(truncated) in str(ei.value)
    assert ei.value.backbone == target.lifecycle.name
    assert ei.value.state == target.lifecycle.state.value
    assert_unchanged(target, before)


def test_garbage_file_names_the_file_and_changes_nothing(target, tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(bytes(range(256)) * 64)
    before = snapshot(target)
    with pytest.raises(CheckpointError) as ei:
        load_safetensors(target, garbage)
    assert str(garbage) in str(ei.value)
    assert_unchanged(target, before)


def test_truncated_second_file_refused_before_first_file_is_written(target, tiny_cfg, tmp_path):
    weights = _good_b(tiny_cfg)
    first = write_checkpoint({n: t for n, t in weights.items() if not n.startswith("layers.2.")},
                             tmp_path / "part-1.safetensors")
    second = write_checkpoint({n: t for n, t in weights.items() if n.startswith("layers.2.")},
                              tmp_path / "part-2.safetensors")
    second.write_bytes(second.read_bytes()[:-8])
    before = snapshot(target)
    with pytest.raises(CheckpointError) as ei:
        load_safetensors(target, [first, second])
    assert str(second) in str(ei.value)
    assert_unchanged(target, before)


@pytest.mark.parametrize("bucket_by", ["layer", 1])
@pytest.mark.parametrize("bad", ["shape", "unknown"])
def test_bad_tensor_in_last_bucket_refused_before_first_bucket(target, tiny_cfg, tmp_path, bucket_by, bad):
    weights = _good_b(tiny_cfg)
    if bad == "shape":
        last_name = "norm.weight"  # sorts last in the file, and its layer is the last bucket
        weights[last_name] = torch.ones(tiny_cfg.hidden_size + 1)
        error = WeightShapeError
    else:
        last_name = "zz_extra.weight"
        weights[last_name] = torch.ones(3)
        error = UnknownWeightError
    path = write_checkpoint(weights, tmp_path / "bad_last.safetensors")
    names = list(checkpoint_index(path))
    assert names[-1] == last_name  # premise: the bad tensor comes last in file order
    if bad == "shape":
        lc = target.lifecycle
        buckets = plan_buckets(names, lambda n: lc.readiness.layer_of_name[n], bucket_by=bucket_by)
        assert last_name in buckets[-1] and all(last_name not in b for b in buckets[:-1])
    calls: list[LoadProgress] = []
    before = snapshot(target)
    with pytest.raises(error) as ei:
        load_safetensors(target, path, bucket_by=bucket_by, progress=calls.append)
    assert last_name in str(ei.value)
    assert calls == []  # not a single bucket was applied
    assert_unchanged(target, before)


@pytest.mark.parametrize("graphs", [False, True])
def test_load_without_begin_reload_is_refused_and_writes_nothing(loaded, ckpt_b, graphs):
    if graphs:
        loaded.capture_graphs()
    state = S.GRAPH_CAPTURED if graphs else S.DERIVED_REFRESHED
    assert loaded.lifecycle.state is state
    before = snapshot(loaded)
    with pytest.raises(IllegalTransitionError) as ei:
        load_safetensors(loaded, ckpt_b)
    assert ei.value.trigger == "weights_loaded"
    assert state.value in str(ei.value)
    assert_unchanged(loaded, before)
    # the refusal is recorded, not silent
    last = loaded.lifecycle.recent_events[-1]
    assert last["event"] == "refused" and last["trigger"] == "weights_loaded"


def test_subset_with_absent_names_raises_and_changes_nothing(target, ckpt_b):
    before = snapshot(target)
    with pytest.raises(CheckpointError) as ei:
        load_safetensors(target, ckpt_b, subset=["layers.0.self_attn.qkv_proj.weight", "layers.7.mlp.down_proj.weight"])
    assert "layers.7.mlp.down_proj.weight" in str(ei.value)
    assert "layers.0.self_attn.qkv_proj.weight" not in str(ei.value)
    assert_unchanged(target, before)


# ---- good input: any bucketing ends FULLY_LOADED with the file's values ---------------------------------------

STRATEGIES = {
    "layer-file-order": {"bucket_by": "layer"},
    "layer-shuffled": {"bucket_by": "layer", "shuffle": True, "seed": 3},
    "by-3-shuffled": {"bucket_by": 3, "shuffle": True, "seed": 4},
    "by-1-in-order": {"bucket_by": 1},
    "by-1-shuffled": {"bucket_by": 1, "shuffle": True, "seed": 5},
    "layer-duplicates": {"bucket_by": "layer", "shuffle": True, "seed": 6, "duplicates": 5},
    "by-1-duplicates": {"bucket_by": 1, "shuffle": True, "seed": 7, "duplicates": 5},
    "by-4-duplicates": {"bucket_by": 4, "duplicates": 5},
}


@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=list(STRATEGIES))
def test_any_bucketing_ends_fully_loaded_with_correct_values(target, tiny_cfg, ckpt_b, strategy):
    kw = STRATEGIES[strategy]
    weights = random_weights(tiny_cfg, 1)
    seen: list[tuple[LoadProgress, LifecycleState]] = []
    report = load_safetensors(target, ckpt_b, progress=lambda p: seen.append((p, target.lifecycle.state)), **kw)
    lc = target.lifecycle
    assert lc.state is S.FULLY_LOADED
    assert lc.missing() == {}
    dups = kw.get("duplicates", 0)
    assert report.tensors == len(weights) + dups
    if kw["bucket_by"] == 1:
        assert report.buckets == len(weights) + dups  # one tensor at a time
    # the state is FULLY_LOADED exactly from the bucket that completed the last layer on, never before
    for p, state in seen:
        assert (state is S.FULLY_LOADED) == (p.layers_ready == p.layers_total), (p, state)
    assert sorted(report.layers_completed) == sorted(lc.readiness.tensors_of_layer)
    _params_match(target, weights)
    target.finalize_loading()
    target.refresh_derived_buffers()
    q = target.layers[0].self_attn.q_size
    layers = range(tiny_cfg.num_hidden_layers)
    expected = torch.cat([weights[f"layers.{i}.self_attn.qkv_proj.weight"][q:] for i in layers])
    assert torch.equal(target._fused_kv_weight, expected)


def test_partial_load_stays_partially_loaded_and_finish_is_refused(target, ckpt_b):
    load_safetensors(target, ckpt_b, subset=lambda n: not n.startswith("layers.1."))
    assert target.lifecycle.state is S.PARTIALLY_LOADED
    with pytest.raises(LayersNotReadyError) as ei:
        target.finalize_loading()
    assert set(ei.value.missing) == {"layers.1"}
    assert target.lifecycle.state is S.PARTIALLY_LOADED


def test_load_report_names_each_file_once_sorted_with_bytes_and_tensors(target, tiny_cfg, tmp_path):
    w = _good_b(tiny_cfg)
    names = list(w)
    half = len(names) // 2
    p2 = write_checkpoint({n: w[n] for n in names[half:]}, tmp_path / "z.safetensors")
    p1 = write_checkpoint({n: w[n] for n in names[:half]}, tmp_path / "a.safetensors")
    report = load_safetensors(target, [p2, p1, p2])
    assert report.files == sorted({str(p1), str(p2)})
    assert report.tensors == len(names)
    assert report.nbytes == sum(t.numel() * t.element_size() for t in w.values())


def test_apply_bucket_validated_skips_tensor_checks_but_not_the_state_check(loaded, tiny_cfg):
    """`validated=True` is for tensors whose checkpoint header was already validated (as `load_safetensors`
    does); whether loading is allowed now is still checked, audited, before anything is written."""
    w = _good_b(tiny_cfg)
    bad = [(n, t.double()) for n, t in w.items() if n.startswith("layers.0.")]
    before = snapshot(loaded)
    with pytest.raises(IllegalTransitionError):
        apply_bucket(loaded, bad, validated=True)  # DERIVED_REFRESHED: no begin_reload yet
    assert_unchanged(loaded, before)
    loaded.begin_reload()
    before = snapshot(loaded)
    with pytest.raises(WeightShapeError):
        apply_bucket(loaded, bad)  # unvalidated buckets are still checked per tensor
    assert_unchanged(loaded, before)
    good = [(n, t) for n, t in w.items() if n.startswith("layers.0.")]
    assert apply_bucket(loaded, good, validated=True) == ["layers.0"]


class _CountingSpecs(dict):
    """The backbone's specs, counting the per-tensor lookups `validate_index` makes."""

    lookups = 0

    def get(self, key, default=None):
        type(self).lookups += 1
        return super().get(key, default)


def _count_spec_lookups(model: DFlashQwen3Draft) -> type[_CountingSpecs]:
    counting = type("Counting", (_CountingSpecs,), {"lookups": 0})
    model.lifecycle.specs = counting(model.lifecycle.specs)
    return counting


def test_headers_checked_in_full_are_not_checked_tensor_by_tensor_again(loaded, tiny_cfg, tmp_path):
    """The next push of the same model (same header bytes) skips the per-tensor check; the same path rewritten
    with one shape changed is checked again and refused (the key is the header's bytes, not the path), nothing
    written."""
    counting = _count_spec_lookups(loaded)
    path = write_checkpoint(_good_b(tiny_cfg), tmp_path / "push.safetensors")
    loaded.begin_reload()
    load_safetensors(loaded, path)  # the header of the cold load's checkpoint A, byte for byte
    assert counting.lookups == 0
    loaded.finalize_loading()
    loaded.refresh_derived_buffers()
    write_checkpoint(random_weights(tiny_cfg, 7), path)  # new values, same names/shapes/dtypes: same header
    loaded.begin_reload()
    counting.lookups = 0
    load_safetensors(loaded, path)
    assert counting.lookups == 0
    loaded.finalize_loading()
    loaded.refresh_derived_buffers()
    weights = _good_b(tiny_cfg)
    weights["layers.2.self_attn.qkv_proj.weight"] = torch.randn(127, tiny_cfg.hidden_size)
    write_checkpoint(weights, path)
    loaded.begin_reload()
    before = snapshot(loaded)
    counting.lookups = 0
    with pytest.raises(WeightShapeError) as ei:
        load_safetensors(loaded, path)
    assert "expected (128, 64) got (127, 64)" in str(ei.value)
    assert counting.lookups == len(loaded.lifecycle.specs)
    assert_unchanged(loaded, before)


def test_a_subset_check_does_not_vouch_for_the_whole_header(target, tiny_cfg, tmp_path):
    """Only a check of every tensor of a header is kept: a subset load of a file with a bad tensor outside the
    subset passes, and the full load of the same file is still refused."""
    weights = _good_b(tiny_cfg)
    weights["layers.2.self_attn.qkv_proj.weight"] = torch.randn(127, tiny_cfg.hidden_size)
    path = write_checkpoint(weights, tmp_path / "half-bad.safetensors")
    load_safetensors(target, path, subset=lambda n: not n.startswith("layers.2."))
    assert validated_headers(target.lifecycle) != checkpoint_index(path).headers
    with pytest.raises(WeightShapeError):
        load_safetensors(target, path)


def test_forgetting_tensors_forgets_the_checked_headers(tiny_cfg, ckpt_b):
    model = DFlashQwen3Draft(tiny_cfg)
    load_safetensors(model, ckpt_b)
    assert validated_headers(model.lifecycle) == checkpoint_index(ckpt_b).headers
    model.lifecycle.freeze_structure({}, [])
    assert validated_headers(model.lifecycle) is None


# ---- progress -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket_by", ["layer", 3, 1])
def test_progress_called_once_per_bucket_with_increasing_counts(target, ckpt_b, bucket_by):
    calls: list[LoadProgress] = []
    report = load_safetensors(target, ckpt_b, bucket_by=bucket_by, shuffle=True, seed=11, progress=calls.append)
    assert len(calls) == report.buckets > 1
    assert [c.bucket for c in calls] == list(range(1, report.buckets + 1))
    assert all(c.buckets == report.buckets for c in calls)
    done = [c.tensors_done for c in calls]
    assert all(b > a for a, b in itertools.pairwise(done)), done
    if bucket_by == 1:
        assert done == list(range(1, report.tensors + 1))
    assert done[-1] == calls[-1].tensors_total == report.tensors
    ready = [c.layers_ready for c in calls]
    assert ready == sorted(ready)
    assert ready[-1] == calls[-1].layers_total == target.lifecycle.readiness.layers_total


# ---- bucket planning and streaming ------------------------------------------------------------------------------


def _names(tiny_cfg) -> list[str]:
    return list(random_weights(tiny_cfg, 0))


def test_plan_buckets_by_layer_groups_each_layer_once(tiny_cfg):
    names = _names(tiny_cfg)
    buckets = plan_buckets(names, layer_of)
    assert len(buckets) == len({layer_of(n) for n in names})
    for b in buckets:
        assert len({layer_of(n) for n in b}) == 1
    assert sorted(n for b in buckets for n in b) == sorted(names)
    shuffled = plan_buckets(names, layer_of, shuffle=True, seed=1)
    assert sorted(map(sorted, shuffled)) == sorted(map(sorted, buckets))
    assert shuffled != buckets  # shuffling did reorder something


@pytest.mark.parametrize("size", [1, 3, 5])
def test_plan_buckets_fixed_size(tiny_cfg, size):
    names = _names(tiny_cfg)
    buckets = plan_buckets(names, layer_of, bucket_by=size, shuffle=True, seed=2)
    assert [len(b) for b in buckets[:-1]] == [size] * (len(buckets) - 1)
    assert 1 <= len(buckets[-1]) <= size
    assert sorted(n for b in buckets for n in b) == sorted(names)


@pytest.mark.parametrize("bucket_by", ["layer", 3, 1])
@pytest.mark.parametrize("seed", [0, 3, 8])
def test_plan_buckets_duplicates_resend_later_without_growing_buckets(tiny_cfg, bucket_by, seed):
    names = _names(tiny_cfg)
    buckets = plan_buckets(names, layer_of, bucket_by=bucket_by, shuffle=True, seed=seed, duplicates=5)
    flat = [n for b in buckets for n in b]
    assert len(flat) == len(names) + 5
    counts = {n: flat.count(n) for n in names}
    assert sorted(counts.values()) == [1] * (len(names) - 5) + [2] * 5
    for n in (n for n, c in counts.items() if c == 2):
        where = [i for i, b in enumerate(buckets) if n in b]
        assert len(where) == 2 and where[0] < where[1], f"{n} resent in the same or an earlier bucket: {where}"
    if bucket_by != "layer":
        assert max(len(b) for b in buckets) <= bucket_by  # bucket_by=1 stays one tensor at a time


@pytest.mark.parametrize("bad", [0, -1, "tensor", 2.5])
def test_plan_buckets_rejects_bad_bucket_by(tiny_cfg, bad):
    with pytest.raises(ValueError, match="bucket_by"):
        plan_buckets(_names(tiny_cfg), layer_of, bucket_by=bad)


@pytest.mark.parametrize("bucket_by", ["layer", 4, 1])
def test_iter_buckets_yields_exactly_one_bucket_per_step(ckpt_a, bucket_by):
    index = checkpoint_index(ckpt_a)
    buckets = plan_buckets(list(index), layer_of, bucket_by=bucket_by, shuffle=True, seed=9)
    it = iter_buckets(index, buckets)
    for bucket in buckets:
        step = next(it)
        assert [n for n, _ in step] == list(bucket)
        assert len(step) == len(bucket)
        for name, t in step:
            assert tuple(t.shape) == index[name].shape and t.dtype == index[name].dtype
    with pytest.raises(StopIteration):
        next(it)


def test_iter_buckets_is_lazy_and_keeps_no_earlier_bucket(tiny_cfg, tmp_path):
    weights = random_weights(tiny_cfg, 0)
    files = [write_checkpoint({n: t for n, t in weights.items() if n.startswith(f"layers.{i}.")},
                              tmp_path / f"part-{i}.safetensors") for i in range(3)]
    index = checkpoint_index(files)
    buckets = [[n for n in index if n.startswith(f"layers.{i}.")] for i in range(3)]
    it = iter_buckets(index, buckets)
    step = next(it)
    assert [n for n, _ in step] == buckets[0]
    assert all(torch.equal(t, weights[n]) for n, t in step)
    refs = [weakref.ref(t) for _, t in step]
    del step
    step = next(it)  # the generator is alive and holds its second bucket now
    assert [n for n, _ in step] == buckets[1]
    gc.collect()
    assert all(r() is None for r in refs), "the iterator kept tensors of an earlier bucket alive"
    # nothing of the third file was read yet: remove it, and only the next step notices
    files[2].unlink()
    with pytest.raises(CheckpointError, match=r"part-2\.safetensors: No such file"):
        next(it)
