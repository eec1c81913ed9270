"""The audit sink never changes what the lifecycle does: a full disk, a closed file, a descriptor that lost its
write permission, a console stream that went away. Each fault is injected for real (`/dev/full`, `close`, `dup2`
of a read-only descriptor, a broken stream) into the same lifecycle run, which must end exactly as the run without
audit: the same states, epochs, readiness, quarantine and exceptions. Each failure is counted, reported once on
stderr, and visible in `recent_events`; `configure_audit` can always replace a broken sink. And the audit logger
is the plugin's own: a host application's structlog configuration and events are left alone."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

from lifecycle import events
from lifecycle.env import EnvSettingError, flag
from lifecycle.errors import IllegalTransitionError, QuarantinedError
from lifecycle.events import (
    STR_CAP,
    AuditSinkError,
    JsonLinesSink,
    configure_audit,
    emit,
    read_events,
    sink_failures,
)
from lifecycle.loading import load_safetensors
from lifecycle.testing import cold_load
from lifecycle.vllm.plugin import activation as plugin
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

Fault = Callable[[JsonLinesSink], None]


def drive(cfg: DFlashConfig, a: Path, b: Path, fault: Fault | None = None, sink: JsonLinesSink | None = None
          ) -> list[Any]:
    """A cold load, a reload, a refused trigger, a reload session that fails inside its block, a recovery path:
    after each step the lifecycle's observable state (or the exception a step raised). `fault` breaks `sink`
    after the cold load."""
    m = DFlashQwen3Draft(cfg, name="sinky")
    lc = m.lifecycle
    trace: list[Any] = []

    def step(name: str, action: Callable[[], Any]) -> None:
        try:
            action()
            outcome = "ok"
        except Exception as e:  # the exception is what is compared
            outcome = type(e).__name__
        trace.append((name, outcome, lc.state.value, lc.epoch, lc.readiness.layers_ready, lc.quarantine_reason,
                       lc.recovery_blocker))

    step("cold load", lambda: load_safetensors(m, a))
    step("finalize", m.finalize_loading)
    step("refresh", m.refresh_derived_buffers)
    step("capture", m.capture_graphs)
    if fault is not None:
        assert sink is not None
        fault(sink)
    step("begin_reload", m.begin_reload)
    step("load b", lambda: load_safetensors(m, b, bucket_by=3, shuffle=True, seed=1))
    step("capture too early", m.capture_graphs)  # refused: IllegalTransitionError
    step("finalize", m.finalize_loading)
    step("refresh", m.refresh_derived_buffers)

    def failing_session() -> None:
        with m.reload_session(rollback=True) as s:
            s.load(a, bucket_by=4)
            raise ConnectionError("trainer went away")

    step("failing session", failing_session)
    step("forward", lambda: m.require_usable())  # QuarantinedError
    step("recover", m.recover)
    step("forward again", lambda: m.require_usable())
    trace.append(("events kept", len(lc.recent_events), [e["seq"] for e in lc.recent_events][-3:]))
    return trace


@pytest.fixture
def baseline(tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path) -> list[Any]:
    configure_audit(console=False)
    trace = drive(tiny_cfg, ckpt_a, ckpt_b)
    outcomes = {t[0]: t[1] for t in trace[:-1]}
    assert outcomes["capture too early"] == IllegalTransitionError.__name__
    assert outcomes["failing session"] == ConnectionError.__name__
    assert outcomes["forward"] == QuarantinedError.__name__ and outcomes["forward again"] == "ok"
    return trace


def full_disk(_sink: JsonLinesSink) -> None:
    """Nothing to do: the sink writes to /dev/full, where every write fails with ENOSPC."""


def closed_file(sink: JsonLinesSink) -> None:
    sink.close()


def write_permission_lost(sink: JsonLinesSink) -> None:
    """The sink's descriptor now refers to the file opened read-only: every write fails (EBADF)."""
    read_only = os.open(sink.path, os.O_RDONLY)
    try:
        os.dup2(read_only, sink._fd)
    finally:
        os.close(read_only)


FAULTS: dict[str, Fault] = {"full disk": full_disk, "closed file": closed_file,
                            "write permission lost mid-run": write_permission_lost}


@pytest.mark.parametrize("fault", list(FAULTS), ids=str)
def test_a_failing_sink_changes_nothing_the_lifecycle_does(
        fault: str, baseline: list[Any], tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    path = Path("/dev/full") if fault == "full disk" else tmp_path / "audit.jsonl"
    before = sink_failures()
    sink = configure_audit(json_path=path, console=False)
    assert sink is not None
    capfd.readouterr()
    trace = drive(tiny_cfg, ckpt_a, ckpt_b, FAULTS[fault], sink)
    assert trace == baseline  # same states, epochs, readiness, quarantine, exceptions, events kept

    lost = sink_failures() - before
    assert lost > 20 and sink.failures == lost  # every event after the fault (all of them on /dev/full)
    err = capfd.readouterr().err
    assert err.count("reload-lifecycle: audit sink") == 1 and str(path) in err  # reported once
    if fault != "full disk":
        written = read_events(path)  # the events before the fault, whole lines
        assert written and [e["seq"] for e in written] == list(range(1, len(written) + 1))
        assert written[-1]["trigger"] == "capture_graphs"
    # the lifecycle's own record says events were lost
    m = DFlashQwen3Draft(tiny_cfg, name="after")
    load_safetensors(m, ckpt_a)
    assert m.lifecycle.recent_events[-1]["sink_failures"] == sink_failures() > before


def test_configure_audit_can_always_replace_a_broken_sink(tiny_cfg: DFlashConfig, ckpt_a: Path, tmp_path: Path,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    broken = configure_audit(json_path=tmp_path / "first.jsonl", console=False)
    assert broken is not None
    write_permission_lost(broken)
    m = DFlashQwen3Draft(tiny_cfg, name="swap")
    load_safetensors(m, ckpt_a)  # writes fail, counted
    assert broken.failures > 0

    def close_fails() -> None:
        raise OSError(5, "Input/output error")

    broken.close = close_fails  # type: ignore[method-assign]  # closing the broken sink fails too: no matter
    good = tmp_path / "second.jsonl"
    assert configure_audit(json_path=good, console=False) is not None
    m.finalize_loading()
    assert [e.get("trigger") for e in read_events(good) if e["event"] == "transition"] == ["finalize_loading"]

    # a reconfigure that fails (its folder is a file) raises, names the path, and leaves the current route alone
    (tmp_path / "a-file").write_text("")
    with pytest.raises(AuditSinkError, match="a-file"):
        configure_audit(json_path=tmp_path / "a-file" / "audit.jsonl", console=False)
    m.refresh_derived_buffers()  # no "I/O operation on closed file": events still go to the working sink
    assert [e["event"] for e in read_events(good)][-2:] == ["refresh", "transition"]
    with pytest.raises(ValueError, match="level must be one of debug, info"):
        configure_audit(level="verbose")
    with pytest.raises(TypeError, match="json_path must be a str or a path"):
        configure_audit(json_path=b"/tmp/x.jsonl")  # type: ignore[arg-type]
    m.capture_graphs()
    assert read_events(good)[-1]["trigger"] == "capture_graphs"


def test_a_console_stream_that_fails_is_counted_not_raised(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    configure_audit(console=True, stream=stream)
    stream.close()  # the terminal went away
    before = sink_failures()
    m = cold_load(DFlashQwen3Draft(tiny_cfg, name="tty"), ckpt_a, refresh=False)
    assert m.lifecycle.can("refresh_derived") and sink_failures() > before
    assert capfd.readouterr().err.count("reload-lifecycle: audit output") == 1


def test_fields_that_cannot_be_printed_are_bounded_not_raised(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                              tmp_path: Path) -> None:
    """An integer of over 4,300 digits (Python refuses to print it), a 5 MB abort reason, nesting 50 deep."""
    path = tmp_path / "audit.jsonl"
    configure_audit(json_path=path, console=False)
    emit("hook_run", backbone="x", rank=0, epoch=0, hook="h", huge=10 ** 5000, deep=_nested(50))
    m = DFlashQwen3Draft(tiny_cfg, name="big-reason")
    load_safetensors(m, ckpt_a)
    m.abort_reload("r" * 5_000_000)
    lc = m.lifecycle
    reason = lc.quarantine_reason
    assert reason is not None and len(reason) <= STR_CAP and reason.endswith("characters)")
    cut = int(reason.rpartition("+")[2].split()[0])
    assert len(reason.partition("...")[0]) + cut == 5_000_000  # says how much was cut
    with pytest.raises(QuarantinedError) as e:
        m.require_usable()
    assert len(str(e.value)) < 2 * STR_CAP and e.value.quarantine_reason == reason
    kept = lc.recent_events[-1]
    assert kept["trigger"] == "abort_reload" and kept["reason"] == reason
    first, *_, last = read_events(path)
    assert first["huge"] == "<int of 16610 bits>" and "nested deeper" in json.dumps(first["deep"])
    assert last["reason"] == reason
    assert max(len(line) for line in path.read_text().splitlines()) < 2 * STR_CAP


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


# ---- the host's structlog -----------------------------------------------------------------------------------------


def test_the_plugin_leaves_the_hosts_structlog_alone(tiny_cfg: DFlashConfig, ckpt_a: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A host application configures structlog itself (JSON lines to its own stream), then the plugin routes the
    audit from the environment: the host's configuration object and its events are unchanged, and the audit
    files hold only lifecycle events."""
    host_out = io.StringIO()
    try:
        structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
                            logger_factory=structlog.PrintLoggerFactory(host_out), cache_logger_on_first_use=False)
        config = structlog.get_config()
        host = structlog.get_logger("host-app")
        host.info("host_started", port=8000)
        for audit_dir in (None, tmp_path / "audit"):  # the default (no audit files), then an audit folder
            if audit_dir is None:
                monkeypatch.delenv(plugin.AUDIT_DIR_ENV, raising=False)
            else:
                monkeypatch.setenv(plugin.AUDIT_DIR_ENV, str(audit_dir))
            monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "false")
            plugin._configure_audit_from_env()
            assert structlog.get_config() == config  # the same processors, factory, wrapper: nothing replaced
            m = DFlashQwen3Draft(tiny_cfg, name=f"plugin-{audit_dir is not None}")
            host.info("host_request", path="/v1/completions")
            cold_load(m, ckpt_a, refresh=False)
            host.warning("host_done")
        configure_audit(console=False)
        lines = [json.loads(line) for line in host_out.getvalue().splitlines()]
        assert lines == [{"port": 8000, "event": "host_started", "level": "info"},
                         *[{"path": "/v1/completions", "event": "host_request", "level": "info"},
                           {"event": "host_done", "level": "warning"}] * 2]  # nothing dropped, nothing added
        (audit_file,) = (tmp_path / "audit").iterdir()
        written = read_events(audit_file)
        assert written and {e["backbone"] for e in written} == {"plugin-True"}
        assert {e["event"] for e in written} <= {"transition", "layer_ready", "hook_run"}
    finally:
        structlog.reset_defaults()


# ---- environment switches -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("TRUE", True), (" yes ", True),
                                                 ("On", True), ("0", False), ("false", False), ("no", False),
                                                 ("OFF", False), ("", False)])
def test_switches_take_the_usual_spellings(value: str, expected: bool, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(plugin.AUDIT_DIR_ENV, raising=False)
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, value)
    assert flag(plugin.AUDIT_CONSOLE_ENV) is expected
    try:
        plugin._configure_audit_from_env()
        emit("transition", backbone="switch-probe", rank=0, epoch=0, trigger="begin_reload")
        assert ("switch-probe" in capsys.readouterr().err) is expected  # "true" used to be ignored silently
    finally:
        configure_audit(console=False)


def test_a_bad_switch_value_or_audit_folder_names_its_variable(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "ture")
    with pytest.raises(EnvSettingError, match=f"^{plugin.AUDIT_CONSOLE_ENV}='ture' is not a switch value"):
        plugin._configure_audit_from_env()
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "loud")
    with pytest.raises(EnvSettingError, match=plugin.AUDIT_CONSOLE_ENV):
        plugin._configure_audit_from_env()
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "0")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, str(tmp_path / "a-file"))
    with pytest.raises(EnvSettingError, match=f"^{plugin.AUDIT_DIR_ENV}=.*a-file.* cannot hold the audit log"):
        plugin._configure_audit_from_env()
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, str(tmp_path / ("x" * 5000)))
    with pytest.raises(EnvSettingError, match=plugin.AUDIT_DIR_ENV) as e:
        plugin._configure_audit_from_env()
    assert "File name too long" in str(e.value) and len(str(e.value)) < 300  # the value is cut in the message
    monkeypatch.setenv(plugin.AUDIT_DIR_ENV, str(tmp_path / "ok"))
    monkeypatch.setenv(plugin.AUDIT_CONSOLE_ENV, "yes")
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    plugin._configure_audit_from_env()  # "yes" turns the console on (it was ignored unless exactly "1")
    emit("hook_run", backbone="x", rank=0, epoch=0, hook="h")
    assert "hook_run" in err.getvalue() and len(list((tmp_path / "ok").iterdir())) == 1


def test_events_module_never_configures_structlog(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(structlog, "configure", lambda **kw: calls.append(kw))
    configure_audit(json_path=tmp_path / "x.jsonl", console=True, stream=io.StringIO(), level="debug")
    configure_audit(console=False)
    assert calls == [] and events.LOGGER_NAME


# ---- bounded strings and checked arguments --------------------------------------------------------------------------


def test_a_megabyte_tensor_name_gives_a_bounded_error(tiny_cfg: DFlashConfig, tmp_path: Path) -> None:
    import torch

    from lifecycle.errors import MESSAGE_CAP, UnknownWeightError
    from lifecycle.loading import write_checkpoint

    ckpt = write_checkpoint({"w" * 1_000_000: torch.zeros(2)}, tmp_path / "hostile.safetensors")
    m = DFlashQwen3Draft(tiny_cfg, name="bounded")
    with pytest.raises(UnknownWeightError) as e:
        load_safetensors(m, ckpt)
    assert len(str(e.value)) < 4000 and "characters)" in str(e.value)  # the name is cut, saying by how much
    assert len(e.value.reason) <= MESSAGE_CAP
    assert len(m.lifecycle.recent_events[-1]["reason"]) <= STR_CAP


def test_api_arguments_are_checked_with_a_clear_message(tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    from lifecycle.loading import plan_buckets
    from lifecycle.vllm.worker import LifecycleWorkerExtension

    m = DFlashQwen3Draft(tiny_cfg, name="args")
    with pytest.raises(TypeError, match=r"checkpoint paths must be a str or os\.PathLike"):
        load_safetensors(m, str(ckpt_a).encode())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="duplicates must be an int >= 0, got -1"):
        plan_buckets(["a", "b"], lambda n: n, duplicates=-1)
    with pytest.raises(ValueError, match="bucket_by must be 'layer' or a positive int, got True"):
        load_safetensors(m, ckpt_a, bucket_by=True)  # type: ignore[arg-type]
    assert m.lifecycle.unloaded  # nothing was loaded

    load_safetensors(m, ckpt_a)
    worker = LifecycleWorkerExtension()
    worker._lifecycle_backbones = lambda: [("draft", m)]  # type: ignore[method-assign]
    kept = len(m.lifecycle.recent_events)
    assert worker.lifecycle_events(last=0) == []  # was: every event
    assert len(worker.lifecycle_events(last=3)) == 3 and len(worker.lifecycle_events(last=10_000)) == kept
    for bad in (-1, True, "5"):
        with pytest.raises(ValueError, match="last must be an int >= 0"):
            worker.lifecycle_events(last=bad)  # type: ignore[arg-type]


def test_an_event_a_lifecycle_audits_as_a_warning_is_written_as_one(tmp_path: Path) -> None:
    # the plugin's `weight_update_session_ended` of an abandoned or refused push, the canary's collapse: a warning
    # that an operator filters on (it was written at info level whatever the caller asked)
    path = tmp_path / "audit.jsonl"
    events.configure_audit(json_path=path, console=False, level="warning")
    try:
        m = DFlashQwen3Draft(DFlashConfig(num_hidden_layers=1))
        m.lifecycle.audit_event("weight_update_session_ended", level="warning", outcome="abandoned")
        m.lifecycle.audit_event("weight_update_session_ended", outcome="finished")  # info: filtered out
    finally:
        events.configure_audit(console=False)
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert (line["level"], line["outcome"]) == ("warning", "abandoned")
