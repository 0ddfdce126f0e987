"""Figure: the layout search's ranking against measured steps on emulated nodes (8 ranks).

    python benchmarks/layout_ranking.py          # inputs/layout_tiny.toml, 2 nodes of 4 ranks

Every layout of 8 ranks that fits the deck runs with stages that sleep for its modelled costs
and messages that wait for the machine model's link when they cross a virtual node (see
`hpcpipe bench layout --help`); the predicted best step is scaled to 400 ms so that sleep
wake-ups stay small beside the actions. Sleeping ranks use no CPU, so 8 run on 2 cores.
Writes benchmarks/results/layout_ranking.json and .png (measured against predicted).
"""

from __future__ import annotations

import argparse

from _common import bench, pyplot, save_figure

FIGURE = "layout_ranking"


def plot(result: dict) -> None:
    plt = pyplot()
    rows = result["rows"]
    pred = [r["predicted_ms"] for r in rows]
    meas = [r["measured_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 5))
    ax.scatter(pred, meas, s=18, label="a layout")
    ax.scatter(pred[:1], meas[:1], s=60, marker="*", color="C3", label="the search's choice")
    low, high = min(pred + meas), max(pred + meas)
    ax.plot([low, high], [low, high], color="grey", lw=0.8, label="measured = predicted")
    rho = result["summary"]["spearman"]
    ax.set_title(f"every layout of 8 ranks that fits: Spearman {rho:.3f}")
    ax.set_xlabel("predicted step (ms, scaled)")
    ax.set_ylabel("measured step on emulated nodes (ms)")
    ax.legend()
    save_figure(fig, FIGURE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    args, rest = ap.parse_known_args()
    plot(bench(FIGURE, args.ranks, "layout", ["inputs/layout_tiny.toml", *rest]))


if __name__ == "__main__":
    main()
