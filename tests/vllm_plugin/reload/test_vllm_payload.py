"""What a draft-reload RPC or transfer chunk may ask for, checked before any model is touched
(lifecycle/vllm/payload.py, lifecycle/vllm/settings.py). No engine (one test sets up vLLM's reload records by hand).

The live-engine side (the same errors through `collective_rpc`, the draft untouched) is in test_vllm_failures.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lifecycle.errors import CheckpointError
from lifecycle.loading import write_checkpoint
from lifecycle.vllm import settings
from lifecycle.vllm.reload.payload import check_path, feed, plan_payload
from lifecycle.vllm.reload.staging import Staging


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    folder = tmp_path / "draft"
    write_checkpoint({f"layers.{i}.w": torch.full((4,), float(i)) for i in range(5)}
                     | {"norm.weight": torch.ones(4)}, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"bucket_size": "2"}, TypeError, "bucket_size must be a positive int or None"),
    ({"bucket_size": 0}, ValueError, "got 0"),
    ({"bucket_size": -3}, ValueError, "got -3"),
    ({"bucket_size": True}, TypeError, "got True"),
    ({"bucket_size": 2.0}, TypeError, "got 2.0"),
    ({"shuffle": "yes"}, TypeError, "shuffle must be bool"),
    ({"seed": 1.5}, TypeError, "seed must be int"),
    ({"exclude_prefixes": "layers.1."}, TypeError, "not one string: 'layers.1.' would be read as its characters"),
    ({"exclude_prefixes": ["layers.1.", ""]}, TypeError, "non-empty strings"),
    ({"exclude_prefixes": 7}, TypeError, "list of name prefixes, got int"),
    ({"exclude_prefixes": ["layers.", "norm."]}, CheckpointError, "leaves out every one"),
])
def test_bad_arguments_are_refused_with_the_argument_named(ckpt: Path, kwargs: dict, error: type, message: str
                                                           ) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_payload(ckpt, **kwargs)


@pytest.mark.parametrize("path", [None, "", 3, b"/tmp"])
def test_a_path_must_be_a_non_empty_path(path: object) -> None:
    with pytest.raises(TypeError, match="weights_path must be a non-empty path"):
        plan_payload(path)


def test_buckets_are_planned_from_the_headers_with_excludes_and_shuffle(ckpt: Path) -> None:
    p = plan_payload(ckpt, bucket_size=2, exclude_prefixes=["norm."])
    assert p.buckets == [["layers.0.w", "layers.1.w"], ["layers.2.w", "layers.3.w"], ["layers.4.w"]]
    assert plan_payload(ckpt).buckets == [[n] for n in sorted(p.index)]  # None: a layer per bucket
    assert plan_payload(ckpt, whole_calls=True).buckets == [sorted(p.index)]  # a draft that needs every tensor
    shuffled = plan_payload(ckpt, bucket_size=1, shuffle=True, seed=4)
    assert sorted(n for b in shuffled.buckets for n in b) == sorted(p.index)
    assert [b[0] for b in shuffled.buckets] != sorted(p.index)


def test_feed_hands_each_bucket_to_load_weights_as_read_from_disk(ckpt: Path) -> None:
    seen: list[list[tuple[str, float]]] = []

    class Model:
        def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
            seen.append([(n, float(t[0])) for n, t in bucket])

    feed(Model(), plan_payload(ckpt, bucket_size=4))
    assert seen == [[("layers.0.w", 0.0), ("layers.1.w", 1.0), ("layers.2.w", 2.0), ("layers.3.w", 3.0)],
                    [("layers.4.w", 4.0), ("norm.weight", 1.0)]]


def test_the_staging_buffer_refuses_a_weight_left_living_in_it() -> None:
    """A weight loader that kept the value it was handed (a view of the reused read buffer) instead of copying it:
    the chunk's end refuses it, naming the tensor, and the draft reads into fresh tensors from then on."""
    staging = Staging(pinned=False)
    region = staging.region(256)
    assert region is not None and staging.buffer is not None
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_buffer("scale", torch.zeros(4))
    model[0].register_parameter("bias", nn.Parameter(torch.empty(4, device="meta")))  # META: no address, not held
    outside = torch.empty(512, dtype=torch.uint8)  # another buffer's bytes
    model[1].weight = nn.Parameter(outside[:32].view(torch.float32).view(4, 2))
    staging.check(model)  # nothing lives in it
    assert not staging.refused and staging.buffer is not None
    held = region.buffer.buffer[region.offset:region.offset + 256]
    model[1].register_buffer("scale", held[192:208].view(torch.float32))  # what a careless loader keeps
    with pytest.raises(CheckpointError, match=r"1\.scale of the draft now live\(s\) in the reader's staging buffer"):
        staging.check(model)
    assert staging.refused and staging.buffer is None  # `staging_for` hands it out no more: fresh reads


def test_the_staging_buffer_refuses_a_weight_a_completed_layer_left_living_in_it() -> None:
    """Within a chunk of a reload the end-of-chunk check reads the modules whose layer completed in the chunk (the
    only ones whose loaders ran): one that bound its weight to the buffer is refused, by name, as before."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in model:
        info = LAYERWISE_INFO[layer] = LayerReloadingInfo(restore_metadata=({}, {}), restore_device=torch.device("cpu"))
        info.load_numel_total, info.kernel_tensors = 1, (dict(layer.named_parameters()), {})
    try:
        staging = Staging(pinned=False)
        staging.start(model)  # both layers wait in the reload
        region = staging.region(256)
        assert region is not None
        LAYERWISE_INFO[model[1]].reset()  # layer 1 completed in the call, and its loader kept the value
        held = region.buffer.buffer[region.offset:region.offset + 32]
        model[1].weight = nn.Parameter(held.view(torch.float32).view(2, 4))
        staging.settle(model)
        with pytest.raises(CheckpointError, match=r"1\.weight of the draft now live\(s\) in the reader's staging"):
            staging.check(model)
        assert staging.refused and staging.buffer is None
    finally:
        for layer in model:
            LAYERWISE_INFO.pop(layer, None)


def test_the_allowed_root_confines_paths_through_symlinks(ckpt: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(ckpt)  # inside by name, outside once resolved
    monkeypatch.setenv(settings.PATH_ROOT_ENV, str(root))
    with pytest.raises(PermissionError, match=r"link'? resolves outside the allowed root") as ei:
        plan_payload(root / "link")
    assert str(ckpt) not in str(ei.value)  # never where the link points (issue 32, item 13)
    with pytest.raises(PermissionError, match="outside the allowed root"):
        check_path(str(root / ".." / "draft"))
    (root / "inside").mkdir()
    write_checkpoint({"w": torch.ones(2)}, root / "inside" / "a.safetensors")
    assert plan_payload(root / "inside").tensors == 1
    monkeypatch.delenv(settings.PATH_ROOT_ENV)
    assert plan_payload(root / "link").tensors == 6  # unset: any path the worker can read


@pytest.mark.parametrize("value", ["relative/dir", "/no/such/folder"])
def test_a_bad_allowed_root_is_an_error_naming_the_variable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.PATH_ROOT_ENV, value)
    with pytest.raises(ValueError, match=rf"RELOAD_LIFECYCLE_PATH_ROOT='{value}' must be an absolute path"):
        settings.allowed_root()


def test_the_partial_policy_per_call_and_engine_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.PARTIAL_ENV, raising=False)
    assert settings.check_partial(None) == "refuse"
    monkeypatch.setenv(settings.PARTIAL_ENV, " KEEP ")
    assert settings.check_partial(None) == "keep"
    assert settings.check_partial("refuse") == "refuse"  # the call wins
    with pytest.raises(ValueError, match=r"partial='Keep': expected one of 'refuse', 'keep' or None"):
        settings.check_partial("Keep")
    monkeypatch.setenv(settings.PARTIAL_ENV, "ignore")
    with pytest.raises(ValueError, match="RELOAD_LIFECYCLE_PARTIAL='ignore' is not one of: refuse, keep"):
        settings.check_partial(None)
