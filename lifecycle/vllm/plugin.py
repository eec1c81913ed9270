"""What the `vllm.general_plugins` entry point does in each vLLM process."""

from __future__ import annotations

import os

from .. import env
from ..events import AuditSinkError, configure_audit
from . import settings
from .version import check_vllm

__all__ = ["AUDIT_CONSOLE_ENV", "AUDIT_DIR_ENV", "activate"]

#: A folder: each process writes its audit events to `audit-<pid>.jsonl` there (events carry their rank).
AUDIT_DIR_ENV = "RELOAD_LIFECYCLE_AUDIT_DIR"
#: A switch (1/true/yes/on): also print readable events to stderr.
AUDIT_CONSOLE_ENV = "RELOAD_LIFECYCLE_AUDIT_CONSOLE"

_active = False


def activate() -> None:
    """Check that vLLM has every name the plugin relies on (else `UnsupportedVLLMError` naming each, with nothing
    patched), route audit events, register the lifecycle-enabled draft classes of the families this vLLM has, and
    wrap the reload entry points. Safe to call more than once."""
    global _active
    if _active:
        return
    version = check_vllm()
    settings.partial_policy()  # a bad engine-wide setting stops the engine here, naming the variable
    settings.allowed_root()
    _configure_audit_from_env()
    from vllm import ModelRegistry

    from . import patches, transfer
    from .capabilities import active_families

    for family in active_families(version):
        for arch in family.architectures:
            ModelRegistry.register_model(arch, f"lifecycle.vllm.registered:{family.name}")
    patches.install()
    transfer.register()
    _active = True


def _configure_audit_from_env() -> None:
    """Route the audit logger (only it: the host's structlog configuration is not touched) from the environment.
    A value the switches do not accept, or a folder where the audit file cannot be written, raises
    `env.EnvSettingError` naming the variable."""
    folder = env.path(AUDIT_DIR_ENV)
    console = env.flag(AUDIT_CONSOLE_ENV)
    path = folder / f"audit-{os.getpid()}.jsonl" if folder is not None else None
    try:
        configure_audit(json_path=path, console=console)  # neither: events stay in each lifecycle's memory ring
    except AuditSinkError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise env.EnvSettingError(AUDIT_DIR_ENV, str(folder), f"cannot hold the audit log: {why}") from e
