"""Figure: data-parallel gradient reductions hidden behind the pipeline, pp2 x dp2.

    python benchmarks/allreduce_overlap.py             # 4 ranks (pp=2 x dp=2), the model below

Trains the pipeline_step model with every schedule on pp = 2 x dp = 2 with the trace on and
reads the reductions' figures from the trace's summary; on a 2-core machine the 4 ranks are
oversubscribed, which the output says. See `hpcpipe bench overlap --help`. Writes
benchmarks/results/allreduce_overlap.json.
"""

from __future__ import annotations

import argparse

from _common import bench
from pipeline_step import MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    args, rest = ap.parse_known_args()
    sets = [x for s in MODEL for x in ("--set", s)]
    bench("allreduce_overlap", args.ranks, "overlap", [args.deck, *sets, *rest])


if __name__ == "__main__":
    main()
