"""vLLM 0.33.0 by its sources (`make compat`): the release wheel is fetched with `pip download --no-deps` into the
git-ignored `.cache/vllm-wheels/` (once; about 340 MB) and read straight from the zip. Every name the plugin relies on
(its own declarations: `capabilities.requirements`) must exist there. 0.33.0 is a CUDA-only build, so this is the
check that can run on a CPU machine; the marker keeps it out of the default run (`make test`), `make compat` runs it
and `.ci/run` runs `make compat` after `make test`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lifecycle.vllm.compat.sources import wheel_reader
from lifecycle.vllm.drafts.families import FAMILIES
from lifecycle.vllm.plugin.capabilities import active_families, missing, requirements

pytestmark = pytest.mark.compat

VERSION = "0.33.0"
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


def test_every_family_is_declared_for_0_33() -> None:
    assert active_families(VERSION) == FAMILIES
    assert {f.name for f in FAMILIES if f.since == "0.33"} == {"qwen3_xpress", "dflash2_beam", "muse_spark_dspark"}
