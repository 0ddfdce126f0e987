"""Loss curve of a pipelined training run against the data's best achievable loss.

The synthetic Markov data has an exactly known entropy rate, so the curve shows how close the
pipelined (and reference-equal) training gets to the optimum. Writes a PNG and JSON.

    python benchmarks/train_loss_curve.py --ranks 2 --steps 300
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import h5py
import numpy as np
from _common import RESULTS, machine, pyplot, run_hpcpipe, save_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    ap.add_argument("--schedule", default="zb-v")
    ap.add_argument("--pp", type=int, default=None, help="pipeline degree (default: --ranks)")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--name", default="loss_curve", help="output file stem in results/")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        sets = [
            f"run.output={out}",
            f"topology.pp={args.pp or args.ranks}",
            f"topology.dp={args.dp}",
            f"run.steps={args.steps}",
            f"pipeline.schedule={args.schedule}",
            "run.log_every=50",
            *args.overrides,
        ]
        log = run_hpcpipe(args.ranks, ["run", args.deck, *[x for s in sets for x in ("--set", s)]])
        with h5py.File(Path(out) / "metrics.h5") as f:
            loss = f["loss"][()]
    optimal = float(
        next(
            w.split("=")[1]
            for line in log.splitlines()
            if line.startswith("train:")
            for w in line.split()
            if w.startswith("optimal_loss=")
        )
    )
    tail = float(np.mean(loss[-20:]))
    print(f"# {args.schedule} on {args.ranks} ranks, {args.steps} steps")
    print(f"{'step':>6} {'loss':>8}")
    for s in sorted({0, *range(49, len(loss), 50), len(loss) - 1}):
        print(f"{s + 1:>6} {loss[s]:>8.4f}")
    print(
        f"optimal loss {optimal:.4f}; mean of last 20 steps {tail:.4f} "
        f"({(tail / optimal - 1) * 100:+.1f}%)"
    )

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    label = f"{args.schedule}, pp={args.pp or args.ranks}, dp={args.dp} ({Path(args.deck).stem})"
    ax.plot(np.arange(1, len(loss) + 1), loss, lw=1.2, label=label)
    ax.axhline(optimal, color="k", ls="--", lw=1, label=f"best achievable {optimal:.3f}")
    ax.set(
        xlabel="step",
        ylabel="loss (nats/token)",
        yscale="log",
        title="hpcpipe: pipelined training on synthetic Markov data",
    )
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / f"{args.name}.png"
    fig.savefig(png, dpi=120)
    path = save_json(
        args.name,
        {
            "schedule": args.schedule,
            "ranks": args.ranks,
            "optimal_loss": optimal,
            "final_mean20": tail,
            "loss": loss.tolist(),
            "machine": machine(),
        },
    )
    print(f"# wrote {png} and {path}")


if __name__ == "__main__":
    main()
