"""The simulator's memory model in bytes, per stage: what a schedule's order keeps alive.

`simulate` counts activations in one unit per stage with one B release share for all stages;
a real model's stages keep different amounts at F and free different amounts at B. Here F of
stage s keeps `ctx_bytes[s]` alive, B turns that into `wctx_bytes[s]` (what W still needs) and
W frees it; a fused BW is a B then a W, so it peaks at `wctx` when W needs more than F saved
(an output gradient it keeps). The order of a rank's actions, not their timing, sets its peak;
the order is the one the simulator executes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.simulate import CostModel, simulate

__all__ = ["activation_peaks"]


def activation_peaks(
    schedule: Schedule, ctx_bytes: Sequence[float], wctx_bytes: Sequence[float]
) -> np.ndarray:
    """Peak live activation bytes per rank (see the module docstring)."""
    sim = simulate(schedule, CostModel())
    ctx = np.asarray(ctx_bytes, dtype=np.float64)[sim.stage]
    wctx = np.asarray(wctx_bytes, dtype=np.float64)[sim.stage]
    f, b, w = (sim.kind == k for k in (Kind.F, Kind.B, Kind.W))
    first = np.select([f, b, w], [ctx, wctx - ctx, -wctx], wctx - ctx)  # BW: its B half
    second = np.where(sim.kind == Kind.BW, -wctx, 0.0)  # BW: its W half
    delta = np.stack([first, second], axis=1)
    peaks = np.zeros(schedule.num_ranks)
    for r in range(schedule.num_ranks):
        lo, hi = int(sim.offsets[r]), int(sim.offsets[r + 1])
        if hi > lo:
            peaks[r] = max(0.0, float(np.cumsum(delta[lo:hi].ravel()).max()))
    return peaks
