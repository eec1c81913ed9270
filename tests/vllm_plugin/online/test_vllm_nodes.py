"""The plugin's multi-node parts that need no engine: its switches reach Ray's workers, the node probe runs where
this package is missing, and the refusal names each node and why. (The same, under real Ray engines:
tests/vllm_plugin/online/test_vllm_ray.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle.errors import NodeSetupError
from lifecycle.vllm.plugin import activation as plugin
from lifecycle.vllm.plugin.nodes import check_reports, node_probe

ROOT = Path(__file__).resolve().parents[3]
# A child interpreter where `import lifecycle` fails, as on a node without the package; it runs the probe it is sent.
HIDDEN = """
import importlib.abc, json, pickle, sys
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lifecycle" or name.startswith("lifecycle."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hidden())
probe = pickle.loads(sys.stdin.buffer.read())
print(json.dumps(probe()))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "lifecycle")))
"""


def report(**fields: Any) -> dict[str, Any]:
    """What a worker where everything is right says (the fields `node_probe` returns), with `fields` changed."""
    return {"node": "gpu-node-1", "ip": "10.0.0.11", "pid": 7, "rank": 0, "version": "0.1.0", "entry_point": True,
            "importable": True, "active": True, "vllm_plugins": None, **fields}


def test_the_switches_are_added_to_what_rays_executor_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.RAY_COPY_PREFIXES_ENV, raising=False)
    plugin.forward_switches_to_ray_workers()
    assert os.environ[plugin.RAY_COPY_PREFIXES_ENV] == "RELOAD_LIFECYCLE_"
    monkeypatch.setenv(plugin.RAY_COPY_PREFIXES_ENV, " MY_APP_ ,OTHER_")
    plugin.forward_switches_to_ray_workers()
    plugin.forward_switches_to_ray_workers()  # once only, and the user's prefixes kept
    assert os.environ[plugin.RAY_COPY_PREFIXES_ENV] == "MY_APP_,OTHER_,RELOAD_LIFECYCLE_"


def test_vllms_ray_executor_copies_the_switches_once_the_plugin_forwarded_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own list of what its V1 Ray executor copies to workers (`get_env_vars_to_copy`)."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, "/tmp/audit")
    monkeypatch.delenv(plugin.RAY_COPY_PREFIXES_ENV, raising=False)
    assert plugin.AUDIT_DIR_ENV not in get_env_vars_to_copy()  # the upstream gap
    plugin.forward_switches_to_ray_workers()
    assert plugin.AUDIT_DIR_ENV in get_env_vars_to_copy()


@pytest.mark.vllm  # cloudpickle (how vLLM's RPCs and Ray send the probe) comes with vLLM: the core has no need of it
def test_the_probe_runs_by_value_where_the_package_is_missing() -> None:
    import cloudpickle

    proc = subprocess.run([sys.executable, "-c", HIDDEN], input=cloudpickle.dumps(node_probe), capture_output=True,
                          timeout=120, cwd="/", env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = proc.stdout.decode().splitlines()
    got, imported = json.loads(lines[-2]), json.loads(lines[-1])
    assert imported == []  # nothing of this package was needed to run it
    assert got["node"] == socket.gethostname() and got["pid"] != os.getpid()
    assert (got["importable"], got["active"], got["rank"]) == (False, False, None)
    assert "No module named 'lifecycle'" in got["import_error"]
    with pytest.raises(NodeSetupError, match=r"cannot be imported there \(ModuleNotFoundError"):
        check_reports([got], driver_version=got["version"])


def test_the_probe_reads_the_flag_activation_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """It read `lifecycle.vllm.plugin._active`, which the layered package no longer has: every Ray engine was
    refused ("the plugin did not load there") although it had loaded."""
    from lifecycle.vllm.plugin import activation

    for active in (True, False):
        monkeypatch.setattr(activation, "_active", active)
        assert node_probe()["active"] is active


def test_the_probe_here_finds_the_package_installed() -> None:
    got = node_probe()
    assert got["importable"] and got["entry_point"] and got["version"] and got["node"] == socket.gethostname()
    check_reports([{**got, "active": True}], driver_version=got["version"])  # nothing to refuse


@pytest.mark.parametrize(("changed", "cause"), [
    ({"importable": False, "version": None, "active": False}, "reload-lifecycle is not installed there"),
    ({"importable": False, "active": False, "import_error": "ImportError: boom"},
     "reload-lifecycle 0.1.0 is installed but its package `lifecycle` cannot be imported there (ImportError: boom)"),
    ({"entry_point": False, "active": False}, "not installed as the reload-lifecycle distribution"),
    ({"vllm_plugins": "other_plugin", "active": False}, "VLLM_PLUGINS='other_plugin' leaves reload_lifecycle out"),
    ({"active": False}, "the plugin did not load there"),
    ({"version": "0.0.9"}, "reload-lifecycle 0.0.9 there, 0.1.0 in the driver: install the same version"),
])
def test_a_worker_without_the_plugin_is_refused_naming_its_node(changed: dict[str, Any], cause: str) -> None:
    reports = [report(), report(rank=1), report(node="gpu-node-2", ip="10.0.0.12", rank=2, **changed),
               report(node="gpu-node-2", ip="10.0.0.12", rank=3, **changed)]
    with pytest.raises(NodeSetupError) as refused:
        check_reports(reports, driver_version="0.1.0")
    message = str(refused.value)
    assert "the vLLM plugin is not active on every node of this Ray engine" in message
    assert "Install reload-lifecycle==0.1.0 (with its vllm extra) on every node" in message
    (line,) = [ln for ln in message.splitlines() if ln.startswith("  node ")]  # gpu-node-1 is fine
    assert line.startswith("  node gpu-node-2 (10.0.0.12), rank(s) 2, 3: ") and cause in line
    assert [n["rank"] for n in refused.value.nodes] == [2, 3]


def test_probes_of_nodes_before_start_only_need_the_package() -> None:
    """A node probed by a Ray task (the engine failed before its workers answered): no vLLM loaded the plugin in
    that task, so only the package is checked."""
    check_reports([report(active=False)], driver_version="0.1.0", started=False)
    with pytest.raises(NodeSetupError, match=r"node gpu-node-1 \(10\.0\.0\.11\), rank\(s\) 0: reload-lifecycle is "
                                             "not installed there"):
        check_reports([report(importable=False, version=None)], driver_version="0.1.0", started=False)


def test_the_audit_file_is_named_by_host_and_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert plugin.audit_file_name(9, "a/b c") == "audit-a_b_c-9.jsonl"
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, str(tmp_path))
    plugin._configure_audit_from_env()
    from lifecycle.events import configure_audit, emit

    try:
        emit("hook_run", backbone="d", rank=3, epoch=0)
    finally:
        configure_audit(console=False)
    (log,) = tmp_path.iterdir()
    assert log.name == f"audit-{socket.gethostname()}-{os.getpid()}.jsonl"
    (event,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert (event["rank"], event["node"]) == (3, socket.gethostname())
