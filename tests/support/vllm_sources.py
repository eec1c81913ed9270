"""vLLM's sources as a later release might have them: the installed files with one edit, or with a file added
(`lifecycle.vllm.compat.sources.Reader`s for the capability and drift checks; nothing is written to disk)."""

from __future__ import annotations

from lifecycle.vllm.compat.sources import Reader

__all__ = ["added", "edited"]


def edited(read: Reader, module_file: str, old: str, new: str) -> Reader:
    """The sources with one edit in one file (as a later vLLM might have changed them)."""

    def reader(rel: str) -> str | None:
        text = read(rel)
        if text is not None and rel.endswith(module_file):
            assert old in text, f"{old!r} not in {rel}: the test's premise changed"
            text = text.replace(old, new)
        return text

    return reader


def added(read: Reader, rel_path: str, text: str) -> Reader:
    """The sources with one more file (a draft a later vLLM might ship)."""

    def reader(rel: str) -> str | None:
        return text if rel == rel_path else read(rel)

    return reader
