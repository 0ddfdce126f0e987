"""Figure: where the schedule search is above the lower bound, the exact optimum decides.

    pip install ortools && python benchmarks/schedule_exact.py     # about 30 minutes
    python benchmarks/schedule_exact.py --costs moe --p 5 --m 1   # another cost model

`benchmarks/schedule_search.py` counts the budgets at which the search is provably optimal (at
the lower bound). Everywhere else either the bound is loose (the search is optimal and the
bound cannot show it) or a faster order exists that the search misses. This figure settles
each such budget for unit costs (or another of schedule_search's cost models), small p and m
in {p, 2p} with an exact solver: OR-Tools' CP-SAT, on both placements the bound considers (one
stage per rank, and the V placement), with the simulator's semantics: per rank one action at a
time, each as long as the cost model says (times scaled to integers), a transfer between ranks
taking the model's communication time, F keeps a stage's activation until its W, the peak
counted after each action within the budget. Each optimal order found is then
rebuilt as an hpcpipe `Schedule` and simulated: its makespan and peak are the simulator's, so
the solver's model is checked against ours case by case. Pure computation; writes
benchmarks/results/schedule_exact.json (schedule_exact_COSTS.json for another cost model).
ortools is needed by this script only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from fractions import Fraction

from _common import RESULTS, ROOT, machine_facts
from schedule_search import deck

from hpcpipe.bench.table import Column, Report
from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.config import costs_for
from hpcpipe.schedules.ir import Schedule
from hpcpipe.schedules.search import Found, fixed_points, min_budget, search
from hpcpipe.schedules.simulate import CostModel, simulate

TIME_LIMIT_S = 180.0


def placements(p: int) -> dict[str, list[tuple[int, ...]]]:
    return {"1 per rank": [(r,) for r in range(p)], "V": [(r, 2 * p - 1 - r) for r in range(p)]}


def _integral(values: list[float]) -> int:
    """The least scale that makes every value an integer (costs such as 0.625 or 0.1)."""
    scale = 1
    for x in values:
        scale = math.lcm(scale, Fraction(x).limit_denominator(1000).denominator)
    return scale


def exact(
    p: int, m: int, placement: list[tuple[int, ...]], budget: float, costs: CostModel
) -> dict:
    """The least makespan over every order on this placement (CP-SAT), with the order.

    Times are scaled to integers (`_integral`), activations counted in their greatest common
    unit; a transfer between ranks takes `costs.comm_time`, within a rank nothing."""
    from ortools.sat.python import cp_model

    n_stages = sum(map(len, placement))
    rank_of = {s: r for r, ss in enumerate(placement) for s in ss}
    arrays = costs.stage_arrays(n_stages)
    if costs.b_frees:
        raise ValueError("the exact model holds a microbatch's activations from its F to its W")
    hop = float(costs.comm_time)
    times = [*arrays["t_f"], *arrays["t_b"], *arrays["t_w"], hop]
    scale = _integral(times)
    dur = {k: [round(x * scale) for x in arrays[f"t_{k.lower()}"]] for k in "FBW"}
    lag = round(hop * scale)
    unit = Fraction(float(min(arrays["activation"]))).limit_denominator(1000)
    act = [round(Fraction(float(a)).limit_denominator(1000) / unit) for a in arrays["activation"]]
    level = math.floor(Fraction(budget).limit_denominator(1000) / unit + Fraction(1, 10**9))
    horizon = m * sum(map(sum, dur.values())) + 2 * n_stages * lag
    model = cp_model.CpModel()
    start: dict[tuple[str, int, int], cp_model.IntVar] = {}
    intervals: list[list] = [[] for _ in range(p)]
    events: list[list] = [[] for _ in range(p)]
    deltas: list[list[int]] = [[] for _ in range(p)]
    for s in range(n_stages):
        r = rank_of[s]
        for mb in range(m):
            for k in "FBW":
                x = model.NewIntVar(0, horizon, f"{s}{k}{mb}")
                start[k, s, mb] = x
                d = dur[k][s]
                intervals[r].append(model.NewIntervalVar(x, d, x + d, f"i{s}{k}{mb}"))
            events[r] += [start["F", s, mb] + dur["F"][s], start["W", s, mb] + dur["W"][s]]
            deltas[r] += [act[s], -act[s]]
    for r in range(p):
        model.AddNoOverlap(intervals[r])
        model.AddReservoirConstraint(events[r], deltas[r], 0, level)

    def after(a: int, b: int) -> int:
        return lag if rank_of[a] != rank_of[b] else 0

    for mb in range(m):
        for s in range(n_stages):
            if s:
                model.Add(
                    start["F", s, mb] >= start["F", s - 1, mb] + dur["F"][s - 1] + after(s - 1, s)
                )
            if s + 1 < n_stages:
                upstream = start["B", s + 1, mb] + dur["B"][s + 1] + after(s + 1, s)
            else:
                upstream = start["F", s, mb] + dur["F"][s]
            model.Add(start["B", s, mb] >= upstream)
            model.Add(start["W", s, mb] >= start["B", s, mb] + dur["B"][s])
    for mb in range(m - 1):  # microbatches are interchangeable: number them by first F
        model.Add(start["F", 0, mb] <= start["F", 0, mb + 1])
    makespan = model.NewIntVar(0, horizon, "makespan")
    for (k, s, _), x in start.items():
        model.Add(makespan >= x + dur[k][s])
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = TIME_LIMIT_S
    solver.parameters.num_workers = 2
    solver.parameters.random_seed = 1
    status = solver.Solve(model)
    out = {"status": solver.StatusName(status), "proven": solver.BestObjectiveBound() / scale}
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        out["makespan"] = solver.ObjectiveValue() / scale
        rows = []
        for r in range(p):
            mine = sorted(
                (solver.Value(x), f"{s}{k}{mb}")
                for (k, s, mb), x in start.items()
                if rank_of[s] == r
            )
            rows.append([a for _, a in mine])
        out["order"] = Schedule.from_actions(
            rows, name="exact", stages_of_rank=placement, num_microbatches=m
        )
    return out


def cases(
    ps: list[int], kind: str, multiples: list[int]
) -> list[tuple[int, int, float, Found | None, Found, float]]:
    """The budgets where the search is above the lower bound (cost model `kind`, m = k p for k
    in `multiples`), with the best fixed schedule that fits (None: none does)."""
    out = []
    for p in ps:
        for m in (k * p for k in multiples):
            costs = costs_for(deck(kind, p, m), p)
            fixed = [f for f in fixed_points(p, m, costs) if isinstance(f, Found)]
            budget = min_budget(p, costs)
            while budget <= 2 * p + 1e-9:
                fits = [f for f in fixed if f.peak <= budget * (1 + 1e-9)]
                best = min(fits, key=lambda f: (f.makespan, f.peak)) if fits else None
                found = search(p, m, costs, budget, fixed=fixed)
                bound = min(
                    lower_bound(
                        pl, m, costs(sum(map(len, pl))), budget, target=found.makespan
                    ).makespan
                    for pl in placements(p).values()
                )
                if found.makespan > bound * (1 + 1e-9):
                    out.append((p, m, budget, best, found, bound))
                budget += 0.5
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 3, 4], help="ranks")
    ap.add_argument(
        "--m", type=int, nargs="+", default=[1, 2], metavar="K", help="microbatches m = K p"
    )
    ap.add_argument(
        "--costs",
        default="unit",
        choices=["unit", "heavy-ends", "moe"],
        help="cost model (schedule_search.py's; default unit)",
    )
    ap.add_argument("--json", default=None, metavar="PATH", help="default: results/, by --costs")
    args = ap.parse_args(argv)
    suffix = "" if args.costs == "unit" else "_" + args.costs.replace("-", "_")
    json_path = args.json or str(RESULTS / f"schedule_exact{suffix}.json")
    ms = ", ".join("m" if k == 1 else f"{k}p" for k in args.m).replace("m", "p", 1)
    try:
        import ortools  # noqa: F401
    except ImportError:
        print("schedule_exact: needs OR-Tools (pip install ortools); nothing measured")
        return 0
    report = Report(
        "schedule_exact",
        [
            f"the budgets where the search is above the lower bound ({args.costs} costs, m in "
            f"{{{ms}}}), settled by an exact solver",
            f"exact = least makespan over every order on either placement (CP-SAT, "
            f"{TIME_LIMIT_S:g} s each), its order re-simulated by hpcpipe; verdict: the bound "
            "is loose there (the search is optimal), or the search misses a faster order",
        ],
        [
            Column("p", "p", "d", 3),
            Column("m", "m", "d", 3),
            Column("budget", "budget", "g", 6),
            Column("fixed", "best fixed", "", 16, "<"),
            Column("fixed_ms", "makespan", "", 8),
            Column("search", "search", "g", 6),
            Column("bound", "bound", "g", 6),
            Column("exact", "exact", "", 6),
            Column("sim", "simulated", "", 9),
            Column("verdict", "verdict", "", 32, "<"),
        ],
        params={"p": args.p, "m": ms, "costs": args.costs, "time_limit_s": TIME_LIMIT_S},
        stream=True,
    )
    report.start()
    loose = behind = unknown = 0
    for p, m, budget, best, found, bound in cases(args.p, args.costs, args.m):
        costs = costs_for(deck(args.costs, p, m), p)
        results = {
            name: exact(p, m, pl, budget, costs(sum(map(len, pl))))
            for name, pl in placements(p).items()
        }
        solved = [r for r in results.values() if "makespan" in r]
        optimal = all(r["status"] == "OPTIMAL" for r in results.values())
        top = min(solved, key=lambda r: r["makespan"]) if solved else None
        sim = "-"
        if top is not None:
            order = top["order"]
            result = simulate(order, costs(order.num_stages))
            peak = float(result.peak_memory.max())
            sim = f"{result.makespan:g}" if peak <= budget * (1 + 1e-9) else "over budget"
        # an order at the lower bound is optimal even where the solver ran out of time
        proven = top is not None and (optimal or top["makespan"] <= bound * (1 + 1e-9))
        if top is not None and top["makespan"] < found.makespan * (1 - 1e-9):
            what = "the optimum" if proven else "an order at"
            verdict = f"search behind {what} {top['makespan']:g}"
            behind += 1
        elif proven:
            verdict = "search optimal: the bound is loose"
            loose += 1
        else:
            verdict = "not proven in time"
            unknown += 1
        report.add(
            {
                "p": p,
                "m": m,
                "budget": budget,
                "fixed": "-" if best is None else best.how.removeprefix("fixed: "),
                "fixed_ms": "-" if best is None else f"{best.makespan:g}",
                "search": found.makespan,
                "bound": bound,
                "exact": f"{top['makespan']:g}" if top is not None else "-",
                "sim": sim,
                "verdict": verdict,
            }
        )
    report.summary |= {"loose_bound": loose, "search_behind": behind, "unproven": unknown}
    report.note(
        f"{loose} case(s) where the search is optimal (the bound is loose there), "
        f"{behind} where a faster order exists that the search misses, {unknown} unproven"
    )
    report.finish()
    shown = " ".join(sys.argv[1:])
    out = report.write(
        json_path,
        command=f"python benchmarks/schedule_exact.py{' ' + shown if shown else ''}",
        machine=machine_facts(),
    )
    print(f"# wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
