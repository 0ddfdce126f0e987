"""[pipeline]: which schedule, how many microbatches, and the costs that predict its run.

Costs describe the model, not a schedule, so one deck compares every schedule fairly: `t_f`,
`t_b`, `t_w` and `activation_memory` give the model as consecutive equal pieces (one value:
each of the pp "full stages", i.e. 1/pp of the model, costs that much). A schedule that cuts
the model into more stages (interleaved: v*pp, the V shapes: 2*pp) gets the share of each of
its stages, e.g. half of a full stage for a V chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hpcpipe.config import option
from hpcpipe.schedules.registry import SCHEDULE_NAMES
from hpcpipe.schedules.simulate import CostModel

__all__ = ["PipelineConfig", "cost_model", "costs_for", "stage_shares"]


@dataclass(frozen=True)
class PipelineConfig:
    """[pipeline]: schedule choice, microbatches and the cost model of `hpcpipe plan`."""

    schedule: str = option(
        "1f1b",
        "pipeline schedule; 'auto' searches for the fastest one that fits memory_budget; "
        "'csv' loads a hand-written one from schedule_csv",
        choices=(*SCHEDULE_NAMES, "auto", "csv"),
    )
    microbatches: int = option(
        8,
        "microbatches per step (m)",
        minimum=1,
        maximum=65536,  # schedules are built and validated action by action: O(pp * m)
    )
    virtual_stages: int | None = option(
        None, "stages per rank for interleaved-1f1b (unset: 2)", minimum=1, maximum=4096
    )
    schedule_csv: str | None = option(
        None, "CSV schedule file (one row of actions per rank) used when schedule = 'csv'"
    )
    overlap_pairs: bool = option(
        False,
        "run the overlapped F&B pairs of the schedules that define them (dualpipe-v) as "
        "pairs: a pair starts once both halves' inputs are there, and each half's all-to-all "
        "(t_alltoall) hides behind the other's compute; off, the same actions run one by one",
    )
    t_f: tuple[float, ...] = option(
        (1.0,),
        "forward time per microbatch: one value per full stage, or per model piece",
        minimum=0.0,
    )
    t_b: tuple[float, ...] = option(
        (1.0,), "backward-for-inputs (B) time, same layout as t_f", minimum=0.0
    )
    t_w: tuple[float, ...] = option(
        (1.0,), "backward-for-weights (W) time, same layout as t_f", minimum=0.0
    )
    t_alltoall: tuple[float, ...] = option(
        (0.0,),
        "MoE all-to-all time per microbatch (dispatch + combine), added to F and to B; same "
        "layout as t_f (0 on stages without MoE blocks)",
        minimum=0.0,
    )
    comm_latency: float = option(0.0, "time for a message between ranks to start", minimum=0.0)
    comm_bandwidth: float | None = option(
        None, "bytes per time unit between ranks (unset: unlimited)", minimum=0.0
    )
    message_bytes: float = option(
        0.0, "bytes of one activation (or its gradient) sent between stages", minimum=0.0
    )
    activation_memory: tuple[float, ...] = option(
        (1.0,),
        "activations one microbatch leaves on a full stage (any unit; 1 = count microbatches)",
        minimum=0.0,
    )
    memory_budget: float | None = option(
        None,
        "schedule = 'auto': most activations a rank may hold, in activation_memory units "
        "(with the default 1.0 per full stage: microbatches of one rank's share; with bytes "
        "per stage: bytes); unset: no limit",
        minimum=0.0,
    )
    activation_freed_by_b: float = option(
        0.0,
        "share of a stage's activations that B releases (W releases the rest)",
        minimum=0.0,
        maximum=1.0,
    )

    def __post_init__(self) -> None:
        if self.schedule == "csv" and not self.schedule_csv:
            raise ValueError("schedule_csv: must name a CSV file when schedule = 'csv'")
        if self.schedule != "csv" and self.schedule_csv:
            raise ValueError(
                f"schedule_csv: is only read when schedule = 'csv' (schedule = {self.schedule!r})"
            )
        if self.memory_budget is not None and self.schedule != "auto":
            raise ValueError(
                f"memory_budget: is only read when schedule = 'auto' (schedule = {self.schedule!r})"
            )
        if self.overlap_pairs and self.schedule != "dualpipe-v":
            raise ValueError(
                "overlap_pairs: only dualpipe-v defines overlapped pairs (schedule = "
                f"{self.schedule!r}; a CSV schedule writes its pairs as 'sFi&tBj' cells)"
            )
        if self.virtual_stages is not None and self.schedule != "interleaved-1f1b":
            raise ValueError(
                "virtual_stages: only interleaved-1f1b takes it "
                f"(schedule {self.schedule!r} has a fixed placement)"
            )
        for key in ("t_f", "t_b", "t_w", "t_alltoall", "activation_memory"):
            values = getattr(self, key)
            if len(values) == 0:
                raise ValueError(f"{key}: needs at least one value")
            if any(not np.isfinite(x) or x < 0 for x in values):
                raise ValueError(f"{key}: values must be finite and >= 0, got {list(values)}")
        if self.comm_bandwidth is not None and self.comm_bandwidth <= 0:
            raise ValueError(f"comm_bandwidth: = {self.comm_bandwidth} must be > 0 (or unset)")


def stage_shares(values: Sequence[float], pp: int, num_stages: int) -> np.ndarray:
    """Per-stage amounts for `num_stages` equal consecutive stages of a model described by
    `values`: one value is each of `pp` full stages; L values are L equal consecutive pieces.
    Uneven cuts are integrated piecewise (a stage covering half of two pieces gets half of each).
    """
    vals = np.asarray(values, dtype=np.float64)
    if vals.size == 1:
        vals = np.full(pp, float(vals[0]))
    if num_stages % vals.size == 0:  # exact when the cuts line up
        k = num_stages // vals.size
        return np.repeat(vals / k, k)
    if vals.size % num_stages == 0:
        return vals.reshape(num_stages, -1).sum(axis=1)
    cumulative = np.concatenate(([0.0], np.cumsum(vals)))
    edges = np.linspace(0.0, 1.0, vals.size + 1)
    return np.diff(np.interp(np.linspace(0.0, 1.0, num_stages + 1), edges, cumulative))


def cost_model(cfg: PipelineConfig, pp: int, num_stages: int) -> CostModel:
    """The simulator's per-stage costs for a schedule of `num_stages` stages on `pp` ranks."""
    # MoE: a dispatch and a combine all-to-all in F, their reverses in B, per microbatch
    a2a = stage_shares(cfg.t_alltoall, pp, num_stages)
    return CostModel(
        t_f=stage_shares(cfg.t_f, pp, num_stages) + a2a,
        t_b=stage_shares(cfg.t_b, pp, num_stages) + a2a,
        t_comm=a2a,
        t_w=stage_shares(cfg.t_w, pp, num_stages),
        comm_latency=cfg.comm_latency,
        comm_bandwidth=cfg.comm_bandwidth,
        message_bytes=cfg.message_bytes,
        activation=stage_shares(cfg.activation_memory, pp, num_stages),
        b_frees=cfg.activation_freed_by_b,
    )


def costs_for(cfg: PipelineConfig, pp: int) -> Callable[[int], CostModel]:
    """`cost_model` for any number of stages: what the schedule search compares placements by."""
    return functools.partial(cost_model, cfg, pp)
