"""Figure: sweep speed on Kripke's problem: kernel, fix-up, whole iteration, KBA efficiency.

    python benchmarks/sweep_grind.py                      # 2 ranks, 32^3 zones, 8 groups, S8
    KRIPKE_EXE=/path/to/kripke.exe python benchmarks/sweep_grind.py   # and Kripke beside it

Writes benchmarks/results/sweep_grind.json; see `hpcpipe bench sweep --help` (arguments this
script does not know are passed on, e.g. `--repeats 15`). With $KRIPKE_EXE set (a Kripke
v1.2.x built with MPI, no OpenMP), Kripke runs the same problem in the same repetitions, every
data layout, and the targets compare with its best layout.
"""

from __future__ import annotations

import argparse

from _common import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args, rest = ap.parse_known_args()
    bench("sweep_grind", args.ranks, "sweep", ["--repeats", "11", *rest])


if __name__ == "__main__":
    main()
