"""The documentation says what the code and the results say: every generated page and block is regenerated and
compared, every project path, module, name and test the pages name exists, every link resolves, and the README and
the changelog keep their shape.

Regenerate the generated parts after a change: `python docs/generate.py` (then commit the result).
Only the API page imports the package's core (and so torch); the rest reads files.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
REGENERATE = "run `python docs/generate.py` and commit the result"


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


# ---- generated pages and blocks ----------------------------------------------------------------------------------


def _shallow() -> bool:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() == "true"


def _counts_masked(text: str) -> str:
    """The page with its "stale by N changes" counts masked: what a shallow clone can check (CI clones fully)."""
    return re.sub(r"stale by (\d+|\?) changes?", "stale by N changes", text)


def _performance_page_current() -> bool:
    page, stored = gen.performance_page(), (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    return page == stored or (_shallow() and _counts_masked(page) == _counts_masked(stored))


def test_every_generated_page_and_block_is_up_to_date() -> None:
    stale = [rel for rel in gen.stale() if rel != "docs/performance.md" or not _performance_page_current()]
    assert not stale, f"out of date with the code or the results: {', '.join(stale)}: {REGENERATE}"


def test_the_generator_writes_only_when_asked_to(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` or a mistyped flag says how to run it and writes nothing; no argument rewrites what is stale."""
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "expected", lambda: {"page.md": "regenerated\n"})
    assert gen.main(["--help"]) == 0 and gen.COMMAND in capsys.readouterr().out
    assert gen.main(["--chek"]) == 2 and "--chek" in capsys.readouterr().err
    assert not (tmp_path / "page.md").exists(), "an argument it does not know rewrote a page"
    assert gen.main(["--check"]) == 1 and not (tmp_path / "page.md").exists()
    assert gen.main([]) == 0 and (tmp_path / "page.md").read_text(encoding="utf-8") == "regenerated\n"


def test_the_generator_names_each_result_measured_on_other_code(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """A stored result whose measured path changed since its commit is named, with the command that measures it
    again (and the device it needs); one measured on this code is not."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    oldest = git("rev-list", "--max-parents=0", "HEAD").split()[0]  # every file of lifecycle/ changed since
    head = git("rev-parse", "HEAD").strip()
    for name, commit, cuda in (("old_cpu", oldest, False), ("old_gpu", oldest, True), ("fresh", head, False)):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"benchmark": name, "machine": {"cuda": cuda}, "measured_on": {"commit": commit, "path": ["lifecycle"]}}),
            encoding="utf-8")
    monkeypatch.setattr(gen, "RESULTS", tmp_path)
    lines = gen.stale_results()
    assert [line.split(":")[0].rsplit("/", 1)[-1] for line in lines] == ["old_cpu.json", "old_gpu.json"], lines
    assert "`python -m benchmarks.old_cpu` again" in lines[0] and "on a CUDA device" in lines[1]


def test_each_generated_page_says_how_it_is_made_and_each_block_is_marked_once() -> None:
    for rel in gen.PAGES:
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert text.startswith(gen.NOTICE + "\n"), f"{rel} does not begin with the generated-page notice"
        assert gen.COMMAND in text.split("\n\n", 3)[2], f"{rel} does not say, at its top, how it is made"
    for rel, blocks in gen.BLOCKS.items():
        text = (ROOT / rel).read_text(encoding="utf-8")
        for name in blocks:
            assert text.count(f"<!-- generated:{name}:begin -->") == 1, (rel, name)
            assert text.count(f"<!-- generated:{name}:end -->") == 1, (rel, name)


def test_the_check_fails_on_a_stale_block_and_on_changed_results(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stale = readme.replace("GRAPH_CAPTURED --> DERIVED_REFRESHED: release_graphs", "GRAPH_CAPTURED --> META: x")
    assert stale != readme and gen.fill_blocks(stale, gen.BLOCKS["README.md"]) == readme
    page = gen.performance_page()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    result = json.loads((tmp_path / "refresh.json").read_text())
    result["summary"]["targets"][0]["figure"] += " (changed)"  # what the page shows is the result's own summary
    (tmp_path / "refresh.json").write_text(json.dumps(result))
    monkeypatch.setattr(gen, "RESULTS", tmp_path)
    changed = gen.performance_page()
    assert changed != page and "(changed)" in changed
    result["measured_on"]["uncommitted"] = ["lifecycle/backbone.py"]  # measured on changes never committed
    (tmp_path / "refresh.json").write_text(json.dumps(result))
    assert gen.performance_page() != changed


def test_the_performance_page_holds_every_stored_result_and_no_figure_by_hand() -> None:
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f"### {path.stem}\n" in text, f"docs/performance.md has no section for {_rel(path)}: {REGENERATE}"
    assert _performance_page_current(), f"docs/performance.md: {REGENERATE} (the stale counts follow the history)"


def test_the_api_page_lists_every_top_level_name() -> None:
    import lifecycle

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^- \*\*`(\w+)", text, flags=re.M))
    assert listed == set(lifecycle.__all__), f"{sorted(listed ^ set(lifecycle.__all__))}: {REGENERATE}"


# ---- the README and the changelog keep their shape ---------------------------------------------------------------


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: the front page stays within 150; move detail to docs/"
    head = "\n".join(lines[:15])
    assert "make demo" in head and "make test" in head, "the two set-up commands belong in the README's first 15 lines"
    text = "\n".join(lines)
    assert 'pytest -m "not engine and not browser"' in text and "make test-quick" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text(), "CI no longer runs the README's test command"
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in text, f"the README's contents table does not list docs/{page.name}"


def _changelog_entries(text: str) -> Iterator[tuple[int, list[str]]]:
    entry: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("- "):
            if entry:
                yield start, entry
            entry, start = [line], number
        elif entry and line.startswith("  ") and line.strip():
            entry.append(line)
        else:
            if entry:
                yield start, entry
            entry = []
    if entry:
        yield start, entry


def test_the_changelog_is_release_notes() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(.+?)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, flags=re.M)
    assert releases[0] == ("Unreleased", "") and all(date for _, date in releases[1:]), releases
    import lifecycle

    assert releases[1][0] == lifecycle.__version__, "the newest release is not the package's version"
    parts = re.split(r"^## \[.+$", text, flags=re.M)[2:]  # each release: its summary, then its sections
    for (version, _), part in zip(releases[1:], parts, strict=True):
        body = part.split("\n<!-- generated:release-links:begin -->")[0]
        assert len(body.splitlines()) <= 140, f"{version}: {len(body.splitlines())} lines: release notes, not a diary"
        summary = body.split("\n### ", 1)[0].strip()
        assert len(summary.splitlines()) >= 3, f"{version} does not begin with its summary, in prose"
    for (newer, _), (older, _) in itertools.pairwise(releases[1:]):
        assert f"[{newer}]: {gen.repository()}/compare/v{older}...v{newer}" in text, f"{newer} has no compare link"
    sections = set(re.findall(r"^### (.+)$", text, flags=re.M))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections
    long = [(n, len(e)) for n, e in _changelog_entries(text) if len(e) > 3]
    assert not long, f"entries longer than three lines (line, length): {long}"
    assert "DECISION" not in text, "decisions belong in docs/decisions.md"


# ---- every name a page mentions exists ---------------------------------------------------------------------------


def _code_spans(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every inline code span outside fenced blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            for span in re.findall(r"`([^`\n]+)`", line):
                yield number, span.strip()


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _resolve_import(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]  # the package holding the file
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, node.module] if node.module else package)


def _lazy_exports(path: Path) -> dict[str, str]:
    """`lifecycle/__init__.py` loads its names on first use from a table (`_EXPORTS`): name -> module."""
    if path != ROOT / "lifecycle" / "__init__.py":
        return {}
    import lifecycle  # light: nothing heavy is imported until a name is used

    return {name: "lifecycle" + module for name, module in lifecycle._EXPORTS.items()}


def _definition(path: Path, name: str, depth: int = 0) -> tuple[Path, ast.AST] | None:
    """Where module `path` gets `name`: its own class/def/assignment, or the module it imports it from."""
    if depth > 8:
        return None
    lazy = _lazy_exports(path)
    if name in lazy:
        target = _module_file(lazy[name])
        return _definition(target, name, depth + 1) if target else None
    for node in _tree(path).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return path, node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return path, node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return path, node
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            source = _resolve_import(path, node)
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            submodule = _module_file(f"{source}.{original}")
            if submodule:
                return submodule, ast.Module(body=[], type_ignores=[])
            target = _module_file(source)
            return _definition(target, original, depth + 1) if target else (path, node)
    if (path.parent / f"{name}.py").is_file() and path.name == "__init__.py":
        return path.parent / f"{name}.py", ast.Module(body=[], type_ignores=[])
    if (path.parent / name / "__init__.py").is_file() and path.name == "__init__.py":
        return path.parent / name / "__init__.py", ast.Module(body=[], type_ignores=[])
    return None


def _class_has(path: Path, cls: ast.ClassDef, attr: str, depth: int = 0) -> bool:
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if (isinstance(t, ast.Name) and t.id == attr) or (
                    isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                    and t.value.id == "self"):
                return True
    for base in cls.bases:
        if isinstance(base, ast.Name) and depth < 8:
            found = _definition(path, base.id)
            if found and isinstance(found[1], ast.ClassDef) and _class_has(found[0], found[1], attr, depth + 1):
                return True
    return False


def _dotted_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        node: ast.AST = _tree(path)
        for i, attr in enumerate(rest):
            if isinstance(node, ast.Module):
                found = _definition(path, attr)
                if found is None:
                    return False
                path, node = found
            elif isinstance(node, ast.ClassDef):
                return _class_has(path, node, attr)
            else:
                return i == len(rest)  # a value's own attributes are not checked
        return True
    return False


@cache
def _test_names() -> dict[str, set[str]]:
    out = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names = set()
        for node in _tree(path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
        out[_rel(path)] = names
    return out


TOP = "lifecycle|models|tests|benchmarks|docs|requirements|\\.ci"
FILE = re.compile(rf"^(?:{TOP})/[\w./-]*$|^(?:Makefile|pyproject\.toml|README\.md|CHANGELOG\.md)$")
TEST = re.compile(r"^(tests/[\w/]+\.py)::([\w:]+)$")
DOTTED = re.compile(r"^((?:lifecycle|models|benchmarks)(?:\.\w+)+)(?:\(.*\))?$")
BARE_TEST = re.compile(r"^test_\w+$")
BARE_FILE = re.compile(r"^\w+\.py$")


def _public_names() -> dict[str, str]:
    import lifecycle

    return {name: "lifecycle" + module for name, module in lifecycle._EXPORTS.items()}


PROJECT = ("lifecycle", "models")
VARIABLES = {"report", "session", "readiness", "draft", "backbone", "layer", "model",  # also names of locals
             "vllm", "torch", "structlog", "transitions"}  # and of libraries


@cache
def _project_classes() -> dict[str, tuple[Path, ast.ClassDef] | None]:
    """Every class defined in the project, by name (None where two modules define one of that name)."""
    out: dict[str, tuple[Path, ast.ClassDef] | None] = {}
    for top in PROJECT:
        for path in (ROOT / top).rglob("*.py"):
            for node in _tree(path).body:
                if isinstance(node, ast.ClassDef):
                    out[node.name] = None if node.name in out else (path, node)
    return out


@cache
def _module_stems() -> dict[str, Path | None]:
    """Every module of the project by its last name (None where two share it), as prose names them."""
    out: dict[str, Path | None] = {}
    for top in PROJECT:
        for path in (ROOT / top).rglob("*.py"):
            stem = path.parent.name if path.name == "__init__.py" else path.stem
            out[stem] = None if stem in out else path
    return out


@cache
def _file_names() -> set[str]:
    return {p.name for top in (*PROJECT, "tests", "benchmarks", "docs") for p in (ROOT / top).rglob("*.py")}


def _problems(path: Path) -> Iterator[str]:
    public = _public_names()
    every_test = set().union(*_test_names().values())
    for line, span in _code_spans(path):
        where = f"{_rel(path)}:{line}: `{span}`"
        if m := TEST.match(span):
            if m.group(2) not in _test_names().get(m.group(1), set()):
                yield f"{where}: no such test"
        elif FILE.match(span):
            if "*" in span or "NAME" in span:
                if not list(ROOT.glob(span.replace("NAME", "*"))):
                    yield f"{where}: matches no file"
            elif not (ROOT / span.rstrip("/")).exists():
                yield f"{where}: no such file or folder"
        elif m := DOTTED.match(span):
            if not _dotted_exists(m.group(1)):
                yield f"{where}: no such module or name"
        elif BARE_TEST.match(span):
            if span not in every_test:
                yield f"{where}: no test of that name"
        elif BARE_FILE.match(span):
            if span not in _file_names():
                yield f"{where}: no module of that name"
        elif m := re.match(r"^([A-Z]\w+)\.(\w+)(?:\(.*\))?$", span):
            cls, attr = m.groups()
            found = (_definition(_module_file(public[cls]), cls) if cls in public
                     else _project_classes().get(cls))
            if found and isinstance(found[1], ast.ClassDef) and not _class_has(found[0], found[1], attr):
                yield f"{where}: `{cls}` has no `{attr}`"
        elif (m := re.match(r"^([a-z_]\w*)\.(\w+)(?:\(.*\))?$", span)) and m.group(1) not in VARIABLES:
            module = _module_stems().get(m.group(1))
            if module is not None and _definition(module, m.group(2)) is None:
                yield f"{where}: module `{m.group(1)}` has no `{m.group(2)}`"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_project_path_module_name_and_test_a_page_names_exists(page: Path) -> None:
    problems = list(_problems(page))
    assert not problems, "\n".join(problems)


def test_the_name_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("`lifecycle/nowhere.py` `lifecycle.loading.no_such_name` "
                    "`tests/project/test_docs.py::test_nothing` "
                    "`DraftBackbone.no_such_method` `test_no_such_test` `nowhere.py` `VLLMDraftFamily.no_such_thing` "
                    "`version.NO_SUCH_NAME` `lifecycle.states.TRANSITIONS` `DraftBackbone.finalize_loading` "
                    "`states.py` `version.TESTED_SERIES` `report.temporaries` "
                    "`tests/project/test_docs.py::test_the_name_check_can_fail`\n")
    problems = list(_problems(page))
    assert len(problems) == 8, problems


# ---- links -------------------------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` or `_`), spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_of_a_page_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)
