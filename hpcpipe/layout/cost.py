"""The cost of one layout: per-stage times, messages, reductions and memory, then its step.

A layout is pp x dp x ep, the order of those dims on the ranks, a schedule (with its virtual
stages) and the microbatch count. Everything here is arithmetic on the deck's model shapes and
the machine model, plus the pipeline simulator for the step:

- compute: a microbatch of n tokens costs n * FLOPs / rate for F, and as much for B and for W
  (the input and the weight gradients of a matmul each cost its forward);
- messages between stages: n * d_model activations, over the slowest pipeline hop (inside a
  node or across);
- MoE: a dispatch and a combine all-to-all per MoE block in F and again in B, over the ep group;
- data parallelism: each stage's gradients are reduced (ring: 2 (g-1)/g of the bytes, 2 (g-1)
  latencies) once its last W is done, one stage after another on a rank, dense parameters over
  dp and expert parameters over the dp / ep replicas of the same experts; what outlasts the
  pipeline is exposed;
- memory: weights, gradients and optimizer moments of the rank's stages (experts / ep of each
  MoE block), plus the schedule's peak of live activations (from its order: a schedule's peak
  does not depend on timing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.layout.machine import Link, Machine
from hpcpipe.layout.shapes import UnitShape
from hpcpipe.schedules import CostModel, Schedule, simulate
from hpcpipe.schedules.ir import Kind

__all__ = [
    "Layout",
    "LayoutCost",
    "Prediction",
    "Workload",
    "activation_per_token",
    "crossings",
    "layout_cost",
    "peak_live",
    "pipeline_costs",
    "predict",
    "static_bytes",
]


@dataclass(frozen=True, order=True)
class Layout:
    """One candidate: degrees, dim order (innermost first), schedule, v and microbatches."""

    pp: int
    dp: int
    ep: int
    order: tuple[str, ...]
    schedule: str
    v: int | None
    m: int

    @property
    def label(self) -> str:
        sched = self.schedule + (f"(v={self.v})" if self.v else "")
        return f"pp{self.pp} dp{self.dp} ep{self.ep} [{','.join(self.order)}] {sched} m={self.m}"


@dataclass(frozen=True)
class Workload:
    """What the deck fixes for every layout: the units, the batch and the number formats."""

    units: tuple[UnitShape, ...]
    global_batch: int
    seq_len: int
    d_model: int
    dtype_bytes: int
    optimizer_states: int  # moments per parameter: 2 for AdamW, 1 for SGD with momentum
    top_k: int = 0

    @functools.cached_property
    def flops(self) -> list[int]:
        return [u.flops_per_token for u in self.units]


@dataclass(frozen=True)
class LayoutCost:
    """A layout's simulator costs plus what the simulator does not model."""

    layout: Layout
    schedule: Schedule
    costs: CostModel
    stage_units: tuple[range, ...]
    compute: np.ndarray  # per stage: F compute time per microbatch (B and W each the same)
    alltoall: np.ndarray  # per stage: all-to-all time in one F (and again in one B)
    reduce: np.ndarray  # per stage: time to reduce its gradients over the replicas
    static_bytes: np.ndarray  # per rank: weights + gradients + optimizer moments
    activation: np.ndarray  # per stage: bytes one microbatch leaves until its W
    peak_activation: np.ndarray  # per rank: the schedule's peak of live activations, bytes
    crosses: dict[str, bool]  # per dim: whether a group of it spans nodes

    @property
    def memory(self) -> np.ndarray:
        return self.static_bytes + self.peak_activation

    @property
    def busy(self) -> np.ndarray:
        """Per rank: compute and all-to-all time of the whole step (no waiting)."""
        m = self.layout.m
        per_stage = m * (3.0 * self.compute + 2.0 * self.alltoall)
        return np.array([per_stage[list(s)].sum() for s in self.schedule.stages_of_rank])


@dataclass(frozen=True)
class Prediction:
    """Predicted step and where its time goes (on the rank that finishes last)."""

    step: float
    makespan: float
    compute: float
    alltoall: float
    idle: float  # bubble and message waits inside the pipeline
    reduce_exposed: float
    memory: float  # the fullest rank's bytes


def ring(group: int, nbytes: float, link: Link) -> float:
    """Ring allreduce: 2 (g-1)/g of the bytes through each rank's link, 2 (g-1) latencies."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (group - 1) * link.latency + 2 * (group - 1) / group * nbytes / link.bandwidth


def alltoall(group: int, nbytes: float, link: Link) -> float:
    """Each rank keeps 1/g of its `nbytes` and exchanges the rest with g-1 peers."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return (group - 1) * link.latency + (group - 1) / group * nbytes / link.alltoall_bandwidth


def crossings(world: int, ranks_per_node: int, layout: Layout) -> dict[str, bool]:
    """Whether any group of pp (a pipeline), dp (a stage's replicas), ep (an expert group) or
    edp (the replicas of one expert shard) spans nodes, from the dims' strides."""
    extent = {"pp": layout.pp, "dp": layout.dp // layout.ep, "ep": layout.ep}
    stride, s = {}, 1
    for d in layout.order:
        stride[d] = s
        s *= extent[d]
    ranks = np.arange(world, dtype=np.int64)
    node = ranks // ranks_per_node

    def spans(dims: tuple[str, ...]) -> bool:
        """A group varies `dims` and fixes the rest: it spans nodes iff some rank and the
        group's first rank (all of `dims` at 0) sit on different nodes."""
        first = ranks.copy()
        for d in dims:
            first -= (ranks // stride[d] % extent[d]) * stride[d]
        return bool((node != first // ranks_per_node).any())

    return {
        "pp": spans(("pp",)),
        "dp": spans(("dp", "ep")),
        "ep": spans(("ep",)),
        "edp": spans(("dp",)),
    }


def activation_per_token(work: Workload, stage_units: tuple[range, ...]) -> np.ndarray:
    """Per stage: bytes one token of a microbatch leaves on the stage until its W."""
    per_unit = [u.activation_bytes_per_token for u in work.units]
    return np.array([float(sum(per_unit[i] for i in r)) for r in stage_units])


def peak_live(schedule: Schedule, activation: np.ndarray) -> np.ndarray:
    """Per rank: the most activation held at once, in the rank's own order (F adds a stage's
    microbatch, W or BW releases it; B releases nothing), so independent of timing and
    linear in `activation`."""
    from hpcpipe.schedules._table import compute_table

    table = compute_table(schedule)
    sign = np.zeros(4)
    sign[Kind.F], sign[Kind.W], sign[Kind.BW] = 1.0, -1.0, -1.0
    live = activation[table.stage] * sign[table.kind]
    np.cumsum(live, out=live)
    starts = table.offsets[:-1]
    base = np.concatenate(([0.0], live))[starts]
    peaks = np.maximum.reduceat(live, starts) if live.size else np.zeros(len(starts))
    return np.maximum(peaks - base, 0.0)


def pipeline_costs(
    work: Workload,
    machine: Machine,
    layout: Layout,
    stage_units: tuple[range, ...],
    crosses: dict[str, bool],
) -> tuple[CostModel, np.ndarray, np.ndarray]:
    """The simulator's costs of the stages `stage_units` (whatever the schedule), with the
    per-stage compute and all-to-all times of one F."""
    tokens = work.global_batch // (layout.dp * layout.m) * work.seq_len
    size = work.dtype_bytes
    flops = work.flops
    compute = np.array([tokens * sum(flops[i] for i in r) for r in stage_units]) / machine.flops
    moe_blocks = np.array([sum(work.units[i].moe for i in r) for r in stage_units], dtype=float)
    a2a_bytes = tokens * work.top_k * work.d_model * size  # one dispatch (or one combine)
    a2a = moe_blocks * 2 * alltoall(layout.ep, a2a_bytes, machine.link(crosses["ep"]))
    hop = machine.link(crosses["pp"])
    costs = CostModel(
        t_f=compute + a2a,
        t_b=compute + a2a,
        t_w=compute,
        t_comm=a2a,
        comm_latency=hop.latency,
        comm_bandwidth=hop.bandwidth,
        message_bytes=float(tokens * work.d_model * size),
        activation=tokens * activation_per_token(work, stage_units),
    )
    return costs, compute, a2a


def static_bytes(
    work: Workload,
    layout: Layout,
    stage_units: tuple[range, ...],
    placement: tuple[tuple[int, ...], ...],
) -> np.ndarray:
    """Per rank: weights, gradients and optimizer moments of its stages (experts / ep)."""
    units = work.units
    per_param = work.dtype_bytes * (2 + work.optimizer_states)  # weight, gradient, moments
    params = [
        sum(units[i].params + units[i].expert_params / layout.ep for i in r) for r in stage_units
    ]
    return np.array([sum(params[s] for s in stages) * per_param for stages in placement])


def layout_cost(
    work: Workload,
    machine: Machine,
    world: int,
    layout: Layout,
    schedule: Schedule,
    stage_units: tuple[range, ...],
    *,
    crosses: dict[str, bool] | None = None,
    peak_per_token: np.ndarray | None = None,
) -> LayoutCost:
    """Every cost of `layout` running `schedule` with the units split as `stage_units`.

    `crosses` (`crossings`) and `peak_per_token` (`peak_live` of the per-token activations)
    may be passed in by a caller that evaluates many layouts sharing them."""
    if crosses is None:
        crosses = crossings(world, machine.ranks_per_node, layout)
    costs, compute, a2a = pipeline_costs(work, machine, layout, stage_units, crosses)
    tokens = work.global_batch // (layout.dp * layout.m) * work.seq_len
    size = work.dtype_bytes
    units = work.units
    dense = np.array([sum(units[i].params for i in r) for r in stage_units], dtype=float)
    experts = np.array([sum(units[i].expert_params for i in r) for r in stage_units], dtype=float)
    experts /= layout.ep
    reduce = np.array(
        [
            ring(layout.dp, d * size, machine.link(crosses["dp"]))
            + ring(layout.dp // layout.ep, e * size, machine.link(crosses["edp"]))
            for d, e in zip(dense, experts, strict=True)
        ]
    )
    static = static_bytes(work, layout, stage_units, schedule.stages_of_rank)
    if peak_per_token is None:
        peak_per_token = peak_live(schedule, activation_per_token(work, stage_units))
    act = np.asarray(costs.activation, dtype=float)
    return LayoutCost(
        layout=layout,
        schedule=schedule,
        costs=costs,
        stage_units=stage_units,
        compute=compute,
        alltoall=a2a,
        reduce=reduce,
        static_bytes=static,
        activation=act,
        peak_activation=tokens * peak_per_token,
        crosses=crosses,
    )


def _reductions_end(cost: LayoutCost, sim: Any) -> np.ndarray:
    """Per rank: when its last gradient reduction ends, each stage's starting at its last
    W (or BW) and a rank's reductions running one after another."""
    weight = (sim.kind == Kind.W) | (sim.kind == Kind.BW)
    num_stages = cost.schedule.num_stages
    ready = np.zeros(num_stages)
    np.maximum.at(ready, sim.stage[weight], sim.end[weight])
    out = np.zeros(cost.schedule.num_ranks)
    for r, stages in enumerate(cost.schedule.stages_of_rank):
        t = 0.0
        for s in sorted(stages, key=lambda s: ready[s]):
            t = max(t, ready[s]) + cost.reduce[s]
        out[r] = t
    return out


def predict(cost: LayoutCost) -> Prediction:
    """Simulate the layout's pipeline and add the exposed gradient reductions."""
    sim = simulate(cost.schedule, cost.costs)
    makespan = sim.makespan
    done = np.maximum(sim.last_end, _reductions_end(cost, sim))
    last = int(np.argmax(done))
    m = cost.layout.m
    stages = list(cost.schedule.stages_of_rank[last])
    compute = float(3 * m * cost.compute[stages].sum())
    a2a = float(2 * m * cost.alltoall[stages].sum())
    step = float(done.max())
    return Prediction(
        step=step,
        makespan=makespan,
        compute=compute,
        alltoall=a2a,
        idle=max(makespan - compute - a2a, 0.0),
        reduce_exposed=max(step - makespan, 0.0),
        memory=float(cost.memory.max()),
    )
