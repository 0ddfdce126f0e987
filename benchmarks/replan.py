"""Figure: re-planning around a slow rank, against not re-planning and the best fixed partition.

    python benchmarks/replan.py               # 2 ranks (pp = 2), the real GPT model, 3 repeats
    python benchmarks/replan_synthetic.py     # 4 ranks (pp = 4) on a synthetic device

One pipeline rank (`--slow-rank`, default the last) is made 2x slower from step 5
(HPCPIPE_INJECT_FAULT kind=slow: every unit's compute stretched). Cases, each run `--repeats`
times in interleaved order, step times the median over the steps that follow the run's last
switch (or, without one, its warm-up):

- balanced: no slowdown, [replan] off (the reference step);
- quiet: no slowdown, [replan] on: what checking costs, and whether noise makes it switch;
- slow: the slowdown, [replan] off;
- replan: the slowdown, [replan] on;
- replan + search: the slowdown, [replan] on with `search` (the schedule and microbatch count
  re-searched for the measured stage costs, within the current activation memory);
- quiet + search: no slowdown, [replan] on with `search`: a schedule faster than the deck's for
  the measured costs is taken once, then nothing moves;
- best fixed: the slowdown from step 1, fixed partitions given as train.stage_units: every
  contiguous one where there are at most 12, else the 4 the simulator predicts fastest with
  the units' FLOPs as costs and the slowdown (a synthetic device's true costs: its modelled
  times follow the FLOPs exactly); the fastest one measured is the best plan computed offline;
- ends: the slowdown from step 5 to step 30, [replan] on: checks until the deck's partition is
  back (or one as fast: ten steps within 5% of the balanced case's).

The real model runs on pp = 2 because this machine has 2 cores: more ranks would share cores,
and their step times would measure the sharing. `inputs/replan_synthetic.toml` runs pp = 4 on a
synthetic device (`[device] synthetic_us_per_row`): each unit's F, B and W last a modelled time,
its real arithmetic inside it and a sleep for the rest, so 4 ranks keep their timing on 2
cores. Writes FIGURE.json, FIGURE_before.png and FIGURE_after.png (FIGURE: replan or
replan_synthetic; the pictures are the timelines of the replan case's last slow step before its
switch, and of its last step).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from _common import RESULTS, machine_facts, run_hpcpipe

from hpcpipe.bench.table import Column, Report

FIGURE = "replan"


def _run(ranks: int, deck: str, out: Path, sets: list[str], fault: str) -> dict[str, Any]:
    overrides = [x for s in [f"run.output={out}", *sets] for x in ("--set", s)]
    run_hpcpipe(
        ranks, ["run", deck, "--overwrite", *overrides], env={"HPCPIPE_INJECT_FAULT": fault}
    )
    with h5py.File(out / "metrics.h5") as f:
        times = f["step_time"][()]
        switches = f["replan/step"][()].tolist() if "replan" in f else []
        units = f["replan/stage_units"][()].tolist() if "replan" in f else []
        plans = [x.decode() for x in f["replan/schedule"][()]] if "replan" in f else []
    return {"times": times, "switches": switches, "units": units, "schedules": plans}


def _checks_until_back(
    r: dict[str, Any], deck: list[int], balanced: float, args: argparse.Namespace
) -> int:
    """Checks, counted from the first one at or after the slowdown's end (step 30), until the
    plan is balanced again (-1: never): the check that switches back to the deck's partition,
    or, where the run settles on another one that is as fast (a partition one layer off can
    be), the first check after which the median of the next two checks' steps is within 5% of
    the balanced run's step (ten steps: five stray by more than that on this machine)."""
    ce = args.check_every
    first = -(-30 // ce) * ce
    moves = list(zip(r["switches"], r["units"], strict=True))
    now = next((units for step, units in reversed(moves) if step < first), deck)
    if now == deck:
        return 1  # never left it
    for step, units in moves:
        if step >= first and units == deck:
            return (step - first) // ce + 1
    times, window = r["times"], 2 * ce
    for k, check in enumerate(range(first, len(times) - window + 1, ce)):
        if float(np.median(times[check : check + window])) <= 1.05 * balanced:
            return k + 1
    return -1


def _steady(times: np.ndarray, after: int) -> float:
    """Median step time after step `after` (steps count from 1)."""
    return float(np.median(times[after:]))


def main(argv: Sequence[str] | None = None, figure: str = FIGURE, **defaults: Any) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deck", default="inputs/gpt_pp4.toml")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--slow-rank", type=int, default=-1, help="default: the last")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-every", type=int, default=5)
    ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    ranks = args.ranks
    slow_rank = args.slow_rank % ranks
    common = [
        f"topology.pp={ranks}",
        "topology.dp=1",
        "pipeline.schedule=1f1b",
        f"run.steps={args.steps}",
        "run.log_every=1000",
        "train.verify=false",
    ]
    on = ["replan.enabled=true", f"replan.check_every={args.check_every}"]
    search = ["replan.search=true"]
    slow = f"rank={slow_rank},at=step:5,kind=slow,factor={args.factor}"
    predicted = _predicted_partitions(args.deck, ranks, slow_rank, args.factor)
    partitions = [units for _, units in (predicted if len(predicted) <= 12 else predicted[:4])]
    deck = _deck_units(args.deck, ranks)
    cases: dict[str, list[float]] = {}
    quiet_switches: list[int] = []
    back_checks: list[int] = []
    ends_switches: list[list[tuple[int, list[int]]]] = []
    replan_units: list[list[int]] = []
    best: dict[str, list[float]] = {}
    first_switch: list[int] = []
    search_plans: list[str] = []
    quiet_search: list[list[tuple[int, str]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for rep in range(args.repeats):
            print(f"# repetition {rep + 1}/{args.repeats}", flush=True)
            r = _run(ranks, args.deck, out / "a", common, "")
            cases.setdefault("balanced", []).append(_steady(r["times"], 10))
            r = _run(ranks, args.deck, out / "b", [*common, *on], "")
            cases.setdefault("quiet", []).append(_steady(r["times"], 10))
            quiet_switches.append(len(r["switches"]))
            r = _run(ranks, args.deck, out / "c", common, slow)
            cases.setdefault("slow", []).append(_steady(r["times"], 10))
            trace = ["trace.enabled=true"] if rep == 0 else []
            r = _run(ranks, args.deck, out / "d", [*common, *on, *trace], slow)
            last = max(r["switches"], default=10)
            cases.setdefault("replan", []).append(_steady(r["times"], last + 1))
            replan_units.append(r["units"][-1] if r["units"] else [])
            first_switch.append(r["switches"][0] if r["switches"] else -1)
            if rep == 0:
                _pictures(out / "d" / "trace.h5", r["switches"], figure)
            r = _run(ranks, args.deck, out / "s", [*common, *on, *search], slow)
            last = max(r["switches"], default=10)
            cases.setdefault("replan_search", []).append(_steady(r["times"], last + 1))
            search_plans.append(
                f"{r['units'][-1]} {r['schedules'][-1]}" if r["switches"] else "no switch"
            )
            r = _run(ranks, args.deck, out / "q", [*common, *on, *search], "")
            last = max(r["switches"], default=10)
            cases.setdefault("quiet_search", []).append(_steady(r["times"], last + 1))
            quiet_search.append(list(zip(r["switches"], r["schedules"], strict=True)))
            for part in partitions:
                sets = [*common, f"train.stage_units={part}"]
                fault = f"rank={slow_rank},at=step:1,kind=slow,factor={args.factor}"
                r = _run(ranks, args.deck, out / "e", sets, fault)
                best.setdefault(str(part), []).append(_steady(r["times"], 10))
            r = _run(ranks, args.deck, out / "f", [*common, *on], f"{slow},until=30")
            back_checks.append(_checks_until_back(r, deck, cases["balanced"][-1], args))
            ends_switches.append(list(zip(r["switches"], r["units"], strict=True)))
    med = {k: statistics.median(v) for k, v in cases.items()}
    best_med = {k: statistics.median(v) for k, v in best.items()}
    best_part = min(best_med, key=best_med.get) if best_med else None
    t_best = best_med[best_part] if best_part else float("nan")
    report = Report(
        figure,
        [
            f"re-planning around a slow rank: {ranks} ranks (pp = {ranks}), {args.deck}, 1f1b, "
            f"{args.steps} steps, rank {slow_rank} {args.factor:g}x slower from step 5",
            f"step time = median after the run's last switch (else after step 10), median of "
            f"{args.repeats} interleaved repetitions; replan.check_every = {args.check_every}",
        ],
        [
            Column("case", "case", "", 46, "<"),
            Column("step_ms", "step ms", ".2f", 8),
            Column("vs_balanced", "vs balanced", ".3f", 11),
            Column("stage_units", "stage_units", "", 14, "<"),
        ],
        params=vars(args),
    )
    vs_best = med["replan"] / t_best
    faster = 1 - med["replan"] / med["slow"]
    overhead = med["quiet"] / med["balanced"] - 1
    cases_shown = [
        ("balanced: no slowdown, replan off", med["balanced"], str(deck)),
        ("quiet: no slowdown, replan on", med["quiet"], str(deck)),
        ("slow rank, replan off", med["slow"], str(deck)),
        ("slow rank, replan on (after its switch)", med["replan"], str(replan_units[-1])),
        ("slow rank, replan + search (after its switch)", med["replan_search"], "see note"),
        ("slow rank, best fixed partition (1f1b)", t_best, str(best_part)),
        ("quiet: no slowdown, replan + search", med["quiet_search"], str(deck)),
    ]
    for name, t, units in cases_shown:
        report.add(
            {
                "case": name,
                "step_ms": t * 1e3,
                "vs_balanced": t / med["balanced"],
                "stage_units": units,
            }
        )
    measured = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in best_med.items())
    simulated = ", ".join(f"{units} {t:.4g}" for t, units in predicted[: len(partitions)])
    which = "every" if len(partitions) == len(predicted) else f"the {len(partitions)} predicted"
    report.note(f"{which} fixed partition with the slowdown, measured (ms): {measured}")
    report.note(
        f"predicted fastest of {len(predicted)} with FLOP costs (simulated; a synthetic "
        f"device's true costs): {simulated}"
    )
    report.note(f"replan + search runs ended on {search_plans}")
    report.note(f"quiet replan + search runs switched (after step, to) {quiet_search}")
    report.note(
        f"replan runs ended on {replan_units}, first switch after step(s) {first_switch}; "
        f"quiet runs switched {quiet_switches} time(s); with the slowdown ending at step 30 "
        f"they switched (after step, to stage_units) {ends_switches}"
    )
    report.target(
        "replan vs the best fixed partition", "<= 1.10", f"{vs_best:.3f}", vs_best <= 1.10
    )
    report.target("replan faster than not re-planning", ">= 30%", f"{faster:.1%}", faster >= 0.30)
    search_vs_best = med["replan_search"] / t_best
    search_faster = 1 - med["replan_search"] / med["slow"]
    report.target(
        "replan + search vs the best fixed partition (1f1b)",
        "<= 1.10",
        f"{search_vs_best:.3f}",
        search_vs_best <= 1.10,
    )
    report.target(
        "replan + search faster than not re-planning",
        ">= 30%",
        f"{search_faster:.1%}",
        search_faster >= 0.30,
    )
    report.target(
        "cost of checking (quiet / balanced - 1)", "<= 1%", f"{overhead:+.2%}", overhead <= 0.01
    )
    report.target(
        "switches without a slowdown", "0", str(sum(quiet_switches)), sum(quiet_switches) == 0
    )
    report.target(
        "checks until balanced after the slowdown ends",
        "<= cooldown + 1 = 2",
        str(back_checks),
        all(0 < b <= 2 for b in back_checks),
    )
    report.summary |= {
        "step_s": med,
        "step_s_runs": cases,
        "best_fixed_s": best_med,
        "replan_vs_best": vs_best,
        "replan_faster_than_slow": faster,
        "replan_search_vs_best": search_vs_best,
        "replan_search_faster_than_slow": search_faster,
        "check_overhead": overhead,
        "checks_until_back": back_checks,
    }
    print(report.render())
    out = report.write(
        RESULTS / f"{figure}.json",
        command=f"python benchmarks/{figure}.py" + "".join(f" {a}" for a in sys.argv[1:]),
        machine=machine_facts(),
    )
    print(f"# wrote {out.relative_to(RESULTS.parent.parent)}")


def _deck_units(deck: str, ranks: int) -> list[int]:
    from hpcpipe.config import load_config
    from hpcpipe.model.models import build_model
    from hpcpipe.schedules.report import runnable_schedule
    from hpcpipe.train.checks import deck_partition

    cfg = load_config(Path(deck), [f"topology.pp={ranks}", "pipeline.schedule=1f1b"])
    schedule, _ = runnable_schedule(cfg.pipeline, ranks, cfg.source)
    ranges = deck_partition(cfg, build_model(cfg.model, cfg.moe), schedule.stages_of_rank)
    return [len(r) for r in ranges]


def _predicted_partitions(
    deck: str, ranks: int, slow_rank: int, factor: float
) -> list[tuple[float, list[int]]]:
    """Every contiguous partition of the deck's model over one stage per rank, with 1F1B's
    simulated step for the true costs (F = B = W = a unit's FLOPs, the slow rank's times
    `factor`), fastest first."""
    from hpcpipe.config import load_config
    from hpcpipe.model.models import build_model
    from hpcpipe.schedules.report import runnable_schedule
    from hpcpipe.schedules.simulate import CostModel, simulate

    cfg = load_config(Path(deck), [f"topology.pp={ranks}", "pipeline.schedule=1f1b"])
    schedule, _ = runnable_schedule(cfg.pipeline, ranks, cfg.source)
    flops = np.array([u.flops_per_token() for u in build_model(cfg.model, cfg.moe)], float)
    prefix = np.concatenate(([0.0], np.cumsum(flops / flops.max())))
    speed = np.ones(ranks)
    speed[slow_rank] = factor
    out = []
    for cuts in itertools.combinations(range(1, len(flops)), ranks - 1):
        bounds = (0, *cuts, len(flops))
        t = np.array([prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds)]) * speed
        step = simulate(schedule, CostModel(t_f=t, t_b=t, t_w=t)).makespan
        out.append((float(step), [b - a for a, b in itertools.pairwise(bounds)]))
    return sorted(out)


def _pictures(trace_path: Path, switches: list[int], figure: str) -> None:
    from hpcpipe.analysis.plots import plot_timeline
    from hpcpipe.io.trace import read_trace

    trace = read_trace(trace_path)
    before = switches[0] if switches else trace.steps[-1]
    plot_timeline(
        trace,
        RESULTS / f"{figure}_before.png",
        step=before,
        title=f"slow rank, before re-planning: step {before} (ends with the REPLAN move)",
    )
    plot_timeline(
        trace, RESULTS / f"{figure}_after.png", step=trace.steps[-1], title="after re-planning"
    )
    print(f"# wrote benchmarks/results/{figure}_before.png, {figure}_after.png")


if __name__ == "__main__":
    main()
