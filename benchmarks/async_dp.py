"""Figure: what one straggling replica costs the others, synchronous vs local steps.

    python benchmarks/async_dp.py             # 2 ranks (dp 2, pp 1), gpt_pp4's model, 32 steps

Replica 1 (rank 1) computes 1.5x longer (`HPCPIPE_INJECT_FAULT` kind=slow): from step 1 to the
end (persistent), or for steps 9-12 only (one round, transient), or not at all. Local steps
run with rounds of every replica's 4 steps (round_end = all) and with rounds that end when the
first replica is done (round_end = first: the straggler takes fewer steps). The figure is
the fast replica's (rank 0's) tokens per second: its shard's tokens over its own wall time,
every wait included (synchronous: the gradient allreduce inside each step, metrics step_time;
local steps: the waits for the averaging, metrics wall_time), over the steps before the last
round (at the last step every replica waits for the others to end with one model, a cost of
stopping, not of running). Its ratio to the same configuration without a straggler is taken
within each repetition; medians of interleaved repetitions. The loss is the mean over the last
4 steps (what the skipped steps of a straggler cost). Writes async_dp.json and .png.
"""

from __future__ import annotations

import argparse
import tempfile
import tomllib
from pathlib import Path

import h5py
import numpy as np
from _common import RESULTS, machine_facts, pyplot, run_hpcpipe, save_figure

from hpcpipe.bench.table import Column, Report

FIGURE = "async_dp"
CONFIGS = (  # mode, average_every, delay, round_end
    ("sync", 1, 0, "all"),
    ("local", 4, 0, "all"),
    ("local", 4, 1, "all"),
    ("local", 4, 1, "first"),
)
STRAGGLERS = {
    "none": "",
    "transient": "rank=1,at=step:9,until=13,kind=slow,factor=1.5",
    "persistent": "rank=1,at=step:1,kind=slow,factor=1.5",
}


def one_run(
    args: argparse.Namespace, mode: str, every: int, delay: int, end: str, fault: str
) -> dict:
    with tempfile.TemporaryDirectory() as out:
        sets = [
            f"run.output={out}",
            "topology.pp=1",
            f"topology.dp={args.ranks}",
            f"run.steps={args.steps}",
            f"run.log_every={args.steps}",
            "train.verify=false",
            f"async.mode={mode}",
        ]
        if mode == "local":
            sets += [f"async.average_every={every}", f"async.delay={delay}"]
            sets += [f"async.round_end={end}"]
        env = {"HPCPIPE_INJECT_FAULT": fault} if fault else None
        run_hpcpipe(
            args.ranks, ["run", args.deck, *[x for s in sets for x in ("--set", s)]], env=env
        )
        with h5py.File(Path(out) / "metrics.h5") as f:
            walls = f["wall_time" if mode == "local" else "step_time"][()]
            loss = f["loss"][()]
            deck = tomllib.loads(f.attrs["config"])
            taken = f["replica_steps"][()] if "replica_steps" in f else None
    kept = args.steps - CONFIGS[-1][1]  # every configuration over the same steps
    tokens = kept * deck["data"]["global_batch"] // args.ranks * deck["model"]["seq_len"]
    # the straggler's (replica 1's) steps per round, before the last round
    steps = float(taken[:-1, 1].mean()) if taken is not None and len(taken) > 1 else every
    return {
        "tok_s": tokens / float(np.sum(walls[:kept])),
        "walls": walls,
        "loss": loss,
        "straggler_steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    args = ap.parse_args()
    cases = [(c, s) for c in CONFIGS for s in STRAGGLERS]
    runs: dict = {case: [] for case in cases}
    for rep in range(args.repeats):  # interleaved, each repetition in a rotated order
        k = rep % len(cases)
        for c, s in cases[k:] + cases[:k]:
            runs[(c, s)].append(one_run(args, *c, STRAGGLERS[s]))
            print(f"# repetition {rep + 1}: {c} {s}: {runs[(c, s)][-1]['tok_s']:.0f} tok/s")
    report = Report(
        FIGURE,
        [
            f"dp={args.ranks} on {args.ranks} ranks (pp 1), {Path(args.deck).stem}'s model, "
            f"{args.steps} steps; replica 1 slowed 1.5x; the fast replica's tokens/s over the "
            f"first {args.steps - CONFIGS[-1][1]} steps, medians of {args.repeats} interleaved "
            "repetitions",
        ],
        [
            Column("mode", "mode", "", 6),
            Column("average_every", "every", "d", 5),
            Column("delay", "delay", "d", 5),
            Column("round_end", "round end", "", 9),
            Column("straggler", "straggler", "", 10),
            Column("straggler_steps", "its steps/round", ".2f", 15),
            Column("tok_s", "fast tok/s", ".0f", 10),
            Column("ratio", "vs no straggler", ".3f", 15),
            Column("loss", "loss (last 4)", ".4f", 13),
        ],
        params=vars(args),
    )
    for c, s in cases:
        base = runs[(c, "none")]
        rs = runs[(c, s)]
        report.add(
            {
                "mode": c[0],
                "average_every": c[1],
                "delay": c[2],
                "round_end": c[3],
                "straggler": s,
                "straggler_steps": float(np.median([r["straggler_steps"] for r in rs])),
                "loss": float(np.median([np.mean(r["loss"][-4:]) for r in rs])),
                "tok_s": float(np.median([r["tok_s"] for r in rs])),
                "ratio": float(
                    np.median([r["tok_s"] / b["tok_s"] for r, b in zip(rs, base, strict=True)])
                ),
            }
        )
    rows = {
        (r["mode"], r["average_every"], r["delay"], r["round_end"], r["straggler"]): r
        for r in report.rows
    }
    for s in ("transient", "persistent"):
        ours = rows[("local", 4, 1, "first", s)]["ratio"]
        sync = rows[("sync", 1, 0, "all", s)]["ratio"]
        every = rows[("local", 4, 1, "all", s)]["ratio"]
        report.target(
            f"fast replica with a {s} 1.5x straggler, local delay 1, rounds ended by the "
            f"first (sync: {sync:.3f}; rounds of every replica's steps: {every:.3f})",
            "within 5%",
            f"{ours:.3f}",
            ours >= 0.95,
        )
    print(report.render())
    path = report.write(
        RESULTS / f"{FIGURE}.json", machine=machine_facts(), command="python benchmarks/async_dp.py"
    )
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, s in zip(axes, ("transient", "persistent"), strict=True):
        for c in CONFIGS:
            walls = np.median([r["walls"] for r in runs[(c, s)]], axis=0)
            label = "sync" if c[0] == "sync" else f"local, every {c[1]}, delay {c[2]}, {c[3]}"
            ax.plot(np.arange(1, len(walls) + 1), np.cumsum(walls), lw=1.2, label=label)
        ax.set(xlabel="step", title=f"{s} straggler (replica 1, 1.5x)")
    axes[0].set_ylabel("fast replica's wall time (s)")
    axes[0].legend()
    save_figure(fig, FIGURE)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
