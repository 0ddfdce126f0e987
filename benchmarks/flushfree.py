"""Figure: a pipeline without a flush and local steps against synchronous schedules, on the
Markov data.

    python benchmarks/flushfree.py            # 2 ranks, gpt_pp4's model, 120 global batches

Each configuration trains the same global batches from the same seed on the same ranks:
synchronous ZB-V and 1F1B (pp 2, a flush every step), 1F1B without a flush (pp 2; 2bw: an
update per global batch; stash: an update per microbatch), and local steps (dp 2, pp 1: each
replica steps on its half of every batch, the two average every 4 steps with delay 1).
Tokens per second is the tokens trained over the training loop's wall
time (the synchronous steps' summed step times; the stream's wall time), median over
interleaved repetitions, with each repetition's ratio to synchronous ZB-V and 1F1B; the loss is
the mean over the last 10 global batches (per global batch: stash averages its microbatch
updates), its gap to synchronous ZB-V's in percent. Writes flushfree.json and flushfree.png.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import tomllib
from pathlib import Path

import h5py
import numpy as np
from _common import RESULTS, machine_facts, pyplot, run_hpcpipe, save_figure

from hpcpipe.bench.table import Column, Report

FIGURE = "flushfree"
CONFIGS = (
    ("zb-v", "sync"),
    ("1f1b", "sync"),
    ("1f1b", "2bw"),
    ("1f1b", "stash"),
    ("1f1b", "local"),
)
AVERAGE_EVERY = 4  # local steps: a round of 4 steps, its averaging overlapped (delay 1)


def one_run(args: argparse.Namespace, schedule: str, mode: str) -> dict:
    pp, dp = (1, args.ranks) if mode == "local" else (args.ranks, 1)
    local = [f"async.average_every={AVERAGE_EVERY}", "async.delay=1"] if mode == "local" else []
    with tempfile.TemporaryDirectory() as out:
        sets = [
            f"run.output={out}",
            f"topology.pp={pp}",
            f"topology.dp={dp}",
            *local,
            f"run.steps={args.steps}",
            f"pipeline.schedule={schedule}",
            f"pipeline.microbatches={args.microbatches}",
            f"async.mode={mode}",
            f"run.log_every={args.steps}",
            "train.verify=false",
        ]
        log = run_hpcpipe(args.ranks, ["run", args.deck, *[x for s in sets for x in ("--set", s)]])
        with h5py.File(Path(out) / "metrics.h5") as f:
            loss = f["loss"][()]
            if mode == "sync":
                seconds = float(np.sum(f["step_time"][()]))
            elif mode == "local":  # rank 0's steps, its waits for the averaging included
                seconds = float(np.sum(f["wall_time"][()]))
            else:
                seconds = float(f.attrs["timing_stream_s"])
            deck = tomllib.loads(f.attrs["config"])
    tokens = args.steps * deck["data"]["global_batch"] * deck["model"]["seq_len"]
    per_batch = loss.reshape(args.steps, -1).mean(axis=1)  # stash: m updates per batch
    found = re.search(r"predicted steady state ([\d.]+)", log)
    return {
        "loss": per_batch,
        "tok_s": tokens / seconds,
        "predicted": float(found.group(1)) if found else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    args = ap.parse_args()
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in CONFIGS}
    for rep in range(args.repeats):  # interleaved, each repetition in a rotated order
        for c in CONFIGS[rep % len(CONFIGS) :] + CONFIGS[: rep % len(CONFIGS)]:
            runs[c].append(one_run(args, *c))
            print(f"# repetition {rep + 1}: {c[0]} {c[1]} {runs[c][-1]['tok_s']:.0f} tok/s")
    base, same = runs[CONFIGS[0]], runs[CONFIGS[1]]
    report = Report(
        FIGURE,
        [
            f"pp={args.ranks} (local: dp={args.ranks}, averaging every {AVERAGE_EVERY} steps, "
            f"delay 1) on {args.ranks} ranks, {Path(args.deck).stem}'s model, "
            f"{args.steps} global batches of {args.microbatches} microbatches; medians of "
            f"{args.repeats} interleaved repetitions",
        ],
        [
            Column("schedule", "schedule", "", 8),
            Column("mode", "mode", "", 6),
            Column("tok_s", "tok/s", ".0f", 8),
            Column("speed", "vs zb-v sync", ".3f", 12),
            Column("speed_1f1b", "vs 1f1b sync", ".3f", 12),
            Column("loss", "loss (last 10)", ".4f", 14),
            Column("loss_gap", "vs zb-v sync %", "+.2f", 14),
            Column("predicted", "predicted steady", ".3f", 16),
        ],
        params=vars(args),
    )
    base_loss = float(np.median([r["loss"][-10:].mean() for r in base]))
    for c in CONFIGS:
        rs = runs[c]
        loss = float(np.median([r["loss"][-10:].mean() for r in rs]))
        report.add(
            {
                "schedule": c[0],
                "mode": c[1],
                "tok_s": float(np.median([r["tok_s"] for r in rs])),
                "speed": float(
                    np.median([r["tok_s"] / b["tok_s"] for r, b in zip(rs, base, strict=True)])
                ),
                "speed_1f1b": float(
                    np.median([r["tok_s"] / b["tok_s"] for r, b in zip(rs, same, strict=True)])
                ),
                "loss": loss,
                "loss_gap": (loss / base_loss - 1) * 100,
                "predicted": rs[0]["predicted"],
            }
        )
    rows = {(r["schedule"], r["mode"]): r for r in report.rows}
    twobw = rows[("1f1b", "2bw")]
    report.target(
        "loss at equal tokens, 2bw vs synchronous zb-v",
        "within 3%",
        f"{twobw['loss_gap']:+.2f}%",
        abs(twobw["loss_gap"]) <= 3.0,
    )
    report.target(
        "2bw tokens/s vs synchronous 1f1b and zb-v (same memory or more)",
        "> 1",
        f"{twobw['speed_1f1b']:.3f}, {twobw['speed']:.3f}",
        twobw["speed_1f1b"] > 1 and twobw["speed"] > 1,
    )
    local = rows[("1f1b", "local")]
    report.target(
        "loss at equal tokens, local steps vs synchronous zb-v",
        "within 3%",
        f"{local['loss_gap']:+.2f}%",
        abs(local["loss_gap"]) <= 3.0,
    )
    print(report.render())
    path = report.write(
        RESULTS / f"{FIGURE}.json",
        machine=machine_facts(),
        command="python benchmarks/flushfree.py",
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in CONFIGS:
        curve = np.median([r["loss"] for r in runs[c]], axis=0)
        ax.plot(np.arange(1, len(curve) + 1), curve, lw=1.2, label=f"{c[0]} {c[1]}")
    ax.set(
        xlabel="global batch (equal tokens)",
        ylabel="loss (nats/token)",
        title=f"without a flush (pp={args.ranks}), local steps (dp={args.ranks}), synchronous",
    )
    ax.legend()
    save_figure(fig, FIGURE)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
