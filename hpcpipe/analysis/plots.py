"""Timeline figure of one step, drawn like the pipeline papers' figures, plus utilisation bars.

Rows are ranks (rank 0 on top); F, B, W and BW boxes carry their microbatch number and the
papers' colours; a rank's later stage (V-shape, interleaved chunks) is hatched. Receive waits,
sends and collectives are thin bars under the row; optional arrows join each send to its
receive. The right panel shows each rank's compute / communication / idle share of the step.
matplotlib is imported here only (through hpcpipe.plotting), so the rest of the analysis works
without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.analysis.messages import match_messages
from hpcpipe.analysis.metrics import union_length
from hpcpipe.io.trace import COMM_KINDS, COMPUTE_KINDS, EventKind, Trace

__all__ = ["COLOURS", "plot_timeline"]

K = EventKind
COLOURS = {
    K.F: "#8fbbe6",
    K.B: "#f5b971",
    K.W: "#9ed08f",
    K.BW: "#e9967a",
    K.OPTIMIZER: "#b0b0b0",
    K.SWEEP_BLOCK: "#8fbbe6",
    K.EXPERT: "#c5a3d9",
    K.ALLREDUCE: "#7e57c2",
    K.ALLTOALL: "#c2185b",
    K.CHECKPOINT: "#6d4c41",
    K.REPLAN: "#d32f2f",
}
_COMM_COLOUR = "#707070"
_COMPUTE = {int(k) for k in COMPUTE_KINDS}
_COMM = {int(k) for k in COMM_KINDS}
_IO = [int(K.CHECKPOINT), int(K.REPLAN)]


def _chunk_of(trace: Trace) -> dict[int, int]:
    """Stage -> position among its rank's stages (0 = first chunk), from the schedule."""
    sched = trace.schedule
    if sched is None:
        return {}
    return {s: i for row in sched.stages_of_rank for i, s in enumerate(sorted(row))}


def plot_timeline(
    trace: Trace,
    png: str | Path,
    step: int | None = None,
    arrows: bool = False,
    title: str | None = None,
) -> Path:
    """Draw `step` (default: the last recorded) of `trace` into `png`; returns the path."""
    from hpcpipe.plotting import pyplot

    plt = pyplot("trace plot", "--png")
    from matplotlib.patches import Patch

    if not trace.steps:
        raise ValueError(f"{trace.path}: the trace has no events")
    step = trace.steps[-1] if step is None else step
    if step not in trace.steps:
        raise ValueError(f"{trace.path}: step {step} is not in the trace {list(trace.steps)}")
    p = trace.num_ranks
    per_rank = [trace.step_events(r, step) for r in range(p)]
    per_rank = [ev[ev["kind"] != K.STEP] for ev in per_rank]
    lo = min(int(e["t_start"].min()) for e in per_rank if e.size)
    hi = max(int(e["t_end"].max()) for e in per_rank if e.size)
    span = max(hi - lo, 1)
    unit, scale = ("ms", 1e6) if span >= 1e6 else ("us", 1e3)
    chunk = _chunk_of(trace)
    label_ok = p <= 48

    height = min(max(3.2, 1.6 + 0.45 * p), 40.0)
    fig, (ax, axu) = plt.subplots(
        1, 2, figsize=(15, height), sharey=True, gridspec_kw={"width_ratios": [5, 1]}
    )
    util = np.zeros((p, 3))
    for r, ev in enumerate(per_rank):
        if not ev.size:
            continue
        t0 = (ev["t_start"] - lo) / scale
        dur = (ev["t_end"] - ev["t_start"]) / scale
        kinds = ev["kind"].tolist()
        comp = np.array([k in _COMPUTE for k in kinds])
        comm = np.array([k in _COMM for k in kinds])
        stage_chunk = np.array([chunk.get(s, 0) for s in ev["stage"].tolist()])
        for k in sorted(set(np.asarray(kinds)[comp].tolist())):
            for later in (False, True):
                sel = comp & (ev["kind"] == k) & ((stage_chunk > 0) == later)
                if not sel.any():
                    continue
                ax.broken_barh(
                    list(zip(t0[sel], dur[sel], strict=True)),
                    (r - 0.4, 0.8),
                    facecolors=COLOURS.get(K(k), "#cccccc"),
                    edgecolor="black",
                    linewidth=0.4,
                    hatch="//" if later else None,
                )
        if label_ok:
            wide = comp & np.isin(ev["kind"], [K.F, K.B, K.W, K.BW]) & (dur * scale > span / 80)
            for i in np.flatnonzero(wide).tolist():
                ax.text(
                    t0[i] + dur[i] / 2,
                    r,
                    str(int(ev["microbatch"][i])),
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        io = np.isin(ev["kind"], _IO)  # checkpoints, layers moving to a new partition
        for k in sorted(set(ev["kind"][io].tolist())):
            sel = io & (ev["kind"] == k)
            ax.broken_barh(
                list(zip(t0[sel], np.maximum(dur[sel], span / scale / 500), strict=True)),
                (r - 0.4, 0.8),
                facecolors=COLOURS[K(k)],
                edgecolor="black",
                linewidth=0.4,
            )
        for k in sorted(set(np.asarray(kinds)[comm].tolist())):
            sel = comm & (ev["kind"] == k)
            w = np.maximum(dur[sel], span / scale / 2000)
            ax.broken_barh(
                list(zip(t0[sel], w, strict=True)),
                (r + 0.25, 0.14),
                facecolors=COLOURS.get(K(k), _COMM_COLOUR),
                linewidth=0,
            )
        c_ns = union_length(ev["t_start"][comp], ev["t_end"][comp])
        both = union_length(ev["t_start"][comp | comm], ev["t_end"][comp | comm])
        util[r] = [c_ns / span, (both - c_ns) / span, 1 - both / span]
    if arrows:
        _draw_arrows(ax, trace, step, lo, scale)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)] if p <= 64 else [""] * p)
    ax.set_xlim(0, span / scale)
    ax.set_xlabel(f"time ({unit}) from the step's start")
    sched = trace.schedule
    name = sched.name if sched is not None else "trace"
    fig.suptitle(title or f"{name}: step {step}, {span / scale:.3f} {unit}")
    present = {K(k) for e in per_rank for k in np.unique(e["kind"]).tolist()}
    handles = [
        Patch(facecolor=COLOURS[k], edgecolor="black", label=k.name)
        for k in COLOURS
        if k in present
    ]
    if present & {K(k) for k in _COMM if k not in COLOURS}:
        handles.append(Patch(facecolor=_COMM_COLOUR, label="send / recv / wait"))
    if chunk and any(v > 0 for v in chunk.values()):
        handles.append(
            Patch(facecolor="white", edgecolor="black", hatch="//", label="later stage of a rank")
        )
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )

    left = np.zeros(p)
    for j, (lab, col) in enumerate(
        (("compute", "#5b9bd5"), ("comm (exposed)", "#a5a5a5"), ("idle", "#f2f2f2"))
    ):
        axu.barh(
            range(p),
            100 * util[:, j],
            left=left,
            height=0.8,
            color=col,
            edgecolor="black",
            linewidth=0.3,
            label=lab,
        )
        left += 100 * util[:, j]
    axu.set_xlim(0, 100)
    axu.set_xlabel("share of the step (%)")
    axu.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=7, frameon=False)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _draw_arrows(ax: Any, trace: Trace, step: int, lo: int, scale: float) -> None:
    msgs = match_messages(trace)
    for k in range(len(msgs)):
        sr, si = int(msgs.send_rank[k]), int(msgs.send_index[k])
        rr, ri = int(msgs.recv_rank[k]), int(msgs.recv_index[k])
        send, recv = trace.events[sr][si], trace.events[rr][ri]
        if int(send["step"]) != step:
            continue
        x0 = (int(send["t_start"]) - lo) / scale
        x1 = (int(recv["t_end"]) - lo) / scale
        ax.annotate(
            "",
            xy=(x1, rr),
            xytext=(x0, sr),
            arrowprops={"arrowstyle": "->", "color": "#444444", "lw": 0.5, "alpha": 0.6},
        )
