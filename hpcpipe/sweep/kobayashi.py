"""Kobayashi benchmark problem 1 and its published reference fluxes, for comparing a solve.

K. Kobayashi, N. Sugimura, Y. Nagaya, "3D radiation transport benchmark problems and results
for simple geometries with void region", Progress in Nuclear Energy 39(2), 119-144 (2001), the
OECD/NEA benchmark. Problem 1 is one octant of a box with reflecting planes x = y = z = 0: a
10 cm source cube (1 n/cm^3/s) in the corner, a void region up to 50 cm and a shield up to 100 cm;
sigma_t = 0.1 in source and shield, 1e-4 in the void; case (i) a pure absorber, case (ii) 50%
scattering (sigma_s = sigma_t / 2). hpcpipe has no reflecting boundaries, so the decks sweep the
whole mirrored box (200 cm, the source cube centred): the same problem. The reference values
are the total scalar flux at the points 1A (x = z = 5, y = 5 ... 95), 1B (the body diagonal
x = y = z = 5 ... 95) and 1C (y = 55, z = 5, x = 5 ... 95), in the benchmark's quarter
coordinates: analytic for case (i), GMVP Monte Carlo for case (ii) (relative 1-sigma errors
given). The numbers are the report's as carried by the benchmark inputs of several transport
codes (three independent copies agree digit for digit); our code computes its own.

Discrete ordinates in a near-void region carry ray effects, so an S_N solution differs from the
reference along the void (known since the benchmark: the TORT solutions of Azmy, Gallmeier and
Lillie in the same issue, pp. 155-166); `compare` reports the ratio per point.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hpcpipe.sweep.config import SweepConfig

__all__ = ["CASES", "POINTS", "REFERENCE", "Comparison", "compare", "kobayashi_config"]

_TABLE = """
line   x   y   z   case (i) exact  case (ii) GMVP  rel. error
1A    5   5   5   5.95659E+00   8.29260E+00  0.00021
1A    5  15   5   1.37185E+00   1.87028E+00  0.00005
1A    5  25   5   5.00871E-01   7.13986E-01  0.00003
1A    5  35   5   2.52429E-01   3.84685E-01  0.00004
1A    5  45   5   1.50260E-01   2.53984E-01  0.00006
1A    5  55   5   5.95286E-02   1.37220E-01  0.00073
1A    5  65   5   1.53283E-02   4.65913E-02  0.00117
1A    5  75   5   4.17689E-03   1.58766E-02  0.00197
1A    5  85   5   1.18533E-03   5.47036E-03  0.00343
1A    5  95   5   3.46846E-04   1.85082E-03  0.00619
1B    5   5   5   5.95659E+00   8.29260E+00  0.00021
1B   15  15  15   4.70754E-01   6.63233E-01  0.00004
1B   25  25  25   1.69968E-01   2.68828E-01  0.00003
1B   35  35  35   8.68334E-02   1.56683E-01  0.00005
1B   45  45  45   5.25132E-02   1.04405E-01  0.00011
1B   55  55  55   1.33378E-02   3.02145E-02  0.00061
1B   65  65  65   1.45867E-03   4.06555E-03  0.00074
1B   75  75  75   1.75364E-04   5.86124E-04  0.00116
1B   85  85  85   2.24607E-05   8.66059E-05  0.00198
1B   95  95  95   3.01032E-06   1.12892E-05  0.00383
1C    5  55   5   5.95286E-02   1.37220E-01  0.00073
1C   15  55   5   5.50247E-02   1.27890E-01  0.00076
1C   25  55   5   4.80754E-02   1.13582E-01  0.00080
1C   35  55   5   3.96765E-02   9.59578E-02  0.00088
1C   45  55   5   3.16366E-02   7.82701E-02  0.00094
1C   55  55   5   2.35303E-02   5.67030E-02  0.00111
1C   65  55   5   5.83721E-03   1.88631E-02  0.00189
1C   75  55   5   1.56731E-03   6.46624E-03  0.00314
1C   85  55   5   4.53113E-04   2.28099E-03  0.00529
1C   95  55   5   1.37079E-04   7.93924E-04  0.00890
"""

CASES = ("i", "ii")


def _parse() -> tuple[dict[str, tuple], dict[tuple[str, str], tuple]]:
    points: dict[str, list] = {}
    ref: dict[tuple[str, str], list] = {}
    for row in _TABLE.strip().splitlines()[1:]:
        line, x, y, z, exact, gmvp, error = row.split()
        points.setdefault(line, []).append((float(x), float(y), float(z)))
        ref.setdefault(("i", line), []).append((float(exact), 0.0))
        ref.setdefault(("ii", line), []).append((float(gmvp), float(error)))
    return (
        {k: tuple(v) for k, v in points.items()},
        {k: tuple(v) for k, v in ref.items()},
    )


POINTS, REFERENCE = _parse()
"""POINTS: the published points per line, quarter coordinates (cm); REFERENCE: (flux in
n/cm^2/s, relative error) per (case, line) and point; case (i) analytic, error 0."""


def kobayashi_config(cells: int = 60, case: str = "ii", **overrides: Any) -> SweepConfig:
    """Problem 1 on the mirrored 200 cm box with `cells` per side. The published points are
    cell centres when 200 / cells = 10 / (2k + 1) cm (cells = 20, 60, 100, 140, ...)."""
    if case not in CASES:
        raise ValueError(f"case: {case!r} is not one of {', '.join(CASES)}")
    if (cells // 20) % 2 == 0 or cells % 20:
        raise ValueError(
            f"cells: = {cells} puts no cell centre on the published points: use 20 x an odd "
            "number (20, 60, 100, 140, ...)"
        )
    scatter = 0.5 if case == "ii" else 0.0
    sigma_t = (0.1, 1.0e-4, 0.1)  # shield, void, source
    config = SweepConfig(
        nx=cells,
        ny=cells,
        nz=cells,
        lengths=(200.0, 200.0, 200.0),
        groups=1,
        sigma_t=tuple((s,) for s in sigma_t),
        sigma_s=tuple((((scatter * s),),) for s in sigma_t),
        source=((0.0,), (0.0,), (1.0,)),
        material=0,
        boxes=((50.0, 150.0) * 3, (90.0, 110.0) * 3),
        box_materials=(1, 2),
        quadrature="level-symmetric",
        order=8,
        tolerance=1e-7,
        max_iterations=200,
    )
    return replace(config, **overrides)


@dataclass(frozen=True)
class Comparison:
    """One point: where it is, the reference (with its error) and what the solve gives."""

    line: str
    point: tuple[float, float, float]
    reference: float
    error: float
    computed: float

    @property
    def ratio(self) -> float:
        return self.computed / self.reference


def compare(phi: np.ndarray, case: str, lengths: tuple[float, ...] = (200.0,) * 3) -> list:
    """The solve's flux (nx, ny, nz) or (nx, ny, nz, 1) at every published point of `case`:
    the value of the cell whose centre is the point (raises if none is)."""
    flux = np.asarray(phi)
    if flux.ndim == 4:
        flux = flux[..., 0]
    shape = flux.shape
    out = []
    for line, points in POINTS.items():
        for point, (ref, err) in zip(points, REFERENCE[(case, line)], strict=True):
            index = []
            for q, n, length in zip(point, shape, lengths, strict=True):
                h = length / n
                i = (length / 2 + q) / h - 0.5  # quarter coordinate -> mirrored box, cell
                if abs(i - round(i)) > 1e-9:
                    raise ValueError(
                        f"point {point} is not a cell centre of the {shape} mesh: use "
                        "kobayashi_config's cell counts"
                    )
                index.append(round(i))
            out.append(Comparison(line, point, ref, err, float(flux[tuple(index)])))
    return out
