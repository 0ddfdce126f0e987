"""Two runs side by side (e.g. 1F1B against ZB-V on the same deck): what changed and by how much."""

from __future__ import annotations

from collections.abc import Callable

from hpcpipe.analysis.metrics import Summary, fmt_time, summarize
from hpcpipe.io.trace import Trace

__all__ = ["compare", "compare_summaries", "table_rows"]


def _row_at(
    name: str, a: float | None, b: float | None, text: Callable[[float], str], width: int = 16
) -> str:
    ta = "-" if a is None else text(a)
    tb = "-" if b is None else text(b)
    ratio = f"{b / a:.3f}" if a and b is not None else "-"
    return f"{name:<34} {ta:>{width}} {tb:>{width}} {ratio:>8}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def compare(a: Trace, b: Trace, threshold: float = 0.1) -> str:
    """A table of the figures that decide between two runs, with the ratio B / A."""
    sa, sb = summarize(a, threshold), summarize(b, threshold)
    return compare_summaries(sa, sb)


def compare_summaries(sa: Summary, sb: Summary) -> str:
    """`compare` on summaries already computed."""
    pa, pb = sa.prediction, sb.prediction
    mean = lambda s, arr: float(arr.mean()) if s.num_ranks else 0.0  # noqa: E731
    name_a, name_b = sa.schedule or "-", sb.schedule or "-"
    w = max(16, len(name_a), len(name_b))  # a schedule's name is never cut

    def _row(*args: object) -> str:
        return _row_at(*args, width=w)

    lines = [
        f"A: {sa.path}",
        f"B: {sb.path}",
        "",
        f"{'':<34} {'A':>{w}} {'B':>{w}} {'B/A':>8}",
        f"{'schedule':<34} {name_a:>{w}} {name_b:>{w}}",
        _row("ranks", sa.num_ranks, sb.num_ranks, str),
        _row("recorded steps", len(sa.steps), len(sb.steps), str),
        _row("step time (median)", sa.step_time_ns, sb.step_time_ns, fmt_time),
        _row("step time predicted", pa and pa.step_time_ns, pb and pb.step_time_ns, fmt_time),
        _row("bubble measured", sa.bubble, sb.bubble, _pct),
        _row("bubble predicted", pa and pa.bubble, pb and pb.bubble, _pct),
        _row("per-rank bubble (papers)", sa.stage_bubble, sb.stage_bubble, _pct),
        _row("peak memory (max over ranks)", sa.peak_bytes or None, sb.peak_bytes or None, _mib),
        _row(
            "busy per rank per step (mean)",
            mean(sa, sa.busy_ns) / len(sa.steps),
            mean(sb, sb.busy_ns) / len(sb.steps),
            fmt_time,
        ),
        _row(
            "comm per rank per step (mean)",
            mean(sa, sa.comm_ns) / len(sa.steps),
            mean(sb, sb.comm_ns) / len(sb.steps),
            fmt_time,
        ),
        _row(
            "late-sender wait per step",
            float(sa.late_sender_ns.sum()) / len(sa.steps),
            float(sb.late_sender_ns.sum()) / len(sb.steps),
            fmt_time,
        ),
        _row(
            "messages per step",
            sa.messages / len(sa.steps),
            sb.messages / len(sb.steps),
            lambda x: f"{x:.0f}",
        ),
    ]
    return "\n".join(lines)


def table_rows(summaries: list[Summary]) -> tuple[str, list[dict[str, object]]]:
    """Many runs, one row each (a job array's parameter sweep): text table and JSON rows."""
    rows: list[dict[str, object]] = []
    for s in summaries:
        p = s.prediction
        rows.append(
            {
                "trace": str(s.path),
                "schedule": s.schedule or "-",
                "ranks": s.num_ranks,
                "step_time_s": s.step_time_ns * 1e-9,
                "predicted_s": p.step_time_ns * 1e-9 if p else None,
                "bubble": s.bubble,
                "bubble_predicted": p.bubble if p else None,
                "peak_bytes": s.peak_bytes,
            }
        )
    width = max([len("run")] + [len(_run_name(r["trace"])) for r in rows])
    sw = max([len("schedule")] + [len(r["schedule"]) for r in rows])  # never cut a name
    lines = [
        f"{'run':<{width}} {'schedule':<{sw}} {'ranks':>5} {'step':>11} {'predicted':>11} "
        f"{'bubble':>7} {'pred.':>7} {'peak mem':>11}"
    ]
    for r in sorted(rows, key=lambda r: r["step_time_s"]):
        pred = "-" if r["predicted_s"] is None else fmt_time(r["predicted_s"] * 1e9)
        pbub = "-" if r["bubble_predicted"] is None else _pct(r["bubble_predicted"])
        lines.append(
            f"{_run_name(r['trace']):<{width}} {r['schedule']:<{sw}} {r['ranks']:>5} "
            f"{fmt_time(r['step_time_s'] * 1e9):>11} {pred:>11} "
            f"{_pct(r['bubble']):>7} {pbub:>7} {_mib(r['peak_bytes'] or 0):>11}"
        )
    return "\n".join(lines), rows


def _run_name(path: str) -> str:
    """The run directory's name (a trace is <run>/trace.h5), else the file name."""
    from pathlib import Path

    p = Path(path)
    return p.parent.name if p.name == "trace.h5" and p.parent.name else p.name
