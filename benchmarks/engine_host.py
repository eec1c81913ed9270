"""One live CPU engine in a process of its own, serving `benchmarks.engine_push`: it runs one push (or the floor)
when told, timed inside the process that holds the engine (vLLM's engine core in-process:
`VLLM_ENABLE_V1_MULTIPROCESSING=0`), and answers with the time and the process's memory around it.

The host of stock vLLM runs with `VLLM_PLUGINS=""` (an allowlist that matches no plugin: vLLM's own draft class,
nothing of this package wrapped). vLLM's output goes to a log file of the host, not to the benchmark's tables.
Ops (`serve`): start (an engine on a shape and weight layout), run (one arm once: its wall and CPU time, the memory
around it), counts (one push counted: bytes hashed, fresh storages, passes over the payload: `support.push_counts`),
check (what the last push left: generation, the fused K/V buffer against the checkpoint, the lifecycle's state and
pins), stop, exit.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import traceback
from contextlib import ExitStack, nullcontext
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["serve"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux: /proc/self/clear_refs, 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Host:
    def __init__(self, role: str) -> None:
        self.role = role
        self.stack: ExitStack | None = None
        self.llm: Any = None
        self.worker: Any = None
        self.draft: Any = None
        self.paths: dict[str, Path] = {}
        self.floor_dest: dict[str, Any] = {}
        self.chunk_plans: dict[tuple[Path, str], list[dict[str, Any]]] = {}
        self.held: list[list[tuple[str, Any]]] = []  # the plain arm's buckets, read before the clock
        self.last: str | None = None
        #: (arm, bucket) -> step -> its timer's in-place cost per call, seconds, one value per probe push
        self.timer_excess: dict[tuple[str, str], dict[str, list[float]]] = {}

    # ---- engine ---------------------------------------------------------------------------------------------
    def start(self, target: str, drafts: dict[str, str], layout: str, shape: dict[str, Any]) -> dict[str, Any]:
        import torch
        from vllm import LLM

        from benchmarks.engine_shapes import EngineShape
        from lifecycle.events import configure_audit
        from lifecycle.vllm.demo.tiny import engine_kwargs
        from support.vllm_inprocess import gpu_weight_layout

        self.shape = EngineShape(**shape)
        self.paths = {k: Path(v) for k, v in drafts.items()}
        self.chunk_plans = {}
        self.timer_excess = {}  # measured on this engine
        self.stack = ExitStack()
        self.stack.enter_context(gpu_weight_layout() if layout == "gpu" else nullcontext())
        configure_audit(console=False)  # events kept in each lifecycle's memory, as an engine without a log
        t0 = time.perf_counter()
        self.llm = LLM(**engine_kwargs(target, self.paths["A"], plugin=self.role == "plugin"))
        start_s = time.perf_counter() - t0
        self.worker = self.llm.collective_rpc(_itself)[0]
        runner = self.worker.model_runner
        self.draft = runner.get_draft_model() if hasattr(runner, "get_draft_model") else runner.drafter.model
        self.last = "A"
        pinned = self.worker.lifecycle_pin()["backbones"] if self.role == "plugin" else {}
        # the floor's destinations: tensors of the checkpoint's shapes, and a fused K/V buffer, made once
        from lifecycle.checkpoint import checkpoint_index
        from lifecycle.read_buffers import MappedBuffer, padded

        index = checkpoint_index(self.paths["A"])
        self.floor_dest = {n: torch.empty(e.shape, dtype=e.dtype) for n, e in index.items()}
        self.floor_fused = torch.empty(self.shape.fused_kv_bytes // 4)
        self.floor_staging = MappedBuffer(torch.empty(sum(padded(e.nbytes) for e in index.values()),
                                                      dtype=torch.uint8))
        self.evict_src = torch.empty(16 * 2**20)
        self.evict_dst = torch.empty_like(self.evict_src)
        gc.collect()
        return {"start_s": round(start_s, 2), "rss_mib": round(_status_kib("VmRSS") / 1024, 1),
                "draft_class": type(self.draft).__name__, "pinned": pinned,
                "layout_weight_shape": list(next(m for n, m in self.draft.named_modules()
                                                 if n.endswith("qkv_proj")).weight.shape)}

    def stop(self) -> None:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = self.worker = self.draft = None
        self.floor_dest = {}
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()
        if self.stack is not None:
            self.stack.close()
            self.stack = None

    # ---- one arm, once ----------------------------------------------------------------------------------------
    def run(self, arm: str, bucket: str, draft: str, steps: bool | str = False) -> dict[str, Any]:
        """One push, timed; `steps=True`: every step timed too (each timer's in-place cost from this arm's probe
        pushes taken off its caller); `steps="probe"`: a probe around every step's timer, to measure that cost
        (`benchmarks.engine_steps.Steps`)."""
        from benchmarks.engine_steps import Steps, timed_steps

        fn = {"floor": self._floor, "session": self._session, "plain": self._plain,
              "layerwise": self._layerwise}[arm]
        folder = self.paths[draft]
        if arm == "session":
            self._chunks(folder, bucket)  # planned before the clock starts (see `_chunks`)
        if arm == "plain":  # the tensors the trainer holds, read before the clock (see `_plain`)
            self.held = [list(b) for b in self._buckets(folder, bucket)]
        self.evict_dst.copy_(self.evict_src)  # every arm from the same cache state (see common.Eviction)
        probed = self.timer_excess.setdefault((arm, bucket), {})
        timers = Steps(probe=steps == "probe",
                       excess={step: statistics.median(xs) for step, xs in probed.items()})
        plugin = self.role == "plugin"
        engine = getattr(self.worker, "weight_transfer_engine", None) if plugin else None
        with timed_steps(timers, self.draft, plugin=plugin, engine=engine) if steps else nullcontext():
            gc.collect()
            gc.disable()
            rss = _status_kib("VmRSS")
            reset = _reset_peak()
            try:
                c0 = time.process_time()
                t0 = time.perf_counter()
                calls = fn(folder, bucket)
                seconds = time.perf_counter() - t0
                cpu = time.process_time() - c0
            finally:
                gc.enable()
                self.held = []  # the trainer's tensors go with the push, whatever became of it
            peak = _status_kib("VmHWM")
        if arm != "floor":
            self.last = draft
        out: dict[str, Any] = {"s": seconds, "cpu_s": cpu, "calls": calls, "rss_mib": round(rss / 1024, 1),
                               "peak_over_mib": round((peak - rss) / 1024, 1) if reset else None}
        if steps == "probe":
            for step, x in timers.excess_per_call().items():
                probed.setdefault(step, []).append(x)
            out["timer_excess_s"] = timers.excess_per_call()
        elif steps:
            out["steps"] = timers.step_seconds()
            out["step_calls"] = dict(timers.calls)
            out["timer_excess_s"] = dict(timers.excess)
        return out

    def counts(self, bucket: str, draft: str) -> dict[str, Any]:
        """One session push of `draft` with `bucket` buckets, counted (`support.push_counts`: deterministic)."""
        from lifecycle.checkpoint import checkpoint_index
        from support.push_counts import push_counts

        folder = self.paths[draft]
        payload = sum(e.nbytes for e in checkpoint_index(folder).values())
        with push_counts(self.draft, payload) as counted:
            self._session(folder, bucket)
        self.last = draft
        return counted.as_dict()

    def _chunks(self, folder: Path, bucket: str) -> list[dict[str, Any]]:
        """The trainer's `update_weights` calls: what it wrote, and how many tensors each call holds (a trainer knows
        that without reading its own files' headers: worked out once, outside the timed push)."""
        from benchmarks.engine_shapes import shard_files
        from lifecycle.checkpoint import checkpoint_index

        planned = self.chunk_plans.get((folder, bucket))
        if planned is not None:
            return [dict(info) for info in planned]

        def whole(path: Path) -> dict[str, Any]:  # one load_weights call for what the chunk holds (None streams)
            return {"path": str(path), "bucket_size": len(checkpoint_index(path))}

        if bucket == "layer":
            planned = [whole(f) for f in shard_files(folder)]
        else:
            planned = [{"path": str(folder), "bucket_size": 1} if bucket == "tensor" else whole(folder)]
        self.chunk_plans[(folder, bucket)] = planned
        return [dict(info) for info in planned]

    def _session(self, folder: Path, bucket: str) -> int:
        """vLLM's native draft session with the plugin's safetensors_file transfer engine."""
        w = self.worker
        w.start_draft_weight_update()
        chunks = self._chunks(folder, bucket)
        for info in chunks:
            w.update_weights(info)
        w.finish_weight_update()
        return len(chunks)

    def _buckets(self, folder: Path, bucket: str) -> Any:
        from benchmarks.engine_shapes import buckets_of
        from lifecycle.checkpoint import checkpoint_index, iter_buckets

        return iter_buckets(checkpoint_index(folder), buckets_of(folder, bucket))

    def _plain(self, folder: Path, bucket: str) -> int:
        """Trainer path (iv): `load_weights` per bucket into the live model, then `process_weights_after_loading`
        (older veRL, vLLM's weight-cache loaders). The tensors are the ones the trainer holds (`held`, read before
        the clock by `run`): read inside it, fresh tensors fault their pages in or not by the process's heap history
        (245 ms vs 45 ms for the same bytes in the plugin's host), which swung this arm 0.97x-4.2x against stock's
        between runs; the trainer's reads are its own, whichever vLLM it pushes to."""
        import importlib

        import torch

        n = 0
        for b in self.held or self._buckets(folder, bucket):
            self.draft.load_weights(b)
            n += 1
        utils = importlib.import_module("vllm.model_executor.model_loader.utils")
        utils.process_weights_after_loading(self.draft, self._model_config(), torch.device("cpu"))
        return n

    def _layerwise(self, folder: Path, bucket: str) -> int:
        """Trainer paths (i)-(iii), and what vLLM's own transfer engines run: vLLM's layerwise reload around the
        `load_weights` calls."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.draft)
        n = 0
        for b in self._buckets(folder, bucket):
            self.draft.load_weights(b)
            n += 1
        finalize_layerwise_reload(self.draft, self._model_config())
        return n

    def _floor(self, folder: Path, bucket: str) -> int:
        """What a push cannot beat: the same bytes read once, bucket by bucket, into one reused buffer, copied
        once into tensors of the same shapes, and each layer's K/V rows written once into a fused buffer."""
        from benchmarks.common import read_floor_bucket
        from benchmarks.engine_shapes import buckets_of
        from lifecycle.checkpoint import checkpoint_index

        index = checkpoint_index(folder)
        rows = 2 * self.shape.kv_size
        fused = self.floor_fused.view(-1, self.shape.hidden)
        fds: dict[Path, int] = {}
        try:
            for names in buckets_of(folder, bucket):
                views = read_floor_bucket(index, names, self.floor_staging, fds)
                for name, value in views:
                    self.floor_dest[name].copy_(value)
                    if name.endswith(("k_proj.weight", "v_proj.weight")):
                        layer = int(name.split(".")[1])
                        at = layer * rows + (0 if name.endswith("k_proj.weight") else self.shape.kv_size)
                        fused[at:at + value.shape[0]].copy_(value)
        finally:
            for fd in fds.values():
                os.close(fd)
        return 0

    def _model_config(self) -> Any:
        return self.worker.vllm_config.speculative_config.draft_model_config

    # ---- what a push left --------------------------------------------------------------------------------------
    def check(self) -> dict[str, Any]:
        """Generation after the last push, the fused K/V buffer against the pushed checkpoint's K/V rows, and
        (plugin) the lifecycle's state and its pin verification."""
        import torch
        from safetensors import safe_open
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from benchmarks.engine_shapes import kv_rows, shard_files

        out: dict[str, Any] = {"draft": self.last}
        try:
            self.llm.reset_prefix_cache()
            res = self.llm.generate([TokensPrompt(prompt_token_ids=[1, 5, 7, 9, 11])],
                                    SamplingParams(max_tokens=6, temperature=0, detokenize=False), use_tqdm=False)
            out["generate"] = {"ok": True, "tokens": list(res[0].outputs[0].token_ids)}
        except Exception as e:
            out["generate"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        inner = self.draft.model
        fused = inner._buffers.get("_fused_kv_weight") if self.role == "plugin" else \
            inner.__dict__.get("_fused_kv_weight")
        kv = {}
        for f in shard_files(self.paths[self.last or "A"]):
            with safe_open(str(f), "pt") as st:
                names = st.keys()  # a safe_open handle is not iterable itself
                kv.update({k: st.get_tensor(k) for k in names if k.endswith(("k_proj.weight", "v_proj.weight"))})
        out["fused_equals_checkpoint"] = bool(isinstance(fused, torch.Tensor) and not fused.is_meta
                                              and torch.equal(fused, kv_rows(kv, self.shape.draft_layers)))
        if self.role == "plugin":
            state = self.worker.lifecycle_states()[0]
            verify = self.worker.lifecycle_verify()["backbones"]
            out.update(state=state["state"], epoch=state["epoch"], quarantine=state["quarantine_reason"],
                       pins_ok=all(v["ok"] for v in verify.values()))
        out["ok"] = out["generate"]["ok"] and out["fused_equals_checkpoint"] and out.get("pins_ok", True) \
            and out.get("quarantine") is None
        return out


def _itself(worker: Any) -> Any:
    return worker


def serve(conn: Connection, role: str, log: str) -> None:
    """The host's loop: one message in, one answer out, until `exit`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the suite's simulated GPU layout (support.vllm_inprocess)
    from lifecycle.vllm.demo.tiny import ENGINE_ENV

    os.environ.update(ENGINE_ENV)
    if role == "stock":
        os.environ["VLLM_PLUGINS"] = ""  # an allowlist that matches no plugin: stock vLLM
    host = Host(role)
    while True:
        msg = conn.recv()
        op = msg.pop("op")
        if op == "exit":
            conn.send({"ok": True, "value": None})
            return
        try:
            value = getattr(host, op)(**msg)
            conn.send({"ok": True, "value": value})
        except Exception as e:
            conn.send({"ok": False, "error": f"{type(e).__name__}: {str(e)[:1500]}",
                       "trace": traceback.format_exc()[-3000:]})
