"""Figure: the schedule search against every fixed schedule and the lower bound, and its cost.

    python benchmarks/schedule_search.py                    # p = 2..5
    python benchmarks/schedule_search.py --p 6 8 --skip-scale --jobs 2   # more ranks

For each p, m in {p, 2p, 4p, 8p} and memory budget from the least that fits to 2p in steps
of 0.5, under three cost models (unit; a heavy first and last stage: embedding and loss at
2x; MoE: an all-to-all of a quarter of F and B in every stage plus 0.1 per message), it runs
`search` and counts: never slower than the best fixed schedule within the budget (must hold
everywhere), strictly faster where that schedule is above the lower bound, and at the bound
(optimal). Where the search does not beat the best fixed schedule, the bound is computed again
with ten times the states (PROOF_STATES), which may prove that schedule optimal. Then the
search's CPU time at p = 64, m = 256 (target: under 60 s). Pure
computation; writes benchmarks/results/schedule_search.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from _common import RESULTS, ROOT, machine_facts

from hpcpipe.bench.table import Column, Report
from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.config import PipelineConfig, costs_for
from hpcpipe.schedules.search import CostsFor, Found, fixed_points, min_budget, search

TARGET_S = 60.0
SCALE = (64, 256)


def deck(kind: str, p: int, m: int) -> PipelineConfig:
    """The cost models: F, B, W per model piece (p pieces), like a deck's [pipeline]."""
    if kind == "unit":
        return PipelineConfig(microbatches=m)
    if kind == "heavy-ends":
        ends = [2.0] + [1.0] * max(p - 2, 0) + [2.0] if p > 1 else [2.0]
        return PipelineConfig(microbatches=m, t_f=tuple(ends), t_b=tuple(ends), t_w=tuple(ends))
    return PipelineConfig(microbatches=m, t_alltoall=(0.25,), comm_latency=0.1)


def _placements(p: int) -> list[list[tuple[int, ...]]]:
    return [[(r,) for r in range(p)], [(r, 2 * p - 1 - r) for r in range(p)]]


BOUND_STATES = 100_000
"""States the bound's search for ranks alone takes (`lower_bound`'s default, `hpcpipe plan`'s)."""
PROOF_STATES = 1_000_000
"""... and where the search does not beat the best fixed schedule: a tighter bound may prove that
schedule optimal (p = 8, m = 32, unit costs, budget 5: 102.5 with the default, 104.5 = V-Half
with this), so the budget is not counted as one the search should have beaten."""


def _bound(p: int, m: int, costs: CostsFor, budget: float, reached: float, states: int) -> float:
    """The lower bound over both placements, proving no further than `reached`."""
    return min(
        lower_bound(
            pl, m, costs(sum(map(len, pl))), budget, target=reached, max_states=states
        ).makespan
        for pl in _placements(p)
    )


def one_case(p: int, m: int, kind: str) -> dict:
    """Every budget of one (p, m, costs): the counts, the CPU seconds they took, and the
    budgets where the best fixed schedule is above the bound and the search does not beat it
    ("missed")."""
    t0 = time.process_time()
    missed = []
    cfg = deck(kind, p, m)
    costs = costs_for(cfg, p)
    fixed = [f for f in fixed_points(p, m, costs) if isinstance(f, Found)]
    counts = dict.fromkeys(("budgets", "behind", "above", "beaten", "at_bound"), 0)
    budget = min_budget(p, costs)
    while budget <= 2 * p + 1e-9:
        found = search(p, m, costs, budget, fixed=fixed)
        fits = [f.makespan for f in fixed if f.peak <= budget * (1 + 1e-9)]
        best_fixed = min(fits) if fits else np.inf
        reached = min(best_fixed, found.makespan)
        bound = _bound(p, m, costs, budget, reached, BOUND_STATES)
        beaten = found.makespan < best_fixed * (1 - 1e-9)
        if best_fixed > bound * (1 + 1e-9) and not beaten:  # is the fixed schedule optimal?
            bound = _bound(p, m, costs, budget, reached, PROOF_STATES)
        counts["budgets"] += 1
        counts["behind"] += int(found.makespan > best_fixed * (1 + 1e-9))
        above = best_fixed > bound * (1 + 1e-9)
        counts["above"] += int(above)
        beaten = above and beaten
        counts["beaten"] += int(beaten)
        if above and not beaten:
            missed.append(
                f"p={p} m={m} {kind} budget {budget:g}: search {found.makespan:g}, "
                f"best fixed {best_fixed:g}, bound {bound:g}"
            )
        counts["at_bound"] += int(found.makespan <= bound * (1 + 1e-9))
        budget += 0.5
    return {**counts, "cpu_s": time.process_time() - t0, "missed": missed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 3, 4, 5], help="ranks")
    ap.add_argument("--costs", nargs="+", default=["unit", "heavy-ends", "moe"])
    ap.add_argument("--skip-scale", action="store_true", help="no p=64, m=256 timing")
    ap.add_argument("--jobs", type=int, default=1, help="processes for the matrix (default 1)")
    ap.add_argument("--json", default=str(RESULTS / "schedule_search.json"), metavar="PATH")
    args = ap.parse_args(argv)
    report = Report(
        "schedule_search",
        [
            "schedule search vs fixed schedules and the lower bound; budgets from the least "
            "that fits to 2p, step 0.5",
            "behind: slower than the best fixed schedule within the budget (must be 0); above: "
            "cases where that schedule is above the bound; beaten: of those, the search strictly "
            "faster; at bound: the search provably optimal",
            f"bound: {BOUND_STATES:,} states of search per rank alone, {PROOF_STATES:,} where "
            "the search does not beat the best fixed schedule",
        ],
        [
            Column("p", "p", "d", 3),
            Column("costs", "costs", "", 10, "<"),
            Column("budgets", "cases", "d", 6),
            Column("behind", "behind", "d", 7),
            Column("above", "above", "d", 6),
            Column("beaten", "beaten", "d", 7),
            Column("at_bound", "at bound", "d", 9),
            Column("cpu_s", "cpu s", ".1f", 7),
        ],
        params={"p": args.p, "costs": args.costs, "m": "p, 2p, 4p, 8p"},
        stream=True,
    )
    report.start()
    totals = dict.fromkeys(("budgets", "behind", "above", "beaten"), 0)
    missed: list[str] = []
    rows = [(p, kind) for p in args.p for kind in args.costs]
    cases = [(p, m, kind) for p, kind in rows for m in (p, 2 * p, 4 * p, 8 * p)]
    with ProcessPoolExecutor(args.jobs) as pool:  # the counts do not depend on the split
        futures = {case: pool.submit(one_case, *case) for case in cases}
        for p, kind in rows:
            row = dict.fromkeys(("budgets", "behind", "above", "beaten", "at_bound", "cpu_s"), 0)
            for m in (p, 2 * p, 4 * p, 8 * p):
                result = futures[p, m, kind].result()
                missed += result.pop("missed")
                for key, value in result.items():
                    row[key] += value
            for key in totals:
                totals[key] += row[key]
            report.add({"p": p, "costs": kind, **row})
    report.summary |= totals | {"missed": missed}
    for line in missed:
        report.note("not beaten: " + line)
    report.target(
        "never behind a fixed schedule", "0 cases", str(totals["behind"]), not totals["behind"]
    )
    report.target(
        "strictly faster where the best fixed schedule is above the bound",
        f"{totals['above']} of {totals['above']}",
        f"{totals['beaten']} of {totals['above']}",
        totals["beaten"] == totals["above"],
    )
    if not args.skip_scale:
        p, m = SCALE
        costs = costs_for(PipelineConfig(microbatches=m), p)
        t0 = time.process_time()
        found = search(p, m, costs, p / 2)
        cpu = time.process_time() - t0
        report.summary |= {"scale_p": p, "scale_m": m, "scale_cpu_s": cpu}
        report.note(
            f"search at p = {p}, m = {m}, budget {p / 2:g}, unit costs: {cpu:.1f} CPU s, "
            f"makespan {found.makespan:g} ({found.how.split(';')[0]})"
        )
        report.target(
            f"search at p={p}, m={m}", f"<= {TARGET_S:g} s", f"{cpu:.1f} s", cpu <= TARGET_S
        )
    report.finish()
    shown = " ".join(sys.argv[1:])
    out = report.write(
        args.json,
        command=f"python benchmarks/schedule_search.py{' ' + shown if shown else ''}",
        machine=machine_facts(),
    )
    print(f"# wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
