"""Figure: MoE dispatch all-to-all (flat, whole dispatch, two-phase) vs raw Alltoallv.

    python benchmarks/moe_alltoall.py                  # 2 ranks; --ranks 4 on a bigger machine

Writes benchmarks/results/moe_alltoall.json. On an oversubscribed machine (more ranks than
cores) the figures partly measure the machine: MPICH polls while it waits.
"""

from __future__ import annotations

import argparse

from _common import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args, rest = ap.parse_known_args()
    bench("moe_alltoall", args.ranks, "alltoall", rest)


if __name__ == "__main__":
    main()
