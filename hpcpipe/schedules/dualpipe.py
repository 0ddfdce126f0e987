"""DualPipeV (DeepSeek-AI 2024/2025): DualPipe "cut in half" onto the V placement.

Rank r holds stages r and 2p-1-r. The order has eight phases: chunk-0 forwards; forward pairs;
split backward of chunk 1 with its W at once; the main phase of (F chunk 0, BW chunk 1,
F chunk 1, BW chunk 0); the drain of forwards; backward pairs where the second half switch to
split backward; W + B pairs; and the owed Ws. Each F followed by a backward of the other
chunk (the main phase's two per iteration, the drain's one) is an overlapped pair `F&B`:
DualPipe runs them as one step so that one microbatch's communication hides behind the
other's compute (the simulator's pair cost: `simulate.durations`). It needs m >= 2p.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules._build import check_pm, concat, phase
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.vshape import v_placement

__all__ = ["dualpipe_v"]


def _rank(r: int, p: int, m: int) -> tuple[np.ndarray, ...]:
    s0, s1 = r, 2 * p - 1 - r
    a = 2 * (p - r - 1)
    q = m - 2 * p + r + 1  # main-phase iterations
    k_a, k_r1, k_d, k_q = np.arange(a), np.arange(r + 1), np.arange(p - r - 1), np.arange(q)
    parts = [
        phase(a, [(Kind.F, s0, k_a, True)]),
        phase(r + 1, [(Kind.F, s0, a + k_r1, True), (Kind.F, s1, k_r1, True)]),
        phase(
            p - r - 1,
            [(Kind.B, s1, k_d, True), (Kind.W, s1, k_d, True), (Kind.F, s1, r + 1 + k_d, True)],
        ),
        phase(
            q,
            [
                (Kind.F, s0, 2 * p - r - 1 + k_q, True),
                (Kind.BW, s1, p - r - 1 + k_q, True),
                (Kind.F, s1, p + k_q, True),
                (Kind.BW, s0, k_q, True),
            ],
        ),
        phase(
            p - r - 1,
            [
                (Kind.BW, s1, p - r - 1 + q + k_d, True),
                (Kind.F, s1, p + q + k_d, True),
                (Kind.BW, s0, q + k_d, True),
            ],
        ),
    ]
    # Backward pairs: from the middle pair on (from its chunk-0 half when r is even) the
    # backward is split and its W queued; the queue is drained in order by the last phases.
    half = (r + 1) // 2
    split1 = k_r1 >= (half if r % 2 else half + 1)
    split0 = k_r1 >= half
    b1_mb, b0_mb = m - r - 1 + k_r1, m - p + k_r1
    kinds, stages, mbs = phase(
        r + 1,
        [
            (Kind.B, s1, b1_mb, split1),
            (Kind.BW, s1, b1_mb, ~split1),
            (Kind.B, s0, b0_mb, split0),
            (Kind.BW, s0, b0_mb, ~split0),
        ],
    )
    parts.append((kinds, stages, mbs))
    queued_stage = stages[kinds == Kind.B]
    queued_mb = mbs[kinds == Kind.B]
    b0_last = m - p + r + 1 + k_d  # split chunk-0 backwards of the W + B phase
    queued_stage = np.concatenate([queued_stage, np.full(p - r - 1, s0)])
    queued_mb = np.concatenate([queued_mb, b0_last])
    parts.append(
        phase(
            p - r - 1,
            [
                (Kind.W, queued_stage[: p - r - 1], queued_mb[: p - r - 1], True),
                (Kind.B, s0, b0_last, True),
            ],
        )
    )
    rest = slice(p - r - 1, None)
    parts.append(phase(r + 1, [(Kind.W, queued_stage[rest], queued_mb[rest], True)]))
    return concat(parts)


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV order for p ranks and m >= 2p microbatches."""
    check_pm("dualpipe-v", p, m)
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs m >= 2p microbatches (got p={p}, m={m}): its main phase starts "
            "once every rank has both chunks in flight; with fewer, zb-v (same V placement, "
            "peak p) or schedule = 'auto' run any m"
        )
    per_rank = [_paired(*_rank(r, p, m)) for r in range(p)]
    return Schedule.from_arrays(
        "dualpipe-v", v_placement(p), m, per_rank, params=(("p", p), ("m", m))
    )


def _paired(kinds: np.ndarray, stages: np.ndarray, mbs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Mark DualPipe's overlapped chunks: each F directly followed by a backward of the rank's
    other stage (the main phase's two pairs per iteration and the drain's one) runs with it."""
    f = kinds[:-1] == Kind.F
    back = (kinds[1:] == Kind.BW) | (kinds[1:] == Kind.B)
    flags = np.zeros(kinds.size, dtype=bool)
    flags[:-1] = f & back & (stages[:-1] != stages[1:])
    return kinds, stages, mbs, flags
