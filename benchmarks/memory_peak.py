"""Figure: peak RSS and peak activation memory per schedule and rank vs the model.

    python benchmarks/memory_peak.py                   # 2 ranks, the pipeline_step model

Writes benchmarks/results/memory_peak.json; see `hpcpipe bench memory --help`.
"""

from __future__ import annotations

import argparse

from _common import bench
from pipeline_step import MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    args, rest = ap.parse_known_args()
    sets = [x for s in MODEL for x in ("--set", s)]
    bench("memory_peak", args.ranks, "memory", [args.deck, *sets, *rest])


if __name__ == "__main__":
    main()
