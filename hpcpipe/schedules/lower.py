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
from collections.abc import Callable

import numpy as np

import hpcpipe.schedules._compiled as _compiled
from hpcpipe.schedules._table import ComputeTable, compute_table
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.simulate import run_rounds

__all__ = ["lower", "lower_table", "lower_with_times", "strip_comm"]


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
    return lower_with_times(table)[0].schedule


def lower_with_times(table: ComputeTable) -> tuple[ComputeTable, np.ndarray]:
    """`lower_table` as the same compute table with positions in the lowered schedule (its
    `schedule`; lowering keeps the compute order), and each compute action's end in a
    unit-time run of the compute order (the validator's proof of deadlock freedom reuses it;
    the run also finds a dependency cycle).

    Every rank keeps its compute order; an action whose input comes from another rank gets
    its RECV right before it, one whose result goes to another rank its SEND right after it.
    An overlapped pair is one step: the RECVs of both halves go before it, the SENDs of both
    after it, so its halves stay adjacent. Those positions follow from the order alone, so
    they are computed at once for every action, or for a large schedule written in one
    compiled pass (`_lower_numba`: a third of the NumPy path's time, which scatters the
    arrays in several passes); then the unit-time run.
    """
    place = _compiled.kernel("_lower_numba", "place") if _compiled.wanted(table.n) else None
    lowered, pos = _place(table) if place is None else _place_compiled(table, place)
    return dataclasses.replace(table, schedule=lowered, pos=pos), _unit_time_run(table)


def _place(table: ComputeTable) -> tuple[Schedule, np.ndarray]:
    """The placement, vectorised: every action's lowered position at once. Returns the
    lowered schedule and the position of each compute action in it."""
    sched = table.schedule
    n, p = table.n, sched.num_ranks
    sends = _outgoing(table) >= 0
    recvs = table.cross
    n_send_total, n_recv_total = int(np.count_nonzero(sends)), int(np.count_nonzero(recvs))
    total = n + n_send_total + n_recv_total
    it = np.int32 if total < 2**31 - 1 else np.int64  # positions; half the memory traffic
    # RECVs before and SENDs after each step: a pair's move to its first and last half
    n_recv = recvs.astype(it)
    n_send = sends.astype(it)
    pf = np.searchsorted(table.pos, sched.pairs) if sched.pairs.size else None
    if pf is not None:
        pb = pf + 1
        n_recv[pf] += n_recv[pb]
        n_recv[pb] = 0
        n_send[pb] += n_send[pf]
        n_send[pf] = 0
    # lowered position of each compute action: its compute index plus every comm action
    # before it (ranks follow each other, so the earlier ranks' are in the running sum)
    slot = n_recv
    slot += n_send
    np.cumsum(slot, out=slot)
    slot -= n_send
    del n_send
    slot += np.arange(n, dtype=it)
    kinds = np.empty(total, dtype=np.int8)
    stages = np.empty(total, dtype=np.int32)
    mbs = np.empty(total, dtype=np.int32)
    kinds[slot] = table.kind
    stages[slot] = table.stage
    mbs[slot] = table.mb
    for mask, before in ((recvs, True), (sends, False)):
        idx = np.flatnonzero(mask)
        at = slot[idx] + (-1 if before else 1)  # RECV right before its step, SEND after
        if pf is not None:
            _pair_slots(at, idx, pf, slot, recvs if before else sends, before)
        fwd = table.kind[idx] == Kind.F  # RECV_F into an F, RECV_B into a B/BW: the consumer's
        codes = (Kind.RECV_F, Kind.RECV_B) if before else (Kind.SEND_F, Kind.SEND_B)
        kinds[at] = np.where(fwd, np.int8(codes[0]), np.int8(codes[1]))
        stages[at] = table.stage[idx]
        mbs[at] = table.mb[idx]
    counts = np.diff(table.offsets)
    counts += np.bincount(table.rank[sends], minlength=p)
    counts += np.bincount(table.rank[recvs], minlength=p)
    offsets = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    for arr in (kinds, stages, mbs):
        arr.flags.writeable = False
    pairs = slot[pf].astype(np.int64) if pf is not None else None
    return sched.replace_actions(offsets, kinds, stages, mbs, pairs), slot.astype(np.int64)


def _place_compiled(
    table: ComputeTable, place: Callable[..., tuple]
) -> tuple[Schedule, np.ndarray]:
    """The placement in one compiled pass (`_lower_numba.place`); the same arrays as `_place`."""
    sched = table.schedule
    pair_first = np.zeros(table.n, dtype=bool)
    pf = np.searchsorted(table.pos, sched.pairs)
    pair_first[pf] = True
    kinds, stages, mbs, offsets, pairs, pos = place(
        table.kind,
        table.stage,
        table.mb,
        table.rank,
        table.cross,
        np.ascontiguousarray(sched.rank_of_stage, dtype=np.int64),
        np.ascontiguousarray(table.offsets, dtype=np.int64),
        pair_first,
        pf.size,
    )
    for arr in (kinds, stages, mbs):
        arr.flags.writeable = False
    return sched.replace_actions(offsets, kinds, stages, mbs, pairs), pos


def _pair_slots(
    at: np.ndarray, idx: np.ndarray, pf: np.ndarray, slot: np.ndarray, has: np.ndarray, recv: bool
) -> None:
    """Move the messages of pairs around the pair: both RECVs before the F half (the F
    half's first), both SENDs after the B half (the F half's first)."""
    pb = pf + 1

    def where(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = np.searchsorted(idx, c)
        hit = k < idx.size
        hit[hit] = idx[k[hit]] == c[hit]
        return k[hit], hit

    if recv:
        k, hit = where(pf)  # the F half's RECV goes before the B half's
        at[k] -= has[pb][hit]
        k, hit = where(pb)
        at[k] = slot[pf][hit] - 1
    else:
        k, hit = where(pf)
        at[k] = slot[pb][hit] + 1
        k, hit = where(pb)  # after the F half's SEND
        at[k] = slot[pb][hit] + 1 + has[pf][hit]


def _unit_time_run(table: ComputeTable) -> np.ndarray:
    """End of each compute action when each takes one unit and a rank runs its next action
    as soon as its inputs exist (a pair's F half waits for both halves' inputs), as integer
    rounds; raises on a cycle."""
    _, end = run_rounds(table, None, None)
    return end.astype(np.int64)


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
    pairs = np.searchsorted(np.flatnonzero(keep), schedule.pairs)
    return schedule.replace_actions(
        offsets, schedule.kinds[keep], schedule.stages[keep], schedule.microbatches[keep], pairs
    )
