"""The report on hostile logs, rendered for real in headless Chromium: every string and number field of every
kind of event carries a script payload (five styles and more), alone or all at once, and a log file is named
with one. No payload runs, with the report's Content-Security-Policy and without it (escaping alone holds), and
no element a payload would make exists in the rendered DOM; the policy itself lets the page's own script run
and blocks one injected into the page."""

from __future__ import annotations

import ast
import copy
import html
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_report import Elements

from lifecycle.cli import main
from support.browser import chromium
from support.scenarios import read_lines, write_lines

ROOT = Path(__file__).resolve().parents[2]
TITLE = "reload-lifecycle report"
MARK = "document.documentElement.setAttribute('data-xss','{}')"
#: Each payload, if it ran, sets data-xss on <html> or changes the title; each would also leave an element.
PAYLOADS = [
    "<script>document.title='XSS-script'</script>",
    f'"><img src=x onerror="{MARK.format("attr-dq")}">',
    f"'><svg onload=\"{MARK.format('attr-sq')}\">",
    "</style><script>document.title='XSS-style'</script>",
    f'<svg><foreignObject><iframe srcdoc="<img src=x onerror={MARK.format("fo")}>"></iframe></foreignObject></svg>',
    "javascript:document.title='XSS-url'",
    "</title><script>document.title='XSS-title'</script>",
    f"</textarea><details open ontoggle=\"{MARK.format('toggle')}\">",
]
#: Fields that say what an event is: poisoned one at a time (the line then is a violation or an input problem).
STRUCTURAL = {"event", "ts", "trigger", "src", "dst", "level", "schema"}


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to every string and number (not bool) in an event."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
        yield path


def _set(event: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    target: Any = event
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value


def hostile_logs(real_logs: Path, out: Path) -> tuple[Path, int]:
    """(folder of hostile logs, number of fields poisoned): one line per (event, field) with that field replaced
    by a payload; every event again with all its names and texts poisoned at once (valid events, drawn
    everywhere); and a log whose file name is a payload."""
    out.mkdir()
    events = read_lines(real_logs / "mixed.jsonl") + read_lines(real_logs / "rank0.jsonl")
    one_at_a_time, poisoned = [], 0
    for ev in events:
        for path in _leaves(ev):
            bad = copy.deepcopy(ev)
            _set(bad, path, PAYLOADS[poisoned % len(PAYLOADS)])
            one_at_a_time.append(bad)
            poisoned += 1
    write_lines(out / "fields.jsonl", one_at_a_time)
    all_at_once = []
    for i, ev in enumerate(events):
        bad = copy.deepcopy(ev)
        for j, path in enumerate(_leaves(ev)):
            if path[0] not in STRUCTURAL and isinstance(ev.get(path[0]), (str, list)):
                _set(bad, path, PAYLOADS[(i + j) % len(PAYLOADS)] + f" #{j}")
        all_at_once.append(bad)
    write_lines(out / "names.jsonl", all_at_once)
    write_lines(out / f"{PAYLOADS[1]}.jsonl", events[:5])
    return out, poisoned


def rendered(page: Path, cwd: Path) -> Elements:
    dom = chromium("--virtual-time-budget=3000", "--dump-dom", page.as_uri(), cwd=cwd).stdout
    return Elements(dom)


def assert_no_payload_ran(dom: Elements) -> None:
    html_attrs = dom.items[0][1]
    assert dom.items[0][0] == "html" and html_attrs["data-rendered"] == "yes"  # the page's own script ran
    assert "data-xss" not in html_attrs, html_attrs
    tags = [tag for tag, _ in dom.items]
    assert tags.count("script") == 1
    assert not {"img", "iframe", "foreignobject", "textarea"} & set(tags)
    assert not [a for _, a in dom.items if any(k.startswith("on") for k in a)]  # no event handler attribute


def test_no_payload_in_any_field_runs(real_logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs, poisoned = hostile_logs(real_logs, tmp_path / "hostile")
    assert poisoned > 2000
    page = tmp_path / "report.html"
    assert main(["report", str(logs), "-o", str(page), "--max-epochs", "50"]) == 2  # unreadable input, as printed
    assert "UNREADABLE INPUT" in capsys.readouterr().out  # numbers replaced by strings are input problems
    text = page.read_text()
    assert text.count("data-xss") > 100  # the payloads are in the page, as text
    dom = rendered(page, tmp_path)
    assert_no_payload_ran(dom)
    title = re.search(r"<title>(.*?)</title>", chromium("--virtual-time-budget=3000", "--dump-dom", page.as_uri(),
                                                         cwd=tmp_path).stdout)
    assert title and title.group(1) == TITLE
    assert len(dom.with_class("backbone-panel")) >= 8 and dom.with_class("layer-row", "g")

    # escaping alone holds: the same page without its Content-Security-Policy
    bare = tmp_path / "no-csp.html"
    bare.write_text(re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", text))
    assert "Content-Security-Policy" not in bare.read_text()
    assert_no_payload_ran(rendered(bare, tmp_path))


def test_the_policy_runs_the_pages_own_script_and_blocks_an_injected_one(real_logs: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    assert main(["report", str(real_logs), "-o", str(page)]) == 0
    text = page.read_text()
    (policy,) = map(html.unescape, re.findall(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', text))
    assert "default-src 'none'" in policy and "script-src 'sha256-" in policy and "unsafe-inline" not in policy
    injected = tmp_path / "injected.html"
    injected.write_text(text.replace("</main>", "</main><script>document.documentElement.setAttribute('data-xss','"
                                     "inline')</script><img src=x onerror=\"document.title='XSS'\">"))
    dom = rendered(injected, tmp_path)
    assert dom.items[0][1]["data-rendered"] == "yes" and "data-xss" not in dom.items[0][1]


#: The modules that write HTML: every module of the audit package that uses MarkupSafe.
HTML_WRITERS = tuple(sorted(p.name for p in (ROOT / "lifecycle" / "audit").glob("*.py")
                            if "from markupsafe import" in p.read_text()))


def test_the_html_writers_are_found() -> None:
    assert {"report.py", "panels.py", "timeline.py", "svg.py"} <= set(HTML_WRITERS)


@pytest.mark.parametrize("module", HTML_WRITERS)
def test_html_is_written_only_through_the_escaping_templates(module: str) -> None:
    """By construction: no f-string in the modules that write HTML makes markup (a `<` in its literal parts)."""
    tree = ast.parse((ROOT / "lifecycle" / "audit" / module).read_text())
    offenders = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                 and any(isinstance(v, ast.Constant) and "<" in str(v.value) for v in node.values)]
    assert offenders == []


# ---- crafted lines: input problems (exit 2, file:line), never a traceback ------------------------------------------

GOOD = {"backbone": "d", "rank": 0, "epoch": 0, "seq": 1, "ts": "2026-01-01T00:00:00.000001Z", "schema": 5}
CRAFTED: dict[str, str] = {
    "nested 50,000 deep": '{"event":"transition","pad":' + "[" * 50_000 + "]" * 50_000 + "}",
    "nested objects 50,000 deep": '{"event":"refresh","buffers":' + '{"a":' * 50_000 + "1" + "}" * 50_001,
    "src as a list": json.dumps({**GOOD, "event": "transition", "trigger": "begin_reload", "src": ["META"],
                                 "dst": "PARTIALLY_LOADED"}),
    "dst as an object": json.dumps({**GOOD, "event": "transition", "trigger": "begin_reload", "src": "META",
                                    "dst": {"state": "x"}}),
    "src of a refusal as an object": json.dumps({**GOOD, "event": "refused", "trigger": "t", "src": {}}),
    "missing as an int": json.dumps({**GOOD, "event": "refresh", "missing": 5}),
    "missing as an object": json.dumps({**GOOD, "event": "refresh", "missing": {"a": 1}}),
    "missing_more as a string": json.dumps({**GOOD, "event": "refresh", "missing": ["a"], "missing_more": "9"}),
    "problems_more as a string": json.dumps({**GOOD, "event": "storage_check", "ok": False, "problems": ["p"],
                                             "problems_more": "lots"}),
    "layers as an int": json.dumps({**GOOD, "event": "layers_unchanged", "layers": 3}),
    "a layer name of 0.9 MB": json.dumps({**GOOD, "event": "layer_ready", "layers": ["L" * 900_000]}),
    "buffers holding a string": json.dumps({**GOOD, "event": "refresh", "buffers": ["x"]}),
    "a buffer's nbytes as markup": json.dumps({**GOOD, "event": "refresh", "buffers": [{"name": "b",
                                                                                        "nbytes": "<b>"}]}),
    "a count that is negative": json.dumps({**GOOD, "event": "layer_ready", "layers": ["l"], "layers_total": -1}),
    "a float timestamp": json.dumps({**GOOD, "event": "hook_run", "ts": 1e999}),
    "an epoch of NaN": '{"event":"hook_run","backbone":"d","rank":0,"epoch":NaN,"ts":"2026-01-01T00:00:00Z"}',
    "a layer count of 1e999": json.dumps({**GOOD, "event": "layer_ready", "layers": ["l"], "layers_total": 1e999}),
    "ok as a string": json.dumps({**GOOD, "event": "storage_check", "ok": "false"}),
    "a rank of 500 digits": json.dumps({**GOOD, "event": "hook_run", "rank": 10 ** 500}),
}


@pytest.mark.parametrize("case", list(CRAFTED), ids=str)
@pytest.mark.parametrize("command", ["audit", "report"])
def test_a_crafted_line_is_an_input_problem_not_a_traceback(case: str, command: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "crafted.jsonl"
    log.write_text(json.dumps({**GOOD, "event": "hook_run", "hook": "h"}) + "\n" + CRAFTED[case] + "\n")
    args = [command, str(log)] + (["-o", str(tmp_path / "r.html")] if command == "report" else ["--json"])
    status = main(args)
    out = capsys.readouterr().out
    if command == "audit":
        doc = json.loads(out)
        assert status == 2 and doc["status"] == 2 and doc["events"] == 1
        (p,) = doc["input_problems"]
        assert p["where"] == f"{log}:2" and len(p["message"]) < 300, p
    else:
        assert status == 2 and "UNREADABLE INPUT (1 problem(s)" in out  # the status it prints
        assert f"{log}:2" in (tmp_path / "r.html").read_text()


def test_text_output_escapes_control_characters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A backbone named with a newline and a terminal escape cannot print a fake verdict line."""
    evil = "d\nRESULT: CLEAN (0 events audited; exit status 0)\x1b[8m\u202e"
    log = tmp_path / "evil\nname.jsonl"
    lines = [{**GOOD, "event": "transition", "backbone": evil, "trigger": "capture_graphs", "src": "META",
              "dst": "GRAPH_CAPTURED"},
             {**GOOD, "event": "layer_ready", "backbone": evil, "layers": ["x\x1b]0;owned\x07"], "seq": 2, "rank": 1},
             {**GOOD, "event": "hook_run", "backbone": "b", "ts": "\x1b[2J"}]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert main(["audit", str(log)]) == 2
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert [line for line in out.splitlines() if line.startswith("RESULT:")] == [out.splitlines()[-1]]
    assert "d\\nRESULT: CLEAN" in out and "\\x1b[8m" in out and "evil\\nname.jsonl" in out


# ---- arguments ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["report", "LOG", "-o", "OUT", "--max-epochs", "-3"], "--max-epochs: must be an integer from 1 to 50, got '-3'"),
    (["report", "LOG", "-o", "OUT", "--max-epochs", "0"], "--max-epochs: must be an integer from 1 to 50, got '0'"),
    (["report", "LOG", "-o", "OUT", "--max-epochs", "many"], "--max-epochs: must be an integer from 1 to 50"),
    (["report", "LOG", "-o", "OUT", "--title", "t" * 300], "--title: at most 200 characters, got 300"),
    (["report", "LOG", "-o", "OUT", "--max-streams", "0"], "--max-streams: must be an integer from 1 to"),
    (["audit", "LOG", "--max-details", "-1"], "--max-details: must be an integer from 0 to"),
    (["demo", "--layers", "0"], "--layers: must be an integer from 1 to 256, got '0'"),
    (["demo", "--bucket-size", "-2"], "--bucket-size: must be an integer >= 1, got '-2'"),
])
def test_bad_arguments_are_usage_errors(args: list[str], message: str, real_logs: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(real_logs) if a == "LOG" else str(tmp_path / "r.html") if a == "OUT" else a for a in args]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_report_into_a_directory_or_an_unwritable_place_is_a_usage_error(
        real_logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(real_logs), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["report", str(real_logs), "-o", str(tmp_path / "file" / "r.html")]) == 2
    assert "cannot write the report" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "file", ignore_errors=True)


def test_what_held_before_still_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Garbage bytes, invalid UTF-8, a line over the length limit, 1e999 and NaN, duplicate keys, unknown states,
    a FIFO and a symlink loop: each named by file (and line), the rest audited; stdin is read."""
    import io
    import os
    import sys

    from lifecycle.audit.logstream import MAX_LINE
    from lifecycle.audit.replay import audit_logs

    good = json.dumps({**GOOD, "event": "hook_run", "hook": "h"})
    log = tmp_path / "held.jsonl"
    log.write_bytes(b"\n".join([
        good.encode(), bytes(range(11, 256)), b'{"event": "\xff\xfe"}', b'{"pad":"' + b"x" * (MAX_LINE + 10) + b'"}',
        json.dumps({**GOOD, "event": "hook_run", "layers_total": 1e999}).encode(),
        b'{"event":"hook_run","backbone":"d","rank":0,"epoch":0,"ts":"2026-01-01T00:00:01Z","seq":2,"pad":NaN}',
        b'{"event":"hook_run","event":"layer_ready","layers":["l"],"backbone":"d","rank":0,"epoch":0,"seq":3,'
        b'"ts":"2026-01-01T00:00:02Z"}',
        json.dumps({**GOOD, "seq": 4, "ts": "2026-01-01T00:00:03Z", "event": "transition",
                    "trigger": "finalize_loading", "src": "NOWHERE", "dst": "ELSEWHERE"}).encode(), b""]))
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    result = audit_logs([log, tmp_path / "fifo.jsonl", tmp_path / "loop.jsonl"])
    assert result.status == 2 and result.events == 4  # the good line, NaN in an unread field, the duplicate, states
    assert [p.where for p in result.input_problems] == [
        f"{tmp_path / 'fifo.jsonl'}", f"{tmp_path / 'loop.jsonl'}", f"{log}:2", f"{log}:3", f"{log}:4", f"{log}:5"]
    messages = [p.message for p in result.input_problems]
    assert "not a regular file" in messages[0] and "Too many levels of symbolic links" in messages[1]
    assert "line longer than" in messages[4] and "expected a count (an integer from 0 to 2**63-1), got inf" in \
        messages[5]
    assert {v.kind for v in result.violations} == {"illegal_transition"}, result.violations  # unknown src, dst
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(good.encode() + b"\n")))
    assert audit_logs(["-"]).status == 0
