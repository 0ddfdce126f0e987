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

Searched forwards only, the states grow with m (p = 10, m = 80, V-Half's budget: 1.15
million to prove it optimal), because until the last round trips nothing shows the idle they
force. So the same search first runs backwards from the end (time reversed: the edges turned
round, tails as releases, memory changes negated): for each y, the least idle any order has
among the rank's last y actions. A forward order that has taken l of n actions is then charged
the idle of the last n - l as well, which prunes almost every order at once (the same proof:
about 60,000 states at any m). Both are relaxations of the same rank, so the result is still a
bound, exact where the forward search completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
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


@dataclass(frozen=True)
class _Machine:
    """The relaxation as jobs on one machine, forwards in time or backwards from the end.

    Kind k's j-th action takes `duration[k]`, changes memory by `memory[k]` (checked against
    the budget when it is taken), starts no earlier than `release[k] + j * release_step[k]`,
    and the makespan is at least its end plus `tail[k] + j * tail_step[k]`; an edge (a, b, lag)
    lets b's j-th action start only `lag` after a's j-th ends. `last_b`: the kind after whose
    last action only the kinds from `w_from` on may run (forwards: the lowest stage's B, then
    only W), or -1."""

    duration: tuple[float, ...]
    memory: tuple[float, ...]
    release: tuple[float, ...]
    release_step: tuple[float, ...]
    tail: tuple[float, ...]
    tail_step: tuple[float, ...]
    edges: tuple[tuple[int, int, float], ...]
    last_b: int = -1
    w_from: int = 0

    @cached_property
    def wiring(self) -> tuple[list[list[int]], list[list[int]], list[float]]:
        """For each kind the edges into it and out of it, and every edge's lag: built once, read
        for every state of every layer."""
        kinds = range(len(self.duration))
        ins = [[e for e, (_, b, _) in enumerate(self.edges) if b == k] for k in kinds]
        outs = [[e for e, (a, _, _) in enumerate(self.edges) if a == k] for k in kinds]
        return ins, outs, [lag for _, _, lag in self.edges]


def _forwards(kinds: RankActions) -> _Machine:
    n = len(kinds.duration)
    release = [0.0] * n
    step = [0.0] * n
    release[0], step[0] = kinds.release, kinds.release_step
    edges = tuple((kinds.pred[k], k, kinds.lag[k]) for k in range(1, n))
    v = n // 3
    return _Machine(
        kinds.duration, kinds.memory, tuple(release), tuple(step), kinds.tail, (0.0,) * n,
        edges, last_b=v, w_from=2 * v,
    )  # fmt: skip


def _backwards(kinds: RankActions, m: int) -> _Machine:
    """The same rank with time running back from the end (t -> makespan - t): every edge
    turned round, tails become releases and releases tails (the last microbatch's forward is
    the first met, with the latest release), and memory changes change sign (what is held
    just before a forward action is what is held just after it, running back)."""
    n = len(kinds.duration)
    tail = [0.0] * n
    step = [0.0] * n
    tail[0] = kinds.release + (m - 1) * kinds.release_step
    step[0] = -kinds.release_step
    edges = tuple((k, kinds.pred[k], kinds.lag[k]) for k in range(1, n))
    return _Machine(
        kinds.duration, tuple(-x for x in kinds.memory), kinds.tail, (0.0,) * n, tuple(tail),
        tuple(step), edges,
    )  # fmt: skip


def relaxed_makespan(
    kinds: RankActions,
    m: int,
    budget: float,
    *,
    target: float = np.inf,
    max_states: int = 100_000,
) -> Relaxed:
    """The least makespan of the rank alone for m microbatches within `budget` (module
    docstring), or `target` if nothing is faster than that.

    First the drain: running back from the end, the least idle among the rank's last actions;
    then the search forwards from the start, where every order that still has those last
    actions to come is charged that idle too. Each prunes what cannot reach `target` and takes
    up to `max_states`: the forward search alone is never cut shorter than without the drain."""
    total = m * sum(kinds.duration)
    room = target - total - kinds.release  # idle a drain may have to show, no more
    drain, back_states = [0.0], 0
    if room > _EPS:
        drain, back_states = _idle_at_end(_backwards(kinds, m), m, budget, room, max_states)
    got, states, exact = _fastest(_forwards(kinds), m, budget, target, drain, max_states)
    return Relaxed(float(min(got, target)), back_states + states, exact)


def _steps(machine: _Machine, m: int, budget: float, layer: dict, prune) -> tuple[dict, int]:
    """One more action from every state of a layer: the next layer (states an earlier-free one
    with the same counts dominates dropped) and how many states were made. `prune(end, span,
    left, counts)` drops a new state (it cannot reach the goal)."""
    dur, mem, rel, rel_step = (
        machine.duration,
        machine.memory,
        machine.release,
        machine.release_step,
    )
    tail, tail_step = machine.tail, machine.tail_step
    n = len(dur)
    ins, outs, lags = machine.wiring
    total = m * sum(dur)
    grown: dict[tuple[int, ...], list] = {}
    made = 0
    for done, group in layer.items():
        used = sum(c * x for c, x in zip(done, mem, strict=True))
        left = total - sum(c * d for c, d in zip(done, dur, strict=True))
        for free, span, pending in group:
            for k in range(n):
                j = done[k]
                if j >= m or (mem[k] > 0 and used + mem[k] > budget + _EPS):
                    continue
                if any(not pending[e] for e in ins[k]):
                    continue
                ready = max([rel[k] + j * rel_step[k], *(pending[e][0] for e in ins[k])])
                end = max(free, ready) + dur[k]
                new_span = max(span, end + tail[k] + j * tail_step[k])
                counts = (*done[:k], j + 1, *done[k + 1 :])
                if prune(end, new_span, left - dur[k], counts):
                    continue
                queues = list(pending)
                for e in ins[k]:
                    queues[e] = pending[e][1:]
                for e in outs[k]:
                    queues[e] = queues[e] + (end + lags[e],)
                queues = [tuple(max(t, end) for t in q) for q in queues]
                grown.setdefault(counts, []).append((end, new_span, tuple(queues)))
                made += 1
    return {counts: _undominated(group) for counts, group in grown.items()}, made


def _start(machine: _Machine) -> dict:
    return {(0,) * len(machine.duration): [(0.0, 0.0, ((),) * len(machine.edges))]}


def _idle_at_end(
    machine: _Machine, m: int, budget: float, room: float, max_states: int
) -> tuple[list[float], int]:
    """Running back from the end: for y = 0, 1, ... the least idle any order has among the
    rank's last y actions (up to `room`: a state with that much is dropped, it has shown
    enough), as deep as `max_states` reaches; and the states made. Idle only grows along an
    order, so each figure holds for every y at or past it."""
    dur = machine.duration
    total = m * sum(dur)

    def enough(end: float, span: float, left: float, counts: tuple[int, ...]) -> bool:
        return end - (total - left) >= room - _EPS

    layer, states, least = _start(machine), 0, [0.0]
    for _ in range(len(dur) * m):
        layer, made = _steps(machine, m, budget, layer, enough)
        states += made
        if not layer:  # every order shows `room` within one more action
            return [*least, room], states
        least.append(
            min(
                free - sum(c * d for c, d in zip(done, dur, strict=True))
                for done, group in layer.items()
                for free, _, _ in group
            )
        )
        if states > max_states:
            break
    return least, states


def _fastest(
    machine: _Machine,
    m: int,
    budget: float,
    target: float,
    drain: list[float],
    max_states: int,
) -> tuple[float, int, bool]:
    """Forwards from the start: the least makespan (or `target`), the states made and whether
    it is exact. An order that has taken l of the rank's n actions still has the last n - l
    to come, with at least `drain[n - l]` idle among them (the last figure for more): its end
    is charged that idle too."""
    dur = machine.duration
    n = len(dur) * m
    total = m * sum(dur)
    last_b, w_from = machine.last_b, machine.w_from
    deepest = len(drain) - 1

    def still(taken: int) -> float:
        return drain[min(n - taken, deepest)]

    layers = 0

    def prune(end: float, span: float, left: float, counts: tuple[int, ...]) -> bool:
        finish = end + left + still(layers + 1)
        if last_b >= 0 and counts[last_b] < m:  # every F and B left ends by the lowest
            w_left = sum(  # stage's last B; only W may follow it
                (m - c) * d for c, d in zip(counts[w_from:], dur[w_from:], strict=True)
            )
            finish = max(finish, end + left - w_left + machine.tail[last_b])
        return max(span, finish) >= target - _EPS

    layer, states = _start(machine), 0
    for _ in range(n):
        layer, made = _steps(machine, m, budget, layer, prune)
        states += made
        layers += 1
        if not layer:
            return float(target), states, True
        if states > max_states:
            after = still(layers)
            reached = min(
                max(span, free + total - sum(c * d for c, d in zip(done, dur, strict=True)) + after)
                for done, group in layer.items()
                for free, span, _ in group
            )
            return float(min(reached, target)), states, False
    best = min(max(span, free) for group in layer.values() for free, span, _ in group)
    return float(min(best, target)), states, True


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
