"""What the plan predicts for a measured step (pure: NumPy and the simulator, no MPI).

`step_figures` compares one measured step with the simulation under the costs it measured
(`hpcpipe.schedules.replay.measured_costs`), and with `replay_in_order`, the same costs executed
in the lowered schedule's own order, SENDs and RECVs included (equal to the simulation since
the lowering waits for each message at its consumer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hpcpipe.schedules import CostModel, Schedule, simulate
from hpcpipe.schedules.replay import COMPUTE, measured_costs, replay_in_order

__all__ = ["COMPUTE", "step_figures"]

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
