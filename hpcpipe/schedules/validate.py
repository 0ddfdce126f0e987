"""The validator: proves a schedule can run, for generated and hand-written schedules alike.

1. Structure (no timing needed): each action's stage lives on its rank; each (stage,
   microbatch) has exactly one F and either one B and one W or one BW; on a rank F comes before
   its B and B before its W; consecutive stages on the same rank keep the data-flow order.
2. Cross-rank order: an unlowered schedule is lowered (see `lower`), which fails with the
   dependency cycle if no order of messages could serve it.
3. Messages of the lowered schedule: every transfer between stages on different ranks has
   exactly one SEND on the producing rank after the producing action and one RECV on the
   consuming rank before the consuming action, and nothing else is sent.
4. Channel order: the runtime sends every message into one stage in one direction on one tag,
   and MPI matches one sender's messages of a tag in the order they were sent, so each such
   channel must be received in the order it is sent.
5. Deadlock, under the runtime's semantics: a SEND never blocks (the message is handed to MPI
   and completed at the end of the step), receives are posted ahead, and a RECV blocks until
   its SEND has been reached. The proof is a certificate found in one pass: time the compute
   actions with every action taking one unit, give each SEND the end of its producer and each
   RECV the start of its consumer; if every rank meets its actions in non-decreasing time, with
   a SEND before a RECV of the same instant, running all actions in time order completes each
   RECV after its SEND. The lowering produces such orders; anything else falls back to
   simulating the execution.
6. With `sends="blocking"` (the runtime's `[train] sends = "blocking"`), deadlock under
   synchronous sends: a SEND completes only once its receiver has posted the receive, which
   the runtime does `lookahead` actions before the RECV (`plan_messages`), and a RECV once its
   SEND has started. Proved by running every rank's messages round by round with those rules.

Errors are `ScheduleError`s that show the rank x step grid with the offending cells marked.
"""

from __future__ import annotations

import numpy as np

import hpcpipe.schedules._compiled as _compiled
from hpcpipe.schedules._table import ComputeTable, compute_table, index_dtype, step_of
from hpcpipe.schedules.errors import ScheduleError
from hpcpipe.schedules.ir import Kind, Schedule
from hpcpipe.schedules.lower import lower_with_times
from hpcpipe.schedules.simulate import run_rounds

__all__ = ["SEND_MODES", "validate"]

SEND_MODES = ("nonblocking", "blocking")


def validate(schedule: Schedule, *, sends: str = "nonblocking", lookahead: int = 8) -> Schedule:
    """Prove `schedule` runs; return the lowered schedule that was proved (run that one).

    `sends`: the runtime's send semantics, "nonblocking" (a SEND never waits) or "blocking"
    (synchronous: a SEND waits until its receiver has posted the receive, `lookahead` actions
    before the RECV). Raises `ScheduleError` (with the grid) for the first problem found.
    """
    if sends not in SEND_MODES:
        raise ValueError(f"sends must be one of {SEND_MODES}, got {sends!r}")
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1 action, got {lookahead}")
    table = compute_table(schedule)
    if schedule.is_lowered:
        lowered, unit_end = schedule, None
    else:
        table, unit_end = lower_with_times(table)
        lowered = table.schedule
    partner = _check_messages(lowered, table, unit_end, sends == "blocking")
    if partner is not None:
        try:
            _blocking_run(lowered, *partner, lookahead)
        except ScheduleError as exc:
            enough = _least_lookahead(lowered, *partner, lookahead)
            raise ScheduleError(
                f"{exc.problem}; it runs with a lookahead of {enough} action(s)",
                lowered,
                exc.marks,
            ) from None
    return lowered


def _name(kind: int, stage: int, mb: int) -> str:
    return f"{stage}{Kind(kind).name}{mb}"


def _check_messages(
    sched: Schedule, table: ComputeTable, unit_end: np.ndarray | None, partners: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps 3 to 5 on a lowered schedule (`table` positions refer to `sched`); with
    `partners`, return (positions of the messages, index of each one's other end)."""
    if unit_end is not None and not partners and _compiled_adjacent(sched, table):
        return None  # our own lowering, every message right where the lowering puts it
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
    need_f, need_b = _crossings(sched)
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
    adjacent = True  # every SEND right after its producer, every RECV right before its user
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
        _check_channel_order(sched, cpos, sends, recvs)
        adjacent = adjacent and bool(
            np.all(cpos[sends] == table.pos[prod] + 1)
            and np.all(cpos[recvs] == table.pos[cons] - 1)
        )
    # our own lowering: the certificate holds by its construction (`_ordered_in_time`)
    proven = (unit_end is not None and adjacent) or _ordered_in_time(
        sched, table, cpos, slot, unit_end
    )
    if proven and not partners:
        return None
    partner = at[slot ^ 1]  # the other end of each message
    del at, at4, slot
    if not proven:
        _nonblocking_run(sched, cpos, partner)
    return (cpos, partner) if partners else None


def _crossings(sched: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Per stage: whether its forward output, and its gradient, go to another rank."""
    rank_of = sched.rank_of_stage
    need_f = np.zeros(sched.num_stages, dtype=bool)
    need_f[:-1] = rank_of[:-1] != rank_of[1:]
    need_b = np.zeros(sched.num_stages, dtype=bool)
    need_b[1:] = rank_of[1:] != rank_of[:-1]
    return need_f, need_b


def _compiled_adjacent(sched: Schedule, table: ComputeTable) -> bool:
    """Steps 3 and 4 for a large schedule in one compiled pass (`_messages_numba.adjacent`),
    true when every message is right and next to its action (then the certificate of step 5
    holds, see `_ordered_in_time`); false, also without numba or for a small schedule, sends
    it through the NumPy check, which reports any problem."""
    if not _compiled.wanted(table.n):
        return False
    adjacent = _compiled.kernel("_messages_numba", "adjacent")
    if adjacent is None:
        return False
    S, m = sched.num_stages, sched.num_microbatches
    need_f, need_b = _crossings(sched)
    at = np.full(4 * S * m, -1, dtype=index_dtype(sched.num_actions))
    return bool(
        adjacent(
            sched.kinds,
            sched.stages,
            sched.microbatches,
            table.pos,
            table.f_at,
            table.b_at,
            need_f,
            need_b,
            m,
            at,
        )
    )


def _check_channel_order(
    sched: Schedule, cpos: np.ndarray, sends: np.ndarray, recvs: np.ndarray
) -> None:
    """Step 4: per channel (a row: one sending stage, one direction), the microbatches must be
    received in the order they are sent. Usually both go in microbatch order (one pass)."""
    if not sends.size:
        return
    spos, rpos = cpos[sends], cpos[recvs]
    if bool(np.all(np.diff(spos, axis=1) > 0)) and bool(np.all(np.diff(rpos, axis=1) > 0)):
        return
    order = np.argsort(spos, axis=1, kind="stable")
    in_send_order = np.take_along_axis(rpos, order, axis=1)
    bad = np.argwhere(np.diff(in_send_order, axis=1) < 0)
    if not bad.size:
        return
    row, i = (int(x) for x in bad[0])
    first, second = int(in_send_order[row, i]), int(in_send_order[row, i + 1])
    raise ScheduleError(
        f"{_at_name(sched, second)} is received before {_at_name(sched, first)}, but their "
        "messages are sent the other way round: one tag carries every message into a stage in "
        "one direction, and MPI delivers them in the order they were sent",
        sched,
        [step_of(sched, first), step_of(sched, second)],
    )


def _ordered_in_time(
    sched: Schedule,
    table: ComputeTable,
    cpos: np.ndarray,
    slot: np.ndarray,
    unit_end: np.ndarray | None,
) -> bool:
    """The certificate of step 5, without simulating: with every compute action one unit long,
    a compute action gets key 4 x its end, a SEND 4 x its producer's end + 2, a RECV 4 x its
    consumer's end - 1 (just before the consumer starts). If keys never fall along any rank's
    actions, running all actions in key order never meets a RECV whose SEND has not run (its
    key is smaller, because the consumer starts after the producer ends).

    A lowering that places every SEND right after its producer and every RECV right before its
    user has this property by construction: the action before a RECV ends no later than its
    user starts, the action after a SEND starts no earlier than its producer ends, and compute
    keys rise along a rank (one action at a time); `_check_messages` checks that placement and
    skips the keys when the unit-time run is the lowering's own (it also proved no cycle)."""
    if cpos.size == 0:
        return True
    if unit_end is None:
        _, unit_end = run_rounds(table, None, None)
    S, m = sched.num_stages, sched.num_microbatches
    horizon = 4 * (int(np.max(unit_end)) + 1) if unit_end.size else 4
    kd = np.int32 if horizon < np.iinfo(np.int32).max else np.int64
    keys = np.empty(sched.num_actions, dtype=kd)
    keys[table.pos] = 4 * unit_end.astype(kd)
    tid = slot >> 1
    direction, rest = np.divmod(tid, S * m)
    is_recv = (slot & 1).astype(bool)
    forward = direction == 0
    prod = np.where(forward, table.f_at[rest], table.b_at[rest])
    cons = np.where(
        forward,
        table.f_at[np.minimum(rest + m, S * m - 1)],
        table.b_at[np.maximum(rest - m, 0)],
    )
    comm_key = np.where(
        is_recv, 4 * unit_end[cons].astype(kd) - 1, 4 * unit_end[prod].astype(kd) + 2
    )
    keys[cpos] = comm_key
    falls = keys[1:] < keys[:-1]
    starts = sched.offsets[1:-1]
    starts = starts[(starts > 0) & (starts < keys.size)]
    falls[starts - 1] = False  # a new rank starts its own sequence
    return not bool(falls.any())


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


def _nonblocking_run(sched: Schedule, cpos: np.ndarray, partner: np.ndarray) -> None:
    """Walk every rank's messages with the runtime's semantics; raise on deadlock.

    A SEND never blocks; a RECV completes once the rank holding its SEND has reached it.
    Compute actions never block here (their inputs were checked to be received earlier), so only
    each rank's sequence of messages matters; each round moves every rank past its SENDs and,
    where its SEND has been reached, past the RECV it is waiting at.
    """
    p = sched.num_ranks
    coff = np.searchsorted(cpos, sched.offsets)
    holder = np.repeat(np.arange(p), np.diff(coff))
    kinds = sched.kinds[cpos]
    recv_at = np.flatnonzero((kinds == Kind.RECV_F) | (kinds == Kind.RECV_B))
    recv_at = np.append(recv_at, cpos.size)  # sentinel
    ptr = coff[:-1].copy()
    stop = coff[1:]
    act = np.flatnonzero(ptr < stop)
    while act.size:
        nxt = recv_at[np.searchsorted(recv_at, ptr[act])]  # the next RECV: SENDs never block
        ptr[act] = np.minimum(nxt, stop[act])
        act = act[ptr[act] < stop[act]]
        if not act.size:
            return
        j = ptr[act]
        q = partner[j]
        ok = ptr[holder[q]] > q
        if not ok.any():
            lines, marks = [], []
            for jj, qq in list(zip(j.tolist(), q.tolist(), strict=True))[:6]:
                r, step = step_of(sched, int(cpos[jj]))
                pr, pstep = step_of(sched, int(cpos[qq]))
                lines.append(
                    f"rank {r} waits at step {step} in {_at_name(sched, int(cpos[jj]))} for "
                    f"{_at_name(sched, int(cpos[qq]))}, which rank {pr} has not reached (its "
                    f"step {pstep})"
                )
                marks.append((r, step))
            raise ScheduleError(
                "deadlock (sends never block, a receive waits for its send): " + "; ".join(lines),
                sched,
                marks,
            )
        ptr[act[ok]] += 1


def _least_lookahead(sched: Schedule, cpos: np.ndarray, partner: np.ndarray, failed: int) -> int:
    """The smallest lookahead above `failed` with which blocking sends cannot deadlock. It
    exists: with one as long as the longest rank every receive is posted at the start, so no
    SEND ever waits, and the nonblocking proof (step 5) already holds."""

    def runs(lookahead: int) -> bool:
        try:
            _blocking_run(sched, cpos, partner, lookahead)
        except ScheduleError:
            return False
        return True

    top = int(np.diff(sched.offsets).max(initial=1))
    lo, hi = failed, failed
    while hi < top:  # doubling, then bisection: lo fails, hi runs
        hi = min(2 * hi, top)
        if runs(hi):
            break
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if runs(mid) else (mid, hi)
    return hi


def _blocking_run(sched: Schedule, cpos: np.ndarray, partner: np.ndarray, lookahead: int) -> None:
    """Step 6: every rank's messages with synchronous sends; raise on deadlock.

    A rank runs its compute actions freely and stops at each message until it can complete:
    a SEND once the receiving rank has reached the position where it posts that receive
    (`lookahead` actions before the RECV), a RECV once the sending rank has reached the SEND.
    """
    p = sched.num_ranks
    offsets = sched.offsets
    coff = np.searchsorted(cpos, offsets)
    holder = np.repeat(np.arange(p), np.diff(coff))
    kinds = sched.kinds[cpos]
    is_recv = (kinds == Kind.RECV_F) | (kinds == Kind.RECV_B)
    start = offsets[holder]
    post = np.where(is_recv, start + np.maximum(0, cpos - start - lookahead + 1), -1)
    need = np.where(is_recv, cpos[partner], post[partner])  # where the other rank must be
    who = holder[partner]
    reached = offsets[:-1].copy()  # every action before this one has run, on each rank
    nxt = coff[:-1].copy()
    stop = coff[1:]
    while True:
        act = np.flatnonzero(nxt < stop)
        if not act.size:
            return
        j = nxt[act]
        reached[act] = cpos[j]
        ok = reached[who[j]] >= need[j]
        if ok.any():
            done = act[ok]
            reached[done] = cpos[j[ok]] + 1
            nxt[done] += 1
            continue
        lines, marks = [], []
        for jj in j[:6].tolist():
            r, step = step_of(sched, int(cpos[jj]))
            q = int(who[jj])
            _, qstep = step_of(sched, int(min(reached[q], offsets[q + 1] - 1)))
            _, wanted = step_of(sched, int(need[jj]))
            what = (
                f"until rank {q} reaches its SEND at step {wanted}"
                if is_recv[jj]
                else f"(synchronous) until rank {q} posts the receive, {lookahead} action(s) "
                f"before its RECV: at step {wanted}"
            )
            lines.append(
                f"rank {r} waits at step {step} in {_at_name(sched, int(cpos[jj]))} {what}; "
                f"rank {q} is at step {qstep}"
            )
            marks.append((r, step))
        raise ScheduleError(
            "deadlock with blocking sends (a SEND waits for its receive to be posted): "
            + "; ".join(lines)
            + "; reorder the sends, raise train.recv_lookahead, or use nonblocking sends",
            sched,
            marks,
        )
