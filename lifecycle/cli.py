"""`reload-lifecycle` console script.

    reload-lifecycle --version
    reload-lifecycle models
    reload-lifecycle demo [--engine torch|vllm] [--model NAME] [--layers N] [--out DIR] [--seed S]
                          [--bucket-size K] [--device cpu|cuda|cuda:N] [-v]
    reload-lifecycle diagram [--format mermaid|dot|markdown] [--state STATE] [-o FILE]
    reload-lifecycle audit LOG [LOG ...] [--json] [--max-details N] [--max-streams N] [--expect-ranks N]
    reload-lifecycle report LOG [LOG ...] -o report.html [--title T] [--max-epochs N] [--max-streams N]
                            [--expect-ranks N]

Wrong usage never shows a traceback: a bad option or value, an unknown draft family, a device or engine this machine
lacks, an output path that cannot be written, and input with nothing to audit are one line on stderr naming what was
wrong and what to do, exit status 2. `audit` and `report` exit with the status their result line prints: 0 clean,
1 violations, 2 unreadable or incomplete input (`report` writes its file either way). The draft families come from
`lifecycle.bundled`, never from a bare `import models` (a `models/` folder in the working directory is left alone).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .audit.coverage import NO_EVENTS
from .audit.diagram import FORMATS
from .audit.replay import MAX_STREAMS, AuditResult
from .audit.rules import VIOLATION_KINDS, WARNING_KINDS
from .audit.text import clip, printable
from .audit.traces import MAX_EPOCHS
from .states import LifecycleState

__all__ = ["MAX_EPOCHS_LIMIT", "MAX_RANKS", "TITLE_CAP", "build_parser", "expected_ranks", "main"]

#: `report --max-epochs` at most: the report's size grows with it.
MAX_EPOCHS_LIMIT = MAX_EPOCHS
#: Characters of a report title at most.
TITLE_CAP = 200
#: `--expect-ranks` names at most this many ranks (and none above it).
MAX_RANKS = 65536


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (no upper bound when None), else a usage error naming
    the range."""
    span = f"from {low} to {high}" if high is not None else f">= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text[:40]!r}")
        return value

    return parse


def expected_ranks(text: str) -> frozenset[int]:
    """`--expect-ranks`: `N` (ranks 0 to N-1), or ranks and runs separated by commas (`4-7`, `2,3`, `5,`).

    >>> sorted(expected_ranks("3")), sorted(expected_ranks("4-6,9")), sorted(expected_ranks("5,"))
    ([0, 1, 2], [4, 5, 6, 9], [5])
    """
    usage = (f"must be N (ranks 0 to N-1, N from 1 to {MAX_RANKS}) or ranks and runs separated by commas "
             f"(4-7,9; each below {MAX_RANKS}), got {text[:40]!r}")
    try:
        if text.strip().isdigit():
            count = int(text)
            if not 1 <= count <= MAX_RANKS:
                raise ValueError
            return frozenset(range(count))
        ranks: set[int] = set()
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, _, high = part.partition("-")
            first, last = int(low), int(high or low)
            if not 0 <= first <= last < MAX_RANKS:
                raise ValueError
            ranks.update(range(first, last + 1))
        if not ranks:
            raise ValueError
        return frozenset(ranks)
    except ValueError:
        raise argparse.ArgumentTypeError(usage) from None


def _title(text: str) -> str:
    if len(text) > TITLE_CAP:
        raise argparse.ArgumentTypeError(f"at most {TITLE_CAP} characters, got {len(text)}")
    return text


def _output_problem(flag: str, path: Path, what: str) -> str | None:
    """Why `path` cannot be written as `what`, None where it can be tried."""
    if path.is_dir():
        return f"{flag} {path}: is a directory; give the {what} to write"
    if not path.parent.exists():
        return f"{flag} {path}: the folder {path.parent} does not exist; create it, or write the {what} elsewhere"
    return None


def _device(text: str) -> str:
    """`demo --device`: cpu, cuda or cuda:N (whether this machine has it is checked when the demo starts)."""
    if re.fullmatch(r"cpu|cuda(:[0-9]{1,3})?", text) is None:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a device the demo runs on: use cpu, cuda or cuda:N")
    return text


def _cmd_families(args: argparse.Namespace) -> int:
    """`demo` and `models` (`lifecycle.cli_demo`, imported here: the other commands start without torch)."""
    from .cli_demo import UsageError, demo_command, models_command

    try:
        return demo_command(args) if args.command == "demo" else models_command(args)
    except UsageError as e:
        return _usage_error(args.command, str(e))


def _cmd_diagram(args: argparse.Namespace) -> int:
    from .audit.diagram import render

    if args.state and args.format == "markdown":
        return _usage_error("diagram", "--state marks a state on a drawn diagram and the markdown table has none: "
                                       "leave --state out, or use --format mermaid or dot")
    text = render(args.format, args.state) + "\n"
    if args.output is None:
        sys.stdout.write(text)
        return 0
    problem = _output_problem("-o", args.output, "diagram file")
    try:
        if problem is None:
            args.output.write_text(text, encoding="utf-8")
    except OSError as e:
        problem = f"-o {args.output}: cannot write the diagram: {e.strerror or e}"
    if problem:
        return _usage_error("diagram", problem)
    print(f"wrote {args.output}")
    return 0


def _nothing_audited(result: AuditResult) -> str:
    """The one line of an audit that saw no event: the input's first problem, and what to give instead."""
    problems = result.input_problems
    first = next((p for p in problems if p.message != NO_EVENTS), problems[0] if problems else None)
    said = printable(f"{clip(first.where, 200)}: {clip(first.message, 400)}") if first else NO_EVENTS
    more = result.input_problem_count - 1 - (first is not None and first.message != NO_EVENTS)
    return (f"nothing to audit: {said}" + (f" (and {more} more problem(s); --json lists them)" if more > 0 else "")
            + "; give the JSON-lines logs that configure_audit(json_path=...) or RELOAD_LIFECYCLE_AUDIT_DIR wrote")


def _cmd_audit(args: argparse.Namespace) -> int:
    from .audit.replay import audit_logs
    from .audit.views import render_json, render_text

    result = audit_logs(args.logs, max_details=args.max_details, max_streams=args.max_streams,
                        expect_ranks=args.expect_ranks)
    if args.json:
        sys.stdout.write(render_json(result) + "\n")  # machines get the result whatever it is
    if result.events == 0:
        return _usage_error("audit", _nothing_audited(result))
    if not args.json:
        sys.stdout.write(render_text(result, show=args.max_details) + "\n")
    return result.status


def _cmd_report(args: argparse.Namespace) -> int:
    from .audit.report import write_report
    from .audit.views import result_line

    problem = _output_problem("-o", args.output, "HTML file")
    if problem:
        return _usage_error("report", problem)
    try:
        result = write_report(args.logs, args.output, title=args.title, max_epochs=args.max_epochs,
                              max_streams=args.max_streams, expect_ranks=args.expect_ranks)
    except OSError as e:
        return _usage_error("report", f"-o {args.output}: cannot write the report: {e.strerror or e}")
    print(f"wrote {args.output}")
    print(result_line(result))
    return result.status  # as printed: a CI step gating on `report` must not pass on garbage


def _usage_error(command: str, message: str) -> int:
    print(f"reload-lifecycle {command}: error: {message}", file=sys.stderr)
    return 2


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (what was wrong, and where the options are told) instead of the
    usage block; exit status 2 as argparse's. `commands`: the parser of each command, by name."""

    commands: Mapping[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


class _Version(argparse.Action):
    """`--version`: the version; on stderr, a line per thing that makes the installed copy not this version's own
    (another `models` shadowing the bundled one, another distribution installing `lifecycle` or `models`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from . import __version__  # here: the offline commands run with a bare `lifecycle` namespace too
        from .bundled import name_clashes
        from .cli_demo import note_shadowed_models

        print(f"reload-lifecycle {__version__}")
        note_shadowed_models()
        for name, others in name_clashes().items():
            print(f"reload-lifecycle: warning: the package `{name}` is also installed by {', '.join(others)}: one "
                  "overwrote the other's files; give reload-lifecycle an environment of its own", file=sys.stderr)
        parser.exit(0)


def _audit_epilog() -> str:
    """Every violation and warning the auditor names, with its meaning, from `lifecycle.audit.rules`."""
    def kinds(title: str, table: dict[str, str]) -> list[str]:
        return [title, *(textwrap.fill(f"{k}: {v}", 100, initial_indent="  ", subsequent_indent="      ")
                         for k, v in table.items())]

    return "\n".join([*kinds("violations (exit status 1):", VIOLATION_KINDS), "",
                      *kinds("warnings (listed and counted; the exit status stays):", WARNING_KINDS)])


def build_parser() -> _Parser:
    parser = _Parser(
        prog="reload-lifecycle",
        description="Safe, in-place, audited weight reload for speculative-decoding draft models.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices

    demo = sub.add_parser(
        "demo",
        help="cold-load and reload a tiny DFlash draft through the lifecycle, and prove it worked",
        description=(
            "Writes checkpoints A and B of a tiny DFlash draft, cold-loads A layer by layer, refreshes the derived "
            "buffers, captures (a real CUDA graph when CUDA is present, storage pinning otherwise), reloads B in "
            "shuffled buckets while showing the guard refuse an early refresh, finalizes, refreshes in place, then "
            "checks that every pinned address is unchanged, every derived buffer is bit-equal to a cold build "
            "from B and the fused path equals the per-layer path. Prints a table, the state sequence and "
            "PASS/FAIL per check; writes audit.jsonl and lifecycle.mmd to --out. Exit status 1 if a check fails."
        ),
    )
    demo.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                      help="torch: the pure-PyTorch backbones (default); vllm: a real in-process vLLM engine "
                           "(needs the vllm extra) with a DFlash draft reloaded in buckets")
    demo.add_argument("--model", default=None, help="draft family (see `reload-lifecycle models`; default dflash)")
    demo.add_argument("--layers", type=int_in(1, 256), default=None, help="decoder layers of the draft (default 4)")
    demo.add_argument("--out", type=Path, default=None, help="output folder (default: a new temporary folder)")
    demo.add_argument("--seed", type=int_in(0), default=0, help="seed for weights and bucket order (default 0)")
    demo.add_argument("--bucket-size", type=int_in(1), default=None,
                      help="tensors per reload bucket (default 3; 5 with --engine vllm)")
    demo.add_argument("--device", type=_device, default=None,
                      help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    demo.add_argument("-v", "--verbose", action="store_true", help="also print every audit event to stderr")
    demo.set_defaults(func=_cmd_families)

    models = sub.add_parser("models", help="list the draft families and what each derives")
    models.set_defaults(func=_cmd_families)

    diagram = sub.add_parser("diagram", help=f"print the state diagram ({', '.join(FORMATS)}) drawn from the "
                                             "transition table")
    diagram.add_argument("--format", choices=FORMATS, default="mermaid",
                         help="; ".join(f"{name}: {what}" for name, what in FORMATS.items()))
    diagram.add_argument("--state", choices=[s.value for s in LifecycleState], default=None,
                         help="highlight this state as the current one (mermaid and dot)")
    diagram.add_argument("-o", "--output", type=Path, default=None, help="write to this file instead of stdout")
    diagram.set_defaults(func=_cmd_diagram)

    logs_help = "JSON-lines audit logs: files, directories (their *.jsonl, *.jsonl.N, *.ndjson, *.log), - for stdin"
    streams_help = (f"(node, rank, backbone) streams replayed, at most (default {MAX_STREAMS}); events of further "
                    "streams are counted as not audited (exit status 2)")
    ranks_help = ("the ranks whose logs the input must hold: N (ranks 0 to N-1, e.g. the world size) or a list "
                  "such as 4-7 (pipeline parallel: the last stage's ranks hold the draft); a rank without events, "
                  "or a backbone some of them lack, is an input problem naming it (exit status 2)")
    audit = sub.add_parser(
        "audit",
        help="replay audit logs (any number of ranks) through the transition table and report every violation",
        description=textwrap.fill(
            "Streams the logs (merged by timestamp), replays each (node, rank, backbone) through the transition "
            f"table in lifecycle/states.py and reports every violation: {', '.join(VIOLATION_KINDS)}; and warnings "
            f"({', '.join(WARNING_KINDS)}) that do not change the exit status (each is told below, and in "
            "docs/audit.md). A corrupt line is reported with file:line and the rest is audited; a binary file is "
            "not read past its start. Expected ranks without events (--expect-ranks) are input problems; input "
            "without a single event is an error (one line on stderr). Exit status: 0 clean, 1 violations, "
            "2 unreadable or incomplete input.", 100),
        epilog=_audit_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument("logs", nargs="+", metavar="LOG", help=logs_help)
    audit.add_argument("--json", action="store_true", help="print the result as JSON (for machines)")
    audit.add_argument("--max-details", type=int_in(0, 1_000_000), default=200,
                       help="violations and input problems listed one by one, at most (all are counted; default 200)")
    audit.add_argument("--max-streams", type=int_in(1, 1_000_000), default=MAX_STREAMS, help=streams_help)
    audit.add_argument("--expect-ranks", type=expected_ranks, default=None, metavar="N", help=ranks_help)
    audit.set_defaults(func=_cmd_audit)

    report = sub.add_parser(
        "report",
        help="write one self-contained HTML report: state diagram with the path taken, per-layer readiness "
             "timelines, derived-buffer addresses per epoch, violations",
        description=(
            "Audits the logs like `audit` and writes ONE offline HTML file (inline CSS, JS and SVG; nothing fetched "
            "from the network), whatever the verdict; the verdict is printed and shown in the report, and is the "
            "exit status, as for audit: 0 clean, 1 violations, 2 unreadable or incomplete input (or a report that "
            "cannot be written, said on stderr)."
        ),
    )
    report.add_argument("logs", nargs="+", metavar="LOG", help=logs_help)
    report.add_argument("-o", "--output", type=Path, required=True, help="the HTML file to write")
    report.add_argument("--title", type=_title, default="reload-lifecycle report",
                        help=f"page title (at most {TITLE_CAP} characters)")
    report.add_argument("--max-epochs", type=int_in(1, MAX_EPOCHS_LIMIT), default=12,
                        help=f"reload epochs drawn per (node, rank, backbone), the latest ones (1 to "
                             f"{MAX_EPOCHS_LIMIT}; default 12)")
    report.add_argument("--max-streams", type=int_in(1, 1_000_000), default=MAX_STREAMS, help=streams_help)
    report.add_argument("--expect-ranks", type=expected_ranks, default=None, metavar="N", help=ranks_help)
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, which names the command
        parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"reload-lifecycle {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
