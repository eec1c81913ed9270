"""Rotated audit logs, read as sets: the files one writer wrote in turn.

The JSON-lines sink rotates its file by size (`configure_audit(max_bytes=)`; inside vLLM
`RELOAD_LIFECYCLE_AUDIT_MAX_BYTES`): when a write would take `B` past the limit, `B` is renamed to `B.<n>`, the next
number (1, 2, 3, ...: the lowest is the oldest), and a new `B` is opened. The auditor takes `B.1`, `B.2`, ..., `B.n`
and `B`, however it was given them (a folder, files in any order), as one writer's input in that order: events at
one timestamp keep the set's order, and a stream that goes on in the next file is one writer (`LogEvent.writer`),
not two. A number missing from 1..n is an input problem naming the file: the lines it held were not seen (removed,
or not given), so the audit is not called clean; the stream's `seq` gap says what was lost.

>>> files, origins, missing = rotated_sets(["a.jsonl", "a.jsonl.3", "a.jsonl.1", "b.jsonl"])
>>> files, [p.source for p in missing]
(['a.jsonl.1', 'a.jsonl.3', 'a.jsonl', 'b.jsonl'], ['a.jsonl.2'])
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .logstream import STDIN, InputProblem

__all__ = ["MISSING_SHOWN", "rotated_sets"]

#: a rotated file: the base name of a log, a dot, its number (1 to 999,999,999)
_ROTATED = re.compile(r"(?P<base>.+\.(?:jsonl|ndjson|log))\.(?P<n>[1-9][0-9]{0,8})")
#: missing files named one by one, at most (the rest counted in one problem)
MISSING_SHOWN = 16


def rotated_sets(files: Sequence[str]) -> tuple[list[str], dict[str, str], list[InputProblem]]:
    """(`files` with each rotated set's files together, oldest first and the current file last, in the order
    the sets were first met; file -> the set's base name for the files of a set; an input problem per missing
    file)."""
    sets: dict[str, dict[int, str]] = {}
    for name in files:
        m = _ROTATED.fullmatch(name) if name != STDIN else None
        base, n = (m.group("base"), int(m.group("n"))) if m else (name, 0)
        sets.setdefault(base, {})[n] = name
    ordered: list[str] = []
    origins: dict[str, str] = {}
    problems: list[InputProblem] = []
    for base, parts in sets.items():
        numbers = sorted(n for n in parts if n)
        ordered.extend(parts[n] for n in numbers)
        if 0 in parts:
            ordered.append(parts[0])
        if not numbers:
            continue
        origins.update({name: base for name in parts.values()})
        lost = [n for n in range(1, numbers[-1]) if n not in parts]
        for n in lost[:MISSING_SHOWN]:
            problems.append(InputProblem(f"{base}.{n}", None, (
                f"missing from the rotated set of {base} ({base}.1 to {base}.{numbers[-1]}, then {base}): the "
                "lines it held were not read (removed, or not given); give every file of the set")))
        if len(lost) > MISSING_SHOWN:
            problems.append(InputProblem(base, None, f"{len(lost) - MISSING_SHOWN} more files of the rotated set "
                                                     "are missing"))
    return ordered, origins, problems
