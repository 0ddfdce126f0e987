"""Figure: planning at scale, build + validate + simulate of every schedule, no MPI.

    python benchmarks/plan_scale.py                       # p = 1024 ranks, m = 4096 microbatches
    python benchmarks/plan_scale.py --p 256 --m 1024 --repeats 1

Plans are pure data, so a layout for thousands of ranks must be checkable on a laptop before a
job is submitted. This times, per schedule, the three pure functions a `hpcpipe plan` or a
job's start-up runs (CPU time of this process, median of the repetitions: the work is
single-threaded NumPy, so CPU time is what it costs even on a shared machine), and checks the
answer while it is there (action count, makespan of 1F1B). Writes
benchmarks/results/plan_scale.json. Speed is measured here, never asserted in a unit test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from _common import RESULTS, ROOT, machine_facts

from hpcpipe.bench.table import Column, Report
from hpcpipe.schedules import SCHEDULE_NAMES, build_schedule, simulate, validate

TARGET_S = 10.0
"""Build + validate + simulate of one schedule at p = 1024, m = 4096, in CPU seconds."""


def _time_one(name: str, p: int, m: int) -> tuple[float, float, float, int, float]:
    t0 = time.process_time()
    sched = build_schedule(name, p, m)
    t1 = time.process_time()
    lowered = validate(sched)
    t2 = time.process_time()
    result = simulate(sched)
    t3 = time.process_time()
    return t1 - t0, t2 - t1, t3 - t2, lowered.num_actions, float(result.makespan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=1024, help="pipeline ranks (default 1024)")
    ap.add_argument("--m", type=int, default=4096, help="microbatches (default 4096)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions per schedule")
    ap.add_argument("--schedules", default=",".join(SCHEDULE_NAMES), help="comma-separated")
    ap.add_argument("--json", default=str(RESULTS / "plan_scale.json"), metavar="PATH")
    args = ap.parse_args(argv)
    p, m = args.p, args.m
    report = Report(
        "plan_scale",
        [
            f"planning at scale: p = {p} ranks, m = {m} microbatches, no MPI; CPU seconds of "
            f"this process, median of {args.repeats} repetition(s)",
            "build = generator, validate = lowering + deadlock proof, simulate = unit costs",
        ],
        [
            Column("schedule", "schedule", "", 16, "<"),
            Column("actions", "lowered actions", "d", 15),
            Column("build_s", "build s", ".2f", 8),
            Column("validate_s", "validate s", ".2f", 10),
            Column("simulate_s", "simulate s", ".2f", 10),
            Column("total_s", "total s", ".2f", 8),
            Column("makespan", "makespan", "g", 10),
        ],
        params={"p": p, "m": m, "repeats": args.repeats},
        stream=True,
    )
    report.start()
    for name in [s for s in args.schedules.split(",") if s]:
        runs = [_time_one(name, p, m) for _ in range(args.repeats)]
        b, v, s, actions, span = (np.median([r[k] for r in runs]) for k in range(5))
        if name == "1f1b" and (actions != 2 * p * m + 4 * (p - 1) * m or span != (m + p - 1) * 3.0):
            sys.exit(f"1f1b at p={p}, m={m}: {actions} actions, makespan {span}: wrong answer")
        report.add(
            {
                "schedule": name,
                "actions": int(actions),
                "build_s": float(b),
                "validate_s": float(v),
                "simulate_s": float(s),
                "total_s": float(b + v + s),
                "makespan": float(span),
            }
        )
    worst = max(report.rows, key=lambda r: r["total_s"])
    report.summary |= {"max_total_s": worst["total_s"], "slowest": worst["schedule"]}
    if (p, m) == (1024, 4096):
        report.target(
            "build + validate + simulate, p=1024, m=4096 (slowest schedule)",
            f"<= {TARGET_S:g} s",
            f"{worst['total_s']:.1f} s",
            worst["total_s"] <= TARGET_S,
            worst["schedule"],
        )
    report.finish()
    shown = " ".join(sys.argv[1:])
    out = report.write(
        args.json,
        command=f"python benchmarks/plan_scale.py{' ' + shown if shown else ''}",
        machine=machine_facts(),
    )
    print(f"# wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
