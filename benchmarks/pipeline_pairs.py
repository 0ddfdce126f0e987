"""Figure: DualPipeV's F&B pairs against the same order run action by action.

    python benchmarks/pipeline_pairs.py                # 8 ranks, m = 16, 20 ms per cost unit

Sleeping stages (see pipeline_synthetic.py) whose F and B each hold half a cost unit of
communication (`t_alltoall = 0.5`, the MoE all-to-alls): run as overlapped pairs, each half's
communication hides behind the other's compute. Writes pipeline_pairs.json.
"""

from __future__ import annotations

import argparse

from _common import bench

FIGURE = "pipeline_pairs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    ap.add_argument("--microbatches", type=int, default=16)
    args, rest = ap.parse_known_args()
    sets = ["--set", f"pipeline.microbatches={args.microbatches}"]
    sets += ["--set", "pipeline.t_alltoall=0.5"]
    base = [args.deck, "--synthetic", "--schedules", "dualpipe-v", "--overlap-pairs", *sets]
    bench(FIGURE, args.ranks, "pipeline", [*base, *rest])


if __name__ == "__main__":
    main()
