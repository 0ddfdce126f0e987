"""Table: every schedule's makespan, peak memory and gap to the lower bound, next to the
published generators, for p in {4, 8, 16} and m in {p, 2p, 4p}.

    python benchmarks/schedule_table.py                 # the table in docs/schedules.md
    python benchmarks/schedule_table.py --p 4 8 --m-factors 1 2

Unit costs (F = B = W = 1 per full stage, a V chunk half of that; free communication), as
the papers state their figures; memory in full-stage microbatches. The published column is
what the authors' generators reach: the V-Half and V-Min building blocks compacted on the
grid (`hpcpipe.schedules.blocks`) and the ZB-V greedy (`hpcpipe.schedules.vgreedy`), our
implementations of their constructions, which reproduce their figures exactly
(tests/schedules/test_published.py). The other schedules are the published orders
themselves. Pure computation: no MPI, the same output on every machine. Exits 1 if any row
is behind its published figure.
"""

from __future__ import annotations

import argparse
import sys

from hpcpipe.schedules import SCHEDULE_NAMES, build_schedule, simulate
from hpcpipe.schedules.blocks import compacted_v, half_block, min_block
from hpcpipe.schedules.bound import lower_bound
from hpcpipe.schedules.listsched import unit_costs
from hpcpipe.schedules.vgreedy import v_greedy_orders


def published(name: str, p: int, m: int) -> tuple[float, float] | None:
    """(makespan, peak) of the published generator's order, where one exists apart from
    the order we build."""
    if name == "v-half":
        orders = [compacted_v(name, p, m, half_block(p))]
    elif name == "v-min":
        orders = [compacted_v(name, p, m, min_block(p))]
    elif name == "zb-v":
        orders = v_greedy_orders(p, m, 2 * p)
    else:
        return None
    costs = unit_costs(p)(2 * p)
    runs = [simulate(o, costs) for o in orders]
    best = min(runs, key=lambda r: r.makespan)
    return best.makespan, float(best.peak_memory.max())


def cell(name: str, p: int, m: int) -> tuple[str, float | None, float | None]:
    """'makespan / peak / gap' for one schedule, with its makespan and peak."""
    try:
        sched = build_schedule(name, p, m)
    except ValueError:
        return "needs m >= 2p" if name == "dualpipe-v" else "not built", None, None
    costs = unit_costs(p)(sched.num_stages)
    result = simulate(sched, costs)
    peak = float(result.peak_memory.max())
    bound = lower_bound(sched.stages_of_rank, m, costs, peak, target=result.makespan)
    gap = bound.gap(result.makespan)
    gap_text = "at bound" if gap <= 1e-9 else f"+{100 * gap:.1f}%"
    return f"{result.makespan:g} / {peak:g} / {gap_text}", result.makespan, peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[4, 8, 16], help="pipeline ranks")
    ap.add_argument("--m-factors", type=int, nargs="+", default=[1, 2, 4], help="m = factor x p")
    args = ap.parse_args(argv)
    heads = [f"m = {k}p" if k > 1 else "m = p" for k in args.m_factors]
    print(
        "unit costs; each cell: makespan / peak memory (full-stage microbatches) / gap to the "
        "lower bound\nfor the schedule's placement and peak; published: the authors' "
        "generator at the same m (- : ours is their order)"
    )
    line = f"{'schedule':<17} {'p':>3}  " + "  ".join(f"{h:<24}" for h in heads) + "  published"
    print(line)
    print("-" * len(line))
    behind = []
    for name in SCHEDULE_NAMES:
        for p in args.p:
            cells, theirs = [], []
            for k in args.m_factors:
                m = k * p
                text, span, peak = cell(name, p, m)
                cells.append(f"{text:<24}")
                pub = published(name, p, m)
                if pub is None:
                    continue
                theirs.append(f"{pub[0]:g}")
                fits = span is not None and peak is not None and pub[1] <= peak + 1e-9
                if fits and span > pub[0] + 1e-9:
                    behind.append(f"{name} p={p} m={m}: {span:g} > {pub[0]:g}")
            print(f"{name:<17} {p:>3}  " + "  ".join(cells) + "  " + (" / ".join(theirs) or "-"))
    if behind:
        print("behind the published generator: " + "; ".join(behind))
        return 1
    print("no row is behind its published generator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
