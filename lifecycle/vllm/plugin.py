"""What the `vllm.general_plugins` entry point does in each vLLM process."""

from __future__ import annotations

import os
from pathlib import Path

from ..events import configure_audit
from . import settings
from .version import check_vllm_version

__all__ = ["AUDIT_CONSOLE_ENV", "AUDIT_DIR_ENV", "activate"]

#: A folder: each process writes its audit events to `audit-<pid>.jsonl` there (events carry their rank).
AUDIT_DIR_ENV = "RELOAD_LIFECYCLE_AUDIT_DIR"
#: "1": also print readable events to stderr.
AUDIT_CONSOLE_ENV = "RELOAD_LIFECYCLE_AUDIT_CONSOLE"

_active = False


def activate() -> None:
    """Check the vLLM version, route audit events, register the lifecycle-enabled draft classes, and wrap the
    reload entry points. Safe to call more than once."""
    global _active
    if _active:
        return
    check_vllm_version()
    settings.partial_policy()  # a bad engine-wide setting stops the engine here, naming the variable
    settings.allowed_root()
    _configure_audit_from_env()
    from vllm import ModelRegistry

    from . import patches, transfer
    from .families import FAMILIES

    for family in FAMILIES:
        for arch in family.architectures:
            ModelRegistry.register_model(arch, f"lifecycle.vllm.registered:{family.name}")
    patches.install()
    transfer.register()
    _active = True


def _configure_audit_from_env() -> None:
    folder = os.environ.get(AUDIT_DIR_ENV)
    console = os.environ.get(AUDIT_CONSOLE_ENV) == "1"
    if folder or console:
        path = Path(folder) / f"audit-{os.getpid()}.jsonl" if folder else None
        configure_audit(json_path=path, console=console)
    else:
        configure_audit(console=False)  # events stay in each lifecycle's in-memory ring (see the worker RPCs)
