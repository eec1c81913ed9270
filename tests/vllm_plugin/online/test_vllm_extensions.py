"""The lifecycle's worker RPCs beside a trainer's own worker extension (issue 35 item 8): SkyRL's server launcher
hard-codes its own `worker_extension_cls`, so `lifecycle.vllm.worker.LifecycleWorkerExtension` could not be set
there and the RPCs (the metrics' state, `reload_draft_weights`, the weight version in the audit) were missing.
Now the plugin joins them to whatever extension the engine has, or to none; a clashing name refuses the start.
The scenario's checks run beside their actions (`support.vllm_scenarios.scenario_extensions`)."""

from __future__ import annotations

from pathlib import Path

from support.vllm_runs import run_scenario


def test_the_lifecycle_rpcs_join_another_extension_or_none_and_a_clash_is_refused(vllm_workdir: Path) -> None:
    result = run_scenario("extensions", vllm_workdir)
    assert result.get("done") and len(result["done"]) == 3, result
