"""`hpcpipe trace summary|export|plot|compare`: read trace files, no MPI, exit 2 on bad input.

Imported by `hpcpipe.cli` to build the parser, so this module imports neither MPI nor
matplotlib (plots load it when drawing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcpipe.cli import register_command
from hpcpipe.config import ConfigError

__all__: list[str] = []


def _configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_action", metavar="ACTION", required=True)
    s = sub.add_parser(
        "summary",
        help="per-rank busy/comm/idle, bubble vs prediction, stragglers, critical path",
        description="Where the time went: per rank, per step, against the simulator.",
    )
    s.add_argument("trace", help="trace file (<run.output>/trace.h5)")
    s.add_argument(
        "--threshold",
        type=float,
        default=0.1,
        help="straggler threshold: fraction above the median (default 0.1)",
    )
    s.add_argument(
        "--step",
        type=int,
        action="append",
        default=None,
        help="only this step (repeatable; default every recorded step)",
    )
    s.add_argument(
        "--json",
        default=None,
        metavar="OUT",
        help="also write the figures as JSON (times in seconds)",
    )
    e = sub.add_parser(
        "export",
        help="Chrome Trace Event Format JSON for Perfetto",
        description="Write the trace for ui.perfetto.dev or chrome://tracing.",
    )
    e.add_argument("trace")
    e.add_argument("--chrome", required=True, metavar="OUT.json", help="output file")
    e.add_argument(
        "--step",
        type=int,
        action="append",
        default=None,
        help="only this step (repeatable; default every recorded step)",
    )
    pl = sub.add_parser(
        "plot",
        help="timeline PNG of one step with utilisation bars",
        description="Pipeline timeline of one step, like the papers' figures.",
    )
    pl.add_argument("trace")
    pl.add_argument("--png", required=True, metavar="OUT.png", help="output file")
    pl.add_argument("--step", type=int, default=None, help="step to draw (default: the last)")
    pl.add_argument("--arrows", action="store_true", help="draw an arrow for each message")
    pl.add_argument("--title", default=None, help="figure title")
    c = sub.add_parser(
        "compare",
        help="two runs side by side: step time, bubble, memory",
        description="Compare two traces (e.g. 1F1B vs ZB-V on the same deck).",
    )
    c.add_argument("a", help="trace A")
    c.add_argument("b", help="trace B")
    c.add_argument("--threshold", type=float, default=0.1, help=argparse.SUPPRESS)
    t = sub.add_parser(
        "table",
        help="one row per run: gather many traces (e.g. a job array) into one table",
        description="Compare any number of traces, e.g. runs/array-123/*/trace.h5.",
    )
    t.add_argument("traces", nargs="+", metavar="TRACE", help="trace files")
    t.add_argument("--json", default=None, metavar="OUT", help="also write the rows as JSON")
    t.add_argument("--threshold", type=float, default=0.1, help=argparse.SUPPRESS)


def _load(path: str):
    from hpcpipe.io.trace import TraceFormatError, read_trace

    try:
        return read_trace(path)
    except TraceFormatError as exc:
        raise ConfigError(exc.path, "", exc.why) from None


def _output(path: str, flag: str) -> Path:
    out = Path(path)
    if out.parent and not out.parent.exists():
        raise ConfigError(flag, "", f"{path}: directory {out.parent} does not exist")
    return out


def _execute(args: argparse.Namespace) -> int:
    from hpcpipe.textsafe import printable

    action = args.trace_action
    try:
        if action == "summary":
            from hpcpipe.analysis.metrics import format_summary, summarize

            trace = _load(args.trace)
            out = _output(args.json, "--json") if args.json else None
            summary = summarize(trace, args.threshold, args.step)
            print(printable(format_summary(summary)))
            if out is not None:
                out.write_text(summary.to_json() + "\n", encoding="utf-8")
        elif action == "export":
            from hpcpipe.analysis.chrome import write_chrome

            trace = _load(args.trace)
            out = _output(args.chrome, "--chrome")
            n = write_chrome(trace, out, args.step)
            print(f"wrote {out}: {n} trace events (open in ui.perfetto.dev or chrome://tracing)")
        elif action == "plot":
            from hpcpipe.plotting import require_matplotlib

            require_matplotlib("trace plot", "--png")
            trace = _load(args.trace)
            out = _output(args.png, "--png")
            from hpcpipe.analysis.plots import plot_timeline

            plot_timeline(trace, out, step=args.step, arrows=args.arrows, title=args.title)
            print(f"wrote {out}")
        elif action == "table":
            import json

            from hpcpipe.analysis.compare import table_rows
            from hpcpipe.analysis.metrics import summarize

            out = _output(args.json, "--json") if args.json else None
            summaries = [summarize(_load(path), args.threshold) for path in args.traces]
            text, rows = table_rows(summaries)
            print(printable(text))
            if out is not None:
                out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        else:
            from hpcpipe.analysis.compare import compare

            print(printable(compare(_load(args.a), _load(args.b), args.threshold)))
    except ValueError as exc:  # bad --step, threshold, ...; ConfigError passes through
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("trace " + action, "", str(exc)) from None
    except BrokenPipeError:  # output piped into `head`: the reader has what it wanted
        raise
    except OSError as exc:
        raise ConfigError("trace " + action, "", f"cannot write output: {exc}") from None
    sys.stdout.flush()
    return 0


register_command("trace", "analyse trace files: summary, export, plot, compare, table (no MPI)")(
    _configure
)(_execute)
