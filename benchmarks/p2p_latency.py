"""Figure: p2p latency and bandwidth, pipeline Mailbox vs raw Send/Recv, 1 B .. 64 MiB.

    python benchmarks/p2p_latency.py                   # 2 ranks; --repeats 7 etc. pass through

Writes benchmarks/results/p2p_latency.json and .png (latency and bandwidth against size).
"""

from __future__ import annotations

import argparse

from _common import bench, pyplot, save_figure

FIGURE = "p2p_latency"


def plot(result: dict) -> None:
    plt = pyplot()
    rows = result["rows"]
    size = [r["bytes"] for r in rows]
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("raw", "raw Send/Recv"), ("mailbox", "hpcpipe Mailbox")):
        lat.plot(size, [r[f"{key}_us"] for r in rows], marker="o", ms=3, label=label)
        bw.plot(size, [r[f"{key}_mbps"] for r in rows], marker="o", ms=3, label=label)
    lat.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="one-way latency (us)")
    bw.set(xscale="log", xlabel="message bytes", ylabel="bandwidth (MB/s)")
    for ax in (lat, bw):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"ping-pong on {result['machine']['ranks']} ranks, {result['machine']['cpu']}")
    save_figure(fig, FIGURE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args, rest = ap.parse_known_args()
    plot(bench(FIGURE, args.ranks, "p2p", rest))


if __name__ == "__main__":
    main()
