"""What the `vllm.general_plugins` entry point does in each vLLM process."""

from __future__ import annotations

import os
import re

from ... import env
from ...events import AuditSinkError, configure_audit, host_name
from .. import settings
from ..settings import AUDIT_CONSOLE_ENV, AUDIT_DIR_ENV, ENV_PREFIX
from .capabilities import check_vllm

__all__ = ["AUDIT_CONSOLE_ENV", "AUDIT_DIR_ENV", "ENV_PREFIX", "RAY_COPY_PREFIXES_ENV", "activate",
           "audit_file_name", "forward_switches_to_ray_workers"]

# AUDIT_DIR_ENV: a folder; each process writes its audit events to `audit-<host>-<pid>.jsonl` there (events carry
# their rank and node), so the folders of several nodes can be gathered into one and audited together.
#: vLLM's Ray executor (V1) copies to its workers only the variables vLLM knows, those with vLLM's prefixes and
#: those with a prefix listed here (comma-separated); the V2 executor copies the driver's whole environment.
RAY_COPY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"

_active = False


def activate() -> None:
    """Check that vLLM has every name the plugin relies on (else `UnsupportedVLLMError` naming each, with nothing
    patched), route audit events, register the lifecycle-enabled draft classes of the families this vLLM has, and
    wrap the reload entry points. Safe to call more than once."""
    global _active
    if _active:
        return
    settings.check_all()  # a misspelled name or a bad value of any setting stops the engine here, naming it
    version = check_vllm()
    forward_switches_to_ray_workers()
    _configure_audit_from_env()
    from vllm import ModelRegistry

    from ..compat import patching
    from ..compat.registry import PATCHES
    from ..drafts.processing import observe_processing
    from ..drafts.runtime import WORKER
    from ..observability.serving_state import finish_report
    from ..observability.weight_checker import record_before_processing
    from ..online import transfer
    from .capabilities import active_families

    patching.apply(PATCHES)  # every wrapper resolved first: a miss refuses here, naming it, with nothing patched
    for family in active_families(version):
        for arch in family.architectures:
            ModelRegistry.register_model(arch, f"lifecycle.vllm.registered:{family.name}")
    transfer.register()
    observe_processing(record_before_processing)  # the weight checker's digests of what processing may empty
    WORKER.finish_report = finish_report  # a finish answers the draft's serving state: one worker round trip
    _active = True


def forward_switches_to_ray_workers() -> None:
    """Make every `RELOAD_LIFECYCLE_*` switch of this process reach the workers of a Ray engine it starts: add
    the prefix to the ones vLLM's Ray executors copy (`VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`, kept as the user
    set it otherwise). Without it, vLLM's V1 Ray executor drops them and no worker writes an audit log."""
    listed = [p.strip() for p in os.environ.get(RAY_COPY_PREFIXES_ENV, "").split(",") if p.strip()]
    if ENV_PREFIX not in listed:
        os.environ[RAY_COPY_PREFIXES_ENV] = ",".join([*listed, ENV_PREFIX])


def audit_file_name(pid: int | None = None, host: str | None = None) -> str:
    """`audit-<host>-<pid>.jsonl`: unique across the nodes whose folders are gathered into one (process ids
    repeat from machine to machine); the host name kept to letters, digits, '.', '_' and '-'.

    >>> audit_file_name(42, "gpu-node-7.example")
    'audit-gpu-node-7.example-42.jsonl'
    """
    host = re.sub(r"[^A-Za-z0-9._-]", "_", host if host is not None else host_name())[:64] or "host"
    return f"audit-{host}-{os.getpid() if pid is None else pid}.jsonl"


def _configure_audit_from_env() -> None:
    """Route the audit logger (only it: the host's structlog configuration is not touched) from the environment.
    A value the switches do not accept, or a folder where the audit file cannot be written, raises
    `env.EnvSettingError` naming the variable."""
    folder = settings.audit_dir()
    console = settings.audit_console()
    path = folder / audit_file_name() if folder is not None else None
    try:  # neither: events stay in each lifecycle's memory ring
        configure_audit(json_path=path, console=console, max_bytes=settings.audit_max_bytes())
    except AuditSinkError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise env.EnvSettingError(AUDIT_DIR_ENV, str(folder), f"cannot hold the audit log: {why}") from e
