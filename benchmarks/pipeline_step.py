"""Measured pipeline step time vs the simulator fed with the measured per-action costs.

For each schedule, trains a few steps on `--ranks` ranks (no oversubscription: use at most one
rank per core) and reads what the run stored in metrics.h5: the median pipeline step time and
the simulator's makespan for the same schedule with the per-stage F/B/W costs measured in that
same run. The ratio is what the runtime adds beyond the plan (messages, waits, interpreter).

    python benchmarks/pipeline_step.py --ranks 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import h5py
from _common import machine, run_hpcpipe, save_json

SCHEDULES = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "v-half",
    "v-min",
    "dualpipe-v",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs per schedule (median taken)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[
            "model.d_model=128",
            "model.d_ff=512",
            "model.seq_len=64",
            "data.global_batch=32",
            "pipeline.microbatches=8",
            "model.layers=6",
        ],
    )
    args = ap.parse_args()

    rows = []
    print(
        f"# pipeline step time on {args.ranks} ranks (pp={args.ranks}, dp=1), "
        f"median of {args.repeats} runs x {args.steps - 1} timed steps"
    )
    print(
        f"{'schedule':<18} {'measured ms':>12} {'simulated ms':>13} {'ratio':>7} "
        f"{'full step ms':>13}"
    )
    for name in args.schedules.split(","):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as out:
                sets = [
                    f"run.output={out}",
                    f"topology.pp={args.ranks}",
                    "topology.dp=1",
                    f"run.steps={args.steps}",
                    f"pipeline.schedule={name}",
                    "run.log_every=1000",
                    *args.overrides,
                ]
                run_hpcpipe(
                    args.ranks, ["run", args.deck, *[x for s in sets for x in ("--set", s)]]
                )
                with h5py.File(Path(out) / "metrics.h5") as f:
                    runs.append(
                        {
                            k.removeprefix("timing_"): float(f.attrs[k])
                            for k in (
                                "timing_pipeline_measured_s",
                                "timing_pipeline_predicted_s",
                                "timing_step_s",
                            )
                        }
                    )
        measured = statistics.median(r["pipeline_measured_s"] for r in runs)
        predicted = statistics.median(r["pipeline_predicted_s"] for r in runs)
        ratios = [r["pipeline_measured_s"] / r["pipeline_predicted_s"] for r in runs]
        full = statistics.median(r["step_s"] for r in runs)
        row = {
            "schedule": name,
            "measured_s": measured,
            "predicted_s": predicted,
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "step_s": full,
        }
        rows.append(row)
        print(
            f"{name:<18} {measured * 1e3:>12.2f} {predicted * 1e3:>13.2f} "
            f"{row['ratio']:>7.3f} {full * 1e3:>13.2f}",
            flush=True,
        )
    path = save_json(
        "pipeline_step",
        {
            "ranks": args.ranks,
            "repeats": args.repeats,
            "overrides": args.overrides,
            "machine": machine(),
            "rows": rows,
        },
    )
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
