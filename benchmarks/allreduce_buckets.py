"""Figure: data-parallel gradient reduction, BucketedAllreduce vs raw Allreduce.

    python benchmarks/allreduce_buckets.py             # 2 ranks; --bucket-mb 1 etc. pass through

Writes benchmarks/results/allreduce_buckets.json.
"""

from __future__ import annotations

import argparse

from _common import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args, rest = ap.parse_known_args()
    bench("allreduce_buckets", args.ranks, "allreduce", rest)


if __name__ == "__main__":
    main()
