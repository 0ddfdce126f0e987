"""A pipeline without a flush against the synchronous schedules, with stages that sleep.

The issue's question: once the pipeline is full, how close does a stream without a flush come
to the no-bubble bound (every rank busy all the time), and does it beat every synchronous
schedule that holds no more activations? Both run on the real interpreters (`PipelineRank`
flushed every step, `FlushFreeRank` over one long stream) with `SleepStage`s that sleep for
the deck's modelled costs, so 8 ranks fit on 2 cores (`hpcpipe.bench.synthetic`).

Throughput is stated as a share of the bound, `rate x work`, where `work` is the planned
compute per microbatch on the rank with the most, so a sleep that overshoots counts against
the runtime, not for it:

- flushed schedules: `m / step time` (median over steps);
- the stream in steady state: on the busiest rank, microbatches per second between the F of
  microbatch N/4 and that of 3N/4 (its first stage there), N the stream's length, where
  fill and drain are out of sight; and over the whole stream, N / its wall time.

The plan's figure beside each is the same formula on the simulator's times.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.bench.harness import median
from hpcpipe.bench.synthetic import polling, sleeping_runner, synthetic_costs
from hpcpipe.bench.table import Column, Report
from hpcpipe.bench.training import StepClock, bench_config, schedule_names
from hpcpipe.config import ConfigError
from hpcpipe.io.trace import Recorder
from hpcpipe.schedules import CostModel, Schedule, ScheduleError, simulate, validate
from hpcpipe.schedules.flushfree import FlushFreePlan, flush_free
from hpcpipe.schedules.ir import Kind
from hpcpipe.schedules.report import load_schedule
from hpcpipe.sleeps import fine_timer_slack
from hpcpipe.train.flushfree_rank import FlushFreeRank
from hpcpipe.train.optim import init_state

__all__ = ["run"]

TARGET_BOUND = 0.97
"""The stream's steady state, as a share of the no-bubble bound (the issue's target)."""

COLUMNS = [
    Column("schedule", "schedule", "", 26, "<"),
    Column("peak_mb", "act peak", ".0f", 8),
    Column("versions", "versions", ".0f", 8),
    Column("plan", "plan", ".3f", 6),
    Column("measured", "measured", ".3f", 8),
    Column("ratio", "meas/plan", ".3f", 9),
    Column("whole", "whole run", ".3f", 9),
    Column("measured_ms", "ms", ".1f", 8),
]


def _work(schedule: Schedule, costs: CostModel) -> float:
    """Planned compute per microbatch on the rank with the most (the bound's denominator)."""
    arrays = costs.stage_arrays(schedule.num_stages)
    per_stage = arrays["t_f"] + arrays["t_b"] + arrays["t_w"]
    return max(float(sum(per_stage[s] for s in row)) for row in schedule.stages_of_rank)


def _busiest(schedule: Schedule, costs: CostModel) -> int:
    arrays = costs.stage_arrays(schedule.num_stages)
    per_stage = arrays["t_f"] + arrays["t_b"] + arrays["t_w"]
    return int(np.argmax([sum(per_stage[s] for s in row) for row in schedule.stages_of_rank]))


def _peak(schedule: Schedule) -> float:
    """Most microbatches' activations a rank holds at once (a rank's share of them)."""
    chunks = len(schedule.stages_of_rank[0])
    return float(simulate(schedule, CostModel(activation=1.0 / chunks)).peak_memory.max())


def _steady_rate(starts: dict[int, float], n: int) -> float:
    """Microbatches per second between the F of microbatch n/4 and of 3n/4."""
    a, b = n // 4, (3 * n) // 4
    return (b - a) / (starts[b] - starts[a]) if starts[b] > starts[a] else float("nan")


def _plan_starts(plan: FlushFreePlan, costs: CostModel, rank: int) -> dict[int, float]:
    """The simulator's start of each microbatch's F on `rank`'s first stage."""
    sched = plan.schedule
    sim = simulate(sched, costs)
    first = sched.stages_of_rank[rank][0]
    lo, hi = int(sched.offsets[rank]), int(sched.offsets[rank + 1])
    out = {}
    for i in range(lo, hi):
        if sched.kinds[i] == Kind.F and sched.stages[i] == first:
            out[int(sched.microbatches[i])] = float(sim.start[i])
    return out


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    fine_timer_slack()
    unit = args.unit_ms * 1e-3
    act_elems = max(1, args.act_bytes // 4)
    p = comm.size
    m = args.microbatches or 2 * p
    config = bench_config(args.deck, args.overrides, p, f"pipeline.microbatches={m}")
    poll = polling(comm, args.wait)
    poll_s = args.poll_us * 1e-6 if poll else 0.0
    names = schedule_names(args.schedules)
    if args.mode not in ("2bw", "stash"):
        raise ConfigError("--mode", "", f"= {args.mode!r}: one of 2bw, stash")
    report = Report(
        "stream",
        [
            f"a pipeline without a flush ({args.mode}, {args.base}) against the synchronous "
            f"schedules on {p} ranks, m={m} per global batch, stages sleeping for the deck's "
            f"[pipeline] costs x {args.unit_ms:g} ms ({args.deck}), "
            + (f"waits poll Test + {args.poll_us:g} us sleeps" if poll else "waits in MPI Wait"),
            "throughput as a share of the no-bubble bound (microbatches per second x planned "
            "work per microbatch on the busiest rank): flushed = m / step time (median of "
            f"--repeats {args.repeats} steps after a warm-up); stream (median of as many "
            "streams) = steady state between "
            f"the F of microbatch N/4 and 3N/4 on the busiest rank (N: {args.updates} global "
            "batches), "
            "'whole run' = N / the stream's wall time; plan = the same on the simulator's times",
            "act peak = most microbatches' activations a rank holds; versions = weight versions "
            "a stage holds at most",
        ],
        COLUMNS,
        params={
            "deck": args.deck,
            "overrides": args.overrides,
            "mode": args.mode,
            "base": args.base,
            "microbatches": m,
            "updates": args.updates,
            "repeats": args.repeats,
            "unit_ms": args.unit_ms,
            "act_bytes": args.act_bytes,
            "wait": "poll" if poll else "mpi",
        },
        stream=comm.rank == 0,
    )
    report.start()
    clock = StepClock(comm)
    for name in names:
        cfg = bench_config(args.deck, args.overrides, p, f"pipeline.microbatches={m}",
                           f"pipeline.schedule={name}")  # fmt: skip
        try:
            schedule = load_schedule(cfg.pipeline, p, cfg.source)
            lowered = validate(schedule)
        except (ConfigError, ScheduleError) as exc:
            report.note(f"{name} skipped: {str(exc).splitlines()[0]}")
            continue
        costs = synthetic_costs(cfg, schedule, unit)
        runner, pp = sleeping_runner(comm, lowered, costs, act_elems, poll_s)
        seconds = []
        for step in range(args.repeats + 1):
            clock.start()
            begin = time.perf_counter()
            runner.step(step, [None] * m, [None] * m, 1.0 / m)
            took = comm.allreduce(time.perf_counter() - begin, op=MPI.MAX)
            if step:  # step 0 is the warm-up
                seconds.append(took)
        runner.free()
        pp.Free()
        work = _work(schedule, costs)
        measured = m * work / median(seconds)
        planned = m * work / simulate(schedule, costs).makespan
        report.add(
            {
                "schedule": f"{name} (flushed)",
                "kind": "flushed",
                "peak_mb": _peak(schedule),
                "versions": 1,
                "plan": planned,
                "measured": measured,
                "ratio": measured / planned,
                "whole": measured,  # flushed, every step is the same: the whole run's rate
                "whole_plan": planned,
                "measured_ms": median(seconds) * 1e3,
            }
        )
    stream_row = _stream(comm, args, config, m, unit, act_elems, poll_s, clock)
    report.add(stream_row)
    _summarize(report, stream_row)
    return report


def _stream(
    comm: MPI.Comm,
    args: argparse.Namespace,
    config: Any,
    m: int,
    unit: float,
    act_elems: int,
    poll_s: float,
    clock: StepClock,
) -> dict[str, Any]:
    """The base schedule over one stream of `args.updates` updates, without a flush."""
    p = comm.size
    window = 1 if args.mode == "stash" else m
    updates = args.updates * (m if args.mode == "stash" else 1)
    plan = flush_free(
        args.base,
        p,
        window,
        updates,
        v=config.pipeline.virtual_stages,
        max_versions=2 if args.mode == "2bw" else None,
    )
    lowered = validate(plan.schedule)
    costs = synthetic_costs(config, plan.schedule, unit)
    optim = config.optim

    def build(low: Schedule, rank: int, stages: dict, params: dict, **kw: Any) -> FlushFreeRank:
        state = {s: init_state(optim, params[s]) for s in params}
        return FlushFreeRank(plan, low, rank, stages, params, optim, state, **kw)

    rec = Recorder(comm.rank)  # every action's interval: the F times the rate is read from
    runner, pp = sleeping_runner(comm, lowered, costs, act_elems, poll_s, build, recorder=rec)
    n = plan.schedule.num_microbatches
    busiest = _busiest(plan.schedule, costs)
    first = plan.schedule.stages_of_rank[busiest][0]
    walls, starts = [], []
    for _ in range(args.repeats):  # the same stream again from its start, each a repetition
        runner.start_stream(0, plan.updates)
        rec.clear()
        clock.start()
        begin = time.perf_counter()
        runner.step(0, [None] * n, [None] * n, 1.0 / window)
        walls.append(comm.allreduce(time.perf_counter() - begin, op=MPI.MAX))
        events = rec.events
        starts.append(
            {
                int(e["microbatch"]): float(e["t_start"]) * 1e-9
                for e in events
                if e["kind"] == int(Kind.F) and e["stage"] == first
            }
        )
    gathered = comm.gather(starts, root=0)
    runner.free()
    pp.Free()
    wall = median(walls)
    work = _work(plan.schedule, costs)
    row: dict[str, Any] = {
        "schedule": f"{args.base} {args.mode} stream",
        "kind": "stream",
        "peak_mb": _peak(plan.schedule),
        "versions": float(plan.peak_versions.max()),
        "plan": _steady_rate(_plan_starts(plan, costs, busiest), n) * work,
        "whole": n * work / wall,
        "measured_ms": wall * 1e3,
        "whole_plan": n * work / simulate(plan.schedule, costs).makespan,
    }
    if gathered is not None:
        row["measured"] = median([_steady_rate(f, n) for f in gathered[busiest]]) * work
        row["ratio"] = row["measured"] / row["plan"]
    return row


def _summarize(report: Report, stream: dict[str, Any]) -> None:
    """The issue's two targets: the bound, and every flushed schedule at no more memory."""
    if "measured" not in stream:
        return
    flushed = [r for r in report.rows if r.get("kind") == "flushed"]
    same = [r for r in flushed if r["peak_mb"] <= stream["peak_mb"] + 1e-9]
    best = max(same, key=lambda r: r["measured"]) if same else None
    report.summary |= {
        "stream_steady": stream["measured"],
        "stream_whole": stream["whole"],
        "stream_plan": stream["plan"],
        "best_flushed_same_memory": best["measured"] if best else None,
        "best_flushed_same_memory_schedule": best["schedule"] if best else None,
    }
    report.note(
        f"stream: steady state {stream['measured']:.3f} of the bound (plan {stream['plan']:.3f}),"
        f" whole run {stream['whole']:.3f} (plan {stream['whole_plan']:.3f}); the flushed "
        f"schedules holding at most its {stream['peak_mb']:g} microbatches' activations: "
        + ", ".join(f"{r['schedule'].split()[0]} {r['measured']:.3f}" for r in same)
    )
    report.target(
        "stream steady state / no-bubble bound",
        f">= {TARGET_BOUND}",
        f"{stream['measured']:.3f}",
        stream["measured"] >= TARGET_BOUND,
        f"plan {stream['plan']:.3f}",
    )
    if best is not None:
        report.target(
            "stream vs best flushed at no more activations",
            "> 1",
            f"{stream['measured'] / best['measured']:.3f}",
            stream["measured"] > best["measured"],
            f"best: {best['schedule']} {best['measured']:.3f}",
        )
