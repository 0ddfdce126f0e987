"""Synthetic-cost pipeline: the real interpreter and transport, with stages that sleep.

Each stage is a stub with the `Stage` interface whose F, B and W sleep for the deck's modelled
cost (`[pipeline]` t_f / t_b / t_w, in units of `--unit-ms`) and hand on fixed-size arrays, run
by `hpcpipe.train.pipeline.PipelineRank` itself. A sleeping rank uses no CPU, so 8 or 16 ranks
fit on 2 cores, and the step time can be held against the plan: the simulator's makespan for
the same costs. The gap is what the runtime adds (messages, waits, interpreter) plus how late
the sleeps end; "replay" simulates the durations the stubs actually had, which separates the
two. Sleeps are plain sleeps with 1 us timer slack: spinning would steal the oversubscribed
cores from the ranks that have work.

For the same reason, with more ranks on a node than cores (`--wait auto`, or `--wait poll`), a
rank waiting for a message polls `Test` and sleeps `--poll-us` between polls instead of spinning
in MPI's `Wait`: the mailbox is the runtime's own with only that blocking call replaced. With
`--wait mpi` it is the unchanged `Wait`, which is right when every rank has a core.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import make_backend
from hpcpipe.bench.harness import median
from hpcpipe.bench.model import step_figures
from hpcpipe.bench.table import Column, Report
from hpcpipe.bench.training import StepClock, bench_config, schedule_names
from hpcpipe.config import ConfigError
from hpcpipe.mpi.p2p import Mailbox
from hpcpipe.schedules import CostModel, Schedule, ScheduleError, validate
from hpcpipe.schedules._table import compute_table
from hpcpipe.schedules.config import cost_model
from hpcpipe.schedules.replay import COMPUTE, action_counts
from hpcpipe.schedules.report import load_schedule
from hpcpipe.schedules.simulate import durations
from hpcpipe.sleeps import fine_timer_slack
from hpcpipe.train.pipeline import PipelineRank

__all__ = ["SleepStage", "polling", "run_synthetic", "sleeping_runner", "synthetic_costs"]

COLUMNS = [
    Column("schedule", "schedule", "", 16, "<"),
    Column("plan_ms", "plan ms", ".2f", 9),
    Column("plan_in_order_ms", "in-order ms", ".2f", 11),
    Column("measured_ms", "measured ms", ".2f", 11),
    Column("plan_ratio", "vs plan", ".3f", 7),
    Column("plan_runtime_ratio", "vs in-order", ".3f", 11),
    Column("ratio", "vs replay", ".3f", 9),
    Column("runtime_ratio", "vs replay in-order", ".3f", 9),
    Column("bubble_pct", "bubble %", ".1f", 8),
    Column("bubble_plan_pct", "plan %", ".1f", 6),
    Column("late_us", "late us/action", ".1f", 8),
    Column("other_ms", "other ms", ".2f", 8),
]


class PollingMailbox(Mailbox):
    """The runtime's mailbox, waiting by `Test` + sleep: on an oversubscribed node a rank
    spinning in `Wait` would take the core from one whose sleep (its compute) has ended.

    The wait is in `_complete`, which every receive goes through: on the CPU path the mailbox
    binds `wait_recv` to its host method per instance, so an override of `wait_recv` itself
    would never run."""

    poll_s: float = 20e-6

    def _complete(self, i: int) -> Any:
        slot = self._order[i]
        if not slot.arrived:
            while not slot.request.Test(slot.status):
                time.sleep(self.poll_s)
            slot.arrived = True  # the status holds the message: no Wait
        return super()._complete(i)


def _pause(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class SleepStage:
    """The `Stage` interface with sleeps for compute: F, B and W each take a fixed time.

    `comm` of F's and of B's time stands for communication inside them (the MoE all-to-alls
    of `t_alltoall`): F computes, then communicates; B communicates, then computes. Run on
    its own, each simply sleeps its whole time. In an overlapped pair (`begin_pair`) the
    communication is "in the network": B's starts with the pair and F's when F's compute
    ends, and each is waited for only when its result is needed (B's before B computes, F's
    at the end of the pair), so it hides behind the other half's compute as the simulator's
    pair cost says.
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        times: tuple[float, float, float],
        act_elems: int,
        comm: float = 0.0,
    ):
        self.index = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.t_f, self.t_b, self.t_w = times
        self.comm = comm
        self._out = np.zeros(act_elems, dtype=np.float32)  # sent on by F, back by B
        self._saved = np.zeros(act_elems, dtype=np.float32)  # stands for saved activations
        self._loss = np.zeros((), dtype=np.float32)
        self._grads = {stage: {"w": np.ones(1, dtype=np.float32)}}
        self._pair: dict[str, float] | None = None  # deadlines of the pair's communication

    def init(self) -> dict[int, dict[str, np.ndarray]]:
        """Parameters: one number, so the runtime's gradient buffers stay trivial."""
        return {self.index: {"w": np.zeros(1, dtype=np.float32)}}

    def begin_pair(self, backward: SleepStage) -> None:
        """This stage's F and `backward`'s B (or BW) run next, overlapped."""
        now = time.perf_counter()
        shared = {"b_comm": now + backward.comm, "f_comm": now}
        self._pair = backward._pair = shared

    def end_pair(self, backward: SleepStage) -> None:
        shared, self._pair, backward._pair = self._pair, None, None
        if shared is not None:
            _pause(shared["f_comm"] - time.perf_counter())

    def forward(
        self, params: Any, x: Any, targets: Any = None, *, loss_weight: float = 1.0
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        _pause(self.t_f - self.comm)
        if self._pair is None:
            _pause(self.comm)
        else:
            self._pair["f_comm"] = time.perf_counter() + self.comm
        return (self._loss if self.is_last else self._out), [self._saved]

    def backward_input(self, params: Any, ctx: Any, dy: Any) -> tuple[np.ndarray | None, Any]:
        if self._pair is None:
            _pause(self.comm)
        else:
            _pause(self._pair["b_comm"] - time.perf_counter())
        _pause(self.t_b - self.comm)
        return (None if self.is_first else self._out), ctx

    def backward_weight(self, params: Any, wctx: Any) -> dict[int, dict[str, np.ndarray]]:
        _pause(self.t_w)
        return self._grads

    def backward_weight_units(
        self, params: Any, wctx: Any
    ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        yield from self.backward_weight(params, wctx).items()


def synthetic_costs(config: Any, schedule: Schedule, unit: float) -> CostModel:
    """The deck's cost model for this schedule, in seconds; transfers free (tiny messages)."""
    costs = cost_model(config.pipeline, schedule.num_ranks, schedule.num_stages)
    arrays = costs.stage_arrays(schedule.num_stages)
    return CostModel(
        t_f=arrays["t_f"] * unit,
        t_b=arrays["t_b"] * unit,
        t_w=arrays["t_w"] * unit,
        t_comm=arrays["t_comm"] * unit,
    )


def sleeping_runner(
    comm: MPI.Comm,
    lowered: Schedule,
    plan: CostModel,
    act_elems: int,
    poll_s: float,
    build: Callable[..., PipelineRank] = PipelineRank,
    **extra: Any,
) -> tuple[PipelineRank, MPI.Comm]:
    """`build(lowered, rank, stages, params, ...)` (PipelineRank or a subclass, `extra` its own
    arguments) over `SleepStage`s with `plan`'s costs, on a duplicate of `comm` (returned, to
    free); waits poll with `poll_s` sleeps when > 0."""
    arrays = plan.stage_arrays(lowered.num_stages)
    mine = lowered.stages_of_rank[comm.rank]
    stages = {
        s: SleepStage(
            s,
            lowered.num_stages,
            (float(arrays["t_f"][s]), float(arrays["t_b"][s]), float(arrays["t_w"][s])),
            act_elems,
            float(arrays["t_comm"][s]),
        )
        for s in mine
    }
    pp = comm.Dup()
    runner = build(
        lowered,
        comm.rank,
        stages,
        {s: stage.init() for s, stage in stages.items()},
        pp_comm=pp,
        dp_comm=MPI.COMM_SELF,
        backend=make_backend("cpu", "float32", 0),
        act_shape=(act_elems,),
        **extra,
    )
    if poll_s > 0:
        runner.mailbox.free()
        runner.mailbox = PollingMailbox(
            pp, runner.backend, runner.messages, runner.act_shape, runner.backend.dtype
        )
        runner.mailbox.poll_s = poll_s
    return runner, pp


def polling(comm: MPI.Comm, wait: str) -> bool:
    """`auto`: poll when this node holds more ranks than it has cores."""
    if wait != "auto":
        return wait == "poll"
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    crowded = node.size > (os.cpu_count() or 1)
    node.Free()
    return bool(comm.allreduce(int(crowded), op=MPI.MAX))


def _late_us(
    lowered: Schedule, plan: CostModel, times: list[dict[tuple[str, int], float]]
) -> float:
    """Mean overshoot of a compute action over its planned time (sleep wake-up latency); a
    pair's halves are planned at their overlapped durations."""
    table = compute_table(lowered)
    planned = durations(table, plan.stage_arrays(lowered.num_stages))
    kind_names = np.array(COMPUTE)[table.kind]
    plan_total: dict[tuple[str, int], float] = {}
    rows = zip(kind_names.tolist(), table.stage.tolist(), planned.tolist(), strict=True)
    for kind, stage, took in rows:
        plan_total[(kind, stage)] = plan_total.get((kind, stage), 0.0) + took
    counts = action_counts(lowered)
    late, count = 0.0, 0
    for per_rank in times:
        for key, total in per_rank.items():
            if key in plan_total:
                late += total - plan_total[key]
                count += counts[key]
    return late / count * 1e6 if count else float("nan")


def run_synthetic(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    fine_timer_slack()
    unit = args.unit_ms * 1e-3
    act_elems = max(1, args.act_bytes // 4)
    config = bench_config(args.deck, args.overrides, comm.size)
    poll = polling(comm, args.wait)
    names = schedule_names(args.schedules)
    report = Report(
        "pipeline-synthetic",
        [
            f"synthetic-cost pipeline on {comm.size} ranks: PipelineRank with stages that sleep "
            f"for the deck's [pipeline] costs x {args.unit_ms:g} ms ({args.deck}"
            + (f" with {' '.join(args.overrides)}" if args.overrides else "")
            + f"), m={config.pipeline.microbatches}, {args.act_bytes}-byte activations, "
            + (f"waits poll Test + {args.poll_us:g} us sleeps" if poll else "waits in MPI Wait"),
            f"{args.repeats} steps per schedule after a warm-up, each started at one instant on "
            "all ranks; medians over steps; plan = simulator with the modelled costs; in-order "
            "= the plan kept in the lowered schedule's message order (what the runtime runs); "
            "replay = the same two with the durations the sleeps really had",
            "late = mean time an F/B/W ran past its modelled cost (sleep wake-up); other = time "
            "outside any action per rank (posting, loop, drain)",
        ],
        COLUMNS,
        params={
            "deck": args.deck,
            "overrides": args.overrides,
            "schedules": names,
            "repeats": args.repeats,
            "unit_ms": args.unit_ms,
            "act_bytes": args.act_bytes,
            "microbatches": config.pipeline.microbatches,
            "wait": "poll" if poll else "mpi",
            "poll_us": args.poll_us if poll else None,
        },
        stream=comm.rank == 0,
    )
    report.start()
    clock = StepClock(comm)
    runs = [(name, name, ()) for name in names]
    if args.overlap_pairs and "dualpipe-v" in names:  # the same order, run as F&B pairs
        at = names.index("dualpipe-v") + 1
        runs.insert(at, ("dualpipe-v", PAIRED, ("pipeline.overlap_pairs=true",)))
    pair_comm: dict[str, float] = {}
    for name, label, extra in runs:
        cfg = bench_config(
            args.deck, args.overrides, comm.size, f"pipeline.schedule={name}", *extra
        )
        try:
            schedule = load_schedule(cfg.pipeline, comm.size, cfg.source)
            lowered = validate(schedule)
        except (ConfigError, ScheduleError) as exc:
            report.add({"schedule": label, "skipped": str(exc).splitlines()[0]})
            report.note(f"{label} skipped: {str(exc).splitlines()[0]}")
            continue
        plan = synthetic_costs(cfg, schedule, unit)
        if lowered.pairs.size:
            pair_comm[label] = _pair_comm(lowered, plan)
        poll_s = args.poll_us * 1e-6 if poll else 0.0
        runner, pp = sleeping_runner(comm, lowered, plan, act_elems, poll_s)
        m = lowered.num_microbatches
        record = []
        for step in range(args.repeats + 1):
            t0 = clock.start()
            begin = time.perf_counter()
            result = runner.step(step, [None] * m, [None] * m, 1.0 / m)
            if step:  # step 0 is the warm-up
                record.append((t0, (begin, time.perf_counter()), result.action_times))
        pp.Free()
        parts = comm.gather(record, root=0)
        if parts is None:
            continue
        steps = []
        for i in range(args.repeats):
            ranks = [part[i] for part in parts]
            times = [t for _, _, t in ranks]
            figures = step_figures(
                lowered, [s for _, s, _ in ranks], times, plan=plan, start=ranks[0][0]
            )
            figures["late_us"] = _late_us(lowered, plan, times)
            steps.append(figures)
        report.add(_row(label, steps))
    _summarize(report, comm.size)
    if PAIRED in pair_comm:
        _summarize_pairs(report, pair_comm[PAIRED])
    return report


PAIRED = "dualpipe-v F&B"
"""The row of DualPipeV run as overlapped pairs (`--overlap-pairs`)."""


def _pair_comm(lowered: Schedule, plan: CostModel) -> float:
    """Seconds of communication inside paired actions on the rank with the most: what the
    pairs can hide at best."""
    comm = plan.stage_arrays(lowered.num_stages)["t_comm"]
    per_rank = np.zeros(lowered.num_ranks)
    rank = np.searchsorted(lowered.offsets, lowered.pairs, side="right") - 1
    hidden = comm[lowered.stages[lowered.pairs]] + comm[lowered.stages[lowered.pairs + 1]]
    np.add.at(per_rank, rank, hidden)
    return float(per_rank.max())


def _summarize_pairs(report: Report, comm_s: float) -> None:
    """DualPipeV's order run as F&B pairs against the same order action by action."""
    rows = {r["schedule"]: r for r in report.rows if "measured_ms" in r}
    if "dualpipe-v" not in rows or PAIRED not in rows:
        return
    single, paired = rows["dualpipe-v"], rows[PAIRED]
    saved = single["measured_ms"] - paired["measured_ms"]
    planned = single["plan_ms"] - paired["plan_ms"]
    comm_ms = comm_s * 1e3
    report.summary |= {"pairs_saved_ms": saved, "pairs_planned_saving_ms": planned}
    report.summary["pairs_comm_ms"] = comm_ms
    report.note(
        f"F&B pairs: DualPipeV {paired['measured_ms']:.1f} ms paired vs {single['measured_ms']:.1f}"
        f" ms action by action, {saved:.1f} ms saved (plan: {planned:.1f} ms) of the "
        f"{comm_ms:.1f} ms of communication inside the busiest rank's pairs"
    )
    report.target(
        "F&B pairs save >= half the communication inside them",
        f">= {comm_ms / 2:.1f} ms",
        f"{saved:.1f} ms",
        saved >= comm_ms / 2,
        f"plan {planned:.1f} ms",
    )


def _row(name: str, steps: list[dict[str, float]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return median([s[key] for s in steps])

    return {
        "schedule": name,
        "plan_ms": med("plan_s") * 1e3,
        "measured_ms": med("measured_s") * 1e3,
        "plan_ratio": med("plan_ratio"),
        "plan_in_order_ms": med("plan_in_order_s") * 1e3,
        "plan_runtime_ratio": med("plan_runtime_ratio"),
        "runtime_ratio": med("runtime_ratio"),
        "in_order_ms": med("in_order_s") * 1e3,
        "replay_ms": med("replay_s") * 1e3,
        "ratio": med("ratio"),
        "bubble_pct": med("bubble") * 100,
        "bubble_plan_pct": med("bubble_plan") * 100,
        "late_us": med("late_us"),
        "other_ms": med("other_s") * 1e3,
        "us_per_action": med("other_us_per_action"),
        "start_late_us": med("start_late_us"),
        "recv_ms": med("recv_s") * 1e3,
        "per_step": steps,
    }


def _summarize(report: Report, ranks: int) -> None:
    rows = [r for r in report.rows if "ratio" in r]
    if not rows:
        return
    plan = np.array([r["plan_ratio"] for r in rows])
    replay = np.array([r["ratio"] for r in rows])
    in_order = np.array([r["plan_runtime_ratio"] for r in rows])
    report.summary |= {
        "max_plan_ratio": float(plan.max()),
        "median_plan_ratio": float(np.median(plan)),
        "max_replay_ratio": float(replay.max()),
        "max_plan_in_order_ratio": float(in_order.max()),
        "median_plan_in_order_ratio": float(np.median(in_order)),
    }
    report.note(
        f"{ranks} ranks: measured / plan median {np.median(plan):.3f}, max {plan.max():.3f}; "
        "measured / plan "
        f"in message order median {np.median(in_order):.3f}, max {in_order.max():.3f}; "
        f"measured / replay max {replay.max():.3f}"
    )
    report.target(
        f"measured / plan, {ranks} ranks (worst schedule)",
        "<= 1.03",
        f"{plan.max():.3f}",
        plan.max() <= 1.03,
        f"median {np.median(plan):.3f}",
    )
