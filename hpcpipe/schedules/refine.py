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

A second phase (`then`) goes on from where that stops or its cap ends it, with two things
that keep the number of simulations per kept move small on long runs (the first phase is
the plain one, so the two never end above it alone). A move refused
is not tried again while the times around it (the gap's start and end, the moved action's
input) stay the same; before the refinement stops, one pass retries every refused move (a
move can help later for reasons far from its gap), so it stops where the old one did: where
no gap move helps. And a change often has to travel through the whole steady state: the gap
moves make it one microbatch per pass (MoE costs, p = 6, m = 48, budget 4: the same four
moves, one microbatch on each time, 45 times, before V-Half's 179.15 drops to the optimum,
178.75). Where the kept moves since one that moved the same action of the microbatch before
the same way repeat, `_State.ripple` makes that period for every later microbatch at once
(then half as many, a quarter, ... where that does not help): one simulation instead of a
pass per microbatch.

When no gap move helps and the cap allows a full pass over them, `refine` also tries every
shift of one action by up to `_SHIFT` positions either way on its rank (again never past an
action of its own stage and kind): a move later as well as earlier, which reaches orders no gap
move does, e.g. deferring a first stage's W to the end so that the last stage's F and B can
alternate (p = 3, m = 3, budget 2.5: 11.5 -> 10.5, the exact optimum). A shift pass costs
about 2 x `_SHIFT` simulations per action, so only small problems get it.

The number of simulations is capped (`max_evals`), not the time: the result is the same on
every rank.

`refine` stops where no single move helps, and some better orders are several moves away on
every rank at once. `deepened` is a kick out of such a stop: each rank runs a few more forwards
before its first backward (as many as the budget holds), so more microbatches are in flight
when the drain begins; `refine` then repairs the steady state the kick disturbed. Unit costs,
p = 16, budget 6.5 (V-Min at peak 6 is the best fixed schedule there): two more forwards per
rank (fewer where the budget is full: the last rank takes one), refined, take m = 16 from
77.5 to 77.0 and m = 128 from 413.5 to 413.0.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from hpcpipe.schedules._table import compute_table
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.simulate import CostModel, Reorders, SimResult, simulate

__all__ = ["deepened", "refine", "shift_pass_evals"]

_REL = 1e-9
_LOOK = 12  # later actions of the rank tried per gap
_SHIFT = 8  # positions an action may move either way in a shift pass
_PERIOD = 32  # most kept moves one period of a ripple may have


def _score(result: SimResult) -> tuple[float, float]:
    return float(result.makespan), float(result.end.sum())


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol_m = _REL * max(1.0, abs(b[0]))
    if a[0] < b[0] - tol_m:
        return True
    return abs(a[0] - b[0]) <= tol_m and a[1] < b[1] - _REL * max(1.0, abs(b[1]))


def _permutation(n: int, frm: int, to: int) -> np.ndarray:
    """Positions 0..n-1 with `frm` moved to `to` (before or after)."""
    idx = np.arange(n)
    if to < frm:
        return np.concatenate([idx[:to], [frm], idx[to:frm], idx[frm + 1 :]])
    return np.concatenate([idx[:frm], idx[frm + 1 : to + 1], [frm], idx[to + 1 :]])


def _moved(sched: Schedule, frm: int, to: int) -> Schedule:
    """The schedule with the action at array position `frm` moved to position `to` (same
    rank; before or after)."""
    idx = _permutation(sched.kinds.size, frm, to)
    return sched.replace_actions(
        sched.offsets, sched.kinds[idx], sched.stages[idx], sched.microbatches[idx]
    )


def shift_pass_evals(actions: int) -> int:
    """Simulations one full shift pass over a schedule of that many actions may take."""
    return 2 * _SHIFT * actions


def refine(
    schedule: Schedule,
    costs: CostModel,
    budget: float | None,
    max_evals: int,
    *,
    shifts: bool = True,
    then: int = 0,
) -> tuple[Schedule, SimResult, int]:
    """Improve `schedule` (unlowered, without pairs) by moves into gaps, then (with `shifts`,
    where a full pass fits `max_evals`) by shifts, then with up to `then` more simulations
    by moves into gaps that make ripples at once and remember refused moves (module
    docstring); returns the best schedule found, its simulation and the number of
    simulations spent."""
    state = _State(schedule, costs, budget, max_evals)
    shifts = shifts and shift_pass_evals(schedule.kinds.size) <= max_evals
    while state.evals < max_evals and _gap_move(state):
        pass
    while shifts and state.evals < max_evals and _shift(state):
        pass
    if then > 0:
        state.fast, state.max_evals = True, state.evals + then
        while state.evals < state.max_evals:
            if _gap_move(state):
                continue
            if not state.skipped:
                break
            state.refused.clear()  # before stopping, one pass that retries every refused move
    return state.best, state.result, state.evals


class _State:
    """The best schedule so far, its simulation and score, and the simulations spent.

    A trial is timed on the start schedule's actions in the trial's order (`Reorders`,
    `simulate`'s figures without building a Schedule); only a kept move builds one."""

    def __init__(self, schedule: Schedule, costs: CostModel, budget: float | None, cap: int):
        self.best, self.costs, self.max_evals = schedule, costs, cap
        self.result = simulate(schedule, costs)
        self.score = _score(self.result)
        self.limit = np.inf if budget is None else budget + _REL * max(1.0, abs(budget))
        self.evals = 0
        self.reorders = Reorders(schedule, costs)
        self.order = np.arange(schedule.kinds.size)  # the best's actions, as the start's
        self.start, self.mbs = schedule, schedule.num_microbatches
        self.moves: list[tuple[int, int, int, int]] = []  # kept: (kind, stage, mb, shift)
        self.refused: set[tuple] = set()  # gap moves refused, with the times around them
        self.skipped = 0  # refused moves the last pass over the gaps did not try again
        self.fast = False  # ripples made at once, refused moves remembered
        self.dead: set[tuple[tuple[int, int, int], ...]] = set()  # ripples that did not help

    def keys(self, table) -> np.ndarray:
        return table.kind.astype(np.int64) * self.best.num_stages + table.stage

    def tried(self, frm: int, to: int) -> bool:
        """Simulate the move of array position `frm` to `to`; keep it when it is better."""
        self.evals += 1
        order = self.order[_permutation(self.order.size, frm, to)]
        got = self.reorders.figures(order)
        if got is None or got[2] > self.limit:  # a dependency cycle, or over the budget
            return False
        if not _better(got[:2], self.score):
            return False
        best = self.best
        self.moves.append(
            (int(best.kinds[frm]), int(best.stages[frm]), int(best.microbatches[frm]), to - frm)
        )
        self.best = _moved(best, frm, to)
        self.result, self.order = simulate(self.best, self.costs), order
        self.score = _score(self.result)
        if self.fast:
            self.ripple()
        return True

    def ripple(self) -> None:
        """Where the last kept moves repeat earlier ones one microbatch on (a change rippling
        through the steady state, one period per pass over the gaps), try the rest of the
        ripple at once: all of it, then half, a quarter, ... Kept moves of the same shape
        that did not help are not tried again."""
        period = _period(self.moves)
        if period is None:
            return
        shape = tuple((k, s, d) for k, s, _, d in period)
        if shape in self.dead:
            return
        self.dead.add(shape)
        ahead = [[(k, s, mb + t, d) for k, s, mb, d in period] for t in range(1, self.mbs)]
        order, at = self.order.copy(), self.at()
        n = 0
        while n < len(ahead) and self._made(order, at, ahead[n]):
            n += 1
        while n and self.evals < self.max_evals:
            order, at = self.order.copy(), self.at()
            for moves in ahead[:n]:
                self._made(order, at, moves)
            self.evals += 1
            got = self.reorders.figures(order)
            if got is not None and got[2] <= self.limit and _better(got[:2], self.score):
                start = self.start
                self.best = start.replace_actions(
                    start.offsets, start.kinds[order], start.stages[order],
                    start.microbatches[order],
                )  # fmt: skip
                self.result, self.order = simulate(self.best, self.costs), order
                self.score = _score(self.result)
                self.moves.clear()
                self.dead.discard(shape)
                return
            n //= 2

    def at(self) -> np.ndarray:
        """Where each of the start schedule's actions is in the best's order."""
        at = np.empty_like(self.order)
        at[self.order] = np.arange(self.order.size)
        return at

    def _made(self, order: np.ndarray, at: np.ndarray, moves: list[tuple[int, int, int, int]]):
        """Make `moves` (kind, stage, microbatch, shift) in turn on `order` and its inverse
        `at`, in place; False at the first that cannot be made (no such microbatch, off its
        rank, or past an action of its own stage and kind), the ones before it made."""
        start = self.start
        for kind, stage, mb, shift in moves:
            if mb >= self.mbs:
                return False
            a = int(self.index[(kind * start.num_stages + stage) * self.mbs + mb])
            if a < 0:
                return False
            frm = int(at[a])
            to = frm + shift
            lo, hi = min(frm, to), max(frm, to) + 1
            if lo < self.rank_lo[a] or hi > self.rank_hi[a]:
                return False
            if np.count_nonzero(self.channel[order[lo:hi]] == self.channel[a]) > 1:
                return False
            order[lo:hi] = np.roll(order[lo:hi], 1 if to < frm else -1)
            at[order[lo:hi]] = np.arange(lo, hi)
        return True

    @cached_property
    def index(self) -> np.ndarray:
        """The start schedule's action for (kind, stage, microbatch), or -1."""
        start = self.start
        keys = (start.kinds.astype(np.int64) * start.num_stages + start.stages) * self.mbs
        index = np.full((int(start.kinds.max()) + 1) * start.num_stages * self.mbs, -1)
        index[keys + start.microbatches] = np.arange(start.kinds.size)
        return index

    @cached_property
    def channel(self) -> np.ndarray:
        return self.start.kinds.astype(np.int64) * self.start.num_stages + self.start.stages

    @cached_property
    def rank_lo(self) -> np.ndarray:
        offsets = self.start.offsets
        return np.repeat(offsets[:-1], np.diff(offsets))

    @cached_property
    def rank_hi(self) -> np.ndarray:
        offsets = self.start.offsets
        return np.repeat(offsets[1:], np.diff(offsets))


def _period(moves: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]] | None:
    """The kept moves since the one that moved the same action of the microbatch before the
    last move's the same way (at most `_PERIOD` of them): one period of a ripple, or None."""
    kind, stage, mb, shift = moves[-1]
    for i in range(len(moves) - 2, max(len(moves) - 2 - _PERIOD, -1), -1):
        if moves[i] == (kind, stage, mb - 1, shift):
            return moves[i + 1 :]
    return None


def _gap_move(state: _State) -> bool:
    """One accepted move of a later action into a gap in front of an earlier one (the
    longest waits first), or False when none helps."""
    best, result = state.best, state.result
    state.skipped = 0
    table = compute_table(best)
    end = np.append(result.end, 0.0)  # dep == n: no input
    ready = end[table.dep] + np.where(table.cross, state.costs.comm_time, 0.0)
    key = state.keys(table)
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
            seen = None
            if state.fast:  # the two actions, by their index in the start schedule, and times
                a, b = int(state.order[table.pos[j]]), int(state.order[table.pos[k]])
                seen = (a, b, float(result.start[k]), float(result.end[k - 1]), float(ready[j]))
                if seen in state.refused:
                    state.skipped += 1
                    continue
            if state.evals >= state.max_evals:
                return False
            if state.tried(int(table.pos[j]), int(table.pos[k])):
                return True
            if seen is not None:
                state.refused.add(seen)
    return False


def _shift(state: _State) -> bool:
    """One accepted shift of an action by 1.._SHIFT positions on its rank (nearest first,
    earlier before later), or False when none helps."""
    table = compute_table(state.best)
    key = state.keys(table)
    for r in range(state.best.num_ranks):
        lo, hi = int(table.offsets[r]), int(table.offsets[r + 1])
        for i in range(lo, hi):
            for d in range(1, _SHIFT + 1):
                for j in (i - d, i + d):
                    if not lo <= j < hi:
                        continue
                    a, b = min(i, j), max(i, j)
                    if np.count_nonzero(key[a : b + 1] == key[i]) > 1:
                        continue  # it would pass a microbatch of its own channel
                    if state.evals >= state.max_evals:
                        return False
                    if state.tried(int(table.pos[i]), int(table.pos[j])):
                        return True
    return False


def deepened(
    schedule: Schedule, costs: CostModel, budget: float | None, extra: int
) -> Schedule | None:
    """`schedule` (unlowered, without pairs) with each rank's next `extra` forwards moved in
    front of its first backward, fewer where the activations held before that backward would
    pass `budget`; None where no rank changes, or the new order deadlocks or peaks above
    `budget` (later than the first backward, on any rank: the kick is then dropped whole,
    not thinned). Forwards keep their order, so every channel still sends in microbatch
    order."""
    if schedule.is_lowered or schedule.pairs.size:
        raise ValueError("deepened: an unlowered schedule without overlapped pairs")
    act = costs.stage_arrays(schedule.num_stages)["activation"]
    limit = np.inf if budget is None else budget + _REL * max(1.0, abs(budget))
    kinds, stages = schedule.kinds, schedule.stages
    order: list[np.ndarray] = []
    changed = False
    for r in range(schedule.num_ranks):
        lo, hi = int(schedule.offsets[r]), int(schedule.offsets[r + 1])
        idx = np.arange(lo, hi)
        back = np.flatnonzero(kinds[lo:hi] != Kind.F)
        if back.size == 0:
            order.append(idx)
            continue
        first = lo + int(back[0])
        held = float(act[stages[lo:first]].sum())
        pulled = []
        for j in range(first, hi):
            if len(pulled) == extra:
                break
            if kinds[j] != Kind.F:
                continue
            if held + act[stages[j]] > limit:
                break
            held += float(act[stages[j]])
            pulled.append(j)
        if pulled:
            changed = True
            rest = np.setdiff1d(np.arange(first, hi), pulled, assume_unique=True)
            idx = np.concatenate([np.arange(lo, first), pulled, rest])
        order.append(idx)
    if not changed:
        return None
    idx = np.concatenate(order)
    kicked = schedule.replace_actions(
        schedule.offsets, kinds[idx], stages[idx], schedule.microbatches[idx]
    )
    try:
        peak = float(simulate(kicked, costs).peak_memory.max())
    except ScheduleError:  # a pulled forward waits for one its neighbour did not pull
        return None
    return kicked if peak <= limit else None
