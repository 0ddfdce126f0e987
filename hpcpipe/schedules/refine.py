"""Local improvement of a schedule's order under real costs and a memory budget.

Generators and the list scheduler fix an order; under the deck's own costs (a heavy last
stage, communication) that order leaves gaps a different order would fill. `refine` looks at
every gap in the simulated timeline, where a rank waits before action x, and tries moving a
later action y of the same rank into it (in front of x), when y's input is there before x
starts. A move is kept when the simulated makespan drops, or stays and the sum of all end
times drops (so progress on ranks off the critical path counts, and the search terminates);
a move that breaks a dependency, exceeds the budget or would reorder a channel is refused.
Microbatches keep their order per stage and kind (the runtime matches messages of one channel
in the order they are sent), so only actions of different (stage, kind) pass each other.

The number of simulations is capped (`max_evals`), not the time: the result is the same on
every rank.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules._table import compute_table
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Schedule
from hpcpipe.schedules.simulate import CostModel, SimResult, simulate

__all__ = ["refine"]

_REL = 1e-9
_LOOK = 12  # later actions of the rank tried per gap


def _score(result: SimResult) -> tuple[float, float]:
    return float(result.makespan), float(result.end.sum())


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol_m = _REL * max(1.0, abs(b[0]))
    if a[0] < b[0] - tol_m:
        return True
    return abs(a[0] - b[0]) <= tol_m and a[1] < b[1] - _REL * max(1.0, abs(b[1]))


def _moved(sched: Schedule, frm: int, to: int) -> Schedule:
    """The schedule with the action at array position `frm` moved to position `to` (< frm,
    same rank)."""
    idx = np.arange(sched.kinds.size)
    idx = np.concatenate([idx[:to], [frm], idx[to:frm], idx[frm + 1 :]])
    return sched.replace_actions(
        sched.offsets, sched.kinds[idx], sched.stages[idx], sched.microbatches[idx]
    )


def refine(
    schedule: Schedule, costs: CostModel, budget: float | None, max_evals: int
) -> tuple[Schedule, SimResult, int]:
    """Improve `schedule` (unlowered, without pairs) by moves into gaps; returns the best
    schedule found, its simulation and the number of simulations spent."""
    best = schedule
    result = simulate(best, costs)
    score = _score(result)
    cap = np.inf if budget is None else budget + _REL * max(1.0, abs(budget))
    evals = 0
    while evals < max_evals:
        table = compute_table(best)
        end = np.append(result.end, 0.0)  # dep == n: no input
        ready = end[table.dep] + np.where(table.cross, costs.comm_time, 0.0)
        key = table.kind.astype(np.int64) * best.num_stages + table.stage
        accepted = False
        gaps = []
        for r in range(best.num_ranks):
            lo, hi = int(table.offsets[r]), int(table.offsets[r + 1])
            for k in range(lo + 1, hi):
                wait = result.start[k] - result.end[k - 1]
                if wait > _REL * max(1.0, result.makespan):
                    gaps.append((-wait, k, hi))
        gaps.sort()  # the longest waits first
        for _, k, hi in gaps:
            passed: set[int] = {int(key[k])}
            for j in range(k + 1, min(hi, k + 1 + _LOOK)):
                kj = int(key[j])
                if kj in passed or ready[j] >= result.start[k]:
                    passed.add(kj)
                    continue
                passed.add(kj)
                if evals >= max_evals:
                    break
                evals += 1
                trial = _moved(best, int(table.pos[j]), int(table.pos[k]))
                try:
                    got = simulate(trial, costs)
                except ScheduleError:
                    continue
                if got.peak_memory.max() > cap:
                    continue
                trial_score = _score(got)
                if _better(trial_score, score):
                    best, result, score = trial, got, trial_score
                    accepted = True
                    break
            if accepted or evals >= max_evals:
                break
        if not accepted:
            break
    return best, result, evals
