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
    """`lower_table`, also returning each compute action's end in the unit-time run that
    ordered the actions (the validator's proof of deadlock freedom reuses it).

    The run executes one action per rank and round; an action whose input comes from another
    rank is preceded by its RECV, one whose result goes to another rank followed by its SEND.
    """
    sched = table.schedule
    n, p = table.n, sched.num_ranks
    out_rank = _outgoing(table)
    sends = out_rank >= 0
    recvs = table.cross
    per_rank = (
        np.diff(table.offsets)
        + np.bincount(table.rank[sends], minlength=p)
        + np.bincount(table.rank[recvs], minlength=p)
    )
    offsets = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(per_rank, out=offsets[1:])
    total = int(offsets[-1])
    kinds = np.empty(total, dtype=np.int8)
    stages = np.empty(total, dtype=np.int32)
    mbs = np.empty(total, dtype=np.int32)
    forward = table.kind == Kind.F
    send_kind = np.where(forward, Kind.SEND_F, Kind.SEND_B).astype(np.int8)
    recv_kind = np.where(forward, Kind.RECV_F, Kind.RECV_B).astype(np.int8)  # of the consumer
    del forward

    never = np.iinfo(np.int64).max
    done = np.full(n + 1, never, dtype=np.int64)  # unit-time end of each action
    done[n] = 0
    dep = table.dep
    cursor = offsets[:-1].copy()  # next free slot of each rank in the lowered arrays
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
            act_ok, a = act[ok], a[ok]
        else:
            act_ok = act
        done[a] = now
        ptr[act_ok] += 1
        slot = cursor[act_ok]
        r = recvs[a]
        if r.any():  # the RECV right before the action that uses the message
            at, got = slot[r], a[r]
            kinds[at] = recv_kind[got]
            stages[at] = table.stage[got]
            mbs[at] = table.mb[got]
            slot = slot + r
        kinds[slot] = table.kind[a]
        stages[slot] = table.stage[a]
        mbs[slot] = table.mb[a]
        s_ = sends[a]
        if s_.any():  # the SEND right after the action that produces the message
            at, prod = slot[s_] + 1, a[s_]
            kinds[at] = send_kind[prod]
            stages[at] = table.stage[prod]
            mbs[at] = table.mb[prod]
        cursor[act_ok] = slot + 1 + s_
        act = act[ptr[act] < stop[act]]
    for arr in (kinds, stages, mbs):
        arr.flags.writeable = False
    return sched.replace_actions(offsets, kinds, stages, mbs), done[:n]


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
