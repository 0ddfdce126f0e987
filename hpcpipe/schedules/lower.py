"""Lowering: add explicit SEND/RECV actions where consecutive stages sit on different ranks.

The runtime executes lowered schedules, so the order of messages is decided here, once, and
proved by the validator, instead of being guessed at run time. Stages on the same rank (the V
turnaround) hand over in memory and get no message.

Placement rule. A SEND goes right after the action that produces the message, a RECV right
before the action that uses it: the runtime posts every receive ahead of time and never waits
for a send to complete, so a rank blocks only where it needs the data, and the lowered order
runs in exactly the time the simulator predicts (which lets a result be used as soon as it
exists). SENDs of one action go in the order of their producers. The validator proves the
order deadlock-free under those semantics (`validate`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hpcpipe.schedules._table import ComputeTable, compute_table, cycle_error
from hpcpipe.schedules.ir import Kind, Schedule

__all__ = ["lower", "lower_table", "lower_with_times", "relocated", "strip_comm"]


def _outgoing(table: ComputeTable) -> np.ndarray:
    """Rank each compute action's result must be sent to, or -1 (none, or same rank)."""
    sched = table.schedule
    rank_of = sched.rank_of_stage
    last = sched.num_stages - 1
    out = np.full(table.n, -1, dtype=np.int64)
    is_f = (table.kind == Kind.F) & (table.stage < last)
    out[is_f] = rank_of[table.stage[is_f] + 1]
    is_b = ((table.kind == Kind.B) | (table.kind == Kind.BW)) & (table.stage > 0)
    out[is_b] = rank_of[table.stage[is_b] - 1]
    out[out == table.rank] = -1
    return out


def lower_table(table: ComputeTable) -> Schedule:
    """Lower the (already structure-checked) schedule behind `table`; raises `ScheduleError`
    if the compute order has a dependency cycle."""
    return lower_with_times(table)[0]


def lower_with_times(table: ComputeTable) -> tuple[Schedule, np.ndarray]:
    """`lower_table`, also returning each compute action's end in a unit-time run of the
    compute order (the validator's proof of deadlock freedom reuses it; the run also finds a
    dependency cycle).

    Every rank keeps its compute order; an action whose input comes from another rank gets
    its RECV right before it, one whose result goes to another rank its SEND right after it.
    Those positions follow from the order alone, so they are computed at once for every
    action; only the unit-time run goes round by round.
    """
    sched = table.schedule
    n, p = table.n, sched.num_ranks
    out_rank = _outgoing(table)
    sends = out_rank >= 0
    del out_rank
    recvs = table.cross
    # lowered position of each compute action: its index within its rank, plus the RECVs up
    # to and including it and the SENDs before it on that rank
    extra = recvs.astype(np.int64)
    extra += sends
    np.cumsum(extra, out=extra)
    starts = table.offsets[:-1]
    before = np.concatenate(([0], extra))[starts]  # RECVs + SENDs of the earlier ranks
    extra -= np.repeat(before, np.diff(table.offsets))
    extra -= sends  # a SEND comes after its own action
    slot = np.arange(n, dtype=np.int64)
    slot += extra  # global compute index + own rank's comm before = lowered position
    del extra
    slot += np.repeat(before, np.diff(table.offsets))  # earlier ranks' comm actions
    total = n + int(np.count_nonzero(sends)) + int(np.count_nonzero(recvs))
    kinds = np.empty(total, dtype=np.int8)
    stages = np.empty(total, dtype=np.int32)
    mbs = np.empty(total, dtype=np.int32)
    kinds[slot] = table.kind
    stages[slot] = table.stage
    mbs[slot] = table.mb
    forward = table.kind == Kind.F
    at = slot[recvs] - 1  # RECV_F into an F, RECV_B into a B/BW: named by the consumer
    kinds[at] = np.where(forward[recvs], Kind.RECV_F, Kind.RECV_B)
    stages[at] = table.stage[recvs]
    mbs[at] = table.mb[recvs]
    at = slot[sends] + 1
    kinds[at] = np.where(forward[sends], Kind.SEND_F, Kind.SEND_B)
    stages[at] = table.stage[sends]
    mbs[at] = table.mb[sends]
    del slot, at, forward
    counts = np.diff(table.offsets)
    counts += np.bincount(table.rank[sends], minlength=p)
    counts += np.bincount(table.rank[recvs], minlength=p)
    offsets = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    for arr in (kinds, stages, mbs):
        arr.flags.writeable = False
    return sched.replace_actions(offsets, kinds, stages, mbs), _unit_time_run(table)


def _unit_time_run(table: ComputeTable) -> np.ndarray:
    """End of each compute action when each takes one unit and a rank runs its next action
    as soon as its input exists (one action per rank and round); raises on a cycle."""
    n = table.n
    never = np.iinfo(np.int64).max
    done = np.full(n + 1, never, dtype=np.int64)
    done[n] = 0
    dep = table.dep
    ptr = table.offsets[:-1].copy()
    stop = table.offsets[1:]
    act = np.flatnonzero(ptr < stop)
    now = 0
    while act.size:
        now += 1
        a = ptr[act]
        ok = done[dep[a]] < now
        if not ok.all():
            if not ok.any():
                raise cycle_error(table, a)
            act, a = act[ok], a[ok]
        done[a] = now
        ptr[act] += 1
        act = np.flatnonzero(ptr < stop)
    return done[:n]


def lower(schedule: Schedule) -> Schedule:
    """The schedule with SEND/RECV actions inserted (unchanged if it already has them)."""
    if schedule.is_lowered:
        return schedule
    return lower_table(compute_table(schedule))


def strip_comm(schedule: Schedule) -> Schedule:
    """Only the compute actions (F, B, W, BW), in the same order."""
    keep = schedule.kinds < Kind.SEND_F
    if keep.all():
        return schedule
    p = schedule.num_ranks
    ranks = np.repeat(np.arange(p), np.diff(schedule.offsets))
    counts = np.bincount(ranks[keep], minlength=p)
    offsets = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return schedule.replace_actions(
        offsets, schedule.kinds[keep], schedule.stages[keep], schedule.microbatches[keep]
    )


def relocated(table: ComputeTable, lowered: Schedule) -> ComputeTable:
    """The same compute table with positions in `lowered` (lowering keeps compute order)."""
    pos = np.flatnonzero(lowered.kinds < Kind.SEND_F)
    return dataclasses.replace(table, schedule=lowered, pos=pos)
