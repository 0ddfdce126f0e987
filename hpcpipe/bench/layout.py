"""Layout ranking on emulated nodes: is the layout search's order the measured order?

Every layout of this world that fits (`hpcpipe plan --search`, all of them) is run with the
real interpreter and transport and stages that sleep for the layout's modelled costs, scaled so
that the predicted best step takes `--target-ms`:

- F, B and W sleep for their compute; F and B also for their MoE all-to-alls;
- a message between stages carries the time it was sent; its consumer waits until that time
  plus the machine model's latency + bytes / bandwidth of the link between the two ranks:
  inside a virtual node (`--ranks-per-node` consecutive ranks) or across. The wait occupies
  the consumer only if the message is late, as a network delay would;
- each stage's gradient reduction runs "in the network" from the stage's last W for the
  modelled ring time, a rank's reductions one after another (the step ends when they have);
  the runtime's own bucketed allreduce of the stubs' one-number gradients runs as well.

So the machine here only has to keep time: what is measured is the schedules' real order of
work and waiting, per-hop node crossings (the model charges the slowest hop on every one) and
the runtime's overheads, against the model's prediction. The figures: Spearman rank correlation
of predicted and measured steps, the chosen layout's measured step against the best measured,
and the chosen layout's measured / predicted.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import make_backend
from hpcpipe.bench.synthetic import PollingMailbox, SleepStage, _pause
from hpcpipe.bench.table import Column, Report
from hpcpipe.bench.training import StepClock
from hpcpipe.config import ConfigError, load_config
from hpcpipe.layout.cost import LayoutCost, Prediction
from hpcpipe.layout.machine import Machine
from hpcpipe.schedules import validate
from hpcpipe.sleeps import fine_timer_slack
from hpcpipe.topology import RankMap
from hpcpipe.train.pipeline import PipelineRank

__all__ = ["rank_correlation", "run"]

COLUMNS = [
    Column("layout", "layout", "", 44, "<"),
    Column("predicted_ms", "predicted ms", ".2f", 12),
    Column("measured_ms", "measured ms", ".2f", 11),
    Column("ratio", "meas/pred", ".3f", 9),
    Column("pred_rank", "pred #", "d", 6),
    Column("meas_rank", "meas #", "d", 6),
]


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties get their mean rank)."""

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # mean rank over ties
            tied = x == v
            r[tied] = r[tied].mean()
        return r

    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den else 1.0


class _Network:
    """One rank's gradient reductions in flight: when the last of them ends."""

    def __init__(self) -> None:
        self.done = 0.0

    def reduce(self, seconds: float) -> None:
        self.done = max(self.done, time.perf_counter()) + seconds


class EmulatedStage(SleepStage):
    """A sleeping stage whose messages arrive after their link's delay and whose gradients
    are reduced, after its last W of a step, in the background (`_Network`)."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        times: tuple[float, float, float],
        comm: float,
        delays: tuple[float, float],
        reduce_s: float,
        m: int,
        network: _Network,
    ):
        super().__init__(stage, num_stages, times, 2, comm)
        self.delay_f, self.delay_b = delays
        self.reduce_s, self.m, self.network = reduce_s, m, network
        self._w = 0
        self._grads = {stage: {"w": np.ones(1)}}  # float64, the backend's type here

    def init(self) -> dict[int, dict[str, np.ndarray]]:
        return {self.index: {"w": np.zeros(1)}}

    @staticmethod
    def _stamped() -> np.ndarray:
        out = np.empty(2)
        out[0] = time.perf_counter()
        return out

    def forward(
        self, params: Any, x: Any, targets: Any = None, *, loss_weight: float = 1.0
    ) -> tuple[Any, Any]:
        if self.delay_f and x is not None:
            _pause(float(x[0]) + self.delay_f - time.perf_counter())
        y, ctx = super().forward(params, x, targets, loss_weight=loss_weight)
        return (y if self.is_last else self._stamped()), ctx

    def backward_input(self, params: Any, ctx: Any, dy: Any) -> tuple[Any, Any]:
        if self.delay_b and isinstance(dy, np.ndarray) and dy.size == 2:
            _pause(float(dy[0]) + self.delay_b - time.perf_counter())
        _, wctx = super().backward_input(params, ctx, dy)
        return (None if self.is_first else self._stamped()), wctx

    def backward_weight(self, params: Any, wctx: Any) -> dict[int, dict[str, np.ndarray]]:
        grads = super().backward_weight(params, wctx)
        self._w += 1
        if self._w % self.m == 0:  # the step's last W of this stage: its gradients are ready
            self.network.reduce(self.reduce_s)
        return grads


def _stages(
    cost: LayoutCost, machine: Machine, rm: RankMap, me: int, scale: float, network: _Network
) -> tuple[Any, dict[int, EmulatedStage], int]:
    lowered = validate(cost.schedule)
    pipeline = rm.group(me, "pp")  # global ranks in pipeline-rank order
    pos = pipeline.index(me)
    rank_of = cost.schedule.rank_of_stage
    nbytes = cost.costs.message_bytes
    last = cost.schedule.num_stages - 1

    def delay(src_stage: int, dst_stage: int) -> float:
        a, b = int(rank_of[src_stage]), int(rank_of[dst_stage])
        if a == b:
            return 0.0
        crosses = pipeline[a] // rm.ranks_per_node != pipeline[b] // rm.ranks_per_node
        return machine.link(crosses).time(nbytes) * scale

    stages = {}
    for s in lowered.stages_of_rank[pos]:
        compute, a2a = float(cost.compute[s]) * scale, float(cost.alltoall[s]) * scale
        stages[s] = EmulatedStage(
            s,
            last + 1,
            (compute + a2a, compute + a2a, compute),
            a2a,
            (delay(s - 1, s) if s > 0 else 0.0, delay(s + 1, s) if s < last else 0.0),
            float(cost.reduce[s]) * scale,
            cost.layout.m,
            network,
        )
    return lowered, stages, pos


def _measure(
    comm: MPI.Comm,
    cost: LayoutCost,
    machine: Machine,
    scale: float,
    steps: int,
    clock: StepClock,
    poll_s: float,
) -> float:
    """Median over steps of the slowest rank's step (reductions included), in seconds."""
    lay = cost.layout
    rm = RankMap.build(comm.size, machine.ranks_per_node, lay.pp, lay.dp, lay.ep, lay.order)
    me = comm.rank
    network = _Network()
    lowered, stages, pos = _stages(cost, machine, rm, me, scale, network)
    pp = comm.Split(rm.group_index(me, "pp"), key=pos)
    dp = comm.Split(rm.group_index(me, "dp"), key=me)
    runner = PipelineRank(
        lowered,
        pos,
        stages,  # type: ignore[arg-type]
        {s: stage.init() for s, stage in stages.items()},
        pp_comm=pp,
        dp_comm=dp,
        backend=make_backend("cpu", "float64", 0),
        act_shape=(2,),
    )
    if poll_s > 0:
        runner.mailbox.free()
        runner.mailbox = PollingMailbox(
            pp, runner.backend, runner.messages, runner.act_shape, runner.backend.dtype
        )
        runner.mailbox.poll_s = poll_s
    m = lay.m
    spans = []
    for step in range(steps + 1):
        network.done = 0.0
        t0 = clock.start()
        runner.step(step, [None] * m, [None] * m, 1.0 / m)
        _pause(network.done - time.perf_counter())
        span = time.perf_counter() - t0
        if step:  # step 0 is the warm-up
            spans.append(comm.allreduce(span, op=MPI.MAX))
    runner.mailbox.free()
    pp.Free()
    dp.Free()
    return float(np.median(spans))


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report | None:
    from hpcpipe.layout.machine import MachineConfig, machine_model
    from hpcpipe.layout.report import run_search

    fine_timer_slack()
    config = load_config(args.deck, args.overrides)
    rpn = args.ranks_per_node
    if rpn < 1:
        raise ConfigError("--ranks-per-node", "", f"= {rpn} must be >= 1")
    mcfg = config.sections.get("machine") or MachineConfig()
    machine = machine_model(mcfg, config.topology.ranks_per_node, config.source, rpn)
    clock = StepClock(comm)
    if not clock.one_clock:  # messages carry send times: one clock, i.e. one host
        raise ConfigError(
            "hpcpipe bench layout", "", "emulates nodes on one host: run every rank on one node"
        )
    ranked: list[tuple[Prediction, LayoutCost]] = []
    if comm.rank == 0:
        ranked = run_search(config, comm.size, ranks_per_node=rpn, top=1 << 30).ranked
    ranked = comm.bcast(ranked)
    if not ranked:
        raise SystemExit(f"no layout of {comm.size} ranks fits {args.deck}")
    scale = args.target_ms * 1e-3 / ranked[0][0].step
    oversubscribed = comm.size > (os.cpu_count() or 1)
    poll_s = args.poll_us * 1e-6 if oversubscribed else 0.0
    report = Report(
        "layout",
        [
            f"every layout of {comm.size} ranks that fits {args.deck} ({len(ranked)}), on "
            f"virtual nodes of {rpn} ranks: stages sleep for the modelled costs x {scale:.3g} "
            f"(the predicted best step = {args.target_ms:g} ms), messages that cross a node "
            "wait for the machine model's link, reductions run from each stage's last W",
            f"medians of {args.repeats} steps after a warm-up; ms on this machine's clock "
            "(predicted = the search's step x the same scale)",
        ],
        COLUMNS,
        params={"deck": args.deck, "ranks_per_node": rpn, "repeats": args.repeats, "scale": scale},
        stream=comm.rank == 0,
    )
    report.start()
    predicted, measured = [], []
    for pred, cost in ranked:
        got = _measure(comm, cost, machine, scale, args.repeats, clock, poll_s)
        predicted.append(pred.step * scale)
        measured.append(got)
    pr = np.argsort(np.argsort(predicted, kind="stable"), kind="stable")
    mr = np.argsort(np.argsort(measured, kind="stable"), kind="stable")
    for i, (_, cost) in enumerate(ranked):
        report.add(
            {
                "layout": cost.layout.label,
                "predicted_ms": predicted[i] * 1e3,
                "measured_ms": measured[i] * 1e3,
                "ratio": measured[i] / predicted[i],
                "pred_rank": int(pr[i]) + 1,
                "meas_rank": int(mr[i]) + 1,
            }
        )
    rho = rank_correlation(np.array(predicted), np.array(measured))
    best = min(measured)
    chosen = measured[0]  # the search's first is its choice
    report.summary |= {"spearman": rho, "chosen_vs_best": chosen / best}
    report.summary["chosen_measured_vs_predicted"] = chosen / predicted[0]
    report.target("rank correlation, predicted vs measured", ">= 0.9", f"{rho:.3f}", rho >= 0.9)
    report.target(
        "chosen layout's measured step / best measured",
        "<= 1.05",
        f"{chosen / best:.3f}",
        chosen / best <= 1.05,
    )
    ratio = chosen / predicted[0]
    report.target(
        "chosen layout, measured / predicted step",
        "within 10%",
        f"{ratio:.3f}",
        abs(ratio - 1.0) <= 0.10,
    )
    return report if comm.rank == 0 else None
