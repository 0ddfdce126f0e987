"""Peak memory per schedule and rank: bytes the runtime held, RSS, and the memory model.

For each schedule the deck's model trains `--steps` steps on the real runtime. `act` is the
peak of what the pipeline held between actions, measured on its arrays (`LiveArrays`: saved
contexts, messages waiting for their consumer or their send, the receive buffers, the step's
batch), and its model the simulator's memory model in bytes: each stage's F keeps what one
microbatch's forward saved (`ctx`), B turns it into what W still needs (`wctx`), both as the
run's first microbatch of that stage kept them, in the schedule's order, plus the message
plan's receive buffers and the batch. Before each schedule the heap is given back to the OS
(`malloc_trim`) and the kernel's peak-RSS mark is reset (`/proc/self/clear_refs`), so
"growth" is what building and running that schedule's trainer added to the resident set; its
model is the static state (parameters, gradient buffers, optimizer slots) plus the modelled
`act`. What growth exceeds that by is working memory inside F/B/W (matmul results, softmax
buffers) and allocator slack, which no schedule model counts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.bench.table import Column, Report
from hpcpipe.bench.training import (
    StepClock,
    StepLog,
    bench_config,
    build_trainer,
    load_or_skip,
    schedule_names,
)
from hpcpipe.config import ConfigError
from hpcpipe.schedules import CostModel, simulate
from hpcpipe.schedules.memory import activation_peaks

__all__ = ["run"]

MIB = 2**20
COLUMNS = [
    Column("schedule", "schedule", "", 16, "<"),
    Column("rank", "rank", "d", 4),
    Column("peak_rss_mib", "peak RSS MiB", ".1f", 12),
    Column("growth_mib", "growth MiB", ".1f", 10),
    Column("model_mib", "model MiB", ".1f", 9),
    Column("growth_ratio", "growth/model", ".2f", 12),
    Column("act_mib", "act MiB", ".2f", 7),
    Column("act_model_mib", "model act MiB", ".2f", 7),
    Column("act_ratio", "act/model", ".3f", 9),
    Column("act_mb", "act mb", ".2f", 6),
    Column("act_model_mb", "model mb", ".2f", 8),
]


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release() -> None:
    """Return freed memory to the OS and restart the peak-RSS mark at the current RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


def _nbytes(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    return int(getattr(tree, "nbytes", 0))


def _static_bytes(trainer: Any) -> int:
    """Parameters, gradient buffers and optimizer slots of this rank's stages."""
    runner = trainer.runner
    grads = sum(b.flat.nbytes for b in (*runner.grads.values(), *runner.expert_grads.values()))
    slots = sum(_nbytes(dict(state.slots)) for state in trainer.opt_state.values())
    return _nbytes(trainer.params) + int(grads) + slots


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:

    if not sys.platform.startswith("linux"):
        raise ConfigError("hpcpipe bench memory", "", "reads /proc: it runs on Linux only")
    names = schedule_names(args.schedules)
    bench_config(args.deck, args.overrides, comm.size)  # a bad deck is bad input, not a skip
    report = Report(
        "memory",
        [
            f"peak memory per rank on {comm.size} ranks (pp={comm.size}, dp=1), deck "
            f"{args.deck}"
            + (f" with {' '.join(args.overrides)}" if args.overrides else "")
            + f", {args.steps} steps per schedule",
            "growth = peak RSS - RSS before the schedule's trainer was built; model = "
            "parameters + gradients + optimizer slots + model activations",
            "act = peak bytes the pipeline held between actions, measured on its arrays "
            "(contexts, messages, receive buffers, batch); model act = the simulator's memory "
            "model with per-stage F/B bytes plus the receive buffers and batch; mb = live "
            "microbatches of a full stage, counted and planned",
        ],
        COLUMNS,
        params={
            "deck": args.deck,
            "overrides": args.overrides,
            "schedules": names,
            "steps": args.steps,
        },
        stream=comm.rank == 0,
    )
    report.start()
    clock = StepClock(comm)

    def build(name: str) -> tuple[Any, Any]:
        return build_trainer(comm, args.deck, args.overrides, name, args.steps)

    # One throwaway step first: imports, NumPy caches and MPI buffers are not any schedule's.
    warm, _ = load_or_skip(lambda: build(names[0]))
    if warm is not None:
        warm[1].step(0)
        warm[0].comms.free()
    del warm
    for name in names:
        _release()
        base = _status_kib("VmRSS") * 1024
        built, why = load_or_skip(lambda name=name: build(name))
        if built is None:
            report.add({"schedule": name, "skipped": why})
            report.note(f"{name} skipped: {why}")
            continue
        ctx, trainer = built
        log = StepLog(trainer.runner, clock)
        for step in range(args.steps):
            trainer.step(step)
        peak = _status_kib("VmHWM") * 1024
        chunks = len(trainer.mine)
        mine = {
            "rank": comm.rank,
            "peak": peak,
            "growth": peak - base,
            "static": _static_bytes(trainer),
            "act": max(r.peak_live_bytes for r in log.results),
            "units": trainer.runner.peak_units_overall / chunks,
            "stages": {k: tuple(v) for k, v in trainer.runner.stage_bytes.items()},
            "buffers": trainer.runner.input_bytes,
        }
        parts = comm.gather(mine, root=0)
        if parts is not None:
            _rows(report, name, trainer.schedule, parts)
        ctx.comms.free()
        del trainer, log, built, ctx
    rows = [r for r in report.rows if "act_ratio" in r]
    if rows:
        ratios = np.array([r["act_ratio"] for r in rows])
        worst = rows[int(np.argmax(np.abs(ratios - 1.0)))]
        report.summary |= {
            "max_act_ratio": float(ratios.max()),
            "min_act_ratio": float(ratios.min()),
        }
        report.target(
            "held bytes measured / predicted, every schedule and rank",
            "within 10%",
            f"{ratios.min():.3f}-{ratios.max():.3f}",
            bool(np.all(np.abs(ratios - 1.0) <= 0.10)),
            f"furthest {worst['schedule']} rank {worst['rank']}",
        )
    return report


def _rows(report: Report, name: str, schedule: Any, parts: list[dict[str, Any]]) -> None:
    stages: dict[int, tuple[int, int]] = {}
    for part in parts:
        stages.update(part["stages"])
    n = schedule.num_stages
    act = activation_peaks(
        schedule, [stages[s][0] for s in range(n)], [stages[s][1] for s in range(n)]
    )
    chunks = len(schedule.stages_of_rank[0])
    units = simulate(schedule, CostModel(activation=1.0 / chunks)).peak_memory
    for part in sorted(parts, key=lambda p: p["rank"]):
        r = part["rank"]
        held = act[r] + part["buffers"]  # what the runtime holds between actions, modelled
        model = part["static"] + held
        report.add(
            {
                "schedule": name,
                "rank": r,
                "peak_rss_mib": part["peak"] / MIB,
                "growth_mib": part["growth"] / MIB,
                "model_mib": model / MIB,
                "growth_ratio": part["growth"] / model if model else float("nan"),
                "act_mib": part["act"] / MIB,
                "act_model_mib": held / MIB,
                "act_ratio": part["act"] / held if held else float("nan"),
                "act_mb": part["units"],
                "act_model_mb": float(units[r]),
                "static_mib": part["static"] / MIB,
                "stage_bytes": {str(s): list(b) for s, b in stages.items()},
            }
        )
