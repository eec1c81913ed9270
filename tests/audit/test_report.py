"""`reload-lifecycle report`: one self-contained HTML file, rendered for real in headless Chromium (screenshot and
rendered DOM), showing the state diagram with the path taken, per-layer readiness timelines, derived-buffer
addresses per epoch and the violations."""

from __future__ import annotations

import re
import shutil
import struct
import zlib
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lifecycle.audit.report import collect, write_report
from lifecycle.audit.svg import state_diagram_svg
from lifecycle.cli import main
from lifecycle.states import TRANSITIONS, TRIGGERS
from lifecycle.testing import write_synthetic
from support.browser import chromium
from support.scenarios import index_of, read_lines, write_lines

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "lifecycle" / "audit" / "assets"

class Elements(HTMLParser):
    """Every element of a page as (tag, attributes)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.items: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.items.append((tag, {k: v or "" for k, v in attrs}))

    def with_class(self, cls: str, tag: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.items if cls in a.get("class", "").split() and (tag is None or t == tag)]

    def by_id(self, ident: str) -> dict[str, str] | None:
        return next((a for _, a in self.items if a.get("id") == ident), None)


def png_facts(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct byte values in the decompressed image data) of a PNG, read with zlib alone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


@pytest.fixture
def edited_logs(real_logs: Path, tmp_path: Path) -> Path:
    """The real logs with two violations: a pinned buffer moved on rank 1, an illegal capture on rank 0."""
    logs = Path(shutil.copytree(real_logs, tmp_path / "logs"))
    ev = read_lines(logs / "rank1.jsonl")
    i = index_of(ev, event="refresh", epoch=2)
    ev[i]["buffers"][0]["data_ptr"] = hex(int(ev[i]["buffers"][0]["data_ptr"], 16) + 256)
    write_lines(logs / "rank1.jsonl", ev)
    ev = read_lines(logs / "rank0.jsonl")
    i = index_of(ev, event="transition", trigger="graphs_verified", epoch=1)
    ev[i].update(src="FULLY_LOADED", trigger="capture_graphs")  # a capture the table does not allow from there
    write_lines(logs / "rank0.jsonl", ev)
    return logs


def test_report_renders_in_headless_chromium(edited_logs: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.html"
    assert main(["report", str(edited_logs), "-o", str(out)]) == 1  # the edited capture is a violation
    assert "wrote" in capsys.readouterr().out

    png = tmp_path / "out.png"
    chromium(f"--screenshot={png}", "--window-size=1400,2000", out.as_uri(), cwd=tmp_path)
    width, height, distinct = png_facts(png)
    assert (width, height) == (1400, 2000)
    assert png.stat().st_size > 40_000 and distinct > 200  # a picture, not a blank page

    dom_text = chromium("--dump-dom", out.as_uri(), cwd=tmp_path).stdout
    dom = Elements(dom_text)
    assert dom.items[0][0] == "html" and dom.items[0][1]["data-rendered"] == "yes"  # the inline script ran
    assert dom.by_id("summary") and dom.by_id("streams") and dom.by_id("violations")
    assert "status-violations" in dom.by_id("status")["class"]  # type: ignore[index]
    rows = dom.with_class("violation", "tr")
    assert Counter(r["data-kind"] for r in rows) >= Counter({"storage_drift": 1, "illegal_transition": 1})
    panel = dom.by_id("backbone-draft")
    assert panel is not None and "open" in panel
    assert len(dom.with_class("state-diagram", "svg")) == 8  # one per backbone
    current = [a for a in dom.with_class("current", "g") if a.get("data-state") == "GRAPH_CAPTURED"]
    assert current and all("state" in a["class"] for a in current)
    assert dom.with_class("taken", "path") and dom.with_class("illegal", "path")
    # draft: 3 ranks x 3 epochs, 6 layers each, all ready
    draft = [a for a in dom.with_class("timeline", "svg") if a["id"].startswith("timeline-r-") and "-draft-" in a["id"]]
    assert len(draft) == 9
    assert len(dom.with_class("ready", "rect")) >= 9 * 6
    assert dom.with_class("missing", "rect") and dom.with_class("unchanged", "rect")  # aborted, selective
    assert dom.with_class("mark-refused", "g") and dom.with_class("mark-begin_reload", "g")
    assert len(dom.with_class("ptr-drift", "td")) == 1
    assert dom.by_id("buffers-r-1-draft") is not None


def test_report_is_one_self_contained_file(edited_logs: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    write_report([edited_logs], out)
    text = out.read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", text)
    assert not re.search(r"<link\b|<script\b[^>]*\bsrc=|@import|url\((?!#)|<img\b|<iframe\b", text)
    assert len(re.findall(r"<script>", text)) == 1 and "<style>" in text
    # the only URLs are SVG's namespace
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) == {"http://www.w3.org/2000/svg"}


def test_clean_logs_report_clean(real_logs: Path, tmp_path: Path) -> None:
    out = tmp_path / "clean.html"
    result = write_report([real_logs], out)
    assert result.status == 0
    dom = Elements(out.read_text())
    assert "status-clean" in dom.by_id("status")["class"]  # type: ignore[index]
    assert dom.by_id("no-violations") is not None and not dom.with_class("violation", "tr")
    assert {a["id"] for a in dom.with_class("backbone-panel")} == {
        "backbone-draft", "backbone-aborted", "backbone-quarantined", "backbone-rebuilt", "backbone-refusals",
        "backbone-selective", "backbone-debugged", "backbone-recovered"}
    # a rebuild while unpinned moves buffers: drawn as moved, not drift
    assert dom.with_class("ptr-moved", "td") and not dom.with_class("ptr-drift", "td")


def test_the_diagram_is_the_table_and_highlights_exactly_the_path_taken(real_logs: Path) -> None:
    result, _ = collect([real_logs])
    for r in result.streams:
        dom = Elements(state_diagram_svg(r.edges, visited=r.visited, current={r.state.value}))
        drawn = {(a["data-src"], a["data-dst"]) for a in dom.with_class("edge", "path") if "data-src" in a}
        assert drawn == {(s.value, t.dest.value) for t in TRANSITIONS for s in t.sources}
        taken = {(a["data-src"], a["data-dst"]) for a in dom.with_class("taken", "path")}
        assert taken == {(src, dst) for (_, src, dst) in r.edges}
        assert {a["data-state"] for a in dom.with_class("visited", "g")} == r.visited
        assert [a["data-state"] for a in dom.with_class("current", "g")] == [r.state.value]


def test_a_long_log_draws_only_the_latest_epochs(real_logs: Path, tmp_path: Path) -> None:
    recorded = [e for e in read_lines(real_logs / "rank0.jsonl") if e["epoch"] <= 1]
    log = tmp_path / "long.jsonl"
    write_synthetic(log, recorded, 150)
    out = tmp_path / "long.html"
    result = write_report([log], out, max_epochs=5)
    assert result.status == 0 and result.streams[0].epoch == 150
    dom = Elements(out.read_text())
    ids = [a["id"] for a in dom.with_class("timeline", "svg")]
    assert ids == [f"timeline-r-0-draft-i-1-e-{e}" for e in range(146, 151)]
    assert "146 earlier epoch(s) not drawn" in out.read_text()


def test_every_step_of_the_table_is_a_timeline_mark_but_per_bucket_bookkeeping(real_logs: Path, tmp_path: Path) -> None:
    """Marks come from the table: every trigger the logs took (all of them) is drawn, `recover` included, except
    the rows declared per-bucket bookkeeping (weights_loaded: the layer rows already show each bucket)."""
    out = tmp_path / "marks.html"
    result = write_report([real_logs], out)
    dom = Elements(out.read_text())
    drawn = {c.removeprefix("mark-") for a in dom.with_class("mark", "g") for c in a["class"].split()
             if c.startswith("mark-")}
    taken = {t for r in result.streams for (t, _, _) in r.edges}
    per_bucket = {t.trigger for t in TRANSITIONS if t.per_bucket}
    assert taken == set(TRIGGERS) and per_bucket == {"weights_loaded"}
    assert drawn == (taken - per_bucket) | {"refused"}
    assert "recover" in drawn


def test_the_inlined_stylesheet_and_script_are_the_packaged_assets(real_logs: Path, tmp_path: Path) -> None:
    """The report inlines assets/report.css and report.js verbatim, and pyproject packages every file there."""
    import tomllib

    out = tmp_path / "assets.html"
    write_report([real_logs], out)
    text = out.read_text()
    files = sorted(ASSETS.iterdir())
    assert [f.name for f in files] == ["report.css", "report.js"]
    for f in files:
        body = f.read_text()
        assert len(body) > 500 and body in text
    assert re.search(r"<style>\s*" + re.escape(files[0].read_text()) + r"</style>", text)
    assert re.search(r"<script>\s*" + re.escape(files[1].read_text()) + r"</script>", text)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    packaged = {f for pattern in patterns["lifecycle.audit"] for f in (ROOT / "lifecycle" / "audit").glob(pattern)}
    assert packaged == set(files)
