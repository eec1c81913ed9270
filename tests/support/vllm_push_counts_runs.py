"""What a push costs, in counts (issue 33 item 4), with vLLM's own DFlash classes in-process on both weight layouts
(`python -m support.vllm_push_counts_runs LAYOUT WORKDIR`), for tests/vllm_plugin/reload/test_push_counts.py.

A DFlash draft wide enough that its linear layers are storages of 1 MiB and more (hidden 512, 2 layers, 21 MB,
on a 2-layer Qwen3 target of the same width), cold-loaded from A and pinned, is pushed B, A, B, ... through the
plugin's transfer session (whole-file, one-layer and one-tensor buckets) and a plain `load_weights` then
`process_weights_after_loading`; the push after two warm-ups (the first sizes the staging buffer) is counted
(`support.push_counts`). Beside each count, the push is checked: the weights and every derived buffer bit-equal to
a cold load of what was pushed, every pinned address kept, and what `/weight_checker` answers for the draft
(`weight_checker.draft_checksums`) equal to a cold engine's answer, and what vLLM logged at WARNING or above
during the counted push about the modules that hold the plugin's own buffers (the draft's model module, its
attention modules: `own_buffer_warnings`). vLLM's warnings about the modules this build does not share with a target
(the embedding, the LM head, the rotary embedding: no push writes them) are in `vllm_warnings`.

Every check stands beside the action it checks (`expect`); the first one that fails ends the run and is the result.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import traceback
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from support.vllm_inprocess import ENV, backbone, build, derived_digests, gpu_weight_layout, identities, setup
from support.vllm_inprocess import weight_digests as weights_of
from support.vllm_writes_runs import expect

__all__ = ["BUCKETS", "RESULT", "run_counts"]

RESULT = "COUNTS_RESULT "
BUCKETS = {"whole": 10**6, "layer": None, "tensor": 1}  # the transfer session's bucket_size


def _shape() -> Any:
    from benchmarks.engine_shapes import EngineShape

    return EngineShape("counts", hidden=512, intermediate=1024, heads=4, kv_heads=2, head_dim=128, draft_layers=2)


def _case(draft: Path) -> Any:
    from support.vllm_inprocess import CASES

    return replace(CASES["dflash"], config=json.loads((draft / "config.json").read_text()))


def session(model: Any, folder: Path, bucket_size: int | None) -> None:
    """vLLM's native draft session with the plugin's transfer engine, the payload in one chunk."""
    import torch
    from vllm.config.weight_transfer import WeightTransferConfig

    from lifecycle.vllm.online.transfer import FileUpdateInfo, engine_class

    cfg = model.vllm_config
    engine = engine_class()(WeightTransferConfig(backend="safetensors_file"), cfg, torch.device("cpu"), model)
    engine.set_weight_update_target(model, cfg.speculative_config.draft_model_config)
    engine.start_weight_update()
    engine.receive_weights(FileUpdateInfo(path=str(folder), bucket_size=bucket_size))
    engine.finish_weight_update()
    engine.reset_weight_update_target()


class Warnings(logging.Handler):
    """What vLLM's loggers ("vllm" and below) say at WARNING or above while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(f"{record.name}: {record.getMessage()}")


def plain(model: Any, tensors: list[tuple[str, Any]]) -> None:
    """Trainer path (iv): load_weights per layer (the trainer's own tensors), then process_weights_after_loading."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    for prefix in ("layers.0.", "layers.1.", ""):
        model.load_weights([(n, t) for n, t in tensors if n.startswith(prefix) and (prefix or "layers." not in n)])
    process_weights_after_loading(model, model.vllm_config.speculative_config.draft_model_config,
                                  torch.device("cpu"))


def emptied_bytes(model: Any) -> int:
    """Bytes of the parameters the draft's processing empties (the CPU repack), in the checkpoint layout."""
    b = backbone(model)
    owned, specs = b.lifecycle_runtime.owned, b.lifecycle.specs
    total = 0
    for module, leaves in b.lifecycle_runtime.emptied_by_processing.items():
        for name in owned.get(module, []):
            if name.rpartition(".")[2] in leaves:
                spec = specs[name]
                total += spec.dtype.itemsize * math.prod(spec.shape)
    return total


def run_counts(work: Path, layout: str) -> dict[str, Any]:
    from benchmarks.engine_shapes import make_checkpoints
    from lifecycle.checkpoint import checkpoint_index
    from lifecycle.vllm.observability.weight_checker import draft_checksums
    from support.push_counts import push_counts
    from support.vllm_trainer_paths import read

    setup()
    ck = make_checkpoints(work, _shape())
    case = _case(ck["A"])
    payload = sum(e.nbytes for e in checkpoint_index(ck["A"]).values())
    counted: dict[str, Any] = {}
    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        cold = {}
        for which in "AB":
            reference = build(case, ck[which], ck["target"])
            cold[which] = {"weights": weights_of(reference), "derived": derived_digests(reference),
                           "checker": draft_checksums(reference)}
            del reference
        expect(cold["A"]["derived"] != cold["B"]["derived"], "drafts A and B derive the same buffers")
        model = build(case, ck["A"], ck["target"])
        backbone(model).capture_graphs()
        pinned = identities(model)
        at = "A"
        sent = {w: read(ck[w]) for w in "AB"}  # the plain path's trainer holds its tensors before it pushes
        pushes = [(f"session, {bucket} buckets", lambda m, w, n=size: session(m, ck[w], n))
                  for bucket, size in BUCKETS.items()] + [("plain load_weights", lambda m, w: plain(m, sent[w]))]
        for what, push in pushes:
            for _ in range(3):  # two warm-ups (the first sizes the staging buffer), then the counted push
                to = "B" if at == "A" else "A"
                warned = Warnings()
                logging.getLogger("vllm").addHandler(warned)
                try:
                    with push_counts(model, payload) as counts:
                        push(model, to)
                finally:
                    logging.getLogger("vllm").removeHandler(warned)
                at = to
                lc = backbone(model).lifecycle
                expect(lc.usable and lc.state.value == "GRAPH_CAPTURED", f"{what}: state {lc.state.value}")
                wrong = sorted(n for n, d in cold[to]["weights"].items() if weights_of(model).get(n) != d)
                expect(not wrong, f"{what}: weights differ from a cold load of {to}: {wrong[:4]}")
                wrong = sorted(n for n, d in cold[to]["derived"].items() if derived_digests(model).get(n) != d)
                expect(not wrong, f"{what}: derived buffers differ from a cold build of {to}: {wrong}")
                moved = sorted(n for n, ident in identities(model).items() if pinned.get(n) != ident)
                expect(not moved, f"{what}: pinned storage moved: {moved}")
                answer = draft_checksums(model)
                wrong = sorted(k for k in cold[to]["checker"] if answer.get(k) != cold[to]["checker"][k])
                expect(not wrong and answer.keys() == cold[to]["checker"].keys(),
                       f"{what}: /weight_checker's draft entries differ from a cold engine's: {wrong[:4]}")
            holders = {type(backbone(model)).__name__} | {type(layer.self_attn).__name__
                                                           for layer in backbone(model).layers}
            counted[what] = {**counts.as_dict(), "vllm_warnings": warned.said,
                             "own_buffer_warnings": [w for w in warned.said
                                                     if any(f": {c}: " in w for c in holders)]}
    return {"layout": layout, "payload_bytes": payload, "emptied_bytes": emptied_bytes(model), "counts": counted}


def main() -> None:
    layout, work = sys.argv[1:]
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    try:
        result: dict[str, Any] = {"ok": True, **run_counts(Path(work), layout)}
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if f.filename.endswith("vllm_push_counts_runs.py") and f.name not in ("expect", "main")]
        where = " <- ".join(f"vllm_push_counts_runs.py:{f.lineno} {f.line}" for f in reversed(frames)) or "?"
        result = {"ok": False, "failed": f"{where}: {type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    print(RESULT + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
