"""Regenerate every figure and the performance report: one command.

    python benchmarks/run_all.py             # hours on 2 cores: the schedule figures are long
    python benchmarks/run_all.py --only p2p_latency,pipeline_step

Runs each figure script (each writes benchmarks/results/<figure>.json, some a .png), then
benchmarks/report.py, which rewrites the tables in docs/performance.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIGURES = (
    "p2p_latency",
    "allreduce_buckets",
    "moe_alltoall",
    "pipeline_step",
    "pipeline_synthetic",
    "pipeline_pairs",
    "replan",
    "replan_synthetic",
    "flushfree",
    "flushfree_synthetic",
    "async_dp",
    "allreduce_overlap",
    "memory_peak",
    "sweep_grind",
    "kobayashi",
    "ckpt_bandwidth",
    "trace_overhead",
    "plan_scale",
    "schedule_search",
    "schedule_exact",
    "schedule_search_large",
    "schedule_search_p9_12",
    "schedule_search_p13",
    "schedule_search_p14",
    "schedule_search_p15",
    "schedule_search_p16",
    "layout_search",
    "layout_ranking",
)
VARIANTS = {
    "schedule_search_large": (
        "schedule_search.py",
        *("--p", "6", "7", "8", "--skip-scale", "--jobs", "2"),
        *("--json", "benchmarks/results/schedule_search_large.json"),
    ),
    "schedule_search_p9_12": (
        "schedule_search.py",
        *("--p", "9", "10", "11", "12", "--skip-scale", "--jobs", "2"),
        *("--json", "benchmarks/results/schedule_search_p9_12.json"),
    ),
    **{
        f"schedule_search_p{p}": (
            "schedule_search.py",
            *("--p", str(p), "--skip-scale", "--jobs", "2"),
            *("--json", f"benchmarks/results/schedule_search_p{p}.json"),
        )
        for p in (13, 14, 15)  # one p a figure: 30-45 minutes each on 2 cores
    },
    "schedule_search_p16": (
        "schedule_search.py",
        *("--p", "16", "--skip-scale", "--jobs", "2"),
        *("--json", "benchmarks/results/schedule_search_p16.json"),
    ),
}
"""Figures written by another figure's script with other arguments (paths from the root)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(FIGURES), help="comma-separated figures")
    args = ap.parse_args()
    chosen = [f for f in args.only.split(",") if f]
    unknown = sorted(set(chosen) - set(FIGURES))
    if unknown:
        ap.error(f"unknown figure(s) {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    for figure in chosen:
        print(f"\n== {figure}", flush=True)
        script, *extra = VARIANTS.get(figure, (f"{figure}.py",))
        subprocess.run([sys.executable, str(HERE / script), *extra], check=True, cwd=HERE.parent)
    subprocess.run([sys.executable, str(HERE / "report.py")], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
