"""GPipe (Huang et al. 2019): every forward, then every backward.

The simplest schedule and the reference for the others: bubble rate (p-1)/(m+p-1) and every
microbatch's activations live at once (peak memory m), for any m >= 1.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules._build import check_pm, concat, phase
from hpcpipe.schedules.ir import Kind, Schedule

__all__ = ["gpipe"]


def gpipe(p: int, m: int) -> Schedule:
    """Rank r holds stage r and runs F0..F(m-1), then BW0..BW(m-1) (fused backward)."""
    check_pm("gpipe", p, m)
    mbs = np.arange(m)
    per_rank = [
        concat([phase(m, [(Kind.F, r, mbs, True)]), phase(m, [(Kind.BW, r, mbs, True)])])
        for r in range(p)
    ]
    return Schedule.from_arrays(
        "gpipe", [(r,) for r in range(p)], m, per_rank, params=(("p", p), ("m", m))
    )
