"""Figure: measured pipeline step time per schedule vs the simulator's replay of its costs.

    python benchmarks/pipeline_step.py                 # 2 ranks (pp=2), the model below

Trains the deck's GPT (made bigger than the deck's default so that an F/B/W takes
milliseconds) with every schedule on the real runtime; see `hpcpipe bench pipeline --help`.
Writes benchmarks/results/pipeline_step.json and .png.
"""

from __future__ import annotations

import argparse

from _common import bench, pyplot, save_figure

FIGURE = "pipeline_step"
MODEL = [
    "model.d_model=128",
    "model.d_ff=512",
    "model.seq_len=64",
    "data.global_batch=32",
    "pipeline.microbatches=8",
]


def plot(result: dict, figure: str, title: str, bars: list[tuple[str, str]]) -> None:
    """Grouped bars per schedule; the first bar is the measured one, labelled with its ratio
    to the second."""
    plt = pyplot()
    rows = [r for r in result["rows"] if r.get(bars[0][0]) is not None]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for k, (key, label) in enumerate(bars):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=label)
    first, second = bars[0][0], bars[1][0]
    for i, r in enumerate(rows):
        top = max(r[key] for key, _ in bars)
        ax.annotate(f"{r[first] / r[second]:.2f}", (i, top), ha="center", va="bottom")
    ax.set_xticks(range(len(rows)), [r["schedule"] for r in rows], rotation=30, ha="right")
    ax.set_ylim(0, 1.3 * max(max(r[key] for key, _ in bars) for r in rows))
    ax.set(ylabel="pipeline step (ms)", title=title)
    ax.legend(loc="upper center", ncols=len(bars), framealpha=0.9)
    save_figure(fig, figure)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    args, rest = ap.parse_known_args()
    sets = [x for s in MODEL for x in ("--set", s)]
    result = bench(FIGURE, args.ranks, "pipeline", [args.deck, *sets, *rest])
    plot(
        result,
        FIGURE,
        f"pipeline step on {args.ranks} ranks: measured vs the simulator (label: ratio)",
        [
            ("measured_ms", "measured"),
            ("replay_ms", "simulator, measured costs"),
            ("in_order_ms", "same, in the lowered message order"),
        ],
    )


if __name__ == "__main__":
    main()
