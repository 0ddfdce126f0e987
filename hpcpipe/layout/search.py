"""Choose the layout: every pp x dp x ep x order x schedule x microbatches that fits, ranked.

Candidates that cannot run are sorted out first, each with its reason (batch split, too many
stages, a schedule that cannot be built, memory), counted per class. The rest are ranked by
predicted step (`cost.predict`), found by branch and bound: a candidate's work on its busiest
rank (compute plus all-to-all, no waiting) is a lower bound on its step, so candidates are
simulated in order of that bound and the search stops once the next bound exceeds the N-th
best step found. The answer is the same as simulating every candidate.

Orders that put the same dims across nodes give the same costs in this model, so only the first
of them (in DIMS permutation order) is kept. Ties are broken by memory, then by the layout's
fields, so every rank and every run picks the same layout.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from hpcpipe.layout.cost import (
    Layout,
    LayoutCost,
    Prediction,
    Workload,
    activation_per_token,
    crossings,
    layout_cost,
    peak_live,
    pipeline_costs,
    predict,
    static_bytes,
)
from hpcpipe.layout.machine import Machine
from hpcpipe.schedules import CostModel, Schedule
from hpcpipe.schedules.registry import SCHEDULE_NAMES, build_schedule, stages_per_rank
from hpcpipe.topology import DIMS

__all__ = ["Rejected", "SearchResult", "divisors", "search_layouts"]

MICROBATCH_SPAN = 8
"""m is tried from pp to this many times pp (where it divides the replica's batch)."""

VIRTUAL_STAGES = (2, 4)
"""interleaved-1f1b is tried with these stages per rank."""


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@dataclass
class Rejected:
    """Candidates left out for one reason: how many, and the first one with its detail."""

    count: int = 0
    example: str = ""


@dataclass
class SearchResult:
    ranked: list[tuple[Prediction, LayoutCost]]
    rejected: dict[str, Rejected] = field(default_factory=dict)
    candidates: int = 0
    fit: int = 0
    simulated: int = 0

    def reject(self, reason: str, example: str) -> None:
        entry = self.rejected.setdefault(reason, Rejected())
        entry.count += 1
        if not entry.example:
            entry.example = example


@functools.lru_cache(maxsize=4096)
def _schedule(name: str, pp: int, m: int, v: int | None) -> Schedule | str:
    """The schedule, or why it cannot be built (schedules depend on no deck value)."""
    try:
        return build_schedule(name, pp, m, v)
    except ValueError as exc:
        return str(exc)


def _orders(pp: int, dp: int, ep: int, world: int, rpn: int) -> dict[tuple[str, ...], dict]:
    """One order per distinct set of node-crossing groups, with those crossings."""
    seen: dict[tuple[bool, ...], tuple[tuple[str, ...], dict]] = {}
    for order in itertools.permutations(DIMS):
        crosses = crossings(world, rpn, Layout(pp, dp, ep, order, "", None, 1))
        seen.setdefault(tuple(crosses.values()), (order, crosses))
    return dict(seen.values())


def _microbatches(rows: int, pp: int) -> list[int]:
    """Every m in [pp, 8 pp] that divides the replica's rows (else the largest below pp), and
    one row per microbatch (the least activation memory) when that is more."""
    ms = [d for d in divisors(rows) if pp <= d <= MICROBATCH_SPAN * pp]
    ms = ms or [max(d for d in divisors(rows) if d <= pp)]
    return ms if rows in ms else [*ms, rows]


def search_layouts(
    work: Workload,
    machine: Machine,
    world: int,
    *,
    experts: int = 0,
    schedules: tuple[str, ...] = SCHEDULE_NAMES,
    top: int = 10,
    partition: object = None,
    auto: int = 0,
    keep_inside: tuple[str, ...] = (),
) -> SearchResult:
    """The `top` best layouts of `world` ranks (and why the others were left out).

    `partition(n_stages, stages_of_rank) -> tuple[range, ...]` splits the units (the deck's
    rule, so the search predicts what the run will do). With `auto` > 0, the schedule search
    (`schedule = "auto"`) also runs, under each layout's memory, for the degrees, order and m
    of the `auto` best layouts found, and its schedules join the ranking. Orders that put a
    group of a dim in `keep_inside` (of size > 1) across nodes are left out."""
    result = SearchResult(ranked=[])
    rpn = min(machine.ranks_per_node, world)
    shared = _Shared(work, machine, world, partition)
    feasible: list[tuple[float, Layout, LayoutCost]] = []
    for pp in divisors(world):
        dp = world // pp
        if work.global_batch % dp:
            result.reject("batch", f"pp={pp}: dp={dp} does not divide the global batch (every m)")
            continue
        rows = work.global_batch // dp
        eps = [e for e in divisors(dp) if experts % e == 0] if experts else [1]
        for ep in eps:
            for order, crosses in _orders(pp, dp, ep, world, rpn).items():
                degree = {"pp": pp, "dp": dp, "ep": ep}
                spans = [d for d in keep_inside if degree.get(d, 1) > 1 and crosses.get(d)]
                if spans:
                    result.reject(
                        "intra_node",
                        f"pp{pp} dp{dp} ep{ep} [{','.join(order)}]: {','.join(spans)} groups "
                        "cross nodes (topology.intra_node with cross_node = 'error')",
                    )
                    continue
                for m, name in itertools.product(_microbatches(rows, pp), schedules):
                    vs = VIRTUAL_STAGES if name == "interleaved-1f1b" else (None,)
                    for v in vs:
                        layout = Layout(pp, dp, ep, order, name, v, m)
                        result.candidates += 1
                        cost = shared.evaluate(layout, crosses, result)
                        if cost is not None:
                            bound = float(cost.busy.max())
                            feasible.append((bound, layout, cost))
    result.fit = len(feasible)
    feasible.sort(key=lambda t: (t[0], t[1]))
    steps: list[float] = []  # max-heap (negated) of the `top` shortest steps so far
    done: list[tuple[float, float, Layout, Prediction, LayoutCost]] = []
    for bound, layout, cost in feasible:
        if len(steps) >= top and bound > -steps[0]:
            break  # no later candidate can beat (or tie) the top-th step
        pred = predict(cost)
        result.simulated += 1
        done.append((pred.step, pred.memory, layout, pred, cost))
        if len(steps) < top:
            heapq.heappush(steps, -pred.step)
        elif pred.step < -steps[0]:
            heapq.heapreplace(steps, -pred.step)
    done.sort(key=lambda t: (t[0], t[1], t[2]))
    result.ranked = [(pred, cost) for _, _, _, pred, cost in done[:top]]
    if auto:
        found = shared.searched(result.ranked, auto, result)
        merged = sorted(result.ranked + found, key=lambda t: (t[0].step, t[0].memory, t[1].layout))
        result.ranked = merged[:top]
    return result


class _Shared:
    """What many candidates share, computed once: partitions and per-token peaks; and the
    schedule search for chosen degrees."""

    def __init__(self, work: Workload, machine: Machine, world: int, partition: object):
        self.work, self.machine, self.world, self.partition = work, machine, world, partition
        self.stage_units: dict[tuple, tuple[range, ...]] = {}
        self.peaks: dict[tuple, np.ndarray] = {}

    def _costs(self, layout: Layout, units: dict, crosses: dict, n_stages: int) -> CostModel:
        """The schedule search's `costs_for` for one layout's partitions."""
        return pipeline_costs(self.work, self.machine, layout, units[n_stages], crosses)[0]

    def searched(
        self, ranked: list[tuple[Prediction, LayoutCost]], count: int, result: SearchResult
    ) -> list[tuple[Prediction, LayoutCost]]:
        """The schedule search's best schedule for the degrees, order and m of the first
        `count` distinct ones in `ranked`, under the memory the rank's weights leave."""
        from hpcpipe.schedules.search import BudgetError, search

        out = []
        seen: set[tuple] = set()
        for _, cost in ranked:
            lay = cost.layout
            key = (lay.pp, lay.dp, lay.ep, lay.order, lay.m)
            p = lay.pp
            if key in seen or len(seen) >= count or 2 * p > len(self.work.units):
                continue  # (the schedule search also cuts the model into 2p stages)
            seen.add(key)
            flat = tuple((r,) for r in range(p))
            vee = tuple((r, 2 * p - 1 - r) for r in range(p))
            placements = {p: flat, 2 * p: vee}
            units = {n: tuple(self.partition(n, pl)) for n, pl in placements.items()}  # type: ignore[operator]
            probe = replace(lay, schedule="auto", v=None)
            statics = [
                float(static_bytes(self.work, probe, units[n], pl).max())
                for n, pl in placements.items()
            ]
            budget = self.machine.memory_bytes - max(statics)

            costs_for = functools.partial(self._costs, probe, units, cost.crosses)
            try:
                found = search(p, lay.m, costs_for, budget)
            except BudgetError as exc:
                result.reject("memory", f"{probe.label}: {exc}")
                continue
            sched = found.schedule  # its own placement's partition (interleaved is not V's)
            split = tuple(self.partition(sched.num_stages, sched.stages_of_rank))  # type: ignore[operator]
            new = layout_cost(
                self.work, self.machine, self.world, probe, sched, split, crosses=cost.crosses
            )
            result.simulated += 1
            if float(new.memory.max()) <= self.machine.memory_bytes:
                out.append((predict(new), new))
        return out

    def evaluate(self, layout: Layout, crosses: dict, result: SearchResult) -> LayoutCost | None:
        """The layout's costs, or None (the reason recorded) when it cannot run or fit."""
        n_units = len(self.work.units)
        n_stages = layout.pp * stages_per_rank(layout.schedule, layout.v)
        if n_stages > n_units:
            result.reject("stages", f"{layout.label}: {n_stages} stages > {n_units} model units")
            return None
        sched = _schedule(layout.schedule, layout.pp, layout.m, layout.v)
        if isinstance(sched, str):
            result.reject("schedule", f"{layout.label}: {sched}")
            return None
        placement = (n_stages, sched.stages_of_rank)
        if placement not in self.stage_units:
            self.stage_units[placement] = tuple(self.partition(*placement))  # type: ignore[operator]
        stage_units = self.stage_units[placement]
        key = (layout.schedule, layout.pp, layout.m, layout.v)
        if key not in self.peaks:
            self.peaks[key] = peak_live(sched, activation_per_token(self.work, stage_units))
        cost = layout_cost(
            self.work,
            self.machine,
            self.world,
            layout,
            sched,
            stage_units,
            crosses=crosses,
            peak_per_token=self.peaks[key],
        )
        need = float(cost.memory.max())
        if need > self.machine.memory_bytes:
            rank = int(cost.memory.argmax())
            result.reject(
                "memory",
                f"{layout.label}: rank {rank} needs {need / 2**30:.1f} GiB (weights, gradients "
                f"and optimizer {cost.static_bytes[rank] / 2**30:.1f}, activations "
                f"{cost.peak_activation[rank] / 2**30:.1f}) > "
                f"{self.machine.memory_bytes / 2**30:.1f}",
            )
            return None
        return cost
