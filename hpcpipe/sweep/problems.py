"""Published sweep problems as decks: Kripke's built-in problem and the Kobayashi benchmarks.

Kripke (LLNL's sweep proxy, v1.2.x) hard-codes one geometry, the dog-leg duct of the Kobayashi
benchmark's problem 3 unreflected to the full box x in [-60, 60], y in [-100, 100],
z in [-60, 60] cm (its `Generate/Space.cpp`), with three materials whose cross sections are the
same in every group (`--sigt 0.1,0.0001,0.1 --sigs 0.05,0.00005,0.05`, within-group scattering
only) and a unit source in the central 20 cm cube. Kripke mixes materials inside a zone by
sub-sampling; hpcpipe paints each cell by its centre, so the two meshes agree where the
region boundaries fall on cell faces and differ by a layer of cells elsewhere. Timing does not
depend on that: the side-by-side (docs/sweep.md) compares the cost per unknown.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpcpipe.sweep.config import SweepConfig

__all__ = ["KRIPKE_BOXES", "kripke_config"]

# The dog leg in Kripke's |x|, |y|, |z| coordinates (material 1, the near-void duct), then the
# source cube (material 0); everything else is the shield (material 2).
_LEGS = (
    ((0.0, 10.0), (0.0, 60.0), (0.0, 10.0)),
    ((0.0, 40.0), (50.0, 60.0), (0.0, 10.0)),
    ((30.0, 40.0), (50.0, 60.0), (0.0, 40.0)),
    ((30.0, 40.0), (50.0, 100.0), (30.0, 40.0)),
)
_SOURCE = ((0.0, 10.0), (0.0, 10.0), (0.0, 10.0))
_HALF = (60.0, 100.0, 60.0)  # half-lengths of the full box


def _mirrored(ranges: tuple[tuple[float, float], ...]) -> list[tuple[float, ...]]:
    """The boxes, in hpcpipe's [0, L] coordinates, covering |x|, |y|, |z| in `ranges`."""
    per_axis = []
    for (lo, hi), half in zip(ranges, _HALF, strict=True):
        spans = [(-hi, hi)] if lo == 0 else [(lo, hi), (-hi, -lo)]
        per_axis.append([(a + half, b + half) for a, b in spans])
    return [(*x, *y, *z) for x in per_axis[0] for y in per_axis[1] for z in per_axis[2]]


KRIPKE_BOXES: tuple[tuple[float, ...], ...] = tuple(
    box for leg in (*_LEGS, _SOURCE) for box in _mirrored(leg)
)
"""The 16 boxes of Kripke's geometry: 15 for the dog leg, the source cube last."""


def kripke_config(n: int = 32, groups: int = 8, order: int = 8, **overrides: Any) -> SweepConfig:
    """Kripke's problem on n^3 zones: by default the side-by-side problem of docs/sweep.md
    (32^3 zones, 8 groups, S8 = 80 directions, isotropic, diamond difference); `overrides` are
    other [sweep] keys (px, py, fixup, ...)."""
    sigma_t = (0.1, 1.0e-4, 0.1)
    sigma_s = (0.05, 5.0e-5, 0.05)
    config = SweepConfig(
        nx=n,
        ny=n,
        nz=n,
        lengths=tuple(2 * h for h in _HALF),
        groups=groups,
        sigma_t=tuple((s,) * groups for s in sigma_t),
        sigma_s=tuple(
            tuple(tuple(s if g == h else 0.0 for h in range(groups)) for g in range(groups))
            for s in sigma_s
        ),
        source=((1.0,) * groups, (0.0,) * groups, (0.0,) * groups),
        material=2,
        boxes=KRIPKE_BOXES,
        box_materials=(1,) * (len(KRIPKE_BOXES) - 1) + (0,),
        quadrature="level-symmetric",
        order=order,
        scheme="dd",
        tolerance=1e-6,
        max_iterations=100,
    )
    return dataclasses.replace(config, **overrides)
