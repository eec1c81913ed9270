"""What the audit tools read: the inputs given (files, folders of log files, `-` for stdin), one stream of events.

Each input is read line by line (`logstream`); several are merged by timestamp (`merge`), the files of a rotated
set (`rotation`) oldest first, as one writer's input.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from .logstream import LOG_PATTERNS, MAX_LINE, STDIN, InputProblem, Item, read_input
from .merge import Merge
from .rotation import rotated_sets

__all__ = ["expand_inputs", "iter_events"]


def expand_inputs(paths: Sequence[str | Path]) -> tuple[list[str], list[InputProblem]]:
    """Files as given; a directory as its log files (`LOG_PATTERNS`, recursively, sorted); `-` as stdin."""
    files: list[str] = []
    problems: list[InputProblem] = []
    for p in paths:
        name = str(p)
        if name == STDIN:
            files.append(STDIN)
            continue
        path = Path(name)
        if path.is_dir():
            found = sorted({str(f) for pattern in LOG_PATTERNS for f in path.rglob(pattern) if f.is_file()})
            if not found:
                problems.append(InputProblem(name, None, f"directory holds no log files ({', '.join(LOG_PATTERNS)})"))
            files.extend(found)
        elif path.exists() and not path.is_file():
            problems.append(InputProblem(name, None, "not a regular file"))
        else:
            files.append(name)  # a missing file is reported when it is opened, in order
    return files, problems



def iter_events(paths: Sequence[str | Path], *, max_line: int = MAX_LINE) -> Iterator[Item]:
    """Every event of every input, merged by timestamp across inputs (each input's own order is kept, so an
    input whose timestamps go backwards stays as written, for the auditor to see), with every input problem
    in its place (an unreadable line takes the previous good timestamp of its input). The files of a rotated set
    (`rotation`) come oldest first, and a file missing from one is an input problem."""
    files, problems = expand_inputs(paths)
    files, origins, missing = rotated_sets(files)
    yield from problems
    yield from missing
    if len(files) == 1:
        yield from read_input(files[0], max_line=max_line)
    elif files:
        yield from Merge(files, max_line, origins).items()
