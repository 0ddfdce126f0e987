"""Figure: the runtime against the plan with stages that sleep for their modelled cost.

    python benchmarks/pipeline_synthetic.py            # 8 ranks, m = 16, 20 ms per cost unit

Sleeping stages use no CPU, so 8 (or 16) ranks run on 2 cores; waits poll instead of spinning
when ranks outnumber cores. The lowered schedules run as the runtime runs them
(pipeline_synthetic.json, .png).
"""

from __future__ import annotations

import argparse

from _common import bench
from pipeline_step import plot

FIGURE = "pipeline_synthetic"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    ap.add_argument("--microbatches", type=int, default=16)
    args, rest = ap.parse_known_args()
    base = [args.deck, "--synthetic", "--set", f"pipeline.microbatches={args.microbatches}"]
    result = bench(FIGURE, args.ranks, "pipeline", [*base, *rest])
    plot(
        result,
        FIGURE,
        f"sleeping stages on {args.ranks} ranks: measured vs the plan (label: ratio)",
        [
            ("measured_ms", "measured"),
            ("plan_ms", "plan (simulator, modelled costs)"),
            ("plan_in_order_ms", "plan in the lowered message order"),
        ],
    )


if __name__ == "__main__":
    main()
