"""The validator: proves a schedule can run, for generated and hand-written schedules alike.

1. Structure (no timing needed): each action's stage lives on its rank; each (stage,
   microbatch) has exactly one F and either one B and one W or one BW; on a rank F comes before
   its B and B before its W; consecutive stages on the same rank keep the data-flow order.
2. Cross-rank order: an unlowered schedule is lowered (see `lower`), which fails with the
   dependency cycle if no order of messages could serve it.
3. Messages of the lowered schedule: every transfer between stages on different ranks has
   exactly one SEND on the producing rank after the producing action and one RECV on the
   consuming rank before the consuming action, and nothing else is sent.
4. Deadlock: the per-rank orders must complete under blocking point-to-point semantics, the
   strictest there is (a SEND returns only when the RECV is posted, and a RECV only when the
   SEND is): then no MPI implementation's buffering choices can hang it. The proof is either a
   global order of all messages that every rank follows (the lowering produces one, checked in
   one pass) or, failing that, a simulation of the blocking execution.
   The proof also covers the runtime's per-channel tags (`messages`): one tag carries every
   message into a stage in one direction, so each channel must be received in the order it is
   sent. Under blocking semantics two messages of one channel received in the other order
   deadlock (the sender waits in the first send, the receiver in the second receive), so any
   schedule that passes step 4 has it.

Errors are `ScheduleError`s that show the rank x step grid with the offending cells marked.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules._table import ComputeTable, compute_table, index_dtype, step_of
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.lower import lower_with_times, relocated
from hpcpipe.schedules.simulate import run_rounds

__all__ = ["validate"]


def validate(schedule: Schedule) -> Schedule:
    """Prove `schedule` runs; return the lowered schedule that was proved (run that one).

    Raises `ScheduleError` (with the grid) for the first problem found.
    """
    table = compute_table(schedule)
    if schedule.is_lowered:
        lowered, unit_end = schedule, None
    else:
        lowered, unit_end = lower_with_times(table)
        table = relocated(table, lowered)
    _check_messages(lowered, table, unit_end)
    return lowered


def _name(kind: int, stage: int, mb: int) -> str:
    return f"{stage}{Kind(kind).name}{mb}"


def _check_messages(sched: Schedule, table: ComputeTable, unit_end: np.ndarray | None) -> None:
    """Steps 3 and 4 on a lowered schedule (`table` positions refer to `sched`)."""
    S, m = sched.num_stages, sched.num_microbatches
    cpos = np.flatnonzero(sched.kinds >= Kind.SEND_F)
    ck = sched.kinds[cpos] - np.int8(Kind.SEND_F)  # 0 SEND_F, 1 RECV_F, 2 SEND_B, 3 RECV_B
    cs = sched.stages[cpos]
    by_kind_stage = np.bincount(ck.astype(np.int32) * S + cs, minlength=4 * S).reshape(4, S)
    for k, s, why in (
        (1, 0, "stage 0 receives no forward input"),
        (2, 0, "stage 0 sends no gradient"),
        (0, S - 1, "the last stage sends no forward output"),
        (3, S - 1, "the last stage receives no gradient"),
    ):
        if by_kind_stage[k, s]:
            j = int(np.flatnonzero((ck == k) & (cs == s))[0])
            at = int(cpos[j])
            raise ScheduleError(
                f"{_name(sched.kinds[at], s, sched.microbatches[at])}: {why}",
                sched,
                [step_of(sched, at)],
            )
    # A transfer is (direction, sending stage, microbatch); each has two slots, 0 for the
    # send and 1 for the receive: slot = ((direction * S + sender) * m + mb) * 2 + is_receive.
    it = index_dtype(4 * S * m)
    lut = np.array(
        [
            (d * S + shift) * 2 * m + recv
            for d, shift, recv in ((0, 0, 0), (0, -1, 1), (1, 0, 0), (1, 1, 1))
        ],
        dtype=it,
    )
    slot = cs.astype(it) * (2 * m)
    del cs
    slot += sched.microbatches[cpos] * 2
    slot += lut[ck]
    del ck
    n_tid = 2 * S * m
    rank_of = sched.rank_of_stage
    need_f = np.zeros(S, dtype=bool)
    need_f[:-1] = rank_of[:-1] != rank_of[1:]
    need_b = np.zeros(S, dtype=bool)
    need_b[1:] = rank_of[1:] != rank_of[:-1]
    need = np.repeat(np.concatenate([need_f, need_b]), 2 * m)  # per slot
    # Scatter messages into their slots; read back to find duplicates; empty needed slots are
    # missing messages, filled unneeded ones are messages nothing waits for.
    c_index = np.arange(cpos.size, dtype=index_dtype(cpos.size))
    at = np.full(2 * n_tid, -1, dtype=c_index.dtype)
    at[slot] = c_index
    bad_slot = (at >= 0) != need
    duplicate = at[slot] != c_index
    if duplicate.any():
        bad_slot[slot[duplicate]] = True
    if bad_slot.any():
        t = int(np.flatnonzero(bad_slot)[0]) >> 1
        _message_count_error(sched, table, t, slot >> 1, cpos)
    del need, bad_slot, duplicate, c_index

    # Rows of (stage, microbatch) tables: producers and consumers of every needed transfer.
    at4 = at.reshape(2, S, m, 2)
    f_at = table.f_at.reshape(S, m)
    b_at = table.b_at.reshape(S, m)
    f_rows, b_rows = np.flatnonzero(need_f), np.flatnonzero(need_b)
    for sends, recvs, prod, cons in (
        (at4[0, f_rows, :, 0], at4[0, f_rows, :, 1], f_at[f_rows], f_at[f_rows + 1]),
        (at4[1, b_rows, :, 0], at4[1, b_rows, :, 1], b_at[b_rows], b_at[b_rows - 1]),
    ):
        early = cpos[sends] < table.pos[prod]
        if early.any():
            j = np.argwhere(early)[0]
            at_j, before = int(cpos[sends[tuple(j)]]), int(table.pos[prod[tuple(j)]])
            raise ScheduleError(
                f"{_at_name(sched, at_j)} is sent before {_at_name(sched, before)} computes it",
                sched,
                [step_of(sched, at_j), step_of(sched, before)],
            )
        late = cpos[recvs] > table.pos[cons]
        if late.any():
            j = np.argwhere(late)[0]
            at_j, user = int(cpos[recvs[tuple(j)]]), int(table.pos[cons[tuple(j)]])
            raise ScheduleError(
                f"{_at_name(sched, at_j)} is received after {_at_name(sched, user)} needs it",
                sched,
                [step_of(sched, at_j), step_of(sched, user)],
            )
    if _ordered_by_unit_time(sched, table, cpos, slot, unit_end):
        return
    partner = at[slot ^ 1]  # the other end of each message
    del at, at4, slot
    _blocking_run(sched, cpos, partner)


def _ordered_by_unit_time(
    sched: Schedule,
    table: ComputeTable,
    cpos: np.ndarray,
    slot: np.ndarray,
    unit_end: np.ndarray | None,
) -> bool:
    """A certificate that blocking execution cannot deadlock, found without simulating it.

    Give each message the key (end of its producing action when every action takes one unit,
    producer's rank). If every rank meets its messages in increasing key order, running the
    messages in key order completes each in turn: when a message is next, both ends have
    finished everything before it (compute actions never block: their inputs were received
    earlier, as checked above). The lowering places messages this way, so generated
    schedules pass here; anything else falls back to simulating the blocking execution.
    """
    if cpos.size == 0:
        return True
    if unit_end is None:
        n = table.n
        _, unit_end = run_rounds(table, np.ones(n), np.zeros(n))
    S, m = sched.num_stages, sched.num_microbatches
    direction, rest = np.divmod(slot >> 1, S * m)
    prod = np.where(direction == 0, table.f_at[rest], table.b_at[rest])
    del direction, rest
    key = unit_end[prod].astype(np.int64) * sched.num_ranks + table.rank[prod]
    rising = key[1:] > key[:-1]
    coff = np.searchsorted(cpos, sched.offsets[1:-1])  # first message of each rank but rank 0
    coff = coff[(coff > 0) & (coff < cpos.size)]
    rising[coff - 1] = True  # a new rank starts its own sequence
    return bool(rising.all())


def _at_name(sched: Schedule, position: int) -> str:
    return _name(sched.kinds[position], sched.stages[position], sched.microbatches[position])


def _message_count_error(
    sched: Schedule,
    table: ComputeTable,
    t: int,
    tid: np.ndarray,
    cpos: np.ndarray,
) -> None:
    """Transfer `t` has the wrong number of sends or receives: say which, mark where."""
    S, m = sched.num_stages, sched.num_microbatches
    direction, rest = divmod(t, S * m)
    s, i = divmod(rest, m)
    fwd = direction == 0
    d = s + 1 if fwd else s - 1
    send_name = f"{s}{'SEND_F' if fwd else 'SEND_B'}{i}"
    recv_name = f"{d}{'RECV_F' if fwd else 'RECV_B'}{i}"
    where = [step_of(sched, int(x)) for x in cpos[tid == t]]
    rank_of = sched.rank_of_stage
    src_rank, dst_rank = int(rank_of[s]), int(rank_of[d])
    mine = sched.kinds[cpos[tid == t]]
    sends = int(np.count_nonzero((mine == Kind.SEND_F) | (mine == Kind.SEND_B)))
    recvs = mine.size - sends
    if src_rank == dst_rank:
        problem = (
            f"{send_name}/{recv_name}: stages {s} and {d} are both on rank {src_rank}, "
            "which hands over in memory without a message"
        )
    elif (sends, recvs) == (1, 0):
        problem = f"{send_name} on rank {src_rank} has no matching {recv_name} on rank {dst_rank}"
    elif (sends, recvs) == (0, 1):
        problem = f"{recv_name} on rank {dst_rank} has no matching {send_name} on rank {src_rank}"
    elif (sends, recvs) == (0, 0):
        problem = (
            f"stage {s} -> {d} microbatch {i} crosses from rank {src_rank} to {dst_rank} "
            f"but has no {send_name} / {recv_name}"
        )
        user = table.f_at[d * m + i] if fwd else table.b_at[d * m + i]
        where.append(step_of(sched, int(table.pos[user])))
    else:
        problem = f"{send_name} appears {sends} time(s) and {recv_name} {recvs} time(s)"
    raise ScheduleError(problem, sched, where)


def _blocking_run(sched: Schedule, cpos: np.ndarray, partner: np.ndarray) -> None:
    """Walk every rank's messages with rendezvous semantics; raise on deadlock.

    Compute actions never block here (their inputs were checked to be received earlier), so
    only the sequence of messages of each rank matters; each round completes every send/receive
    pair whose two ends are both at the head of their rank's sequence.
    """
    p = sched.num_ranks
    coff = np.searchsorted(cpos, sched.offsets)
    holder = np.repeat(np.arange(p), np.diff(coff))
    ptr = coff[:-1].copy()
    stop = coff[1:]
    act = np.flatnonzero(ptr < stop)
    while act.size:
        j = ptr[act]
        q = partner[j]
        ok = ptr[holder[q]] == q
        if not ok.any():
            lines, marks = [], []
            for jj, qq in list(zip(j.tolist(), q.tolist(), strict=True))[:6]:
                r, step = step_of(sched, int(cpos[jj]))
                pr, pstep = step_of(sched, int(cpos[qq]))
                at = int(cpos[jj])
                name = _name(sched.kinds[at], sched.stages[at], sched.microbatches[at])
                other = int(cpos[qq])
                oname = _name(sched.kinds[other], sched.stages[other], sched.microbatches[other])
                lines.append(
                    f"rank {r} blocks at step {step} in {name} until rank {pr} reaches "
                    f"{oname} (its step {pstep})"
                )
                marks.append((r, step))
            raise ScheduleError(
                "deadlock under blocking send/receive: " + "; ".join(lines), sched, marks
            )
        ptr[act[ok]] += 1
        act = act[ptr[act] < stop[act]]
