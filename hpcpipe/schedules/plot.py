"""Pictures of a simulated schedule: an ASCII rank x time grid and a matplotlib timeline.

Both draw what the papers draw: one row per rank, time to the right, each action labelled with
its microbatch, idle time left blank, so bubbles are visible at a glance. Labels are F (forward),
B (backward for inputs), W (backward for weights) and X (fused backward, B and W at once);
lowercase marks a rank's odd-numbered stage (the second chunk of a V or interleaved rank).
matplotlib is imported only when a PNG is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hpcpipe.schedules.ir import Kind
from hpcpipe.schedules.simulate import SimResult

__all__ = ["ascii_timeline", "legend_entries", "plot_pareto", "plot_timeline"]

_LETTER = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}
_COLOR = {Kind.F: "#4c72b0", Kind.B: "#55a868", Kind.W: "#c9b03a", Kind.BW: "#8172b2"}


def _chunk_index(result: SimResult) -> np.ndarray:
    """Position of each action's stage within its rank's stages (0 = first chunk)."""
    sched = result.schedule
    local = np.zeros(sched.num_stages, dtype=np.int64)
    for row in sched.stages_of_rank:
        for i, s in enumerate(row):
            local[s] = i
    return local[result.stage]


def _labels(result: SimResult) -> list[str]:
    chunk = _chunk_index(result)
    out = []
    for k, c, mb in zip(
        result.kind.tolist(), chunk.tolist(), result.microbatch.tolist(), strict=True
    ):
        letter = _LETTER[Kind(k)]
        out.append(f"{letter.lower() if c % 2 else letter}{mb}")
    return out


def _pair_index(result: SimResult) -> np.ndarray:
    """Indices (into the result's arrays) of the F halves of overlapped pairs."""
    sched = result.schedule
    if not sched.pairs.size:
        return np.zeros(0, dtype=np.int64)
    compute = np.flatnonzero(sched.kinds < Kind.SEND_F)
    return np.searchsorted(compute, sched.pairs)


def ascii_timeline(result: SimResult, *, max_width: int = 160, max_ranks: int = 32) -> str:
    """Rank x time grid. One column is the shortest action's duration; an action fills the
    columns it covers (label, then '-'), idle columns show '.'. Cut to `max_width` characters
    and `max_ranks` rows, saying so."""
    sched = result.schedule
    durations = result.end - result.start
    positive = durations[durations > 0]
    if positive.size == 0:
        return "(nothing to draw: every action takes zero time)"
    quantum = float(positive.min())
    labels = _labels(result)
    paired = _pair_index(result)
    for j in paired + 1:  # the backward half of an F&B pair
        labels[j] = "&" + labels[j]
    cell = max(len(s) for s in labels) + 1
    columns = math.ceil(result.makespan / quantum - 1e-9)
    fit = max(1, (max_width - 8) // cell)
    shown = min(columns, fit)
    ranks = min(sched.num_ranks, max_ranks)
    lines = []
    for r in range(ranks):
        row = ["." * (cell - 1)] * shown
        for j in range(int(result.offsets[r]), int(result.offsets[r + 1])):
            c0 = round(result.start[j] / quantum)
            c1 = max(c0 + 1, round(result.end[j] / quantum))
            for c in range(c0, min(c1, shown)):
                row[c] = labels[j] if c == c0 else "-" * (cell - 1)
        lines.append(f"{r:>5} |" + "".join(f"{x:<{cell}}" for x in row))
    notes = []
    if shown < columns:
        notes.append(f"first {shown} of {columns} columns")
    if ranks < sched.num_ranks:
        notes.append(f"first {ranks} of {sched.num_ranks} ranks")
    legend = (
        f"one column = {quantum:g} time units; F forward, B backward (inputs), W backward "
        "(weights), X fused backward; lowercase = a rank's second stage; '.' idle"
        + ("; &: the backward half of an overlapped F&B pair" if paired.size else "")
    )
    if notes:
        legend += " (" + "; ".join(notes) + ")"
    return "\n".join([*lines, legend])


_LEGEND = {
    Kind.F: "F forward",
    Kind.B: "B backward (inputs)",
    Kind.W: "W weights",
    Kind.BW: "B+W fused backward",
}


def legend_entries(result: SimResult) -> list[tuple[Kind | None, str]]:
    """What the timeline's legend lists: each kind of action drawn, and the hatching (None)
    when some rank runs a second stage; nothing that is not in the picture."""
    present = {Kind(k) for k in np.unique(result.kind).tolist()}
    entries: list[tuple[Kind | None, str]] = [(k, t) for k, t in _LEGEND.items() if k in present]
    if (_chunk_index(result) % 2 == 1).any():
        entries.append((None, "a rank's 2nd stage (hatched)"))
    return entries


def plot_timeline(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG timeline: one bar per action coloured by kind (hatched for a rank's second
    stage), microbatch numbers where they fit; gaps are the bubbles."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    sched = result.schedule
    p = sched.num_ranks
    fig = Figure(figsize=(min(24.0, 4.0 + 0.12 * result.start.size / max(p, 1)), 1.0 + 0.4 * p))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    chunk = _chunk_index(result)
    durations = result.end - result.start
    for k in (Kind.F, Kind.B, Kind.W, Kind.BW):
        for odd in (False, True):
            sel = (result.kind == k) & ((chunk % 2 == 1) == odd)
            if not sel.any():
                continue
            ax.barh(
                result.rank[sel],
                durations[sel],
                left=result.start[sel],
                height=0.8,
                color=_COLOR[k],
                edgecolor="black",
                linewidth=0.3,
                hatch="//" if odd else None,
            )
    from matplotlib.patches import Rectangle

    for j in _pair_index(result):  # an F&B pair: one frame around its two halves
        ax.add_patch(
            Rectangle(
                (result.start[j], result.rank[j] - 0.45),
                result.end[j + 1] - result.start[j],
                0.9,
                fill=False,
                edgecolor="crimson",
                linewidth=1.2,
            )
        )
    wide = durations >= 0.02 * max(result.makespan, 1e-12)
    if p <= 64 and wide.sum() <= 4000:
        for j in np.flatnonzero(wide):
            ax.text(
                result.start[j] + durations[j] / 2,
                result.rank[j],
                str(int(result.microbatch[j])),
                ha="center",
                va="center",
                fontsize=6,
            )
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    ax.set_ylabel("rank")
    # above the axes (never over a bar), only the kinds drawn, and the hatching explained
    handles = [
        Patch(
            facecolor=_COLOR.get(k, "white"),
            edgecolor="black",
            linewidth=0.3,
            hatch="//" if k is None else None,
            label=label,
        )
        for k, label in legend_entries(result)
    ]
    if sched.pairs.size:
        handles.append(
            Patch(fill=False, edgecolor="crimson", linewidth=1.2, label="F&B pair (overlapped)")
        )
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=max(1, min(len(handles), int(fig.get_figwidth() / 2.2))),  # rows when narrow
        fontsize=7,
        frameon=False,
    )
    bubble = 100 * result.bubble_fraction
    fig.suptitle(
        title or f"{sched.name}: makespan {result.makespan:g}, bubble {bubble:.1f}%", fontsize=10
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out


def plot_pareto(
    front: Sequence[tuple[float, float]],
    fixed: Sequence[tuple[str, float, float]],
    path: str | Path,
    *,
    title: str = "",
    budget: float | None = None,
) -> Path:
    """Write a PNG of makespan against peak memory: the search's front as a staircase
    (the best makespan within each budget) and every fixed schedule as a labelled point."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if front:
        peaks = [x for x, _ in front]
        spans = [y for _, y in front]
        right = max([*peaks, *(x for _, x, _ in fixed)]) * 1.05
        ax.step([*peaks, right], [*spans, spans[-1]], where="post", color="#c44e52", lw=1.5)
        ax.plot(peaks, spans, "o", color="#c44e52", label="search front")
    for name, peak, span in fixed:
        ax.plot([peak], [span], "s", color="#4c72b0", ms=5)
        ax.annotate(name, (peak, span), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.plot([], [], "s", color="#4c72b0", ms=5, label="fixed schedules")
    if budget is not None:
        ax.axvline(budget, color="gray", ls="--", lw=1, label=f"memory_budget {budget:g}")
    ax.set_xlabel("peak activation memory per rank (activation_memory units)")
    ax.set_ylabel("makespan (time units)")
    ax.set_title(title or "makespan vs peak memory", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
