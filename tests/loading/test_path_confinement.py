"""`RELOAD_LIFECYCLE_PATH_ROOT` confines every file a draft-reload path reaches, not only the folder it names
(lifecycle/confined.py, lifecycle/checkpoint.py, lifecycle/vllm/payload.py; issue 25, items 1-3). No engine.

Before: only the path argument was resolved and checked. A folder inside the root holding a link to a file outside
passed, and the outside file's tensors were read; a link to a text file leaked its first 8 bytes and its size
through the header-length message; and the checked path was opened again by name, so a link swapped in after the
check was followed outside the root.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from lifecycle.checkpoint import write_checkpoint
from lifecycle.errors import CheckpointError
from lifecycle.vllm import settings
from lifecycle.vllm.reload.payload import feed, plan_payload

SECRET = "secret.weight"


@pytest.fixture(params=["openat2", "walk"])
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of opening beneath the root: the kernel's openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) and the
    component-by-component walk without following links (kernels without openat2)."""
    try:
        from lifecycle import confined
    except ImportError:  # the code before the fix has neither
        return str(request.param)
    if request.param == "walk":
        monkeypatch.setattr(confined, "OPENAT2", False)
    elif not confined.OPENAT2:
        pytest.fail("this kernel is expected to have openat2 (Linux >= 5.6)")
    return str(request.param)


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """ROOT (the allowed root) with ROOT/ckpt/a.safetensors, and OUTSIDE with a checkpoint and a text file."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_checkpoint({"layers.0.w": torch.ones(4)}, root / "ckpt" / "a.safetensors")
    write_checkpoint({SECRET: torch.full((4,), 7.0)}, outside / "secret.safetensors")
    (outside / "notes.txt").write_text("BEGIN RSA PRIVATE KEY..\n")  # 25 bytes; its first 8 are a huge length
    monkeypatch.setenv(settings.PATH_ROOT_ENV, str(root))
    return root, outside


def _names_fed(path: Path) -> set[str]:
    names: set[str] = set()

    class Model:
        def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
            names.update(n for n, _ in bucket)

    feed(Model(), plan_payload(path))
    return names


def test_a_link_in_a_folder_inside_the_root_to_a_file_outside_is_refused(layout: tuple[Path, Path], opener: str
                                                                          ) -> None:
    root, outside = layout
    (root / "ckpt" / "zz.safetensors").symlink_to(outside / "secret.safetensors")
    with pytest.raises(PermissionError, match=r"zz\.safetensors.*outside the allowed root") as ei:
        plan_payload(root / "ckpt")
    assert isinstance(ei.value, CheckpointError)  # the loaders audit it as a refusal
    assert "secret" not in str(ei.value)  # not even the name of what it points at


def test_a_link_inside_the_root_that_stays_inside_is_read(layout: tuple[Path, Path], opener: str) -> None:
    """A published checkpoint is often a link (`latest -> step-100`, the Hugging Face cache's blobs): links are
    followed when the path is resolved, and each file is then opened by its resolved path, beneath the root."""
    root, _ = layout
    (root / "latest").symlink_to(root / "ckpt")
    (root / "blobs").mkdir()
    write_checkpoint({"layers.1.w": torch.ones(4)}, root / "blobs" / "b1")
    (root / "ckpt" / "b.safetensors").symlink_to(Path("..") / "blobs" / "b1")
    assert _names_fed(root / "latest") == {"layers.0.w", "layers.1.w"}


def test_nothing_of_a_refused_file_reaches_the_message(layout: tuple[Path, Path], opener: str) -> None:
    """The text file's first 8 bytes read as a little-endian length and its size were quoted before."""
    root, outside = layout
    (root / "ckpt" / "zz.safetensors").symlink_to(outside / "notes.txt")
    with pytest.raises(PermissionError) as ei:
        plan_payload(root / "ckpt")
    message = str(ei.value)
    first8 = int.from_bytes((outside / "notes.txt").read_bytes()[:8], "little")
    assert str(first8) not in message and "25 bytes" not in message and "notes" not in message, message
    assert "header" not in message


@pytest.mark.parametrize("how", ["file_link", "folder_link", "open_file"])
def test_a_refused_path_never_names_a_links_target_or_an_open_file(layout: tuple[Path, Path], how: str) -> None:
    """Issue 32, item 13: a path given as a link out of the root, or as `/proc/self/fd/N` (one of the engine's open
    files), was refused with a message naming where it points ("resolves to /.../outside/secret.safetensors")."""
    root, outside = layout
    fd = os.open(outside / "notes.txt", os.O_RDONLY)
    try:
        if how == "file_link":
            (root / "ln.safetensors").symlink_to(outside / "secret.safetensors")
            given = str(root / "ln.safetensors")
        elif how == "folder_link":
            (root / "dir").symlink_to(outside)
            given = str(root / "dir")
        else:
            given = f"/proc/self/fd/{fd}"
        with pytest.raises(PermissionError) as ei:
            plan_payload(given)
    finally:
        os.close(fd)
    message = str(ei.value)
    assert given in message and "outside the allowed root" in message, message
    assert str(outside) not in message and "secret" not in message and "notes" not in message, message


def test_a_folder_swapped_for_a_link_between_the_check_and_the_open_is_not_followed(
        layout: tuple[Path, Path], opener: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic check-then-open: the folder is real when its path is resolved and a link to OUTSIDE right
    after. Before, the checked path was opened again by name and the outside folder's tensors were read."""
    root, outside = layout
    target = str(root / "ckpt")
    real = os.path.realpath
    swapped: list[bool] = []

    def realpath_then_swap(path: object, *args: object, **kwargs: object) -> str:
        out = real(path, *args, **kwargs)  # type: ignore[arg-type]
        if os.fspath(path) == target and not swapped:  # type: ignore[arg-type]
            swapped.append(True)
            os.rename(target, str(root / "ckpt-old"))
            os.symlink(outside, target)
        return out

    monkeypatch.setattr(os.path, "realpath", realpath_then_swap)
    with pytest.raises(PermissionError, match=r"ckpt.*symbolic link|outside the allowed root"):
        plan_payload(root / "ckpt")
    assert swapped


def test_a_folder_swapped_for_a_link_right_before_the_file_is_opened_is_not_followed(
        layout: tuple[Path, Path], opener: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same swap after every path was resolved and listed, just before the first file is opened: the open
    itself must follow no link (before, `os.open` of the checked name followed it to OUTSIDE/a.safetensors)."""
    root, outside = layout
    write_checkpoint({SECRET: torch.full((4,), 7.0)}, outside / "a.safetensors")
    real_open = os.open
    swapped: list[bool] = []

    def swap_then_open(path: object, *args: object, **kwargs: object) -> int:
        if not swapped and os.fspath(path).startswith(str(root)):  # type: ignore[arg-type]
            swapped.append(True)
            os.rename(root / "ckpt", root / "ckpt-old")
            os.symlink(outside, root / "ckpt")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", swap_then_open)
    try:
        names = _names_fed(root / "ckpt")
    except PermissionError as e:
        assert isinstance(e, CheckpointError) and "symbolic link" in str(e)
    else:
        pytest.fail(f"read through the swapped link: {sorted(names)}")
    assert swapped


def test_a_link_flipping_under_the_reader_never_reaches_outside(layout: tuple[Path, Path], opener: str) -> None:
    """ROOT/ckpt flips, atomically, between a link to a folder inside and one to OUTSIDE while paths are planned
    and read: each attempt is refused or reads the inside folder, never the outside one (before, a flipping
    thread won about 20 times in 1.7 s)."""
    root, outside = layout
    os.rename(root / "ckpt", root / "real")
    link = root / "ckpt"
    link.symlink_to(root / "real")
    stop = threading.Event()

    def flip() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            tmp = root / f".flip-{n}"
            os.symlink(outside if n % 2 else root / "real", tmp)
            os.replace(tmp, link)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    outcomes = {"inside": 0, "refused": 0, "outside": 0}
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            try:
                names = _names_fed(link)
            except (PermissionError, CheckpointError):
                outcomes["refused"] += 1
                continue
            outcomes["outside" if SECRET in names else "inside"] += 1
    finally:
        stop.set()
        flipper.join()
    assert outcomes["outside"] == 0, outcomes
    assert outcomes["inside"] + outcomes["refused"] > 20, outcomes
