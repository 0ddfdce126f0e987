"""Zero-bubble schedules with one stage per rank (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism"): the backward is split into B (gradient of the input, on the critical path) and
W (gradient of the weights, which nothing downstream waits for), and W fills the bubbles.

ZB-H1 keeps 1F1B's order of F and B and its warm-up (p-1-r forwards on rank r), but rank r runs
each W r microbatches after its B. The deferred Ws fill the cool-down, so the bubble drops from
(p-1)(T_F+T_B+T_W) to (p-1)(T_F+T_B-T_W) for m >= p, while no rank holds more than 1F1B's peak
of p microbatches.

ZB-H2 also fills the warm-up: rank r starts with 2(p-1-r)+1 forwards (enough to cover the wait
for its first B), then repeats B, W, F with each W 2r microbatches after its B. Every rank holds
2p-1 microbatches at its peak, and with T_F = T_B = T_W each rank runs without a gap from its
first F to its last W when m >= 2p-1 (the papers' "zero bubble": only the pipeline fill and
drain of (p-1)T_F remain, which overlap with the neighbouring training steps). With fewer
microbatches the warm-up cannot be that deep; there the generator also runs the list scheduler
under ZB-H2's memory and keeps the faster, which reaches the lower bound in every case we test.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules._build import COMPACT_MAX_P, check_pm, concat, fastest, phase
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.listsched import unit_list_schedule

__all__ = ["zb_h1", "zb_h2"]


def _split_rank(r: int, m: int, warm: int, defer: int, order: str) -> tuple[np.ndarray, ...]:
    """Warm-up forwards, then per microbatch k the slots of `order` (F = forward warm+k,
    B = backward k, W = weights of k-defer), then the Ws still owed."""
    k = np.arange(m)
    slots = {
        "F": (Kind.F, r, k + warm, k + warm < m),
        "B": (Kind.B, r, k, True),
        "W": (Kind.W, r, k - defer, k >= defer),
    }
    first_w_left = max(m - defer, 0)
    tail = np.arange(first_w_left, m)
    return concat(
        [
            phase(warm, [(Kind.F, r, np.arange(warm), True)]),
            phase(m, [slots[c] for c in order]),
            phase(tail.size, [(Kind.W, r, tail, True)]),
        ]
    )


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's memory, bubble (p-1)(T_F+T_B-T_W) for m >= p; any m >= 1 is valid."""
    check_pm("zb-h1", p, m)
    per_rank = [_split_rank(r, m, min(p - 1 - r, m), r, "FBW") for r in range(p)]
    return Schedule.from_arrays(
        "zb-h1", [(r,) for r in range(p)], m, per_rank, params=(("p", p), ("m", m))
    )


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2: peak 2p-1 microbatches, no gap inside any rank's span for m >= 2p-1."""
    check_pm("zb-h2", p, m)
    per_rank = [_split_rank(r, m, min(2 * (p - 1 - r) + 1, m), 2 * r, "BWF") for r in range(p)]
    written = Schedule.from_arrays(
        "zb-h2", [(r,) for r in range(p)], m, per_rank, params=(("p", p), ("m", m))
    )
    if m >= 2 * p - 1 or p > COMPACT_MAX_P:
        return written
    return fastest([written, unit_list_schedule("zb-h2", p, m, False, float(2 * p - 1))], p)
