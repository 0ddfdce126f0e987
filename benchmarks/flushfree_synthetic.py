"""Figure: a pipeline without a flush against every flushed schedule, 8 ranks, synthetic costs.

    python benchmarks/flushfree_synthetic.py     # 8 ranks, m = 2p = 16, about 2 minutes

Stages sleep for the deck's modelled costs (20 ms per unit), so 8 ranks fit on 2 cores; the
flushed schedules and the 2BW stream of 1F1B run on the real interpreters. Throughput is a
share of the no-bubble bound (hpcpipe.bench.stream). Writes flushfree_synthetic.json and .png.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import bench, pyplot, save_figure

FIGURE = "flushfree_synthetic"


def plot(result: dict) -> None:
    rows = [r for r in result["rows"] if r.get("measured") is not None]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["plan"] for r in rows], 0.4, label="plan (simulator)", color="#bbbbbb")
    colors = ["#d62728" if r["kind"] == "stream" else "#1f77b4" for r in rows]
    ax.bar(x + 0.2, [r["measured"] for r in rows], 0.4, label="measured", color=colors)
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["measured"] + 0.01, f"{r['measured']:.2f}", ha="center", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xticks(x, [r["schedule"].replace(" (flushed)", "") for r in rows], rotation=30,
                  ha="right", fontsize=8)  # fmt: skip
    ax.set_ylabel("throughput / no-bubble bound")
    ax.set_ylim(0, 1.2)
    ax.set_title(
        f"{result['params']['base']} {result['params']['mode']} without a flush (red) vs "
        f"flushed schedules, m={result['params']['microbatches']}, sleeping stages",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    save_figure(fig, FIGURE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    args, rest = ap.parse_known_args()
    plot(bench(FIGURE, args.ranks, "stream", [args.deck, *rest]))


if __name__ == "__main__":
    main()
