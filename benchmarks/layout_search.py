"""Figure: how long `hpcpipe plan --search` takes to rank every layout of a big world.

    python benchmarks/layout_search.py                  # worlds 512, 4096, 65536
    python benchmarks/layout_search.py --worlds 4096 --repeats 1

The 32-layer MoE GPT planning deck (inputs/layout_moe_gpt32.toml) on worlds of 8-GPU nodes:
candidates enumerated, how many the branch and bound had to simulate, CPU seconds of this
process (median of the repetitions; the search is single-threaded), and the layout chosen.
The search must feel interactive: targets 10 s at 4,096 ranks and 60 s at 65,536. Writes
benchmarks/results/layout_search.json. Speed is measured here, never asserted in a unit test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from _common import RESULTS, ROOT, machine_facts

from hpcpipe.bench.table import Column, Report
from hpcpipe.config import load_config
from hpcpipe.layout.report import run_search

DECK = ROOT / "inputs" / "layout_moe_gpt32.toml"
TARGETS = {4096: 10.0, 65536: 60.0}
"""CPU seconds for one search, by world size."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="512,4096,65536", help="comma-separated world sizes")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions per world")
    ap.add_argument("--json", default=str(RESULTS / "layout_search.json"), metavar="PATH")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    config = load_config(DECK)
    report = Report(
        "layout_search",
        [
            f"plan --search on {DECK.relative_to(ROOT)}: every pp x dp x ep x order x schedule "
            f"x microbatches layout; CPU seconds, median of {args.repeats} repetition(s)",
            "simulated = candidates the branch and bound could not rule out by their work bound",
        ],
        [
            Column("world", "world", "d", 6),
            Column("candidates", "candidates", "d", 10),
            Column("fit", "fit", "d", 6),
            Column("simulated", "simulated", "d", 9),
            Column("cpu_s", "CPU s", ".2f", 6),
            Column("step_ms", "step ms", ".1f", 8),
            Column("chosen", "chosen", "", 44, "<"),
        ],
        params={"deck": str(DECK.relative_to(ROOT)), "repeats": args.repeats},
        stream=True,
    )
    report.start()
    for world in worlds:
        times = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            result = run_search(config, world, top=1)
            times.append(time.process_time() - t0)
        pred, cost = result.ranked[0]
        report.add(
            {
                "world": world,
                "candidates": result.candidates,
                "fit": result.fit,
                "simulated": result.simulated,
                "cpu_s": float(np.median(times)),
                "step_ms": pred.step * 1e3,
                "chosen": cost.layout.label,
            }
        )
    for row in report.rows:
        if row["world"] in TARGETS:
            limit = TARGETS[row["world"]]
            report.target(
                f"layout search, world {row['world']}",
                f"<= {limit:g} s",
                f"{row['cpu_s']:.2f} s",
                row["cpu_s"] <= limit,
            )
    report.finish()
    shown = " ".join(sys.argv[1:])
    out = report.write(
        args.json,
        command=f"python benchmarks/layout_search.py{' ' + shown if shown else ''}",
        machine=machine_facts(),
    )
    print(f"# wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
