"""Pipelines without a flush: weight stashing (PipeDream) and double-buffered weights (2BW).

A synchronous schedule drains every step: the optimizer waits for the last backward, so fill
and drain come back every step. Without the flush a stage updates its weights as soon as it has
the gradients of a window of microbatches, while later microbatches are already in flight. The
order of the actions is an ordinary schedule over the whole stream (`window * updates`
microbatches, one fill and one drain); this module derives from that order *when* each stage
updates and *which weight version* each action reads:

- stage s applies update k right after the last weight-gradient action (W, or a fused BW) of
  window k (microbatches `k*window .. (k+1)*window - 1`) in its rank's order, and updates land
  in window order;
- F reads the stage's newest version at that point; B and W read the version their F read
  (weight stashing), so each gradient is the gradient of the weights its microbatch saw, and
  update k adds window k's gradients to version k (the newest).

Window 1 is PipeDream's weight stashing (an update per microbatch; a stage keeps one version per
microbatch in flight). A window at least as long as the pipeline is deep is PipeDream-2BW: every
stage holds at most two versions. `hpcpipe.train.flushfree_reference` trains with the same
tables in one process, the oracle of a flush-free run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.registry import build_schedule
from hpcpipe.schedules.simulate import CostModel, simulate

__all__ = ["FlushFreePlan", "SteadyState", "flush_free", "plan_updates", "steady_state"]

_WEIGHT_GRADIENT = (int(Kind.W), int(Kind.BW))
_COMPUTE = (int(Kind.F), int(Kind.B), int(Kind.W), int(Kind.BW))


@dataclass(frozen=True, eq=False)
class FlushFreePlan:
    """A schedule over a stream of microbatches plus the weight versions its actions read.

    `version[s, j]` is the update count of stage s's weights that microbatch j's F, B and W on
    stage s use; `landing[s, k]` is the position, among its rank's compute actions, of the
    action right after which stage s applies update k.
    """

    schedule: Schedule
    window: int
    updates: int
    version: np.ndarray
    landing: np.ndarray

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @cached_property
    def delay(self) -> np.ndarray:
        """Updates between the version a microbatch's gradient was computed on and the one it
        is applied to, per (stage, microbatch): 0 everywhere is synchronous training."""
        j = np.arange(self.schedule.num_microbatches)
        return (j // self.window)[None, :] - self.version

    @cached_property
    def peak_versions(self) -> np.ndarray:
        """Weight versions each stage holds at once: the newest plus those its in-flight
        microbatches still read (a stashed version is freed by its last W)."""
        return np.array([self._peak(s) for s in range(self.num_stages)], dtype=np.int64)

    def version_bytes(self, param_bytes: np.ndarray | list[float]) -> np.ndarray:
        """Peak bytes of weights held per rank, for `param_bytes[s]` bytes of weights on stage
        s (optimizer state is kept once, for the newest version only)."""
        per_stage = np.asarray(param_bytes, dtype=np.float64) * self.peak_versions
        out = np.zeros(self.schedule.num_ranks)
        np.add.at(out, self.schedule.rank_of_stage, per_stage)
        return out

    def _peak(self, s: int) -> int:
        kinds, mbs = _stage_actions(self.schedule, s)
        reads: dict[int, int] = {}
        newest, peak, k = 0, 1, 0
        lands = self.landing[s]
        positions = _stage_positions(self.schedule, s)
        for pos, kind, j in zip(positions, kinds, mbs, strict=True):
            v = int(self.version[s, j])
            if kind == Kind.F:
                reads[v] = reads.get(v, 0) + 1
            elif kind in _WEIGHT_GRADIENT:
                reads[v] -= 1
                if not reads[v]:
                    del reads[v]
            while k < self.updates and lands[k] == pos:
                newest, k = newest + 1, k + 1
            peak = max(peak, len(reads.keys() | {newest}))
        return peak


def flush_free(
    base: str,
    p: int,
    window: int,
    updates: int,
    *,
    v: int | None = None,
    max_versions: int | None = None,
) -> FlushFreePlan:
    """Schedule `base` over `window * updates` microbatches without a flush (see the module
    docstring); `max_versions` (2 for 2BW) is checked on every stage."""
    if window < 1 or updates < 1:
        raise ValueError(f"window = {window} and updates = {updates} must both be >= 1")
    return plan_updates(build_schedule(base, p, window * updates, v), window, max_versions)


def plan_updates(schedule: Schedule, window: int, max_versions: int | None = None) -> FlushFreePlan:
    """Derive update points and weight versions for `schedule` run without a flush."""
    m = schedule.num_microbatches
    if window < 1 or m % window:
        raise ValueError(
            f"window = {window} must divide the stream's {m} microbatches into whole updates"
        )
    updates = m // window
    version = np.zeros((schedule.num_stages, m), dtype=np.int64)
    landing = np.zeros((schedule.num_stages, updates), dtype=np.int64)
    for s in range(schedule.num_stages):
        kinds, mbs = _stage_actions(schedule, s)
        pos = _stage_positions(schedule, s)
        grad = np.isin(kinds, _WEIGHT_GRADIENT)
        if np.bincount(mbs[grad], minlength=m).tolist() != [1] * m:
            raise ValueError(
                f"{schedule.name}: stage {s} must compute each microbatch's weight gradient "
                "exactly once (one W or fused BW per microbatch)"
            )
        done = np.zeros(updates, dtype=np.int64)
        np.maximum.at(done, mbs[grad] // window, pos[grad])
        landing[s] = np.maximum.accumulate(done)  # updates land in window order
        forward = kinds == Kind.F
        version[s, mbs[forward]] = np.searchsorted(landing[s], pos[forward], side="right")
    plan = FlushFreePlan(schedule, window, updates, version, landing)
    if max_versions is not None:
        worst = int(plan.peak_versions.max())
        if worst > max_versions:
            s = int(plan.peak_versions.argmax())
            raise ValueError(
                f"{schedule.name} without a flush, window {window}: stage {s} holds {worst} "
                f"weight versions, more than the {max_versions} allowed; a longer window "
                "(more microbatches per update) keeps fewer in flight"
            )
    return plan


def _rank_compute(schedule: Schedule, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lo, hi = int(schedule.offsets[rank]), int(schedule.offsets[rank + 1])
    kinds = schedule.kinds[lo:hi].astype(np.int64)
    keep = np.isin(kinds, _COMPUTE)
    return kinds[keep], schedule.stages[lo:hi][keep], schedule.microbatches[lo:hi][keep]


def _stage_positions(schedule: Schedule, s: int) -> np.ndarray:
    """Positions among its rank's compute actions of stage s's actions, in order."""
    _, stages, _ = _rank_compute(schedule, int(schedule.rank_of_stage[s]))
    return np.flatnonzero(stages == s)


def _stage_actions(schedule: Schedule, s: int) -> tuple[np.ndarray, np.ndarray]:
    kinds, stages, mbs = _rank_compute(schedule, int(schedule.rank_of_stage[s]))
    mine = stages == s
    return kinds[mine], mbs[mine].astype(np.int64)


@dataclass(frozen=True)
class SteadyState:
    """Throughput once the pipeline is full, against the bound of no bubble at all."""

    efficiency: float
    """Busy share of the rank with the most work per microbatch over the middle half of the
    stream's run: 1.0 is the no-bubble bound (work per rank)."""
    microbatches_per_time: float
    interval: tuple[float, float]


def steady_state(plan: FlushFreePlan, costs: CostModel | None = None) -> SteadyState:
    """Simulate the stream; in steady state every rank completes microbatches at one rate, so
    the throughput over the no-bubble bound is the busy share of the rank with the most work
    per microbatch, measured over the middle half of the run (fill and drain left out: plan a
    stream several times longer than the pipeline is deep)."""
    sim = simulate(plan.schedule, costs or CostModel())
    t1, t2 = 0.25 * sim.makespan, 0.75 * sim.makespan
    r = int(sim.busy.argmax())
    lo, hi = int(sim.offsets[r]), int(sim.offsets[r + 1])
    inside = np.clip(sim.end[lo:hi], t1, t2) - np.clip(sim.start[lo:hi], t1, t2)
    efficiency = float(inside.sum()) / (t2 - t1) if t2 > t1 else 0.0
    work = float(sim.busy[r]) / plan.schedule.num_microbatches
    return SteadyState(efficiency, efficiency / work if work else 0.0, (t1, t2))
