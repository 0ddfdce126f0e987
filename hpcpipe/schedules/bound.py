"""A makespan lower bound: no schedule of this placement, costs and memory budget is faster.

For each rank r (costs per stage; F of stage s allocates `activation[s]`, held until its W):

- **work**: every F, B and W of its stages, m times (a fused BW counts as min(B+W, BW)).
- **head**: its first F cannot start before one microbatch's forwards reach its first stage.
- **fill**: until the first backward can reach the rank (one microbatch's forwards to the loss
  and backwards down to the rank, `E_r`), it can only run forwards, and with nothing freed
  they must fit the budget together: busy time before `E_r` is at most a fractional knapsack
  of forward time under the budget (each stage's forwards also start no earlier than their
  input can arrive). The rest of `E_r - head` is idle.
- **drain**: after the last forward of its last stage starts, that microbatch's backward
  needs a round trip through the stages above; meanwhile the rank can only run backwards and
  weights of microbatches whose activations it still holds, at most the budget less the last
  microbatch's own: a knapsack of (B + W) time per activation. The rest of the round trip is
  idle. With a budget below all m microbatches, some W must precede that last forward, so the
  fill and drain idles are disjoint and add; otherwise only the larger counts.

- **memory x time**: a microbatch's activations on a stage live at least from its F's start
  through the round trip to its B's end (the part B frees) or W's end (the rest); the live
  total never exceeds the budget, so m x that activation-time on the rank is at most budget x
  makespan (what binds when the budget holds only a few microbatches).

- **one rank alone** (rankbound.py): where the budget binds, the fill, the drain and every
  round trip in between interact; the rank's own actions are ordered exactly, with the other
  ranks never in its way (their actions take their time but never wait), most binding rank
  first, within `max_states` of search in all (forwards, and backwards from the end for the
  idle of the last round trips). This is what proves V-Half and V-Min optimal at their
  budgets, where the terms above each fall short.

It holds for schedules run action by action; overlapped F&B pairs hide part of each half's
communication (`simulate.durations`), which these terms charge in full.

The bound is max over ranks of head + work + idle, of the memory x time term and of the rank
alone, and of the critical path of one microbatch plus m-1 passes through the slowest stage
(the last of its m forwards or backwards starts no earlier).
It is exact for schedules with no gap inside any rank's span when only the head is forced
(ZB-V and ZB-H2 with F = B = W, the papers' "zero bubble"), and for memory-bound warm-ups it
charges exactly the forwards the budget cannot hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hpcpipe.schedules.rankbound import RankActions, rank_actions, relaxed_makespan
from hpcpipe.schedules.simulate import CostModel

__all__ = ["LowerBound", "lower_bound", "rank_alone"]


@dataclass(frozen=True)
class LowerBound:
    """The bound and the rank whose terms reach it (`why` says which term binds)."""

    makespan: float
    rank: int
    head: float
    work: float
    idle: float
    why: str

    def gap(self, makespan: float) -> float:
        """Relative distance of a makespan above the bound (0: at the bound)."""
        return makespan / self.makespan - 1.0 if self.makespan > 0 else 0.0


def _knapsack(limit: float, items: list[tuple[float, float]]) -> float:
    """Most busy time from (memory per unit of time, time available) items under a memory
    limit; fractional, so a relaxation: never less than what a schedule achieves."""
    got, room = 0.0, limit
    for rate, amount in sorted(items):
        if amount <= 0:
            continue
        if rate <= 0:
            got += amount
            continue
        take = min(amount, room / rate)
        got += take
        room -= take * rate
        if room <= 0:
            break
    return got


@dataclass(frozen=True, eq=False)
class _Path:
    """Per-stage costs (a B alone at most a fused BW; B + W, or BW if cheaper) and one
    microbatch alone on this placement: the earliest start of F and of B on each stage and
    the end of its critical path."""

    stages_of_rank: tuple[tuple[int, ...], ...]
    t_f: np.ndarray
    t_b: np.ndarray
    t_w: np.ndarray
    t_bwd: np.ndarray
    activation: np.ndarray
    rank_of: np.ndarray
    f_start: np.ndarray
    b_start: np.ndarray
    critical: float

    def rank_actions(self, r: int, b_frees: float) -> RankActions:
        """Rank r's kinds of action for the search of the rank alone."""
        per_stage = {
            "t_f": self.t_f,
            "t_b": self.t_b,
            "t_bwd": self.t_bwd,
            "activation": self.activation,
        }
        row = self.stages_of_rank[r]
        return rank_actions(row, self.f_start, self.b_start, self.critical, per_stage, b_frees)


def _one_microbatch(stages_of_rank: Sequence[Sequence[int]], costs: CostModel) -> _Path:
    num_stages = sum(len(row) for row in stages_of_rank)
    arr = costs.stage_arrays(num_stages)
    t_f, t_b, t_w = arr["t_f"], arr["t_b"], arr["t_w"]
    t_bwd = np.minimum(t_b + t_w, arr["t_bw"])
    t_b_min = np.minimum(t_b, arr["t_bw"])
    rank_of = np.empty(num_stages, dtype=np.int64)
    for r, row in enumerate(stages_of_rank):
        rank_of[list(row)] = r
    hop = np.where(rank_of[1:] != rank_of[:-1], costs.comm_time, 0.0)  # stage s -> s+1
    f_start = np.concatenate(([0.0], np.cumsum(t_f[:-1] + hop)))
    b_start = np.empty(num_stages)
    b_start[-1] = f_start[-1] + t_f[-1]  # the loss
    for s in range(num_stages - 2, -1, -1):
        b_start[s] = b_start[s + 1] + t_b_min[s + 1] + hop[s]
    rows = tuple(tuple(row) for row in stages_of_rank)
    critical = float(b_start[0] + t_bwd[0])
    return _Path(
        rows, t_f, t_b_min, t_w, t_bwd, arr["activation"], rank_of, f_start, b_start, critical
    )


def rank_alone(stages_of_rank: Sequence[Sequence[int]], r: int, costs: CostModel) -> RankActions:
    """Rank r's actions on this placement, as `lower_bound` hands them to
    `rankbound.relaxed_makespan` (for tests and for studying one rank)."""
    return _one_microbatch(stages_of_rank, costs).rank_actions(r, costs.b_frees)


def lower_bound(
    stages_of_rank: Sequence[Sequence[int]],
    m: int,
    costs: CostModel,
    budget: float | None = None,
    *,
    target: float | None = None,
    max_states: int = 100_000,
) -> LowerBound:
    """The lower bound for m microbatches on this placement (module docstring).

    `budget`: per-rank activation memory in the units of `costs.activation` (None: unlimited).
    `target`: a makespan some schedule of this placement reaches within the budget, if known:
    the bound never exceeds it, so the search for one rank alone stops proving there.
    `max_states`: how many states the searches for ranks alone may take in all (0: none);
    the rank searched first may take up to twice that (its backward and its forward search
    each get what is left), the next ones what it left over.
    """
    path = _one_microbatch(stages_of_rank, costs)
    t_f, t_b_min, t_w, t_bwd, act = path.t_f, path.t_b, path.t_w, path.t_bwd, path.activation
    rank_of, f_start, b_start, critical = path.rank_of, path.f_start, path.b_start, path.critical
    cap = np.inf if budget is None else float(budget)
    # the last of a stage's m forwards (backwards) starts (m-1) of them after the first could,
    # and its microbatch still has the rest of the critical path to go
    serial = (m - 1) * float(np.maximum(t_f, t_b_min).max())
    best = LowerBound(
        critical + serial,
        int(rank_of[int(np.argmax(np.maximum(t_f, t_b_min)))]),
        0.0,
        critical + serial,
        0.0,
        "one microbatch's critical path"
        + (f" after {m - 1} others through the slowest stage" if m > 1 else ""),
    )
    totals: list[tuple[float, int]] = []  # (the terms' total, rank) where memory binds
    for r, row in enumerate(stages_of_rank):
        row = list(row)
        work = float(m * (t_f[row] + t_bwd[row]).sum())
        head = float(f_start[row].min())
        first_b = float(b_start[row].min())
        fill_items = [
            (act[s] / t_f[s] if t_f[s] > 0 else 0.0, min(m * t_f[s], first_b - f_start[s]))
            for s in row
        ]
        fill = max(0.0, (first_b - head) - _knapsack(cap, fill_items))
        last = max(row)
        trip = float(b_start[last] - f_start[last] - t_f[last])
        held = float(act[row].sum())
        # memory held per unit of remaining work: a whole B + W, or a W alone after its B
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            whole = np.where(t_bwd[row] > 0, act[row] / t_bwd[row], np.inf)
            w_only = np.where(t_w[row] > 0, (1.0 - costs.b_frees) * act[row] / t_w[row], np.inf)
        rates = np.nan_to_num(np.minimum(whole, w_only), nan=0.0)
        drain_items = list(zip(rates.tolist(), (m * t_bwd[row]).tolist(), strict=True))
        drain = max(0.0, trip - _knapsack(max(cap - held, 0.0), drain_items))
        forced = cap < m * held
        idle = fill + drain if forced else max(fill, drain)
        total = head + work + idle
        if forced:
            totals.append((total, r))
        if total > best.makespan:
            parts = [f"rank {r}: work {work:g} after its first input at {head:g}"]
            if fill > 0:
                parts.append(f"{fill:g} idle before the first backward (budget)")
            if drain > 0:
                parts.append(f"{drain:g} idle in the last round trip (budget)")
            best = LowerBound(total, r, head, work, idle, ", ".join(parts))
        if np.isfinite(cap) and cap > 0:
            to_b = b_start[row] - f_start[row] + t_b_min[row]
            life = costs.b_frees * to_b + (1.0 - costs.b_frees) * (to_b + t_w[row])
            held_time = float(m * (act[row] * life).sum()) / cap
            if held_time > best.makespan:
                why = (
                    f"rank {r}: {m} microbatches' activations live at least "
                    f"{held_time * cap / m:g} (activation x time) each, within a budget of {cap:g}"
                )
                best = LowerBound(held_time, r, head, work, held_time - head - work, why)
    goal = np.inf if target is None else float(target)
    left = max_states
    for _, r in sorted(totals, reverse=True):  # the likeliest to bind first
        if left <= 0 or best.makespan >= goal - 1e-9:
            break
        row = list(stages_of_rank[r])
        kinds = path.rank_actions(r, costs.b_frees)
        alone = relaxed_makespan(kinds, m, cap, target=goal, max_states=left)
        left -= alone.states
        if best.makespan + 1e-9 < alone.makespan < np.inf:  # inf: nothing fits the budget
            head = float(f_start[row].min())
            work = float(m * (t_f[row] + t_bwd[row]).sum())
            how = "exactly" if alone.exact else f"bounded after {alone.states} states"
            why = (
                f"rank {r} alone, the other ranks never in its way: its fastest order within "
                f"the budget of {cap:g} ({how})"
            )
            best = LowerBound(alone.makespan, r, head, work, alone.makespan - head - work, why)
    return best
