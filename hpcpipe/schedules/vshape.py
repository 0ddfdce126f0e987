"""V-shape schedules: rank r holds stages r and 2p-1-r, so a microbatch goes down the ranks and
back up, and the last stage (the loss) sits on rank 0 next to the first. Each stage is half of
a rank's share of the model; memory figures below are in full-stage units (two chunks).

ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): a hand-written order (warm-up of
chunk-0 forwards, then F B W of chunk 0 alternating with F B W of chunk 1, then a cool-down that
runs backwards first and weights last). Peak memory p, like 1F1B, and with T_F = T_B = T_W no
gap inside any rank's span once m >= 2p-1.

With m < 2p-1 the hand-written order (built for 2p-1 microbatches, the extra ones dropped)
leaves gaps; there (up to p = 64) the generator also builds the paper's greedy (`vgreedy`) and
the list scheduler at ZB-V's memory (p) and keeps the fastest.

V-Min and V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): a schedule
is one building block, the F/B/W of a single microbatch on every stage with fixed time offsets,
repeated every 6 chunk-time units (F+B+W of both chunks). A rank's peak memory is the lifespan
of its activations in the block (F start to W end) divided by that period, so choosing the
offsets chooses the memory. Two constructions compete, and the faster under unit costs wins
(ties: the first):

1. Our block: offsets placed greedily in data-flow order, each at the first time its input is
   ready whose slot modulo 6 is still free on that rank; the descent (stages 0..p-1) steps by 1
   unit per stage, the climb back by 1 (V-Min) or 2 (V-Half); the repeated order is squeezed
   by the simulator. Linear in the number of actions: the only one used above p = 64.
2. The paper's block, repeated and compacted on a unit grid (`blocks`) as the paper builds it.

Both hold the published peaks, (p+4)//3 (V-Min) and (p+2)//2 (V-Half) full-stage
microbatches, for every p we test; bubble rates about 2p/(3m) and p/(2m). Any m >= 1 works.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcpipe.schedules._build import COMPACT_MAX_P, check_pm, concat, fastest, phase
from hpcpipe.schedules.blocks import compacted_v, half_block, min_block
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.listsched import unit_list_schedule
from hpcpipe.schedules.vgreedy import v_greedy_orders

__all__ = ["building_block", "repeat_block", "v_half", "v_min", "v_placement", "zb_v"]

PERIOD = 6  # F, B, W of both chunks of one microbatch on one rank, in chunk-time units


def v_placement(p: int) -> list[tuple[int, int]]:
    """Rank r holds stages r and 2p-1-r: the model goes down the ranks and back up."""
    return [(r, 2 * p - 1 - r) for r in range(p)]


# ---------------------------------------------------------------- ZB-V (hand-written order)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V, peak p; any m >= 1 (m < 2p-1: the faster of the truncated order and the list
    scheduler at memory p)."""
    check_pm("zb-v", p, m)
    written = _zb_v_written(p, m)
    if m >= 2 * p - 1 or p > COMPACT_MAX_P:
        return written
    greedy = v_greedy_orders(p, m, 2 * p)
    return fastest([written, unit_list_schedule("zb-v", p, m, True, float(p)), *greedy], p)


def _zb_v_written(p: int, m: int) -> Schedule:
    n = max(2 * p - 1, m)
    loops = n - p
    per_rank = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        warm = 2 * (p - r) - 1
        j = np.arange(loops)
        k_r = np.arange(r)
        k_pr = np.arange(p - r)
        kinds, stages, mbs = concat(
            [
                phase(warm, [(Kind.F, s0, np.arange(warm), True)]),
                phase(r, [(Kind.F, s1, k_r, True), (Kind.F, s0, warm + k_r, True)]),
                phase(
                    p - r,
                    [
                        (Kind.F, s1, r + k_pr, True),
                        (Kind.B, s1, k_pr, True),
                        (Kind.W, s1, k_pr, True),
                    ],
                ),
                phase(
                    loops,
                    [
                        (Kind.F, s0, warm + r + j, warm + r + j < n),
                        (Kind.B, s0, j, True),
                        (Kind.W, s0, j, True),
                        (Kind.F, s1, p + j, True),
                        (Kind.B, s1, p - r + j, True),
                        (Kind.W, s1, p - r + j, True),
                    ],
                ),
                phase(
                    r, [(Kind.B, s0, loops + k_r, True), (Kind.B, s1, p - r + loops + k_r, True)]
                ),
                phase(
                    p - r,
                    [(Kind.B, s0, loops + r + k_pr, True), (Kind.W, s0, loops + k_pr, True)],
                ),
                phase(r, [(Kind.W, s1, n - r + k_r, True)]),
                phase(r, [(Kind.W, s0, n - r + k_r, True)]),
            ]
        )
        keep = mbs < m
        per_rank.append((kinds[keep], stages[keep], mbs[keep]))
    return Schedule.from_arrays("zb-v", v_placement(p), m, per_rank, params=(("p", p), ("m", m)))


# ---------------------------------------------------------------- building blocks


def building_block(p: int, climb: int | Sequence[int]) -> np.ndarray:
    """Offsets (3 x 2p: F, B, W per stage) of one microbatch's block on the V placement.

    Each action goes at the first time >= its input's end (+1 unit of work) whose slot
    modulo PERIOD is free on its rank; the descent steps by 1 per stage, the climb by `climb`
    (or by `climb[i]` into the i-th stage of the second chunk, counted from the turn).
    """
    climbs = [climb] * p if isinstance(climb, int | np.integer) else list(climb)
    if len(climbs) != p:
        raise ValueError(f"building_block: {len(climbs)} climbs for the {p} second-chunk stages")
    stages = 2 * p
    rank = [s if s < p else stages - 1 - s for s in range(stages)]
    used: list[set[int]] = [set() for _ in range(p)]

    def place(s: int, earliest: int) -> int:
        t = earliest
        while t % PERIOD in used[rank[s]]:
            t += 1
        used[rank[s]].add(t % PERIOD)
        return t

    off = np.zeros((3, stages), dtype=np.int64)
    for s in range(stages):
        off[0, s] = place(s, 0 if s == 0 else off[0, s - 1] + (1 if s < p else climbs[s - p]))
    for s in range(stages - 1, -1, -1):
        off[1, s] = place(s, (off[0, s] if s == stages - 1 else off[1, s + 1]) + 1)
    for s in range(stages):
        off[2, s] = place(s, off[1, s] + 1)
    return off


def repeat_block(name: str, p: int, m: int, offsets: np.ndarray, params=()) -> Schedule:
    """Repeat a block every PERIOD units for m microbatches; each rank runs its actions in time
    order. Offsets are distinct modulo PERIOD on each rank, so the order is a permutation of
    time slots: it is laid out on a (rank x time) grid and read back row by row."""
    placement = np.asarray(v_placement(p), dtype=np.int64)
    stages = 2 * p
    span = int(offsets.max()) + PERIOD * (m - 1) + 1
    code_t = np.int32 if 3 * stages * m < 2**31 else np.int64
    grid = np.full((p, span), -1, dtype=code_t)
    i = np.arange(m, dtype=np.int64)
    for kind in range(3):
        for chunk in range(2):
            s = placement[:, chunk]  # (p,)
            times = offsets[kind, s][:, None] + PERIOD * i[None, :]
            codes = (kind * stages + s)[:, None] * m + i[None, :]
            grid[np.arange(p)[:, None], times] = codes
    taken = grid >= 0
    codes = grid[taken]
    counts = np.count_nonzero(taken, axis=1)
    del grid, taken
    offsets_r = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets_r[1:])
    km, mb = np.divmod(codes, code_t(m))  # in the codes' own width: half the traffic
    kind, stage = np.divmod(km, code_t(stages))
    arrays = (
        kind.astype(np.int8),
        stage.astype(np.int32, copy=False),
        mb.astype(np.int32, copy=False),
    )
    for arr in arrays:
        arr.flags.writeable = False  # fresh and ours: the Schedule need not copy them
    return Schedule(
        name=name,
        stages_of_rank=tuple(tuple(int(x) for x in row) for row in placement),
        num_microbatches=m,
        offsets=offsets_r,
        kinds=arrays[0],  # F, B, W codes are 0, 1, 2
        stages=arrays[1],
        microbatches=arrays[2],
        params=tuple(params),
    )


def _controllable(name: str, p: int, m: int, climb: int, paper_block) -> Schedule:
    params = (("p", p), ("m", m))
    ours = repeat_block(name, p, m, building_block(p, climb), params)
    if p > COMPACT_MAX_P:
        return ours
    return fastest([ours, compacted_v(name, p, m, paper_block(p), params)], p)


def v_min(p: int, m: int) -> Schedule:
    """V-Min: the shortest lifespans; peak (p+4)//3 full-stage microbatches."""
    check_pm("v-min", p, m)
    return _controllable("v-min", p, m, 1, min_block)


def v_half(p: int, m: int) -> Schedule:
    """V-Half: half of 1F1B's memory, (p+2)//2, for a smaller bubble than V-Min."""
    check_pm("v-half", p, m)
    return _controllable("v-half", p, m, 2, half_block)
