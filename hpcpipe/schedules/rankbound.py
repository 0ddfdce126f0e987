"""One rank alone: the fastest order of its own actions within its memory budget, solved exactly.

bound.py charges each rank its work plus the fill and the drain its memory budget forces,
each estimated on its own. When the budget holds only a few microbatches they interact: the
budget lets the rank start only so many microbatches before it must wait for one to come
back, and every such wave pays a round trip, not only the first and the last. This module
solves the relaxation in which the other ranks never get in the way (each of their actions
takes its time but never waits for another): what remains is one machine running the rank's
F, B and W actions with time lags between a microbatch's consecutive actions (the stages of
other ranks in between), release times (its first stage's inputs arrive no faster than the
slowest stage above can make them), tails (what is left of a microbatch's path after an
action) and the memory budget. Any schedule's makespan is at least this relaxation's optimum.

Microbatches are interchangeable, so each kind of action (F, B or W of one stage) can be
taken in microbatch order (relabel the later actions of two microbatches that pass each
other). A state is then how many of each kind are done, when the rank is free, the makespan
so far and when each started microbatch's next action may begin; every action starts as early
as it can (a left-shifted schedule is as fast). The search runs layer by layer, one action per
layer, and drops a state that an earlier-free state with the same counts dominates (checked
against a few, `_undominated`) and any that cannot finish below `target`. Past `max_states`
it stops and returns the least lower bound of the layer it reached: every order passes
through that layer, so the figure is still a bound, only a looser one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import le

import numpy as np

__all__ = ["RankActions", "Relaxed", "rank_actions", "relaxed_makespan"]

_EPS = 1e-9
_AGAINST = 8


@dataclass(frozen=True)
class RankActions:
    """A rank's kinds of action, in order F of its stages (upwards), B (downwards), W.

    Kind k's j-th action may start once the j-th action of kind `pred[k]` ended `lag[k]`
    before (kind 0: the `release + j * release_step`); it takes `duration[k]`, changes the
    rank's memory by `memory[k]` when it ends, and the makespan is at least its end plus
    `tail[k]`."""

    duration: tuple[float, ...]
    pred: tuple[int, ...]
    lag: tuple[float, ...]
    tail: tuple[float, ...]
    memory: tuple[float, ...]
    release: float
    release_step: float


@dataclass(frozen=True)
class Relaxed:
    """The relaxation's optimum (`exact`) or a bound on it (the state limit was reached)."""

    makespan: float
    states: int
    exact: bool


def rank_actions(
    row: Sequence[int],
    f_start: np.ndarray,
    b_start: np.ndarray,
    critical: float,
    stage_costs: dict[str, np.ndarray],
    b_frees: float,
) -> RankActions:
    """The kinds of action of the rank holding stages `row`, from one microbatch's earliest
    F and B start per stage (`f_start`, `b_start`) and the end of its critical path.

    `stage_costs`: t_f, t_b (a B alone, at most a fused BW), t_bwd (B + W, or BW if
    cheaper) and activation per stage."""
    t_f, t_b, t_bwd, act = (stage_costs[k] for k in ("t_f", "t_b", "t_bwd", "activation"))
    stages = sorted(row)
    v = len(stages)
    duration: list[float] = []
    pred: list[int] = []
    lag: list[float] = []
    tail: list[float] = []
    memory: list[float] = []
    for i, s in enumerate(stages):  # F upwards; the next F waits for the stages in between
        duration.append(float(t_f[s]))
        pred.append(i - 1)
        lag.append(float(f_start[s] - f_start[stages[i - 1]] - t_f[stages[i - 1]]) if i else 0.0)
        tail.append(float(critical - f_start[s] - t_f[s]))
        memory.append(float(act[s]))
    for i, s in enumerate(stages):  # B downwards: after the last F's round trip, or the B above
        duration.append(float(t_b[s]))
        if i == v - 1:
            pred.append(v - 1)
            lag.append(float(b_start[s] - f_start[s] - t_f[s]))
        else:
            above = stages[i + 1]
            pred.append(v + i + 1)
            lag.append(float(b_start[s] - b_start[above] - t_b[above]))
        tail.append(float(critical - b_start[s] - t_b[s]))
        memory.append(-b_frees * float(act[s]))
    for i, s in enumerate(stages):  # W after its own B
        duration.append(float(t_bwd[s] - t_b[s]))
        pred.append(v + i)
        lag.append(0.0)
        tail.append(0.0)
        memory.append(-(1.0 - b_frees) * float(act[s]))
    first = stages[0]
    return RankActions(
        tuple(duration),
        tuple(pred),
        tuple(lag),
        tuple(tail),
        tuple(memory),
        release=float(f_start[first]),
        release_step=float(t_f[:first].max()) if first else 0.0,
    )


def relaxed_makespan(
    kinds: RankActions,
    m: int,
    budget: float,
    *,
    target: float = np.inf,
    max_states: int = 100_000,
) -> Relaxed:
    """The least makespan of the rank alone for m microbatches within `budget` (module
    docstring), or `target` if nothing is faster than that."""
    n = len(kinds.duration)
    dur, pred, lag, tail, mem = (
        kinds.duration,
        kinds.pred,
        kinds.lag,
        kinds.tail,
        kinds.memory,
    )
    consumers = [[j for j in range(n) if pred[j] == k] for k in range(n)]
    v = n // 3
    last_b = v  # B of the rank's lowest stage: what is left after it is its tail
    total_work = m * sum(dur)
    # state: (free at, makespan so far, per kind the times its pending actions may start)
    layer: dict[tuple[int, ...], list[tuple[float, float, tuple[tuple[float, ...], ...]]]] = {
        (0,) * n: [(0.0, 0.0, ((),) * n)]
    }
    states = 0
    for _ in range(n * m):
        grown: dict[tuple[int, ...], list] = {}
        for done, group in layer.items():
            used = sum(c * x for c, x in zip(done, mem, strict=True))
            left = total_work - sum(c * d for c, d in zip(done, dur, strict=True))
            for free, span, pending in group:
                for k in range(n):
                    if done[k] >= m or (mem[k] > 0 and used + mem[k] > budget + _EPS):
                        continue
                    if k == 0:
                        ready = kinds.release + done[0] * kinds.release_step
                    elif pending[k]:
                        ready = pending[k][0]
                    else:
                        continue
                    end = max(free, ready) + dur[k]
                    new_span = max(span, end + tail[k])
                    after = left - dur[k]
                    finish = end + after
                    counts = (*done[:k], done[k] + 1, *done[k + 1 :])
                    if counts[last_b] < m:  # every F and B left ends by the lowest stage's
                        w_left = sum(  # last B; only W may follow it
                            (m - c) * d for c, d in zip(counts[2 * v :], dur[2 * v :], strict=True)
                        )
                        finish = max(finish, end + after - w_left + tail[last_b])
                    if max(new_span, finish) >= target - _EPS:
                        continue
                    queues = list(pending)
                    if k:
                        queues[k] = pending[k][1:]
                    for j in consumers[k]:
                        queues[j] = pending[j] + (end + lag[j],)
                    queues = [tuple(max(t, end) for t in q) for q in queues]
                    grown.setdefault(counts, []).append((end, new_span, tuple(queues)))
                    states += 1
        layer = {counts: _undominated(group) for counts, group in grown.items()}
        if not layer:
            return Relaxed(float(target), states, True)
        if states > max_states:
            reached = min(
                max(span, free + total_work - sum(c * d for c, d in zip(done, dur, strict=True)))
                for done, group in layer.items()
                for free, span, _ in group
            )
            return Relaxed(float(min(reached, target)), states, False)
    best = min(max(span, free) for group in layer.values() for free, span, _ in group)
    return Relaxed(float(min(best, target)), states, True)


def _undominated(group: list) -> list:
    """The states with the same counts, less those a state kept before is at least as good as
    in every figure (free at, makespan so far, each pending start). Only the first `_AGAINST`
    kept (the earliest free) are compared: keeping a dominated state costs time, not
    correctness, and comparing every pair costs more than it saves."""
    unique = {(s[0], s[1], *(t for q in s[2] for t in q)): s for s in group}
    kept: list[tuple[tuple[float, ...], tuple]] = []
    for vec in sorted(unique):
        loose = tuple(x + _EPS for x in vec)
        if any(all(map(le, seen, loose)) for seen, _ in kept[:_AGAINST]):
            continue
        kept.append((vec, unique[vec]))
    return [state for _, state in kept]
