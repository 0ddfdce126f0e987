"""What `hpcpipe plan` shows for a sweep deck: the KBA plan, its predicted efficiency, the
wavefront over the rank grid, a stage chart that fits a terminal, and the same as a PNG.

A sweep has no pipeline/data/expert layout: its parallel structure is the Px x Py rank grid and
the order in which the octants' wavefronts cross it, so that is what is drawn. Pure: no MPI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.sweep.plan import Simulation, SweepPlan, closed_form_stages

__all__ = ["deck_plan_text", "plan_text", "plot_plan", "stage_chart", "wavefront"]

_OCTANT_COLOURS = (
    "#4c72b0",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
)


def wavefront(sim: Simulation, octant: int | None = None) -> np.ndarray:
    """Stage at which each rank starts `octant` (default: the corner sequence's first; under
    `nearest` the ranks reach it at different places in their lists), shape (py, px)."""
    plan = sim.plan
    octant = plan.octants[0] if octant is None else octant
    at = [next(i for i, t in enumerate(ts) if t.octant == octant) for ts in plan.tasks]
    first = np.round(sim.start[np.arange(plan.ranks), at] / sim.task_time).astype(np.int64)
    return first.reshape(plan.py, plan.px)


def _octant_rows(sim: Simulation) -> np.ndarray:
    """(ranks, stages) array: the octant a rank sweeps in each unit stage, -1 when idle."""
    plan = sim.plan
    rows = np.full((plan.ranks, sim.stages), -1, dtype=np.int64)
    cols = np.round(sim.start / sim.task_time).astype(np.int64)
    for r in range(plan.ranks):
        rows[r, cols[r]] = [t.octant for t in plan.tasks[r]]
    return rows


def stage_chart(sim: Simulation, *, max_width: int = 100, max_ranks: int = 32) -> str:
    """Rank x stage chart, one character per column: the octant digit a rank sweeps, '.' idle.

    A column covers ceil(stages / max_width) stages when the sweep is longer than the width;
    it shows the octant the rank spends most of that column on ('.' when mostly idle)."""
    rows = _octant_rows(sim)
    ranks, stages = rows.shape
    per = max(1, -(-stages // max_width))
    cols = -(-stages // per)
    shown = min(ranks, max_ranks)
    lines = [
        f"stage chart: one column = {per} stage(s) of unit task time; digit = the octant a rank "
        "sweeps, '.' idle"
    ]
    ruler = [" "] * cols
    for c in range(0, cols, 10):  # the stage number every ten columns
        label = str(c * per)
        if c + len(label) <= cols:
            ruler[c : c + len(label)] = label
    lines.append(f"{'rank':>5} {''.join(ruler).rstrip()}")
    for r in range(shown):
        text = []
        for c in range(cols):
            chunk = rows[r, c * per : (c + 1) * per]
            busy = chunk[chunk >= 0]
            if busy.size * 2 < chunk.size or busy.size == 0:
                text.append(".")
            else:
                text.append(str(int(np.bincount(busy).argmax())))
        lines.append(f"{r:>5} {''.join(text)}")
    if shown < ranks:
        lines.append(f"... {ranks - shown} more ranks (the chart shows the first {shown})")
    return "\n".join(lines)


def _wavefront_table(front: np.ndarray, max_side: int = 16) -> str:
    py, px = front.shape
    if px > max_side or py > max_side:
        return (
            f"wavefront: the first octant reaches the far corner at stage {int(front.max())} "
            f"(grid {px} x {py} too large to print)"
        )
    width = max(3, len(str(int(front.max()))) + 1)
    lines = ["wavefront of the first octant: the stage at which each rank (ix, iy) starts it"]
    lines.append("iy\\ix" + "".join(f"{ix:>{width}}" for ix in range(px)))
    for iy in reversed(range(py)):
        lines.append(f"{iy:>5}" + "".join(f"{int(v):>{width}}" for v in front[iy]))
    return "\n".join(lines)


def plan_text(
    plan: SweepPlan,
    sim: Simulation,
    *,
    max_width: int = 100,
    blocking: str = "",
) -> str:
    """The sweep's plan view: decomposition, predicted stages and efficiency, wavefront, chart
    (`blocking`: the line saying how the blocking was chosen)."""
    m = plan.tasks_per_octant
    closed = closed_form_stages(plan.px, plan.py, m, plan.order) if plan.order != "custom" else 0
    ideal = 8 * m
    lines = [
        plan.describe(),
        *([blocking] if blocking else []),
        f"predicted: {sim.stages} stages"
        + (f" (closed form {closed})" if closed else "")
        + f" for {ideal} tasks per rank "
        f"(8 octants x M = {m}), parallel efficiency {sim.efficiency:.3f}",
        "  (unit task time, free messages: the plan's own bound, before any kernel or link cost)",
        "",
        _wavefront_table(wavefront(sim)),
        "",
        stage_chart(sim, max_width=max_width),
    ]
    return "\n".join(lines)


def deck_plan_text(cfg: Any) -> str:
    """`plan_text` of a `[sweep]` section (SweepConfig): what a dry run shows for a sweep."""
    from hpcpipe.sweep.blocking import describe_blocking
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.plan import blocking_for, plan_for, simulate

    problem = build_problem(cfg)
    blocking = blocking_for(cfg, problem)
    plan = plan_for(cfg, problem, blocking)
    line = describe_blocking(blocking)
    return plan_text(plan, simulate(plan), blocking=line)


def plot_plan(sim: Simulation, path: str | Path, *, title: str | None = None) -> Path:
    """PNG: the rank x time chart coloured by octant, and the first octant's wavefront as a
    heat map over the rank grid (the diagonal that gives KBA its fill and drain)."""
    from hpcpipe.plotting import pyplot

    plt = pyplot("plan", "--png")
    from matplotlib.patches import Patch

    plan = sim.plan
    rows = _octant_rows(sim)
    ranks, stages = rows.shape
    fig, (ax, axw) = plt.subplots(
        1,
        2,
        figsize=(min(18.0, 6.0 + 0.06 * stages), min(12.0, 2.0 + 0.3 * min(ranks, 32))),
        gridspec_kw={"width_ratios": [3, 1]},
    )
    for o in range(8):
        for r in range(min(ranks, 64)):
            cols = np.flatnonzero(rows[r] == o)
            if cols.size:
                ax.broken_barh(
                    [(int(c), 1) for c in cols],
                    (r - 0.4, 0.8),
                    facecolors=_OCTANT_COLOURS[o],
                    edgecolor="none",
                )
    shown = min(ranks, 64)
    ax.set_ylim(shown - 0.5, -0.5)
    ax.set_xlim(0, stages)
    ax.set_xlabel("stage (unit task time)")
    ax.set_ylabel("rank")
    present = sorted({t.octant for t in plan.tasks[0]})
    ax.legend(
        handles=[Patch(facecolor=_OCTANT_COLOURS[o], label=f"octant {o}") for o in present],
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=len(present),
        fontsize=7,
        frameon=False,
    )
    front = wavefront(sim)
    im = axw.imshow(front, origin="lower", cmap="Blues")
    if plan.px <= 16 and plan.py <= 16:  # small grids: the numbers themselves
        middle = (int(front.min()) + int(front.max())) / 2
        for iy in range(plan.py):
            for ix in range(plan.px):
                value = int(front[iy, ix])
                colour = "white" if value > middle else "black"
                axw.text(ix, iy, str(value), ha="center", va="center", fontsize=7, color=colour)
    else:
        fig.colorbar(im, ax=axw, shrink=0.7)
    axw.set_xlabel("ix")
    axw.set_ylabel("iy")
    first = plan.octants[0]
    axw.set_title(f"wavefront: stage at which\neach rank starts octant {first}", fontsize=8)
    fig.suptitle(
        title
        or f"KBA sweep on {plan.px} x {plan.py} ranks: {sim.stages} stages, predicted "
        f"efficiency {sim.efficiency:.3f}",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
