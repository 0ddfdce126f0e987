"""The compiled message check behind `validate._check_messages` (imported only with numba)."""

from __future__ import annotations

import numpy as np
from numba import njit

from hpcpipe.schedules.ir import Kind

_SEND_F = int(Kind.SEND_F)


@njit(cache=True)
def adjacent(kinds, stages, mbs, pos, f_at, b_at, need_f, need_b, m, at):  # pragma: no cover
    """Whether every message is right (steps 3 and 4) and each SEND sits right after its
    producer, each RECV right before its consumer. Two passes: scatter every message into its
    slot of `at` (all -1; slot = ((direction * S + sender) * m + mb) * 2 + is_receive), then
    walk every needed channel in microbatch order. False at the first doubt, without saying
    what: the NumPy check then finds and reports it.
    """
    S = need_f.size
    filled = 0
    for i in range(kinds.size):
        c = kinds[i] - _SEND_F  # 0 SEND_F, 1 RECV_F, 2 SEND_B, 3 RECV_B
        if c < 0:
            continue
        s = stages[i]
        if ((c == 1 or c == 2) and s == 0) or ((c == 0 or c == 3) and s == S - 1):
            return False  # a message off either end of the pipeline
        direction, sender = c >> 1, s
        if c == 1:
            sender = s - 1
        elif c == 3:
            sender = s + 1
        slot = ((direction * S + sender) * m + mbs[i]) * 2 + (c & 1)
        if at[slot] >= 0:
            return False  # a duplicate
        at[slot] = i
        filled += 1
    beside = True
    needed = 0
    for direction in range(2):
        need = need_f if direction == 0 else need_b
        done = f_at if direction == 0 else b_at
        step = 1 if direction == 0 else -1
        for s in range(S):
            if not need[s]:
                continue
            needed += 2 * m
            in_order = True
            base = (direction * S + s) * m
            for i in range(m):
                snd, rcv = at[(base + i) * 2], at[(base + i) * 2 + 1]
                if snd < 0 or rcv < 0:
                    return False  # a missing message
                prod, cons = pos[done[s * m + i]], pos[done[(s + step) * m + i]]
                if snd < prod or rcv > cons:
                    return False  # sent before it is computed, received after it is used
                if snd != prod + 1 or rcv != cons - 1:
                    beside = False
                if i and (snd <= at[(base + i - 1) * 2] or rcv <= at[(base + i - 1) * 2 + 1]):
                    in_order = False
            if not in_order:
                row = at[base * 2 : (base + m) * 2].reshape(m, 2)
                rpos = row[np.argsort(row[:, 0]), 1]
                if np.any(rpos[1:] < rpos[:-1]):
                    return False  # received out of the order sent
    if filled != needed:
        return False  # a message nothing waits for
    return beside
