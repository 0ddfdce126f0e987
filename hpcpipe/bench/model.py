"""What the plan predicts for a measured step (pure: NumPy and the simulator, no MPI).

`measured_costs` turns the per-(kind, stage) action times one step measured into the
simulator's `CostModel`; `step_figures` compares one measured step with the simulation under
those costs, and with `replay_in_order`, the same costs executed in the lowered schedule's
message order (which the simulator does not model); `activation_peaks` is the
simulator's memory model in bytes with each stage's own B release (the simulator's `b_frees`
is one share for all stages, while the stages of a real model free different amounts at B).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hpcpipe.schedules import CostModel, Kind, Schedule, simulate

__all__ = [
    "COMPUTE",
    "action_counts",
    "activation_peaks",
    "measured_costs",
    "replay_in_order",
    "step_figures",
    "waits_at_consumers",
]

COMPUTE = ("F", "B", "W", "BW")
RECV = ("RECV_F", "RECV_B")
SEND = ("SEND_F", "SEND_B")


def action_counts(schedule: Schedule) -> dict[tuple[str, int], int]:
    """How many actions of each (kind name, stage) one step runs, over all ranks."""
    counts: dict[tuple[str, int], int] = {}
    for kind, stage in zip(schedule.kinds.tolist(), schedule.stages.tolist(), strict=True):
        key = (Kind(kind).name, stage)
        counts[key] = counts.get(key, 0) + 1
    return counts


def measured_costs(
    schedule: Schedule, action_times: Mapping[tuple[str, int], float], **extra: Any
) -> CostModel:
    """Per-stage mean F/B/W/BW time per action from one step's totals per (kind, stage).

    Means are over the actions the schedule runs, not over microbatches: DualPipe-V fuses B
    and W for most microbatches of a stage but splits them for a few. A stage that only runs
    BW gives B and W half of it each; one that never fuses gets BW = B + W.
    """
    n = schedule.num_stages
    counts = action_counts(schedule)

    def per_stage(kind: str) -> np.ndarray:
        return np.array(
            [action_times.get((kind, s), np.nan) / counts.get((kind, s), np.nan) for s in range(n)]
        )

    t_f, t_b, t_w, t_bw = (per_stage(k) for k in COMPUTE)
    split = ~np.isnan(t_b)
    t_bw = np.where(np.isnan(t_bw), np.nan_to_num(t_b) + np.nan_to_num(t_w), t_bw)
    t_b = np.where(split, t_b, t_bw / 2)
    t_w = np.where(split, np.nan_to_num(t_w), t_bw / 2)
    return CostModel(t_f=np.nan_to_num(t_f), t_b=t_b, t_w=t_w, t_bw=t_bw, **extra)


def replay_in_order(lowered: Schedule, costs: CostModel) -> float:
    """Makespan when every rank also keeps the lowered schedule's message order.

    The simulator lets a result leave the moment its action ends; the runtime sends it when it
    reaches the SEND action, which the lowering may have put behind a RECV that waits for
    another rank. Here SENDs take no time and a RECV waits until its SEND has run, so the
    difference from the simulator's makespan is what the message order costs, and the
    difference from a measured step is what the runtime itself adds.
    """
    arrays = costs.stage_arrays(lowered.num_stages)
    dur = {
        Kind.F: arrays["t_f"],
        Kind.B: arrays["t_b"],
        Kind.W: arrays["t_w"],
        Kind.BW: arrays["t_bw"],
    }
    acts = [lowered.rank_actions(r) for r in range(lowered.num_ranks)]
    pos = [0] * len(acts)
    now = [0.0] * len(acts)
    sent: dict[tuple[int, int, int], float] = {}  # (RECV kind, receiving stage, mb) -> time
    moved = True
    while moved:
        moved = False
        for r, mine in enumerate(acts):
            while pos[r] < len(mine):
                stage, kind, mb = mine[pos[r]]
                if kind in dur:
                    now[r] += float(dur[kind][stage])
                elif kind == Kind.SEND_F:
                    sent[(Kind.RECV_F, stage + 1, mb)] = now[r]
                elif kind == Kind.SEND_B:
                    sent[(Kind.RECV_B, stage - 1, mb)] = now[r]
                elif (kind, stage, mb) in sent:
                    now[r] = max(now[r], sent[(kind, stage, mb)])
                else:
                    break  # waits for a SEND another rank has not reached yet
                pos[r] += 1
                moved = True
    if any(p < len(a) for p, a in zip(pos, acts, strict=True)):
        raise ValueError(f"{lowered.name}: the lowered message order deadlocks")
    return max(now, default=0.0)


def waits_at_consumers(lowered: Schedule) -> Schedule:
    """The lowered schedule with each RECV moved to just before the action that uses it.

    The lowering places receives by a unit-time run (every action, a fused BW too, one unit),
    which can leave a rank blocked on a message while work it could do waits behind it. With
    sends that never block and receives posted ahead, as the runtime's Mailbox does them,
    waiting where the data is needed cannot deadlock, and `replay_in_order` of the result is
    the simulator's makespan.
    """
    consumer = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.BW: Kind.RECV_B}
    kinds: list[int] = []
    stages: list[int] = []
    mbs: list[int] = []
    offsets = [0]
    for r in range(lowered.num_ranks):
        actions = lowered.rank_actions(r)
        pending = {
            (a.kind, a.stage, a.microbatch) for a in actions if a.kind in (Kind.RECV_F, Kind.RECV_B)
        }
        for a in actions:
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                continue
            key = (consumer.get(a.kind), a.stage, a.microbatch)
            if key in pending:
                pending.remove(key)
                kinds.append(int(key[0]))  # type: ignore[arg-type]
                stages.append(a.stage)
                mbs.append(a.microbatch)
            kinds.append(int(a.kind))
            stages.append(a.stage)
            mbs.append(a.microbatch)
        if pending:
            raise ValueError(f"{lowered.name}: rank {r} receives {sorted(pending)} nothing uses")
        offsets.append(len(kinds))
    return Schedule(
        lowered.name,
        lowered.stages_of_rank,
        lowered.num_microbatches,
        np.array(offsets),
        np.array(kinds),
        np.array(stages),
        np.array(mbs),
        lowered.params,
    )


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
