"""Pipeline schedules on the real runtime: measured step time and bubble vs the simulator.

For every schedule the deck's model is trained for a few steps by the training runtime itself
(`Trainer`, as `hpcpipe run` builds it) on pp = world ranks. Schedules take turns, `--steps`
steps each per repetition, so they share the machine's noise; each trainer's first step is a
warm-up (first-touch allocations). Every pipeline step starts at one instant on all ranks and
lasts until the last rank is done; "replay" is the simulator's makespan for the same schedule
with the per-stage F/B/W costs measured in that same step, so the ratio is what the runtime
(messages, waits, the interpreter) adds beyond the plan's critical path of compute.

With `--synthetic` the stages are stubs that sleep for the deck's modelled costs (see
`hpcpipe.bench.synthetic`).
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.bench.harness import median
from hpcpipe.bench.model import step_figures
from hpcpipe.bench.table import Column, Report
from hpcpipe.bench.training import (
    StepClock,
    StepLog,
    bench_config,
    build_trainer,
    load_or_skip,
    schedule_names,
)

__all__ = ["COLUMNS", "run", "summarize_steps"]

TARGET_RATIO = 1.05
"""Measured step over the simulator's replay of its own costs, every schedule (run as planned)."""

COLUMNS = [
    Column("schedule", "schedule", "", 16, "<"),
    Column("measured_ms", "measured ms", ".2f", 11),
    Column("replay_ms", "replay ms", ".2f", 9),
    Column("ratio", "ratio", ".3f", 6),
    Column("in_order_ms", "in-order ms", ".2f", 11),
    Column("runtime_ratio", "vs in-order", ".3f", 11),
    Column("bubble_pct", "bubble %", ".1f", 8),
    Column("bubble_replay_pct", "replay %", ".1f", 8),
    Column("recv_ms", "recv ms", ".2f", 7),
    Column("other_ms", "other ms", ".2f", 8),
    Column("us_per_action", "us/action", ".1f", 9),
    Column("step_ms", "full step ms", ".2f", 12),
]


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    if args.synthetic:
        from hpcpipe.bench.synthetic import run_synthetic

        return run_synthetic(comm, args)
    return run_measured(comm, args)


def summarize_steps(name: str, steps: list[dict[str, float]]) -> dict[str, Any]:
    """One table row from the per-step figures of one schedule (medians over steps)."""

    def med(key: str) -> float:
        return median([s[key] for s in steps])

    ratios = [s["ratio"] for s in steps]
    return {
        "schedule": name,
        "measured_ms": med("measured_s") * 1e3,
        "replay_ms": med("replay_s") * 1e3,
        "ratio": median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "in_order_ms": med("in_order_s") * 1e3,
        "runtime_ratio": med("runtime_ratio"),
        "order_ratio": med("order_ratio"),
        "bubble_pct": med("bubble") * 100,
        "bubble_replay_pct": med("bubble_replay") * 100,
        "recv_ms": med("recv_s") * 1e3,
        "send_ms": med("send_s") * 1e3,
        "other_ms": med("other_s") * 1e3,
        "us_per_action": med("other_us_per_action"),
        "start_late_us": med("start_late_us"),
        "steps": len(steps),
        "per_step": steps,
    }


def _gathered(comm: MPI.Comm, log: StepLog) -> list[list[Any]] | None:
    """Rank 0: per step (warm-up dropped), every rank's (common start, span, action times)."""
    mine = [
        (t0, span, result.action_times)
        for t0, span, result in zip(log.starts[1:], log.spans[1:], log.results[1:], strict=True)
    ]
    parts = comm.gather(mine, root=0)
    if parts is None:
        return None
    return [[part[i] for part in parts] for i in range(len(mine))]


def run_measured(comm: MPI.Comm, args: argparse.Namespace) -> Report:

    names = schedule_names(args.schedules)
    bench_config(args.deck, args.overrides, comm.size)  # a bad deck is bad input, not a skip
    total = args.repeats * args.steps + 1
    report = Report(
        "pipeline",
        [
            f"pipeline step on {comm.size} ranks (pp={comm.size}, dp=1), deck {args.deck}"
            + (f" with {' '.join(args.overrides)}" if args.overrides else ""),
            f"{args.repeats} repetitions x {args.steps} step(s) per schedule, schedules taking "
            "turns; medians over steps; replay = simulator with this step's measured F/B/W "
            "costs; ratio = measured / replay; in-order = the same costs kept in the lowered "
            "schedule's message order (what the runtime executes)",
            "bubble = idle share of all ranks within the step (measured / replay); recv = mean "
            "rank's time waiting in RECV actions; other = time outside any action (posting, "
            "loop, drain) per rank, also per action; full step adds data and the optimizer",
        ],
        COLUMNS,
        params={
            "deck": args.deck,
            "overrides": args.overrides,
            "schedules": names,
            "repeats": args.repeats,
            "steps": args.steps,
        },
        stream=comm.rank == 0,
    )
    report.start()
    clock = StepClock(comm)
    trainers: dict[str, tuple[Any, Any, StepLog]] = {}
    skipped: dict[str, str] = {}
    for name in names:

        def build(name: str = name) -> tuple[Any, Any]:
            return build_trainer(comm, args.deck, args.overrides, name, total)

        built, why = load_or_skip(build)
        if built is None:
            skipped[name] = why or "cannot run"
            continue
        ctx, trainer = built
        trainers[name] = (ctx, trainer, StepLog(trainer.runner, clock))
        trainer.step(0)  # warm-up, dropped below
    step = 1
    for _ in range(args.repeats):
        for _, trainer, _ in trainers.values():
            for k in range(args.steps):
                trainer.step(step + k)
        step += args.steps
    for name in names:
        if name in skipped:
            report.add({"schedule": name, "skipped": skipped[name]})
            continue
        ctx, trainer, log = trainers[name]
        gathered = _gathered(comm, log)
        if gathered is not None:
            steps = [
                step_figures(
                    trainer.lowered,
                    [span for _, span, _ in ranks],
                    [times for _, _, times in ranks],
                    start=ranks[0][0],
                )
                for ranks in gathered
            ]
            row = summarize_steps(name, steps)
            row["step_ms"] = median(trainer.history["step_time"][1:]) * 1e3
            report.add(row)
        ctx.comms.free()
        del trainers[name]
        gc.collect()
    _summarize(report, skipped)
    return report


def _summarize(report: Report, skipped: dict[str, str]) -> None:
    rows = [r for r in report.rows if "ratio" in r]
    for name, why in skipped.items():
        report.note(f"{name} skipped: {why}")
    if not rows:
        return
    ratios = np.array([r["ratio"] for r in rows])
    runtime = np.array([r["runtime_ratio"] for r in rows])
    report.summary |= {
        "median_ratio": float(np.median(ratios)),
        "max_ratio": float(ratios.max()),
        "median_runtime_ratio": float(np.median(runtime)),
        "max_runtime_ratio": float(runtime.max()),
    }
    report.note(
        f"measured / replay over schedules: median {np.median(ratios):.3f}, max "
        f"{ratios.max():.3f}; "
        f"measured / in-order: median {np.median(runtime):.3f}, max {runtime.max():.3f}"
    )
    report.target(
        "measured / replay (worst schedule)",
        f"<= {TARGET_RATIO:.2f}",
        f"{ratios.max():.3f}",
        ratios.max() <= TARGET_RATIO,
        f"median {np.median(ratios):.3f}",
    )
