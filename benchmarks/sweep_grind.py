"""Figure: sweep grind time and KBA parallel efficiency, measured vs model vs plan.

    python benchmarks/sweep_grind.py                   # 32^3 cells, S8, 8 groups, 2 ranks

Writes benchmarks/results/sweep_grind.json; see `hpcpipe bench sweep --help`.
"""

from __future__ import annotations

import argparse

from _common import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args, rest = ap.parse_known_args()
    bench("sweep_grind", args.ranks, "sweep", rest)


if __name__ == "__main__":
    main()
