"""Event-driven simulation of a schedule under a cost model: time, bubbles and memory.

Each rank runs its compute actions in order; an action starts when the rank is free and its
input has arrived (the producing action's end, plus the transfer time when the producer sits on
another rank). Transfers overlap computation (the runtime pre-posts receives and uses
non-blocking sends), so SEND/RECV actions of a lowered schedule take no rank time here. The
simulation is vectorised over ranks: each round starts the next action of every rank whose
input is ready, so its cost is (rounds x numpy calls), not (actions x Python statements).

Memory model: running F on stage s allocates `activation[s]` (one microbatch's activations on
that stage); a split backward releases the fraction `b_frees` of it at the end of B (what B no
longer needs, e.g. the output gradients) and the rest at the end of W; a fused BW releases all
of it at its end. Peak memory per rank is the maximum of the live total over its execution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hpcpipe.schedules._rank_order import run_in_rank_order
from hpcpipe.schedules._table import ComputeTable, compute_table, cycle_error
from hpcpipe.schedules.ir import Action, Kind, Schedule

__all__ = ["CostModel", "Reorders", "SimResult", "simulate"]

Costs = float | Sequence[float]


def _per_stage(value: Costs, num_stages: int, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(num_stages, float(arr))
    if arr.shape != (num_stages,):
        raise ValueError(
            f"{name}: {arr.size} per-stage values given but the schedule has {num_stages} stages"
        )
    return arr.copy()


@dataclass(frozen=True)
class CostModel:
    """Per-stage compute times, transfer cost and activation memory.

    Times are in one unit of your choice; `t_f`, `t_b`, `t_w`, `t_bw` and `activation` are a
    scalar (every stage) or one value per stage of the schedule simulated. `t_bw` (fused
    backward) defaults to `t_b + t_w`. A transfer between stages on different ranks takes
    `comm_latency + message_bytes / comm_bandwidth` (bandwidth in bytes per time unit; None is
    unlimited); stages on the same rank hand over for free.
    """

    t_f: Costs = 1.0
    t_b: Costs = 1.0
    t_w: Costs = 1.0
    t_bw: Costs | None = None
    comm_latency: float = 0.0
    comm_bandwidth: float | None = None
    message_bytes: float = 0.0
    activation: Costs = 1.0
    b_frees: float = 0.0
    t_comm: Costs = 0.0
    """Communication inside each F and each B of a stage (MoE all-to-alls), part of `t_f` and
    `t_b`: what an overlapped pair's other half can hide (see `durations`)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.b_frees <= 1.0:
            raise ValueError(f"b_frees must be within [0, 1], got {self.b_frees}")
        if self.comm_bandwidth is not None and self.comm_bandwidth <= 0:
            raise ValueError(f"comm_bandwidth must be > 0 (or None), got {self.comm_bandwidth}")
        if self.comm_latency < 0 or self.message_bytes < 0:
            raise ValueError("comm_latency and message_bytes must be >= 0")

    @property
    def comm_time(self) -> float:
        """Time for one activation or gradient to cross between ranks."""
        if self.comm_bandwidth is None:
            return float(self.comm_latency)
        return float(self.comm_latency + self.message_bytes / self.comm_bandwidth)

    def stage_arrays(self, num_stages: int) -> dict[str, np.ndarray]:
        """Per-stage arrays: t_f, t_b, t_w, t_bw, activation (each of length num_stages)."""
        out = {
            name: _per_stage(getattr(self, name), num_stages, name)
            for name in ("t_f", "t_b", "t_w", "activation", "t_comm")
        }
        if self.t_bw is None:
            out["t_bw"] = out["t_b"] + out["t_w"]
        else:
            out["t_bw"] = _per_stage(self.t_bw, num_stages, "t_bw")
        for name, arr in out.items():
            if np.any(arr < 0) or not np.all(np.isfinite(arr)):
                raise ValueError(f"{name} values must be finite and >= 0")
        return out


@dataclass(frozen=True, eq=False)
class SimResult:
    """Predicted execution of a schedule: per-action times, per-rank figures.

    Arrays `start`, `end`, `kind`, `stage`, `microbatch`, `rank` hold the compute actions in
    rank order (rank r's are `[offsets[r]:offsets[r+1]]`).
    """

    schedule: Schedule
    costs: CostModel
    start: np.ndarray
    end: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    rank: np.ndarray
    offsets: np.ndarray
    busy: np.ndarray
    peak_memory: np.ndarray

    @cached_property
    def makespan(self) -> float:
        """End of the last action (every rank starts at time 0)."""
        return float(self.end.max()) if self.end.size else 0.0

    @cached_property
    def first_start(self) -> np.ndarray:
        return _segment(np.minimum.reduceat, self.start, self.offsets, 0.0)

    @cached_property
    def last_end(self) -> np.ndarray:
        return _segment(np.maximum.reduceat, self.end, self.offsets, 0.0)

    @property
    def bubble(self) -> np.ndarray:
        """Idle time of each rank within the makespan (what one synchronised step costs)."""
        return self.makespan - self.busy

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time within the makespan."""
        total = self.makespan * self.schedule.num_ranks
        return float(self.bubble.sum() / total) if total > 0 else 0.0

    @property
    def stage_bubble(self) -> np.ndarray:
        """Idle time of each rank between its own first start and last end.

        This is the measure of the zero-bubble papers ("longest stage time"): when steps
        follow each other without a barrier, a rank's start and end skew overlaps the
        neighbouring steps, so only the gaps inside its own span cost throughput.
        """
        return (self.last_end - self.first_start) - self.busy

    @property
    def stage_bubble_fraction(self) -> float:
        """The papers' bubble rate: max over ranks of 1 - busy / own span."""
        span = self.last_end - self.first_start
        ok = span > 0
        if not ok.any():
            return 0.0
        return float(np.max(1.0 - self.busy[ok] / span[ok]))

    def timeline(self, rank: int) -> list[tuple[Action, float, float]]:
        """(action, start, end) of one rank's compute actions, in execution order."""
        lo, hi = int(self.offsets[rank]), int(self.offsets[rank + 1])
        kinds = [Kind(k) for k in range(len(Kind))]
        return [
            (Action(int(s), kinds[int(k)], int(mb)), float(t0), float(t1))
            for k, s, mb, t0, t1 in zip(
                self.kind[lo:hi],
                self.stage[lo:hi],
                self.microbatch[lo:hi],
                self.start[lo:hi],
                self.end[lo:hi],
                strict=True,
            )
        ]


def _segment(ufunc_reduceat, values: np.ndarray, offsets: np.ndarray, empty: float) -> np.ndarray:
    p = offsets.size - 1
    out = np.full(p, empty)
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    if values.size and nonempty.any():
        out[nonempty] = ufunc_reduceat(values, offsets[:-1][nonempty])
    return out


def durations(table: ComputeTable, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Duration of every compute action from the per-stage cost arrays.

    An overlapped pair (F of one microbatch with the B or BW of another) hides each half's
    communication `c` behind the other half's compute `t - c`: the halves take
    `t_F - min(c_F, t_B - c_B)` and `t_B - min(c_B, t_F - c_F)`, so the pair costs
    `(t_F - c_F) + (t_B - c_B) + max(0, c_F - (t_B - c_B)) + max(0, c_B - (t_F - c_F))`:
    both computes, plus what neither hid (DualPipe's F&B).
    """
    by_kind = np.stack([arrays["t_f"], arrays["t_b"], arrays["t_w"], arrays["t_bw"]])
    dur = by_kind[table.kind, table.stage]
    pairs = table.schedule.pairs
    comm = arrays.get("t_comm")
    if pairs.size and comm is not None and comm.any():
        pf = np.searchsorted(table.pos, pairs)
        pb = pf + 1
        c_f, c_b = comm[table.stage[pf]], comm[table.stage[pb]]
        compute_f = np.maximum(dur[pf] - c_f, 0.0)
        compute_b = np.maximum(dur[pb] - c_b, 0.0)
        dur[pf] -= np.minimum(np.minimum(c_f, dur[pf]), compute_b)
        dur[pb] -= np.minimum(np.minimum(c_b, dur[pb]), compute_f)
    return dur


def run_rounds(
    table: ComputeTable,
    dur: np.ndarray | None,
    delay: np.ndarray | None,
    delay2: np.ndarray | None = None,
) -> tuple[np.ndarray, ...]:
    """Start/end of every compute action: list scheduling in each rank's fixed order.

    `delay[a]`: transfer time of action a's input; `delay2[a]`: of its second input (a
    pair's F half also waits for its B half's input, since the two start together); `dur`
    None: unit time, no transfer cost. Raises `ScheduleError` (dependency cycle) when no rank
    can move.
    """
    dep = table.dep if table.timed_dep is None else table.timed_dep
    start, end, stuck = run_in_rank_order(table.offsets, dep, table.pair_dep, dur, delay, delay2)
    if stuck is not None:
        raise cycle_error(table, stuck)
    return start, end[: table.n]


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Predict per-rank timelines, makespan, bubbles and peak activation memory.

    Checks the schedule's structure first (the same checks as `validate` that need no timing)
    and raises `ScheduleError` for a schedule that cannot run.
    """
    costs = costs or CostModel()
    table = compute_table(schedule)
    arrays = costs.stage_arrays(schedule.num_stages)
    dur = durations(table, arrays)
    delay = np.where(table.cross, costs.comm_time, 0.0)
    delay2 = None if table.pair_cross is None else np.where(table.pair_cross, costs.comm_time, 0.0)
    start, end = run_rounds(table, dur, delay, delay2)
    change = _activation_changes(arrays, costs.b_frees)
    peak = _peaks(change[table.stage, table.kind], table.offsets)
    busy = np.bincount(table.rank, weights=dur, minlength=schedule.num_ranks)
    return SimResult(
        schedule=schedule,
        costs=costs,
        start=start,
        end=end,
        kind=table.kind,
        stage=table.stage,
        microbatch=table.mb,
        rank=table.rank,
        offsets=table.offsets,
        busy=busy,
        peak_memory=peak,
    )


def _activation_changes(arrays: dict[str, np.ndarray], b_frees: float) -> np.ndarray:
    """(stage, kind) -> the change of the rank's live activations when that action runs."""
    share = np.array([1.0, -b_frees, b_frees - 1.0, -1.0])
    return np.outer(arrays["activation"], share)


def _peaks(live: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each rank's peak live activations from the changes of its actions in its order (=
    time order on that rank); `live` is overwritten with the running totals."""
    np.cumsum(live, out=live)
    starts = offsets[:-1]
    base = np.zeros(starts.size)  # the running total before each rank's first action
    later = starts > 0
    base[later] = live[starts[later] - 1]
    return np.maximum(_segment(np.maximum.reduceat, live, offsets, 0.0) - base, 0.0)


class Reorders:
    """Makespan, sum of ends and peak memory of reorderings of one schedule's actions, each
    rank keeping its own actions: `refine` tries thousands of moves, and building and checking
    a Schedule for each costs several times the timing itself. The arithmetic is `simulate`'s,
    so the figures are the same bit for bit; a reordering that cannot run (a dependency
    cycle) gives None where `simulate` raises (for a reordering within ranks every check of
    `compute_table` that can fail is such a cycle)."""

    def __init__(self, schedule: Schedule, costs: CostModel):
        if schedule.is_lowered or schedule.pairs.size:
            raise ValueError("Reorders: an unlowered schedule without overlapped pairs")
        table = compute_table(schedule)
        arrays = costs.stage_arrays(schedule.num_stages)
        self._dur = durations(table, arrays)
        self._delay = np.where(table.cross, costs.comm_time, 0.0)
        self._dep = table.dep.astype(np.int64)  # action -> its input's action (n: none)
        self._change = _activation_changes(arrays, costs.b_frees)[table.stage, table.kind]
        self._offsets = table.offsets
        self._n = table.n

    def figures(self, order: np.ndarray) -> tuple[float, float, float] | None:
        """(makespan, sum of the ends, peak over ranks) when position k runs the schedule's
        action `order[k]` (a permutation that keeps each action on its rank's range)."""
        n = self._n
        at = np.empty(n + 1, dtype=np.int64)
        at[order] = np.arange(n)
        at[n] = n
        _, end, stuck = run_in_rank_order(
            self._offsets, at[self._dep[order]], None, self._dur[order], self._delay[order], None
        )
        if stuck is not None:
            return None
        end = end[:n]
        peak = _peaks(self._change[order], self._offsets)
        return float(end.max()) if n else 0.0, float(end.sum()), float(peak.max())
