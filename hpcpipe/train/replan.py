"""Re-planning a running pipeline around slow ranks: measured action costs in, a partition out.

Under pipeline parallelism the slowest rank sets everyone's pace. The interpreter already times
every action; every `check_every` steps those times (medians over the window) are turned into a
rate per pipeline rank (seconds per unit of layer weight, per action kind), the layer partition
is re-balanced for those rates and then moved a stage boundary at a time while the simulator,
fed the same rates, predicts a shorter step. A switch happens only when the predicted gain
clears `min_gain` in two windows in a row (the plan proposed in one is predicted again from the
next one's costs: chosen as the best for its own window, a plan's gain there is biased high by
that window's noise), and not within `cooldown` checks of the last one, so measurement noise
never makes the plan flap.

Everything here is pure (numbers in, numbers out); `hpcpipe.train.workload` gathers the costs,
shares rank 0's decision and moves the layers (`hpcpipe.mpi.collectives.exchange_objects`).
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError, option
from hpcpipe.model.models import balance_placement
from hpcpipe.schedules.ir import Schedule
from hpcpipe.schedules.simulate import CostModel, simulate

__all__ = [
    "COMPUTE_KINDS",
    "Measured",
    "Proposal",
    "ReplanConfig",
    "Replanner",
    "action_costs",
    "cost_model",
    "estimate_speeds",
    "initial_scale",
    "schedule_label",
    "unit_groups",
]

COMPUTE_KINDS = ("F", "B", "W", "BW")
_UNIT_KINDS = {"F": ("F",), "B": ("B",), "W": ("W",), "BW": ("B", "W")}
"""The units' own timers inside each kind of compute action (a fused BW runs both)."""

Costs = Mapping[tuple[str, int], float]
"""Seconds per action, keyed by (action kind name, stage)."""


@dataclass(frozen=True)
class ReplanConfig:
    """[replan]: move layers between pipeline ranks while training, by their measured speed."""

    enabled: bool = option(
        False, "re-balance the layer partition from measured action costs during training"
    )
    check_every: int = option(
        10,
        "steps per check: the window whose median costs are compared with the plan (one "
        "small gather and one broadcast per check)",
        minimum=2,
    )
    min_gain: float = option(
        0.05,
        "switch only when the new partition's predicted step is at least this fraction "
        "shorter than the current one's (measured with the same costs); a partition made for "
        "a slow rank is left for any gain once that slowdown has eased by more than this",
        minimum=0.0,
        maximum=0.9,
    )
    cooldown: int = option(
        1, "checks after a switch during which no other switch happens", minimum=0
    )
    confirm: bool = option(
        True,
        "switch only when the next check predicts the proposed plan at least `min_gain` "
        "faster again, from its own window's costs (a plan is chosen as the best for its "
        "window, so the gain predicted there includes that window's noise); costs the first "
        "switch one check of delay. A plan made for a slow rank is left at once when the "
        "slowdown eases",
    )
    search: bool = option(
        False,
        "also re-search the schedule for the measured stage costs when re-planning (the "
        "schedule search of `pipeline.schedule = 'auto'`, on the pipeline's own stage "
        "placement, holding no more microbatches' activations than the current schedule); "
        "a few seconds on rank 0 each time the proposed partition changes",
    )
    speeds: tuple[float, ...] = option(
        (),
        "relative compute speed of each pipeline rank when known in advance (e.g. "
        "[1, 1, 0.5, 1]: rank 2 is half as fast); the first partition and `hpcpipe plan` "
        "use it; empty = all equal",
        minimum=1e-3,
    )


def action_costs(
    schedule: Schedule, pp_rank: int, window: Sequence[Mapping[tuple[str, int], float]]
) -> dict[tuple[str, int], float]:
    """One rank's seconds per compute action over a window of steps: the median of each
    (kind, stage)'s per-step total over its count in the schedule (not always m: DualPipeV
    mixes fused BW with split B/W on one stage)."""
    counts = Counter((a.kind.name, a.stage) for a in schedule.rank_actions(pp_rank))
    out: dict[tuple[str, int], float] = {}
    for key in {k for entry in window for k in entry}:
        if key[0] in COMPUTE_KINDS and counts[key]:
            total = _median([entry.get(key, 0.0) for entry in window])
            out[key] = total / counts[key]
    return out


def cost_model(costs: Costs, n_stages: int) -> CostModel:
    """The simulator's per-stage costs from per-action ones; a stage timed only as fused BW is
    split in halves, one timed only as B + W is fused as their sum."""

    def per_stage(kind: str) -> np.ndarray:
        return np.array([costs.get((kind, s), np.nan) for s in range(n_stages)])

    t_f, t_b, t_w, t_bw = (per_stage(k) for k in COMPUTE_KINDS)
    split = ~np.isnan(t_b)
    t_bw = np.where(np.isnan(t_bw), np.nan_to_num(t_b) + np.nan_to_num(t_w), t_bw)
    t_b = np.where(split, t_b, t_bw / 2)
    t_w = np.where(split, np.nan_to_num(t_w), t_bw / 2)
    return CostModel(t_f=np.nan_to_num(t_f), t_b=t_b, t_w=t_w, t_bw=t_bw)


@dataclass(frozen=True)
class Measured:
    """One check's window, merged over ranks (dp replicas of a stage: the slowest)."""

    stage_seconds: Costs
    """Seconds per action, by (kind, stage)."""
    unit_seconds: Costs
    """Seconds per step spent inside each unit, by (kind, global unit index)."""


@dataclass(frozen=True)
class Proposal:
    """A partition balanced for the estimated rank speeds (and with `[replan] search` a
    schedule searched for the costs it leaves), with both predicted steps."""

    ranges: tuple[range, ...]
    current: tuple[range, ...]
    slowness: tuple[float, ...]
    """Per pipeline rank: time for the same layer, relative to the fastest rank."""
    predicted_now: float
    predicted_new: float
    schedule: Schedule | None = None
    """The schedule to switch to (None: keep the current one)."""
    current_name: str = ""
    current_microbatches: int = 0
    recheck: Proposal | None = None
    """The previous check's proposal, predicted again from this window's costs (None: there
    was none for the running plan)."""

    @property
    def gain(self) -> float:
        """Fraction of the current predicted step the new partition saves."""
        if self.predicted_now <= 0:
            return 0.0
        return 1.0 - self.predicted_new / self.predicted_now

    @property
    def changes(self) -> bool:
        return self.ranges != self.current or self.schedule is not None

    def describe(self) -> str:
        def sizes(ranges: Sequence[range]) -> list[int]:
            return [len(r) for r in ranges]

        switch = ""
        if self.schedule is not None:
            switch = f", schedule {self.current_name} -> {schedule_label(self.schedule)}"
            m = self.schedule.num_microbatches
            if m != self.current_microbatches:
                switch += f", microbatches {self.current_microbatches} -> {m}"
        return (
            f"relative slowness per pipeline rank [{', '.join(f'{x:.2f}' for x in self.slowness)}]"
            f", predicted step {self.predicted_now * 1e3:.2f} ms -> "
            f"{self.predicted_new * 1e3:.2f} ms (gain {self.gain * 100:.1f}%), stage_units "
            f"{sizes(self.current)} -> {sizes(self.ranges)}{switch}"
        )


def schedule_label(schedule: Schedule) -> str:
    """A schedule's name, and for a searched one how the search built it."""
    how = schedule.param("how")
    return f"{schedule.name} ({how})" if how else schedule.name


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))  # a few values: ~20x cheaper than np.median


def estimate_speeds(
    unit_seconds: Mapping[int, float],
    unit_rank: Mapping[int, int],
    groups: Sequence[Hashable],
    n_ranks: int,
    nominal: Mapping[Hashable, float],
) -> np.ndarray:
    """Each rank's slowness (the fastest = 1) from the time its units took.

    Units of one group (same layer type and size: the transformer blocks) cost the same on
    equal ranks, so a group held by several ranks compares them directly: a rank's slowness is
    the median, over such groups, of its median unit time over the fastest rank's. A rank that
    shares no group (a V's first rank holding only the embedding and the loss head) is timed
    against `nominal`, the group costs learnt at earlier checks; without those it counts as 1.
    """
    by_group: dict[Hashable, dict[int, list[float]]] = {}
    for i, sec in unit_seconds.items():
        by_group.setdefault(groups[i], {}).setdefault(unit_rank[i], []).append(sec)
    ratios: dict[int, list[float]] = {r: [] for r in range(n_ranks)}
    for per_rank in by_group.values():
        if len(per_rank) < 2:
            continue
        med = {r: _median(v) for r, v in per_rank.items()}
        fastest = max(min(med.values()), 1e-300)
        for r, m in med.items():
            ratios[r].append(m / fastest)
    slowness = np.ones(n_ranks)
    for r in range(n_ranks):
        if ratios[r]:
            slowness[r] = _median(ratios[r])
            continue
        known = [
            sec / nominal[groups[i]]
            for i, sec in unit_seconds.items()
            if unit_rank[i] == r and nominal.get(groups[i], 0.0) > 0
        ]
        if known:
            slowness[r] = _median(known)
    return slowness / max(float(slowness.min()), 1e-300)


@dataclass
class Replanner:
    """Rank 0's re-planning state: what layers cost on a nominal rank (learnt at every check),
    and the switching rule: a gain threshold, met in two windows in a row (`confirm`), and a
    cooldown after each switch."""

    config: ReplanConfig
    schedule: Schedule
    groups: Sequence[Hashable]
    """Per unit: units with the same key cost the same on equal ranks (type and size)."""
    nominal: dict[Hashable, float] = field(default_factory=dict)
    """Seconds per step of one unit of each group on a rank of slowness 1 (F + B + W)."""
    checks_since_switch: int | None = None
    """None before the first switch (no cooldown yet)."""
    planned_for: tuple[float, ...] = ()
    """Each rank's slowness when layers last moved (empty before the first such switch)."""
    _descent_key: tuple[Any, ...] | None = None
    _descent: tuple[range, ...] = ()
    rows: int = 0
    """Rows of a replica's batch, which the microbatches split; 0: the count stays (MoE
    routing is defined per microbatch, so its decks keep theirs)."""
    blocking_lookahead: int = 0
    """With blocking sends (`train.sends`), the receive lookahead a searched schedule must be
    proven deadlock-free for, as the deck's own is before the run; 0: nonblocking sends."""
    _search_key: tuple[Any, ...] | None = None
    _searched: Any = None  # the search's answer for `_search_key` (a Found, or None)
    _pending: Proposal | None = None  # the last check's proposal that waits for the next
    _pending_base: tuple[Any, ...] = ()  # ... made for this partition and schedule
    _proposed_base: tuple[Any, ...] = ()  # the partition and schedule the last proposal saw

    def propose(self, current: Sequence[range], measured: Measured) -> Proposal:
        """Estimate rank speeds and unit costs from `measured`, balance the partition for
        them, and predict the step of both partitions from the same estimates (each stage's
        time outside its units, messages and dispatch, stays with the stage)."""
        schedule, n = self.schedule, self.schedule.num_stages
        n_ranks = len(schedule.stages_of_rank)
        owner = np.empty(n, dtype=np.int64)
        for r, row in enumerate(schedule.stages_of_rank):
            owner[list(row)] = r
        unit_rank = {i: int(owner[s]) for s, rg in enumerate(current) for i in rg}
        totals: dict[int, float] = {}
        for (_, i), sec in measured.unit_seconds.items():
            totals[i] = totals.get(i, 0.0) + sec
        slowness = estimate_speeds(totals, unit_rank, self.groups, n_ranks, self.nominal)
        learnt: dict[Hashable, list[float]] = {}
        for i, sec in totals.items():
            learnt.setdefault(self.groups[i], []).append(sec / slowness[unit_rank[i]])
        self.nominal.update({g: _median(v) for g, v in learnt.items()})
        cost = np.array([self.nominal.get(g, 0.0) for g in self.groups], dtype=np.float64)
        cost = np.maximum(cost, 1e-3 * max(float(cost.mean()), 1e-300))
        ranges = tuple(balance_placement(cost, n, schedule.stages_of_rank, slowness))
        # each action keeps its measured time outside its units (messages, dispatch); the
        # time inside them scales with the modelled work of the stage's units on its rank
        # (per kind: an F and a fused BW of one stage spend different shares inside their
        # units, which matters once a schedule with other kinds of actions is predicted)
        counts = Counter((a.kind.name, a.stage) for row in schedule.actions for a in row)
        share: dict[tuple[str, int], float] = {}
        for (kind, s), sec in measured.stage_seconds.items():
            if counts[(kind, s)] and kind in _UNIT_KINDS:
                inside = sum(
                    measured.unit_seconds.get((k, i), 0.0)
                    for k in _UNIT_KINDS[kind]
                    for i in current[s]
                )
                share[(kind, s)] = min(max(inside / counts[(kind, s)] / max(sec, 1e-300), 0.0), 1.0)

        def work(rg: Sequence[range]) -> np.ndarray:
            return np.array([slowness[owner[s]] * cost[list(r)].sum() for s, r in enumerate(rg)])

        now = work(current)

        def modelled_costs(rg: Sequence[range], rows: float = 1.0) -> CostModel:
            """Per-stage costs under partition `rg`, microbatches of `rows` times the
            current rows: the time inside the units scales with both, the rest stays."""
            ratio = work(rg) / np.maximum(now, 1e-300) * rows
            modelled = {
                key: sec * (1.0 - share.get(key, 0.0) + share.get(key, 0.0) * ratio[key[1]])
                for key, sec in measured.stage_seconds.items()
            }
            return cost_model(modelled, n)

        def predict(rg: Sequence[range]) -> float:
            return simulate(schedule, modelled_costs(rg)).makespan

        before = predict(current)
        # the descent costs a few simulations per stage boundary: it runs again only when the
        # balanced or the current partition changes (every check otherwise costs what it did
        # before it: one or two simulations), so a quiet run pays for it once
        key = (tuple(current), tuple(ranges), schedule.fingerprint())
        if key != self._descent_key:
            self._descent_key, self._descent = key, _descend(ranges, predict)[0]
        ranges = self._descent
        after = predict(ranges) if ranges != tuple(current) else before
        if after >= before:  # nothing predicted faster than staying
            ranges, after = tuple(current), before
        found = None
        if self.config.search:
            found = self._search(key, ranges, modelled_costs)
        if found is not None and found.makespan < after * (1.0 - 1e-9):
            after = found.makespan
        else:
            found = None
        seen = tuple(float(x) for x in slowness)
        recheck = None
        pending = self._pending
        self._proposed_base = (key[0], key[2])  # current partition, schedule fingerprint
        if pending is not None and self._pending_base == self._proposed_base:
            if pending.schedule is None:
                again = predict(pending.ranges)
            else:  # its microbatches hold m / count of the current rows each
                rows = schedule.num_microbatches / pending.schedule.num_microbatches
                again = simulate(pending.schedule, modelled_costs(pending.ranges, rows)).makespan
            recheck = replace(
                pending, slowness=seen, predicted_now=before, predicted_new=again, recheck=None
            )
        return Proposal(
            ranges,
            tuple(current),
            seen,
            before,
            after,
            found.schedule if found is not None else None,
            schedule_label(schedule),
            schedule.num_microbatches,
            recheck,
        )

    def _search(
        self,
        key: tuple[Any, ...],
        ranges: tuple[range, ...],
        costs_of: Callable[[tuple[range, ...], float], CostModel],
    ) -> Any:
        """The fastest schedule the search finds for the stage costs `ranges` would have, on
        this schedule's placement, holding no more activations than it does now (in bytes:
        a microbatch of other rows holds them in proportion), for the current microbatch
        count and, with `rows`, every count in [p, 4p] that divides them (None where the
        search does not build this placement). Run again only when the partitions or the
        schedule change."""
        from hpcpipe.schedules.search import BudgetError, placement_of, search

        schedule = self.schedule
        where = (*key, ranges)
        if where == self._search_key:
            return self._searched
        v_shape = placement_of(schedule)
        p, m = schedule.num_ranks, schedule.num_microbatches
        chunks = len(schedule.stages_of_rank[0])
        best = None
        if v_shape is not None:
            now = replace(costs_of(ranges, 1.0), activation=1.0 / chunks)
            budget = float(simulate(schedule, now).peak_memory.max())
            counts = [m] + [
                k for k in range(p, 4 * p + 1) if self.rows and k != m and self.rows % k == 0
            ]
            for count in counts:
                rows = m / count  # each microbatch's rows, relative to now
                costs = replace(costs_of(ranges, rows), activation=rows / chunks)
                try:
                    found = search(p, count, lambda n, c=costs: c, budget, placements=(v_shape,))
                except BudgetError:  # fewer, larger microbatches may not fit
                    continue
                if not self._runs_with_blocking_sends(found.schedule):
                    continue
                if best is None or found.makespan < best.makespan * (1.0 - 1e-9):
                    best = found
        self._search_key, self._searched = where, best
        return best

    def _runs_with_blocking_sends(self, schedule: Schedule) -> bool:
        """Whether `schedule` is proven to run with this run's sends (always, nonblocking)."""
        from hpcpipe.schedules.errors import ScheduleError
        from hpcpipe.schedules.validate import validate

        if not self.blocking_lookahead:
            return True
        try:
            validate(validate(schedule), sends="blocking", lookahead=self.blocking_lookahead)
        except ScheduleError:
            return False
        return True

    def decide(self, proposal: Proposal) -> Proposal | None:
        """The plan to switch to now (remembered as such), or None to keep the running one.

        A switch needs a predicted gain of `min_gain`: the hysteresis that keeps noise in the
        measured costs from moving layers. With `confirm`, the gain must show in two windows
        in a row: a proposal that clears it waits, and the next check predicts that same plan
        again from its own window's costs (`Proposal.recheck`); the switch is to it when it
        clears `min_gain` there too. A plan is the best of many for the window it was chosen
        in, so its gain there includes that window's noise (which is how a quiet run used to
        switch); the next window's noise is independent of that choice. A check within the
        cooldown cannot switch but may propose, so after a switch the first check past the
        cooldown can confirm; a check that cannot propose (a stage not timed) keeps the
        proposal waiting.

        A partition a switch made for a slow rank is left at once, for any predicted gain, once
        that slowdown has eased by more than `min_gain` (the slowest rank's slowness, relative
        to the fastest, has dropped by more than that fraction since the layers last moved): a
        slowdown that ends is evidence, not noise, and the partition made for it would
        otherwise stay up to `min_gain` slower than the balanced one. Only an easing after a
        move of layers counts, so noise in the window of a switch of schedule alone, or around
        a partition made for equal ranks, never makes a plan switch on a smaller gain."""
        cooling = False
        if self.checks_since_switch is not None:
            self.checks_since_switch += 1
            cooling = self.checks_since_switch <= self.config.cooldown
        chosen = None if cooling else self._choose(proposal)
        self._pending = None
        if chosen is None:
            if self.config.confirm and self._clears(proposal):
                self._pending = proposal
                self._pending_base = self._proposed_base
            return None
        self.checks_since_switch = 0
        if chosen.ranges != chosen.current:  # layers moved: for these speeds
            self.planned_for = chosen.slowness
        return chosen

    def waiting(self) -> bool:
        """Whether a proposal waits for the next check to confirm it."""
        return self._pending is not None

    def _choose(self, proposal: Proposal) -> Proposal | None:
        """The plan to switch to now, if any (`decide`)."""
        if proposal.changes and proposal.gain > 0.0 and self._slowdown_eased(proposal.slowness):
            return proposal
        if not self.config.confirm:
            return proposal if self._clears(proposal) else None
        again = proposal.recheck
        return again if again is not None and self._clears(again) else None

    def _clears(self, proposal: Proposal) -> bool:
        """Whether `proposal` changes the plan for a predicted gain of at least `min_gain`."""
        return proposal.changes and proposal.gain > 0.0 and proposal.gain >= self.config.min_gain

    def _slowdown_eased(self, slowness: Sequence[float]) -> bool:
        """Whether the slowest rank the last switch was made for is now faster by more than
        `min_gain` (relative to the fastest rank, at both times)."""
        if not self.planned_for:
            return False
        return max(self.planned_for) / max(slowness) - 1.0 > self.config.min_gain


def _descend(
    start: Sequence[range], predict: Callable[[Sequence[range]], float]
) -> tuple[tuple[range, ...], float]:
    """The partition the simulator predicts fastest near `start`, and its predicted step.

    `balance_placement` balances the work inside the units; the simulator also counts what
    stays with a stage whatever it holds (sends, dispatch, the loss) and the schedule's
    dependencies, so a stage with much of that should hold fewer units than the balance gives.
    Steepest descent over moves of one stage boundary by one unit, each stage keeping one.
    """
    bounds = [r.start for r in start] + [start[-1].stop]

    def ranges(b: Sequence[int]) -> tuple[range, ...]:
        return tuple(range(a, z) for a, z in itertools.pairwise(b))

    best = predict(ranges(bounds))
    for _ in range(bounds[-1]):  # each round strictly faster: a bound, never reached
        trials = []
        for i in range(1, len(bounds) - 1):
            for step in (-1, 1):
                trial = list(bounds)
                trial[i] += step
                if trial[i - 1] < trial[i] < trial[i + 1]:
                    trials.append((predict(ranges(trial)), trial))
        if not trials:
            break
        t, trial = min(trials, key=lambda x: x[0])
        if t >= best * (1.0 - 1e-9):  # no move is faster beyond round-off
            break
        bounds, best = trial, t
    return ranges(bounds), best


def unit_groups(units: Sequence[Any]) -> list[Hashable]:
    """Units that cost the same on equal ranks share a key: their type and parameter count."""
    return [(type(u).__name__, int(getattr(u, "n_params", 0))) for u in units]


def initial_scale(config: ReplanConfig, n_ranks: int, source: str) -> list[float] | None:
    """Per-rank time per unit of weight from `replan.speeds` (None when not given)."""
    if not config.speeds:
        return None
    if len(config.speeds) != n_ranks:
        raise ConfigError(
            source,
            "replan.speeds",
            f"= {list(config.speeds)} must give one speed per pipeline rank ({n_ranks})",
        )
    return [1.0 / s for s in config.speeds]
