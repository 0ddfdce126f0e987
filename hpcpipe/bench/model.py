"""What the plan predicts for a measured step (pure: NumPy and the simulator, no MPI).

`step_figures` compares one measured step with the simulation under the costs it measured
(`hpcpipe.schedules.replay.measured_costs`), and with `replay_in_order`, the same costs executed
in the lowered schedule's own order, SENDs and RECVs included (equal to the simulation since
the lowering waits for each message at its consumer); `activation_peaks` is the
simulator's memory model in bytes with each stage's own B release (the simulator's `b_frees`
is one share for all stages, while the stages of a real model free different amounts at B).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hpcpipe.schedules import CostModel, Kind, Schedule, simulate
from hpcpipe.schedules.replay import COMPUTE, measured_costs, replay_in_order

__all__ = ["COMPUTE", "activation_peaks", "step_figures"]

RECV = ("RECV_F", "RECV_B")
SEND = ("SEND_F", "SEND_B")


def _sum(times: Mapping[tuple[str, int], float], kinds: Sequence[str]) -> float:
    return float(sum(v for (k, _), v in times.items() if k in kinds))


def step_figures(
    schedule: Schedule,
    spans: Sequence[tuple[float, float]],
    action_times: Sequence[Mapping[tuple[str, int], float]],
    plan: CostModel | None = None,
    start: float | None = None,
) -> dict[str, float]:
    """One step on every rank against the simulator.

    `schedule` is the lowered schedule the runtime ran. `spans[r]` is when rank r's
    interpreter began and ended the step, on a clock all ranks share, and `action_times[r]`
    its seconds per (kind name, stage). The step takes from `start` (the instant every rank
    was told to begin; default the first begin) to the last end. The prediction ("replay")
    simulates the schedule with the per-stage costs this step measured, freely and in the
    lowered message order; with `plan`, the planned costs are simulated too. Bubbles are idle
    shares of all ranks' time within the step, as `SimResult.bubble_fraction` defines them.
    """
    p = len(spans)
    if start is None:
        start = min(s for s, _ in spans)
    measured = max(e for _, e in spans) - start
    merged: dict[tuple[str, int], float] = {}
    for times in action_times:
        merged.update(times)
    costs = measured_costs(schedule, merged)
    replay = simulate(schedule, costs)
    in_order = replay_in_order(schedule, costs)
    compute = [_sum(t, COMPUTE) for t in action_times]
    actions = [len(schedule.rank_actions(r)) for r in range(p)]
    other = [(e - s) - sum(t.values()) for (s, e), t in zip(spans, action_times, strict=True)]
    out = {
        "measured_s": measured,
        "replay_s": replay.makespan,
        "ratio": measured / replay.makespan if replay.makespan > 0 else float("nan"),
        "in_order_s": in_order,
        "order_ratio": in_order / replay.makespan if replay.makespan > 0 else float("nan"),
        "runtime_ratio": measured / in_order if in_order > 0 else float("nan"),
        "bubble": 1.0 - sum(compute) / (p * measured) if measured > 0 else float("nan"),
        "bubble_replay": replay.bubble_fraction,
        "compute_s": float(np.mean(compute)),
        "recv_s": float(np.mean([_sum(t, RECV) for t in action_times])),
        "send_s": float(np.mean([_sum(t, SEND) for t in action_times])),
        "other_s": float(np.mean(other)),
        "other_us_per_action": float(np.mean([o / a for o, a in zip(other, actions, strict=True)]))
        * 1e6,
        "start_late_us": float(np.mean([s - start for s, _ in spans])) * 1e6,
    }
    if plan is not None:
        planned = simulate(schedule, plan)
        plan_in_order = replay_in_order(schedule, plan)
        out |= {
            "plan_s": planned.makespan,
            "plan_in_order_s": plan_in_order,
            "plan_runtime_ratio": measured / plan_in_order if plan_in_order > 0 else float("nan"),
            "plan_ratio": measured / planned.makespan if planned.makespan > 0 else float("nan"),
            "bubble_plan": planned.bubble_fraction,
        }
    return out


def activation_peaks(
    schedule: Schedule, ctx_bytes: Sequence[float], wctx_bytes: Sequence[float]
) -> np.ndarray:
    """Peak live activation bytes per rank when F of stage s keeps `ctx_bytes[s]` alive, B
    turns that into `wctx_bytes[s]` (what W still needs) and W frees it; a fused BW is a B
    then a W, so it peaks at `wctx` when W needs more than F saved (the output gradient).

    The order of a rank's actions, not their timing, sets its peak; the order is the one the
    simulator executes.
    """
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
