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


def plot(result: dict, figure: str, measured: str, predicted: str, label: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if r.get(measured) is not None]
    names = [r["schedule"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], [r[measured] for r in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r[predicted] for r in rows], 0.4, label=label)
    for i, r in zip(x, rows, strict=True):
        ax.annotate(
            f"{r[measured] / r[predicted]:.2f}", (i, max(r[measured], r[predicted])), ha="center"
        )
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set(ylabel="pipeline step (ms)", title=result["title"][0][:100])
    ax.legend()
    save_figure(fig, figure)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    args, rest = ap.parse_known_args()
    sets = [x for s in MODEL for x in ("--set", s)]
    result = bench(FIGURE, args.ranks, "pipeline", [args.deck, *sets, *rest])
    plot(result, FIGURE, "measured_ms", "replay_ms", "simulator (measured costs)")


if __name__ == "__main__":
    main()
