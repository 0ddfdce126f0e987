"""What the plan predicts for measured costs (pure data, no MPI).

`measured_costs` turns the per-(kind, stage) action times a step measured into the simulator's
`CostModel`; `replay_in_order` executes a lowered schedule in its own order, SENDs and RECVs
included, with those costs. The lowering puts each RECV just before the action that uses it,
so the replay equals the simulator's makespan: the order the runtime executes is the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hpcpipe.schedules._table import compute_table
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.simulate import CostModel, durations

__all__ = ["COMPUTE", "action_counts", "measured_costs", "replay_in_order"]

COMPUTE = ("F", "B", "W", "BW")


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
    """Makespan when every rank also keeps the lowered schedule's message order, as the
    runtime does: SENDs take no time, a RECV waits until its SEND has run. For a lowering with
    receives at their consumers it equals the simulator's makespan (tested for every
    schedule); for a hand-written order, the difference is what that order costs, and the
    difference from a measured step is what the runtime itself adds."""
    table = compute_table(lowered)
    took = np.zeros(lowered.num_actions)  # per position: compute actions' time (pairs too)
    took[table.pos] = durations(table, costs.stage_arrays(lowered.num_stages))
    took_of = [
        took[lowered.offsets[r] : lowered.offsets[r + 1]].tolist() for r in range(lowered.num_ranks)
    ]
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
                if kind < Kind.SEND_F:
                    now[r] += took_of[r][pos[r]]
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
