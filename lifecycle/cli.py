"""`reload-lifecycle` console script.

    reload-lifecycle models
    reload-lifecycle demo [--engine torch|vllm] [--model NAME] [--layers N] [--out DIR] [--seed S]
                          [--bucket-size K] [--device cpu|cuda] [-v]
    reload-lifecycle diagram [--format mermaid|dot|markdown] [--state STATE] [-o FILE]
    reload-lifecycle audit LOG [LOG ...] [--json] [--max-details N] [--max-streams N] [--expect-ranks N]
    reload-lifecycle report LOG [LOG ...] -o report.html [--title T] [--max-epochs N] [--max-streams N]
                            [--expect-ranks N]

Every numeric option is checked against its range and a bad value is a usage error (exit status 2), as is an
output path that cannot be written. `audit` and `report` exit with the status their result line prints: 0 clean,
1 violations, 2 unreadable or incomplete input (`report` writes its file either way).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .audit.diagram import FORMATS
from .audit.replay import MAX_STREAMS
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


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from .vllm.demo.engine_demo import run_vllm_demo

        return 0 if run_vllm_demo(args.out, bucket_size=args.bucket_size or 5, seed=args.seed) else 1
    from models.demo import run_demo

    result = run_demo(model_name=args.model, layers=args.layers, out_dir=args.out, seed=args.seed,
                      bucket_size=args.bucket_size, device=args.device, verbose=args.verbose)
    return 0 if result.ok else 1


def _cmd_models(args: argparse.Namespace) -> int:
    from models import FAMILIES

    width = max(map(len, FAMILIES))
    for fam in FAMILIES.values():
        print(f"{fam.name:<{width}} {fam.summary}\n{'':<{width}} derives: {fam.derives}")
    return 0


def _cmd_diagram(args: argparse.Namespace) -> int:
    from .audit.diagram import render

    text = render(args.format, args.state) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from .audit.replay import audit_logs
    from .audit.views import render_json, render_text

    result = audit_logs(args.logs, max_details=args.max_details, max_streams=args.max_streams,
                        expect_ranks=args.expect_ranks)
    sys.stdout.write((render_json(result) if args.json else render_text(result, show=args.max_details)) + "\n")
    return result.status


def _cmd_report(args: argparse.Namespace) -> int:
    from .audit.report import write_report
    from .audit.views import result_line

    if args.output.is_dir():
        return _usage_error("report", f"-o {args.output}: is a directory; give the HTML file to write")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reload-lifecycle",
        description="Safe, in-place, audited weight reload for speculative-decoding draft models.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

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
    demo.add_argument("--model", default="dflash", help="draft family (see `reload-lifecycle models`; default dflash)")
    demo.add_argument("--layers", type=int_in(1, 256), default=4, help="decoder layers of the draft (default 4)")
    demo.add_argument("--out", type=Path, default=None, help="output folder (default: a new temporary folder)")
    demo.add_argument("--seed", type=int_in(0), default=0, help="seed for weights and bucket order (default 0)")
    demo.add_argument("--bucket-size", type=int_in(1), default=3, help="tensors per reload bucket (default 3)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("-v", "--verbose", action="store_true", help="also print every audit event to stderr")
    demo.set_defaults(func=_cmd_demo)

    models = sub.add_parser("models", help="list the draft families and what each derives")
    models.set_defaults(func=_cmd_models)

    diagram = sub.add_parser("diagram", help="print the state diagram (mermaid or DOT) drawn from the transition table")
    diagram.add_argument("--format", choices=FORMATS, default="mermaid",
                         help="mermaid (default) or dot (Graphviz DOT text; no graphviz binary needed to write it)")
    diagram.add_argument("--state", choices=[s.value for s in LifecycleState], default=None,
                         help="highlight this state as the current one")
    diagram.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
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
        description=(
            "Streams the logs (merged by timestamp), replays each (node, rank, backbone) through the transition "
            "table in lifecycle/states.py and reports every violation: illegal_transition, state_mismatch, "
            "event_out_of_state, not_ready, storage_drift, ends_mid_reload, epoch_disagreement, epoch_jump, "
            "out_of_order, missing_events; and warnings (abandoned_epoch) that do not change the exit status (see "
            "README). A corrupt line is reported with file:line and the rest is audited. Input without events, and "
            "expected ranks without events (--expect-ranks), are input problems. Exit status: 0 clean, "
            "1 violations, 2 unreadable or incomplete input."
        ),
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
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
