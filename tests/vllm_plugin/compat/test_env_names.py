"""A misspelled setting fails closed, its prefix too (lifecycle/env.py `check_names`, issue 31 item 5).

Before: only a name whose squeezed ASCII form began with RELOADLIFECYCLE was checked, so `RELAOD_LIFECYCLE_PATH_ROOT`,
`RELOAD_LIFECYLE_PATH_ROOT` and the right name with one Cyrillic, Greek or fullwidth letter were ignored: the path
root was silently off. Now every name is folded (NFKD, upper case, look-alikes as Latin letters, `A-Z0-9` only) and
refused when it is within `NEAR_MISS` edits of a setting or its beginning within `NEAR_MISS` of the prefix; the names
of real environments (vLLM's own, CUDA's, the shell's...) are many more edits away and pass.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from lifecycle import env
from lifecycle.env import NEAR_MISS, EnvSettingError, edit_distance, fold
from lifecycle.vllm import settings
from lifecycle.vllm.plugin import activation as plugin

PREFIX, KNOWN = settings.ENV_PREFIX, settings.KNOWN_ENV
ROOT_ENV = settings.PATH_ROOT_ENV


def refusal(environ: dict[str, str]) -> EnvSettingError:
    with pytest.raises(EnvSettingError) as ei:
        env.check_names(PREFIX, KNOWN, environ)
    return ei.value


# ---- the names of the issue, through the plugin's activation -----------------------------------------------------
MISSPELLED_ROOTS = {
    "RELAOD_LIFECYCLE_PATH_ROOT": "is refused, not ignored",  # two letters swapped in the prefix
    "RELOAD_LIFECYLE_PATH_ROOT": "is refused, not ignored",  # a letter left out of the prefix
    "RELOAD_LIFECYCLE_PATH_R\u041e\u041eT": "CYRILLIC CAPITAL LETTER O",
    "RELOAD_LIF\u0395CYCLE_PATH_ROOT": "GREEK CAPITAL LETTER EPSILON",
    "\uff32\uff25\uff2c\uff2f\uff21\uff24_LIFECYCLE_PATH_ROOT": "FULLWIDTH LATIN CAPITAL LETTER R",
    "r\u0435load_lifecycle_path_root": "CYRILLIC SMALL LETTER IE",
    "RELOAD_LIF\u00c9CYCLE_PATH_ROOT": "LATIN CAPITAL LETTER E WITH ACUTE",
    "RELOAD-LIFECYCLE-PATH-ROOT": "",  # in the prefix as folded: refused as before
}


@pytest.fixture
def inactive(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plugin.activate()` runs as in a fresh vLLM process, no setting set."""
    monkeypatch.setattr(plugin, "_active", False)
    for name in KNOWN:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", list(MISSPELLED_ROOTS))
def test_a_misspelled_prefix_or_a_look_alike_letter_stops_the_plugin_naming_the_intended_setting(
        name: str, inactive: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, str(tmp_path))
    with pytest.raises(EnvSettingError) as ei:
        plugin.activate()
    message = str(ei.value)
    assert ei.value.variable == name and message.startswith(f"{name}={str(tmp_path)!r} is not a reload-lifecycle "
                                                            f"setting: did you mean {ROOT_ENV}?"), message
    assert MISSPELLED_ROOTS[name] in message, message  # what the note says: the letters that only look alike
    assert plugin._active is False  # the engine does not start; nothing was patched


@pytest.mark.parametrize(("name", "intended"), [
    ("RELOAD_LIFECYCLE_TAKEOVER_IDLE_S", "RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S"),
    ("RELOAD_LIFECYCLE_AUDIT", "RELOAD_LIFECYCLE_AUDIT_DIR"),
    ("RELOAD_LIFECYCLE_ACCEPTANCE_MINTOKEN", "RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS"),
    ("RELOAD_LIFECYCLE_PARTIAL_POLICY", "RELOAD_LIFECYCLE_PARTIAL")])
def test_a_setting_with_a_word_left_out_or_added_is_refused_naming_it(name: str, intended: str) -> None:
    message = str(refusal({name: "1"}))
    assert message.startswith(f"{name}='1' is not a reload-lifecycle setting: did you mean {intended}?"), message


@pytest.mark.parametrize("name", ["RELOAD_LIFECYCLE_FOO", "RELAOD_LIFECYLE_FOO", "RELOAD_LIFECYCLE"])
def test_a_name_in_the_prefix_that_is_no_setting_is_refused_listing_the_settings(name: str) -> None:
    message = str(refusal({name: "x"}))
    assert f"is not a reload-lifecycle setting: the settings are {', '.join(KNOWN)}" in message, message


def test_the_error_counts_the_other_unknown_names_and_a_registered_one_passes(tmp_path: Path) -> None:
    env.check_names(PREFIX, KNOWN, {ROOT_ENV: str(tmp_path), "PATH": "/bin", "VLLM_PLUGINS": ""})
    error = refusal({ROOT_ENV: "/", "RELAOD_LIFECYCLE_PARTIAL": "keep", "RELOAD_LIFECYLE_AUDIT_DIR": "/a"})
    assert error.variable == "RELAOD_LIFECYCLE_PARTIAL" and "; and 1 more unknown RELOAD_LIFECYCLE_* name" in str(error)


# ---- both sides of the threshold ---------------------------------------------------------------------------------
LOOK_ALIKES = {"A": "\u0410\u0391", "B": "\u0412\u0392", "C": "\u0421", "E": "\u0415\u0395", "H": "\u041d\u0397",
               "I": "\u0406\u0399", "K": "\u041a\u039a", "M": "\u041c\u039c", "N": "\u039d", "O": "\u041e\u039f",
               "P": "\u0420\u03a1", "S": "\u0405", "T": "\u0422\u03a4", "X": "\u0425\u03a7", "Y": "\u0423\u03a5"}
EDIT_LETTERS = st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


@st.composite
def near_misses(draw: st.DrawFn) -> tuple[str, str]:
    """(a registered name, that name after up to NEAR_MISS edits, any number of letters in another case, as a
    look-alike or fullwidth, or `_` as `-`)."""
    name = draw(st.sampled_from(KNOWN))
    chars = list(name)
    for _ in range(draw(st.integers(1, NEAR_MISS))):
        i = draw(st.integers(0, len(chars) - 1))
        kind = draw(st.sampled_from(["insert", "delete", "replace", "swap"]))
        if kind == "insert":
            chars.insert(i, draw(EDIT_LETTERS))
        elif kind == "delete" and len(chars) > 1:
            del chars[i]
        elif kind == "replace":
            chars[i] = draw(EDIT_LETTERS)
        elif i + 1 < len(chars):
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
    for i in draw(st.lists(st.integers(0, len(chars) - 1), max_size=4)):
        c = chars[i]
        options = [c.lower(), "-" if c == "_" else c, chr(ord(c) + 0xFEE0) if c.isalnum() else c,
                   *LOOK_ALIKES.get(c, "")]
        chars[i] = draw(st.sampled_from(options))
    return name, "".join(chars)


@given(near_misses())
def test_every_name_within_the_threshold_of_a_setting_is_refused_naming_it(case: tuple[str, str]) -> None:
    intended, name = case
    assume(name != intended and _reference(fold(name), fold(intended)) <= NEAR_MISS)  # 2 edits can make 3 in OSA
    error = refusal({name: "v"})
    assert error.variable == name
    assert f"is not a reload-lifecycle setting: did you mean {intended}?" in str(error)


#: Names of real environments: the shell's, Python's, CI's, the accelerator stacks', the ML libraries'
REAL_NAMES = (
    "PATH", "HOME", "USER", "SHELL", "PWD", "OLDPWD", "LANG", "LC_ALL", "TERM", "TMPDIR", "HOSTNAME", "LOGNAME",
    "DISPLAY", "EDITOR", "PAGER", "TZ", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "PIP_INDEX_URL", "LD_LIBRARY_PATH", "LD_PRELOAD", "CI",
    "GITHUB_ACTIONS", "GITHUB_WORKSPACE", "GITHUB_REF", "RUNNER_TEMP", "BUILDKITE", "SLURM_JOB_ID", "SLURM_PROCID",
    "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING",
    "NVIDIA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
    "NCCL_CUMEM_ENABLE", "TORCH_CUDA_ARCH_LIST", "TORCHINDUCTOR_CACHE_DIR", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_DISTRIBUTED_DEBUG", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_AFFINITY",
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN",
    "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TOKENIZERS_PARALLELISM", "WANDB_API_KEY", "WANDB_PROJECT",
    "RAY_ADDRESS", "RAY_DEDUP_LOGS", "VLLM_PLUGINS", "VLLM_LOGGING_LEVEL", "VLLM_USE_V1", "VLLM_CACHE_ROOT",
    "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "VLLM_SERVER_DEV_MODE", "VLLM_ALLREDUCE_USE_SYMM_MEM", "RELOAD",
    "RELOAD_CONFIG", "AUTO_RELOAD", "LIFECYCLE_HOOKS", "UVICORN_RELOAD", "FLASK_ENV", "DJANGO_SETTINGS_MODULE",
    "LIFECYCLE_STAGE",
)


def test_the_names_of_real_environments_pass_and_lie_far_beyond_the_threshold() -> None:
    env.check_names(PREFIX, KNOWN, dict.fromkeys(REAL_NAMES, "1"))
    assert min(_closeness(n) for n in REAL_NAMES) > 2 * NEAR_MISS


def test_no_name_vllm_reads_is_taken_for_a_setting() -> None:
    """Every variable vLLM's `envs.py` names (read from its file, without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    names = set(re.findall(r"\"([A-Z][A-Z0-9_]{2,})\"", (Path(spec.origin).parent / "envs.py").read_text()))
    assert len(names) > 100, len(names)
    env.check_names(PREFIX, KNOWN, dict.fromkeys(names, "1"))
    closest = min(names, key=_closeness)
    assert _closeness(closest) > 2 * NEAR_MISS, closest  # today 9 (VLLM_ALLREDUCE_USE_FLASHINFER)


#: The words of real environments' names and of the settings' own (without the prefix)
WORDS = sorted({w for n in (*REAL_NAMES, *(k.removeprefix(PREFIX) for k in KNOWN)) for w in n.split("_")})


@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=5))
def test_a_name_made_of_other_words_passes(words: list[str]) -> None:
    """A name made of those words passes (`AUDIT_DIR`, `SESSION_TAKEOVER_IDLE_S` of another tool too) unless it
    holds RELOAD then LIFECYCLE: within two edits of the prefix it is ours (`RELOAD_CI_LIFECYCLE_X` is refused)."""
    assume(not ("RELOAD" in words and "LIFECYCLE" in words[words.index("RELOAD"):]))
    env.check_names(PREFIX, KNOWN, {"_".join(words): "1"})


def _closeness(name: str) -> int:
    """Edits from `name` (folded) to the nearest setting, or to the prefix for its beginning."""
    folded = fold(name)
    return min(edit_distance(fold(PREFIX), folded, 40, prefix=True),
               *(edit_distance(folded, fold(k), 60) for k in KNOWN))


# ---- the pieces ----------------------------------------------------------------------------------------------------
def test_fold_reads_case_separators_fullwidth_accents_and_look_alikes_as_latin_letters() -> None:
    assert fold("reload-lifecycle_Path root") == "RELOADLIFECYCLEPATHROOT"
    assert fold("\uff32\uff25\uff2c") == "REL"  # fullwidth (NFKD)
    assert fold("\u00c9\u00e9") == "EE"  # an accent set apart (NFKD), then dropped
    assert fold("\u0420\u0415\u041b\u041e\u0410\u0414") == "PEOA"  # Cyrillic Р Е О А; Л, Д look like no Latin letter
    assert fold("\u03a1\u0395\u039b\u039f\u0391\u0394") == "PEOA"  # Greek Ρ Ε Ο Α; Λ and Δ dropped
    assert fold("\u043e\u0440\u0441") == "OPC"  # lower-case Cyrillic, upper-cased first


def _reference(a: str, b: str) -> int:
    """The optimal-string-alignment distance, the full table."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


@given(st.text("ABCD", max_size=9), st.text("ABCD", max_size=9), st.integers(0, 4))
def test_the_banded_distance_agrees_with_the_full_table(a: str, b: str, limit: int) -> None:
    assert edit_distance(a, b, limit) == min(_reference(a, b), limit + 1)
    nearest_start = min(_reference(a, b[:n]) for n in range(len(b) + 1))
    assert edit_distance(a, b, limit, prefix=True) == min(nearest_start, limit + 1)


def test_the_settings_are_far_enough_apart_that_a_near_miss_names_one() -> None:
    """Two settings at least 2 * NEAR_MISS + 1 edits apart: a name within NEAR_MISS of one is nearer to it than to
    any other, so the error names the intended one (a new setting too close to another fails here)."""
    folded = [fold(k) for k in KNOWN]
    gaps = {(a, b): _reference(a, b) for i, a in enumerate(folded) for b in folded[i + 1:]}
    assert min(gaps.values()) > 2 * NEAR_MISS, min(gaps, key=gaps.__getitem__)
