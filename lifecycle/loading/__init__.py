"""A reference safetensors loader: streams tensors in buckets and drives the backbone's lifecycle.

>>> import tempfile, torch
>>> from lifecycle.bundled import qwen3_dflash as q
>>> from lifecycle.events import configure_audit; _ = configure_audit(console=False)
>>> cfg = q.DFlashConfig(num_hidden_layers=2)
>>> path = write_checkpoint(q.random_weights(cfg, seed=0), tempfile.mkdtemp() + "/a.safetensors")
>>> model = q.DFlashQwen3Draft(cfg)
>>> report = load_safetensors(model, path, bucket_by="layer")
>>> model.lifecycle.state.value, report.buckets
('FULLY_LOADED', 5)

The whole checkpoint header is validated (names, shapes, dtypes) before the first tensor is read, so a bad
file changes nothing. Then each bucket is read from disk (only that bucket is in memory), written into the
parameters (copied in place when they exist, materialised when they are META), and reported to the lifecycle
as one `weights_loaded` call. Buckets can come in any order, with duplicates, or cover only a subset.

One module per step: `plan` (the buckets), `validate` (the header check, and the headers each lifecycle passed
already), `write` (one bucket: its checks, its writes, its report), `load` (`load_safetensors`, the loop over a
checkpoint's buckets); `target` says what the loader needs of a backbone. Reading and writing checkpoint files is
`lifecycle.checkpoint`'s.
"""

from __future__ import annotations

from ..checkpoint import IndexEntry, checkpoint_index, iter_buckets, write_checkpoint
from .load import LoadProgress, LoadReport, Subset, load_safetensors
from .plan import BucketBy, plan_buckets
from .target import LoadTarget
from .validate import VALIDATED_HEADERS_CAP, validate_index, validated_headers
from .write import BeforeWrite, Writer, apply_bucket, non_finite, write_tensor

__all__ = [
    "VALIDATED_HEADERS_CAP",
    "BeforeWrite",
    "BucketBy",
    "IndexEntry",
    "LoadProgress",
    "LoadReport",
    "LoadTarget",
    "Subset",
    "Writer",
    "apply_bucket",
    "checkpoint_index",
    "iter_buckets",
    "load_safetensors",
    "non_finite",
    "plan_buckets",
    "validate_index",
    "validated_headers",
    "write_checkpoint",
    "write_tensor",
]
