"""The memory-controllable V family between the published points: blocks for the budgets that
V-Min, V-Half and ZB-V skip.

A V block's second-chunk forwards climb back up the ranks one slot per stage (V-Min's block,
`vshape.building_block(p, 1)`), two (V-Half's) or three. A slot more of climb into a stage
lengthens the lifespans of the activations held below it, so the repeated block holds more
microbatches in flight, and rank 0, whose last forward's round trip ends the schedule, starts
that forward earlier. Mixing the climbs, k stages at c + 1 and the others at c (the k next to
the turn or the k next to the end, or some next to each), gives blocks at every peak between
two published ones; each is repeated and compacted like V-Min and V-Half
(`blocks.compacted_v`). Unit costs, p = 16, m = 16: a budget of 7 takes 74.5 (the lower
bound; V-Min at peak 6 takes 77.5, V-Half at 9 takes 68.5), and p = 8, m = 64, budget 5.5
takes 199.5 against V-Half's 200.5. Where half a microbatch more than V-Min's peak holds
no one-sided mix that beats it, a two-sided one does: unit costs, p = 12, budget 5.5, two
stages next to the turn and one next to the end take 56.0, 92.0, 164.0, 308.0 for m = 12,
24, 48, 96 (V-Min 56.5, 92.5, 164.5, 308.5; the one-sided blocks at that peak 57.0 and
more), and p = 15, budget 6.5, 71.0 to 386.0 for m = 15 to 120 (V-Min half a unit more).

A block's peak is known before it is built (`blocks.repeated_peak`), so `members` builds only
the blocks with the most chunk activations the budget holds (more in flight: the last forward
starts earlier), within a count of simulated actions. The peaks depend on p and m only, not on
the budget or the costs, so they are sized once per (p, m) (`sized`): a Pareto sweep or a
search per budget at p = 64 would otherwise size its 4,158 blocks again each time (1 to 2.6
CPU seconds). Compaction costs more than linear time in the actions, so above
`COMPACT_MAX_P` ranks, like the published blocks' compaction, the family is not built.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hpcpipe.schedules._build import COMPACT_MAX_P
from hpcpipe.schedules.blocks import compacted_v, repeated_peak
from hpcpipe.schedules.ir import Schedule
from hpcpipe.schedules.simulate import CostModel
from hpcpipe.schedules.vshape import building_block

__all__ = ["Member", "climbs", "members", "rank_rows", "sized"]


@dataclass(frozen=True)
class Member:
    """One block of the family: its climb per second-chunk stage (from the turn) and its
    peak in chunk activations."""

    climb: tuple[int, ...]
    chunks: int

    def describe(self) -> str:
        base = min(self.climb)
        steep = [c > base for c in self.climb]
        turn = steep.index(False)  # steeper stages next to the turn (a mix keeps one at base)
        end = steep[::-1].index(False)
        where = [
            f"{k} stage{'s' if k > 1 else ''} next to the {side}"
            for k, side in ((turn, "turn"), (end, "end"))
            if k
        ]
        return f"V block family: climb {base + 1} into {' and '.join(where)}, {base} elsewhere"


def climbs(p: int) -> Iterator[tuple[int, ...]]:
    """The mixed climbs: base 1 (V-Min to V-Half) and 2 (V-Half to ZB-V), k = 1 .. p-1 stages
    one slot steeper, next to the turn, then next to the end; then the two-sided mixes, some
    stages next to the turn and some next to the end (at least one stays at base)."""
    for base in (1, 2):
        for turn in (True, False):
            for k in range(1, p):
                yield tuple(base + 1 if (i < k if turn else i >= p - k) else base for i in range(p))
    for base in (1, 2):
        for at_turn in range(1, p - 1):
            for at_end in range(1, p - at_turn):
                yield tuple(base + 1 if i < at_turn or i >= p - at_end else base for i in range(p))


def rank_rows(off: np.ndarray, p: int) -> np.ndarray:
    """Block offsets per stage (F, B rows of `building_block`) as rows F0 F1 B1 B0 per rank,
    the form `blocks.compacted_v` and `blocks.repeated_peak` take."""
    last = 2 * p - 1
    return np.array([[off[0, r], off[0, last - r], off[1, last - r], off[1, r]] for r in range(p)])


@lru_cache(maxsize=8)  # p = 64, m = 256: 8.5 MB of blocks
def sized(p: int, m: int) -> tuple[tuple[Member, np.ndarray], ...]:
    """Every climb's block (read-only) and its peak over m microbatches, in `climbs` order."""
    out = []
    for climb in climbs(p):
        block = rank_rows(building_block(p, climb), p)
        chunks = repeated_peak(block, m)
        block.setflags(write=False)  # shared by every later call
        out.append((Member(climb, chunks), block))
    return tuple(out)


def members(
    p: int, m: int, costs: CostModel, budget: float | None, max_actions: int
) -> list[tuple[Member, Schedule]]:
    """The family's distinct schedules with the largest peak that fits `budget` (in the units
    of `costs.activation`; None: any), built while their actions add up to `max_actions`.

    Chunk activations are counted at the largest stage's: with uneven activations a block
    that would fit may be left out (the simulator's peak, in the deck's units, is what the
    search then checks)."""
    if p < 2 or p > COMPACT_MAX_P or max_actions < 6 * p * m:
        return []
    act = float(costs.stage_arrays(2 * p)["activation"].max())
    room = np.inf if budget is None or act <= 0 else budget / act + 1e-9
    blocks = [(member, block) for member, block in sized(p, m) if member.chunks <= room]
    if not blocks:
        return []
    top = max(member.chunks for member, _ in blocks)
    out: list[tuple[Member, Schedule]] = []
    seen: set[str] = set()
    actions_left = max_actions
    for member, block in blocks:
        if member.chunks != top:
            continue
        actions_left -= 6 * p * m
        if actions_left < 0:
            break
        sched = compacted_v("v-family", p, m, block)
        key = sched.fingerprint()  # few microbatches: many blocks compact alike
        if key not in seen:
            seen.add(key)
            out.append((member, sched))
    return out
