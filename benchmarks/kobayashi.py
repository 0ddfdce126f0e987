"""Figure: Kobayashi benchmark problem 1 against its published reference fluxes.

    python benchmarks/kobayashi.py                 # 2 ranks, about a minute on 2 cores
    python benchmarks/kobayashi.py --ranks 4 --cells 100

Solves inputs/sweep_kobayashi.toml (hpcpipe.sweep.kobayashi: the mirrored 200 cm box, the
published points on cell centres) with `hpcpipe run` under mpiexec for both cases, pure
absorber (i) and 50% scattering (ii), with the deck's S8 and with a product set of 16 polar x
8 azimuthal points per quadrant (512 directions), and prints, per published point, the
reference (analytic for (i), GMVP Monte Carlo for (ii)) and the ratio computed / reference for
each solve. Writes benchmarks/results/kobayashi.json; docs/sweep.md shows the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import RESULTS, ROOT, machine_facts, run_hpcpipe

from hpcpipe.bench.table import Column, Report
from hpcpipe.sweep.kobayashi import compare
from hpcpipe.sweep.output import read_flux

DECK = ROOT / "inputs" / "sweep_kobayashi.toml"
PURE_ABSORBER = "sweep.sigma_s=[[[0.0]], [[0.0]], [[0.0]]]"
QUADRATURES = {
    "S8": [],
    "P16x8": ["sweep.quadrature='product'", "sweep.order=16", "sweep.azimuthal=8"],
}


def _solve(ranks: int, cells: int, case: str, quad: list[str], out: Path) -> np.ndarray:
    sets = [f"sweep.px={ranks}", f"sweep.nx={cells}", f"sweep.ny={cells}", f"sweep.nz={cells}"]
    sets += [*quad, "sweep.plot=false", f"run.output='{out}'"]
    if case == "i":
        sets.append(PURE_ABSORBER)
    args = ["run", str(DECK), "--overwrite"]
    for s in sets:
        args += ["--set", s]
    run_hpcpipe(ranks, args)
    phi, _ = read_flux(out / "flux.h5")
    return phi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cells", type=int, default=60, help="per side: 20 x an odd number")
    ap.add_argument("--json", default=str(RESULTS / "kobayashi.json"), metavar="PATH")
    args = ap.parse_args(argv)
    columns = [
        Column("case", "case", "", 4, "<"),
        Column("line", "line", "", 4, "<"),
        Column("point", "point (cm)", "", 14, "<"),
        Column("reference", "reference", ".4e", 11),
        Column("error", "ref err", ".1%", 7),
    ]
    columns += [Column(q, f"{q} / ref", ".3f", 9) for q in QUADRATURES]
    report = Report(
        "kobayashi",
        [
            f"Kobayashi problem 1 (Prog. Nucl. Energy 39, 119 (2001)), {args.cells}^3 cells over "
            f"the mirrored 200 cm box, {args.ranks} ranks; total scalar flux at the published "
            "points (quarter coordinates), reference: case i analytic, case ii GMVP Monte Carlo",
            "S8 = level-symmetric, 80 directions; P16x8 = product set, 16 polar x 8 azimuthal "
            "per quadrant, 512 directions; ratio = hpcpipe / reference",
        ],
        columns,
        params={"ranks": args.ranks, "cells": args.cells},
        stream=True,
    )
    report.start()
    spread: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("i", "ii"):
            computed = {
                q: compare(_solve(args.ranks, args.cells, case, sets, Path(tmp) / f"{case}{q}"),
                           case)
                for q, sets in QUADRATURES.items()
            }  # fmt: skip
            first = next(iter(computed.values()))
            for k, point in enumerate(first):
                row = {
                    "case": case,
                    "line": point.line,
                    "point": "({:g}, {:g}, {:g})".format(*point.point),
                    "reference": point.reference,
                    "error": point.error,
                }
                for q, rows in computed.items():
                    row[q] = rows[k].ratio
                    spread.setdefault(f"{case} {q}", []).append(rows[k].ratio)
                report.add(row)
    for key, ratios in spread.items():
        r = np.array(ratios)
        within = float(np.mean(np.abs(r - 1) <= 0.2))
        report.summary[key] = {"median_ratio": float(np.median(r)), "within_20pct": within}
        report.note(
            f"case {key}: median ratio {np.median(r):.3f}, {100 * within:.0f}% of the 30 points "
            f"within 20%, range {r.min():.3g} .. {r.max():.3g}"
        )
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    out = report.write(
        args.json,
        command=f"python benchmarks/kobayashi.py{' ' + shown if shown else ''}",
        machine=machine_facts(),
    )
    print(f"# wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
