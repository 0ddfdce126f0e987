"""Figure: checkpoint write/read bandwidth vs plain h5py and the disk's raw rate.

    python benchmarks/ckpt_bandwidth.py                # 1 GiB on 2 ranks; --size-mib, --dir

Writes benchmarks/results/ckpt_bandwidth.json; see `hpcpipe bench ckpt --help`.
"""

from __future__ import annotations

import argparse

from _common import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args, rest = ap.parse_known_args()
    bench("ckpt_bandwidth", args.ranks, "ckpt", rest)


if __name__ == "__main__":
    main()
