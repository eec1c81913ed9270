"""Every change the plugin makes to vLLM, and every other vLLM name it relies on: one record each, in one place.

`patching.apply` installs the process-wide wrappers from these records at activation (every target resolved first;
a miss refuses, naming it, with nothing patched); `patching.wrap_instance`, `swap_class` and `write_private` refuse
a change to one of vLLM's objects that is not declared here; `plugin.capabilities` checks every record against
vLLM's sources (at activation on the installed vLLM, in `make compat` on the 0.33 wheel); `docs/generate.py` writes
docs/architecture.md's table from them. A wrapper is named "module:function" under `lifecycle.vllm`.
"""

from __future__ import annotations

from .records import READS, REGISTERS, SWAPS_CLASS, WRAPS, WRAPS_INSTANCE, WRITES, Patch

__all__ = ["PATCHES"]

_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_RELOAD = "vllm.model_executor.model_loader.reload"
_TYPES = "vllm.model_executor.model_loader.reload.types"
_WORKER = "vllm.v1.worker.gpu_worker"
_ASYNC_LLM = "vllm.v1.engine.async_llm"
_LLM_ENGINE = "vllm.v1.engine.llm_engine"
_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.speculator"
_SPEC_METRICS = "vllm.v1.spec_decode.metrics"
_TRANSFER = "vllm.distributed.weight_transfer"
_RL_ROUTES = "vllm.entrypoints.rl.online.api_router"

_BEGIN = "a draft reload epoch begins with vLLM's layerwise reload (explicit paths, transfer sessions)"
_FINISH = "the epoch finishes after vLLM's finalize: every layer ready, reload hooks, refresh in place"
_COLD = ("after a cold load the draft builds its derived buffers; inside a reload epoch the epoch is finished, "
         "never by replaying cold-load processing")


def _wraps(module: str, target: str, wrapper: str, why: str, user: str, since: str = "0.32") -> Patch:
    return Patch(WRAPS, module, target, why, user, wrapper, since)


def _reads(module: str, target: str, user: str, why: str = "") -> Patch:
    return Patch(READS, module, target, why or f"read by {user}", user)


_LAYERWISE_ENTRIES = tuple(
    p for module in (_LAYERWISE, _RELOAD, f"{_RELOAD}.inplace", f"{_RELOAD}.torchao_decorator") for p in (
        _wraps(module, "initialize_layerwise_reload", "reload.hooks:wrap_initialize", _BEGIN, "reload.hooks"),
        _wraps(module, "finalize_layerwise_reload", "reload.hooks:wrap_finalize", _FINISH, "reload.hooks")))

#: Every record, by the layer that applies or reads it.
PATCHES: tuple[Patch, ...] = (
    # ---- reload: vLLM's layerwise reload and the loader's processing -------------------------------------------
    _wraps(_LAYERWISE, "_layerwise_process", "reload.hooks:wrap_layerwise_process",
           "a draft's layer is processed only once every tensor and shard arrived; then it counts as loaded",
           "reload.hooks"),
    _wraps(_LAYERWISE, "get_numel_loaded", "reload.counting:wrap_numel_loaded",
           "the elements a buffered load writes, counted by vLLM's dry run of the loader once per loader and arguments "
           "where the answer depends on shapes alone (unquantized layers); every other load dry-run as vLLM does",
           "reload.counting"),
    _wraps(_LAYERWISE, "_copy_and_restore_kernel_tensors", "reload.hooks:wrap_copy_back",
           "a layer's copy back into its live tensors is recorded before the first copy (an interrupt part way "
           "leaves it known to be written)", "reload.hooks"),
    _wraps(_LAYERWISE, "_reload_attention_scales", "reload.hooks:wrap_copy_back",
           "as the copy back: attention scales written into live tensors", "reload.hooks"),
    *_LAYERWISE_ENTRIES,
    _wraps("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading",
           "reload.hooks:wrap_process_weights_after_loading", _COLD, "reload.hooks"),
    _wraps("vllm.model_executor.model_loader.utils", "process_weights_after_loading",
           "reload.hooks:wrap_process_weights_after_loading", _COLD, "reload.hooks"),
    Patch(WRAPS_INSTANCE, "vllm.model_executor.layers.quantization.base_config",
          "QuantizeMethodBase.process_weights_after_loading",
          "per draft layer: the K/V rows captured before processing empties the weight; processing from outside "
          "vLLM's reload machinery skipped mid-reload", "drafts.processing"),
    Patch(WRAPS_INSTANCE, "vllm.model_executor.parameter", "BasevLLMParameter.weight_loader",
          "per tracked draft parameter (plain torch Parameters carry it as an attribute, vLLM's behind this "
          "property): a direct call outside every load_weights begins an epoch; the draft does not draft until it "
          "finishes", "reload.writes"),
    Patch(WRAPS_INSTANCE, "vllm.model_executor.models.lilicorr", "LiLiCorrHead.materialize_inference_buffers",
          "LiLiCorr's correlator head: its derived tensors are the draft's buffers, refreshed in place; vLLM's call at "
          "the end of every load_weights points the head at them instead of building new ones", "drafts.submodules"),
    Patch(WRITES, "vllm.model_executor.layers.linear", "layer._cpu_skip_gemm_dispatch",
          "on CPU the linears a submodule's buffers read keep their weight in checkpoint layout (vLLM's own flag for "
          "MLA's kv_b_proj: F.linear instead of a oneDNN repack that empties the weight)", "drafts.submodules"),
    Patch(SWAPS_CLASS, "vllm.model_executor.models", "inner_model.__class__",
          "each family's inner draft model (its `inner` class, checked with the family) gets the lifecycle mixin",
          "reload.classes"),
    Patch(REGISTERS, "vllm.model_executor.models.registry", "_ModelRegistry.register_model",
          "each active family's architectures are served by the lifecycle-enabled class", "plugin.activation"),
    Patch(WRITES, _LAYERWISE, "model._do_torchao_reload",
          "an unwound reload gives a torchao model its flag back, as vLLM's finalize does", "reload.unwind"),
    _reads(_TYPES, "LayerReloadingInfo.load_numel", "reload.hooks"),
    Patch(WRITES, _TYPES, "LayerReloadingInfo.load_numel_total",
          "a draft module's total leaves out the plugin's own buffers (derived buffers, K/V shadows: no checkpoint "
          "carries them), else vLLM's finalize warns \"Failed to load weights\" for the module on every push; "
          "read by the layer completion checks", "reload.counting"),
    _reads(_TYPES, "LayerReloadingInfo.loaded_weights", "reload.shards", "what each layer received, per shard"),
    _reads(_TYPES, "LayerReloadingInfo.kernel_tensors", "reload.unwind"),
    _reads(_TYPES, "LayerReloadingInfo.can_load", "reload.unwind"),
    _reads(_TYPES, "LayerReloadingInfo.reset", "reload.unwind"),
    _reads("vllm.model_executor.model_loader.reload.utils", "get_layer_tensors", "reload.shards"),
    _reads("vllm.model_executor.model_loader.reload.utils", "get_tensor_load_numel", "reload.shards"),
    _reads("vllm.model_executor.model_loader.reload.meta", "SKIP_LOAD_TENSORS", "reload.shards"),
    _reads("vllm.model_executor.model_loader.reload.meta", "materialize_layer", "reload.partial"),
    _reads(_LAYERWISE, "LAYERWISE_INFO", "reload.unwind", "unwinding a failed reload"),
    _reads(_LAYERWISE, "_place_kernel_tensors", "reload.unwind", "unwinding a failed reload"),
    _reads(_LAYERWISE, "_get_original_loader", "reload.direct",
           "a completed layer's buffered loads replayed straight into its kept tensors"),
    _reads("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase", "reload.direct",
           "a layer written in place is processed in place"),
    _reads("vllm.model_executor.layers.linear", "QKVParallelLinear", "reload.shards"),
    _reads("vllm.model_executor.layers.linear", "MergedColumnParallelLinear", "reload.shards"),
    _reads("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", "drafts.quantized",
           "checkpoint layout of a layer's kept tensors"),
    _reads("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod", "reload.counting",
           "an embedding's loader counts by shapes alone"),
    _reads("vllm.model_executor.model_loader.weight_utils", "default_weight_loader", "reload.counting",
           "a plain parameter's loader counts by shapes alone"),
    _reads("vllm.model_executor.layers.attention", "is_deferred_attention_layer", "drafts.quantized"),
    _reads("vllm.model_executor.models.registry", "ModelRegistry", "plugin.activation"),
    # ---- serving: the drafting gate ------------------------------------------------------------------------------
    _wraps("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._input_fits_in_drafter", "serving.gate:wrap_fits",
           "False while a draft is not usable: vLLM then runs the step without the drafter", "serving.gate"),
    _wraps("vllm.v1.worker.gpu.spec_decode.dflash.speculator", "DFlashSpeculator.propose",
           "serving.runner_v2:wrap_propose", "the same gate on Model Runner V2: zero draft tokens without running "
           "the draft", "serving.runner_v2"),
    _wraps("vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator", "StandaloneARSpeculator.propose",
           "serving.runner_v2:wrap_propose", "the same gate on V2's draft-model speculator (`method='draft_model'`, "
           "vLLM #43091): zero draft tokens without running the draft", "serving.runner_v2"),
    _reads("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_draft_model", "drafts.owners"),
    _reads("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.get_draft_model", "drafts.owners"),
    _reads(_SPECULATOR, "DraftModelSpeculator.draft_tokens", "serving.runner_v2"),
    _reads(_SPECULATOR, "DraftModelSpeculator.draft_logits", "serving.runner_v2"),
    _reads(_SPECULATOR, "DraftModelSpeculator.draft_token_confidence_probs", "serving.runner_v2"),
    _reads(_SPECULATOR, "DraftModelSpeculator.model", "serving.runner_v2"),
    _reads("vllm.v1.worker.gpu.input_batch", "InputBatch.idx_mapping", "serving.runner_v2"),
    _reads("vllm.v1.worker.gpu.spec_decode.dspark.utils", "load_dspark_model", "drafts.own_heads"),
    _reads("vllm.v1.worker.gpu.spec_decode.eagle.utils", "maybe_share_target_embed", "drafts.own_heads"),
    _reads("vllm.v1.worker.gpu.spec_decode.eagle.utils", "_should_share", "drafts.own_heads"),
    _reads("vllm.model_executor.models.gemma4_dspark", "Gemma4DSparkForCausalLM.dspark_shares_target_embeddings",
           "drafts.own_heads"),
    # ---- online: weight-update sessions, the transfer engine -------------------------------------------------------
    _wraps(_WORKER, "Worker._start_weight_update", "online.sessions:wrap_start",
           "one push owns the draft: a start while a draft push is active is refused, an idle one taken over; a policy "
           "session is vLLM's", "online.sessions"),
    _wraps(_WORKER, "Worker.update_weights", "online.sessions:wrap_update",
           "a chunk of another push is refused untouched; a re-sent tensor is compared; a refused draft chunk ends the "
           "epoch and names what was refused", "online.sessions"),
    _wraps(_WORKER, "Worker.finish_weight_update", "online.sessions:wrap_finish",
           "a finish of another push is refused untouched; a refused draft finish ends the epoch and closes vLLM's "
           "session", "online.sessions"),
    _wraps(_ASYNC_LLM, "AsyncLLM.start_weight_update", "online.answers:answer_conflict",
           "a refused start answers 409 naming the refusal", "online.answers"),
    _wraps(_ASYNC_LLM, "AsyncLLM.start_draft_weight_update", "online.answers:answer_conflict",
           "a refused start answers 409 naming the refusal", "online.answers"),
    _wraps(_ASYNC_LLM, "AsyncLLM.update_weights", "online.answers:answer_unprocessable",
           "a refused chunk answers 422 naming the refusal (409: another push's)", "online.answers"),
    _wraps(_ASYNC_LLM, "AsyncLLM.finish_weight_update", "online.answers:wrap_async_finish",
           "vLLM's two calls, the workers' finish carrying the trainer's weight_version (bounded; one worker round "
           "trip); a refusal answers 422 (409: another push's)", "online.answers"),
    _wraps("vllm.entrypoints.rl.offline", "RLOfflineMixin.finish_weight_update", "online.answers:wrap_offline_finish",
           "vLLM's two calls, the workers' finish carrying the trainer's weight_version (offline LLM)",
           "online.answers"),
    _wraps(_WORKER, "Worker.sleep", "online.sleep:wrap_sleep",
           "a level-2 sleep frees the draft's weights without a copy (vLLM #52479): the draft is quarantined until a "
           "refill writes every layer, refreshed in place", "online.sleep"),
    _reads(_WORKER, "Worker._sleep_saved_parameters", "online.sleep", "the parameters a level-2 sleep preserves"),
    Patch(WRITES, _WORKER, "Worker._weight_update_active",
          "a refused draft finish closes vLLM's session (vLLM leaves it open, refusing every later start)",
          "online.sessions"),
    Patch(REGISTERS, f"{_TRANSFER}.factory", "WeightTransferEngineFactory.register_engine",
          "the safetensors_file transfer engine", "online.transfer"),
    _reads(_WORKER, "Worker._weight_update_is_draft", "online.sessions"),
    _reads(f"{_TRANSFER}.base", "WeightTransferEngine.reset_weight_update_target", "online.sessions"),
    _reads(f"{_TRANSFER}.base", "WeightTransferEngine.set_weight_update_target", "online.transfer"),
    _reads(f"{_TRANSFER}.factory", "WeightTransferEngineFactory._registry", "online.transfer"),
    _reads("vllm.exceptions", "GracefulHTTPError", "online.answers", "HTTP answers"),
    # the RL route layer (`vllm serve`'s weight-sync routes, one module in 0.32 and 0.33): each route calls the
    # engine client's method the plugin wraps (AsyncLLM's, above), so the front-process hooks see every HTTP push
    *(Patch(READS, _RL_ROUTES, route, f"the route `/{route}` calls AsyncLLM.{method}, which the plugin wraps",
            user, calls=method) for route, method, user in (
        ("start_weight_update", "start_weight_update", "online.answers"),
        ("start_draft_weight_update", "start_draft_weight_update", "online.answers"),
        ("update_weights", "update_weights", "online.answers"),
        ("finish_weight_update", "finish_weight_update", "online.answers"),
        ("update_weight_version", "update_weight_version", "observability.frontend"),
        ("weight_checker", "compute_weight_checksums", "observability.weight_checker"))),
    # ---- observability: the weight checker, the front process ------------------------------------------------------
    _wraps(_WORKER, "Worker.compute_weight_checksums", "observability.weight_checker:wrap_compute",
           "the draft's weights and derived-buffer verdicts in vLLM's /weight_checker", "observability.weight_checker"),
    _reads(_WORKER, "Worker._weight_checksum_prefix", "observability.weight_checker"),
    _wraps(_WORKER, "Worker.shutdown", "observability.serving_state:wrap_shutdown",
           "the serving period the front process handed last is audited (its `acceptance` event) when the worker "
           "stops", "observability.serving_state"),
    _wraps(_ASYNC_LLM, "AsyncLLM.__init__", "observability.frontend:wrap_async_init",
           "the front view of an online engine (metrics, canary)", "observability.frontend"),
    _wraps(_ASYNC_LLM, "AsyncLLM.shutdown", "observability.frontend:wrap_async_shutdown",
           "the serving period's final `acceptance` event handed to the workers before vLLM stops them",
           "observability.frontend"),
    _wraps(_ASYNC_LLM, "AsyncLLM.collective_rpc", "observability.frontend:wrap_async_rpc",
           "every push seen: kind, outcome, duration; the workers' state pulled after it", "observability.frontend"),
    _wraps(_ASYNC_LLM, "AsyncLLM.update_weight_version", "observability.frontend:wrap_async_version",
           "the canary's period labelled with the trainer's weight_version (bounded: 422)", "observability.frontend"),
    _wraps(_LLM_ENGINE, "LLMEngine.__init__", "observability.frontend:wrap_sync_init",
           "the front view of an offline engine, and its stat logger", "observability.frontend"),
    _wraps(_LLM_ENGINE, "LLMEngine.collective_rpc", "observability.frontend:wrap_sync_rpc",
           "every push seen (offline)", "observability.frontend"),
    _wraps(_LLM_ENGINE, "LLMEngine.set_weight_version", "observability.frontend:wrap_sync_version",
           "the canary's period labelled (offline)", "observability.frontend"),
    _reads(_ASYNC_LLM, "AsyncLLM._client_count", "observability.front_view",
           "with several API servers, server 0 alone counts the workers' totals"),
    _reads("vllm.v1.engine.core_client", "AsyncMPClient.client_index", "observability.front_view",
           "which API server this is"),
    _reads("vllm.v1.metrics.loggers", "StatLoggerBase", "observability.stat_logger"),
    _reads("vllm.v1.metrics.stats", "SchedulerStats.spec_decoding_stats", "observability.front_view"),
    *(_reads(_SPEC_METRICS, f"SpecDecodingStats.{n}", "observability.front_view")
      for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                "num_draft_tokens_per_pos")),
    # ---- entry: the worker RPCs join any worker extension -----------------------------------------------------------
    _wraps("vllm.v1.worker.worker_base", "WorkerWrapperBase.init_worker", "worker:wrap_init_worker",
           "the lifecycle's worker RPCs join whatever worker_extension_cls the engine has (a trainer's own): the "
           "worker class gets LifecycleWorkerExtension among its bases unless it has it", "worker"),
    # ---- plugin: every Ray node runs the plugin ----------------------------------------------------------------------
    _wraps("vllm.v1.executor.abstract", "Executor.__init__", "plugin.nodes:wrap_executor_init",
           "a Ray executor checks that every worker's node runs the plugin", "plugin.nodes"),
    _reads("vllm.v1.executor.abstract", "Executor.collective_rpc", "plugin.nodes", "the per-node probe"),
)
