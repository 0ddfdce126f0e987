"""Data-parallel gradient reductions hidden behind the pipeline: pp x dp on the real runtime.

For every schedule the deck's model trains on pp = `--pp` ranks per replica and dp = world /
pp replicas with the trace on; the trace's summary, with the definitions `hpcpipe trace
summary` prints, gives per schedule the reductions' time in flight, the share of it hidden
(over before the step's last compute or message ended on any rank) and the exposed time: what
the reductions added to the step. A reduction starts when its stage's last W has run, so a
stage whose last W is the step's last action (stage 0 in most schedules) can only hide behind
its own bucket's successors; the table says how much each schedule leaves exposed.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.bench.table import Column, Report
from hpcpipe.bench.training import bench_config, build_trainer, load_or_skip, schedule_names

__all__ = ["run"]

COLUMNS = [
    Column("schedule", "schedule", "", 16, "<"),
    Column("reduce_ms", "in flight ms", ".3f", 12),
    Column("hidden_pct", "hidden %", ".1f", 8),
    Column("behind_compute_pct", "own compute %", ".1f", 13),
    Column("exposed_ms", "exposed ms", ".3f", 10),
    Column("blocking_ms", "blocking ms", ".3f", 11),
    Column("step_ms", "step ms", ".2f", 8),
    Column("exposed_step_pct", "exposed/step %", ".1f", 14),
]
TARGET = 0.80


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    pp = args.pp
    if pp < 1 or comm.size % pp or comm.size // pp < 2:
        from hpcpipe.config import ConfigError

        raise ConfigError(
            "--pp", "", f"{pp} must divide the world ({comm.size}) into at least 2 replicas"
        )
    dp = comm.size // pp
    names = schedule_names(args.schedules)
    layout = (f"topology.pp={pp}", f"topology.dp={dp}")
    bench_config(args.deck, args.overrides, comm.size, *layout)  # bad deck: bad input
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local, cores = node.size, _cores()
    node.Free()
    over = local > cores
    report = Report(
        "overlap",
        [
            f"gradient reductions on {comm.size} ranks (pp={pp} x dp={dp}), deck {args.deck}"
            + (f" with {' '.join(args.overrides)}" if args.overrides else ""),
            f"{args.repeats} traced step(s) per schedule after one warm-up; figures from the "
            "trace's summary (hpcpipe trace summary): in flight = mean rank's reductions per "
            "step; hidden = share over before the step's last compute or message ended on any "
            "rank; own compute = share during the rank's own F/B/W; exposed = mean rank's "
            "reduction time after that, per step; blocking = mean rank's blocking Allreduce of "
            "the same buffers with nothing else running (median of 5)",
            (
                f"OVERSUBSCRIBED: {local} ranks on {cores} cores; the shares are what this "
                "machine shows, step times are not meaningful"
                if over
                else f"{local} ranks per node on {cores} cores"
            ),
        ],
        COLUMNS,
        params={
            "deck": args.deck,
            "overrides": args.overrides,
            "schedules": names,
            "pp": pp,
            "dp": dp,
            "steps": args.repeats,
            "oversubscribed": over,
        },
        stream=comm.rank == 0,
    )
    report.start()
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="hpcpipe-overlap-") as tmp:
        where = Path(comm.bcast(tmp if comm.rank == 0 else None))
        for name in names:
            row = _one_schedule(comm, args, name, layout, where / f"{name}.h5")
            if isinstance(row, str):
                skipped[name] = row
                report.add({"schedule": name, "skipped": row})
            elif row is not None:
                report.add(row)
            gc.collect()
    _summarize(report, skipped)
    return report


def _one_schedule(
    comm: MPI.Comm, args: argparse.Namespace, name: str, layout: tuple[str, ...], path: Path
) -> dict[str, Any] | str | None:
    """One schedule's row on rank 0 (None elsewhere), or why it cannot run (every rank)."""
    from hpcpipe.analysis import summarize
    from hpcpipe.io.trace import read_trace

    extra = (*layout, "trace.enabled=true", f"trace.path={path}")

    def build() -> tuple[Any, Any]:
        return build_trainer(comm, args.deck, args.overrides, name, args.repeats + 1, *extra)

    built, why = load_or_skip(build)
    if built is None:
        return why or "cannot run"
    ctx, trainer = built
    for step in range(args.repeats + 1):
        trainer.step(step)
    trainer.write_trace()
    blocking = comm.gather(_blocking_s(trainer.runner))
    ctx.comms.free()
    if comm.rank != 0:
        return None
    blocking_ms = float(np.mean(blocking)) * 1e3
    trace = read_trace(path)
    s = summarize(trace, steps=trace.steps[1:])  # the first step warms up
    n = len(s.steps)
    reduce = float(s.reduce_ns.mean()) / n * 1e-6
    exposed = float(s.reduce_exposed_ns.mean()) / n * 1e-6
    behind = float(s.reduce_behind_compute_ns.sum()) / max(float(s.reduce_ns.sum()), 1.0)
    step_ms = s.step_time_ns * 1e-6
    return {
        "schedule": name,
        "reduce_ms": reduce,
        "hidden_pct": 100 * (s.reduce_hidden or 0.0),
        "behind_compute_pct": 100 * behind,
        "exposed_ms": exposed,
        "blocking_ms": blocking_ms,
        "step_ms": step_ms,
        "exposed_step_pct": 100 * exposed / step_ms if step_ms else 0.0,
    }


def _blocking_s(runner: Any, repeats: int = 5) -> float:
    """What this rank's reductions cost when nothing hides them: a blocking Allreduce of each
    of its gradient buffers on its data-parallel group, median of `repeats` after a warm-up."""
    total = 0.0
    pairs = [(runner.reducer, runner.grads), (runner.expert_reducer, runner.expert_grads)]
    for reducer, buffers in pairs:
        if reducer.comm.size == 1:
            continue
        for s in sorted(buffers):
            flat = buffers[s].flat
            if not flat.size:
                continue
            work = flat.copy()
            times = []
            for _ in range(repeats + 1):
                reducer.comm.Barrier()
                t0 = MPI.Wtime()
                reducer.comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
                times.append(MPI.Wtime() - t0)
            total += float(np.median(times[1:]))
    return total


def _summarize(report: Report, skipped: dict[str, str]) -> None:
    for name, why in skipped.items():
        report.note(f"{name} skipped: {why}")
    rows = [r for r in report.rows if "hidden_pct" in r]
    if not rows:
        return
    hidden = np.array([r["hidden_pct"] for r in rows]) / 100
    vs_blocking = np.array([r["exposed_ms"] / r["blocking_ms"] for r in rows if r["blocking_ms"]])
    report.summary |= {
        "median_hidden": float(np.median(hidden)),
        "min_hidden": float(hidden.min()),
        "max_hidden": float(hidden.max()),
    }
    note = (
        f"hidden share of the time in flight over schedules: median "
        f"{100 * np.median(hidden):.1f}%, min {100 * hidden.min():.1f}%"
    )
    if vs_blocking.size:
        report.summary["median_exposed_over_blocking"] = float(np.median(vs_blocking))
        note += (
            f"; exposed / blocking: median {np.median(vs_blocking):.2f} (what the step still "
            "pays, against a reduction nothing hides)"
        )
    report.note(note)
    report.target(
        "reductions hidden, share of their time in flight (median over schedules)",
        f">= {100 * TARGET:.0f}%",
        f"{100 * np.median(hidden):.1f}%",
        bool(np.median(hidden) >= TARGET),
        f"min {100 * hidden.min():.1f}%",
    )
