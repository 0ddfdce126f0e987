"""Pair every send event with its receive, the way MPI matched them.

A message is identified by (step, source rank, destination rank, channel, receiving stage,
microbatch): SEND_F of stage s pairs with RECV_F of stage s+1, SEND_B of stage s with RECV_B of
stage s-1 (the schedule's convention), and generic SEND/RECV pairs share their (stage,
microbatch) tag. Repeats of one identity pair in time order, as MPI's non-overtaking rule does.
Vectorised: a trace with millions of messages is matched in a few numpy passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hpcpipe.io.trace import EventKind, Trace

__all__ = ["Messages", "match_messages"]

K = EventKind
# kind -> (channel, stage shift to the receiving stage); sends first, then receives
_SEND = {K.SEND_F: (0, 1), K.SEND_B: (1, -1), K.SEND: (2, 0)}
_RECV = {K.RECV_F: (0, 0), K.RECV_B: (1, 0), K.RECV: (2, 0)}


@dataclass(frozen=True, eq=False)
class Messages:
    """Matched messages: message i went from row `send_index[i]` of rank `send_rank[i]` to row
    `recv_index[i]` of rank `recv_rank[i]` (rows of `Trace.events`)."""

    send_rank: np.ndarray
    send_index: np.ndarray
    recv_rank: np.ndarray
    recv_index: np.ndarray
    unmatched_sends: int
    unmatched_recvs: int

    def __len__(self) -> int:
        return int(self.send_rank.size)

    @cached_property
    def by_recv(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(recv rank, recv row) -> (send rank, send row)."""
        return {
            (int(rr), int(ri)): (int(sr), int(si))
            for rr, ri, sr, si in zip(
                self.recv_rank, self.recv_index, self.send_rank, self.send_index, strict=True
            )
        }


def _keys(rows: np.ndarray, table: dict, sending: bool) -> np.ndarray:
    channel = np.zeros(rows.size, dtype=np.int64)
    shift = np.zeros(rows.size, dtype=np.int64)
    for kind, (ch, sh) in table.items():
        sel = rows["kind"] == kind
        channel[sel], shift[sel] = ch, sh
    rank = rows["rank"].astype(np.int64)
    peer = rows["peer"].astype(np.int64)
    src, dst = (rank, peer) if sending else (peer, rank)
    return np.stack(
        [
            rows["step"].astype(np.int64),
            src,
            dst,
            channel,
            rows["stage"] + shift,
            rows["microbatch"].astype(np.int64),
        ],
        axis=1,
    )


def _occurrence(group: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Position of each item among the items of its group, in time order."""
    order = np.lexsort((t, group))
    g = group[order]
    idx = np.arange(g.size)
    first = np.ones(g.size, dtype=bool)
    first[1:] = g[1:] != g[:-1]
    occ = np.empty(g.size, dtype=np.int64)
    occ[order] = idx - np.maximum.accumulate(np.where(first, idx, 0))
    return occ


def match_messages(trace: Trace) -> Messages:
    """Match the trace's send events to its receive events (see the module docstring)."""
    tab = trace.table
    sends = tab[np.isin(tab["kind"], list(_SEND))]
    recvs = tab[np.isin(tab["kind"], list(_RECV))]
    empty = np.zeros(0, dtype=np.int64)
    if sends.size == 0 or recvs.size == 0:
        return Messages(empty, empty, empty, empty, int(sends.size), int(recvs.size))
    keys = np.concatenate([_keys(sends, _SEND, True), _keys(recvs, _RECV, False)])
    _, group = np.unique(keys, axis=0, return_inverse=True)
    group = group.reshape(-1)
    gs, gr = group[: sends.size], group[sends.size :]
    os_, or_ = _occurrence(gs, sends["t_start"]), _occurrence(gr, recvs["t_start"])
    span = int(max(os_.max(), or_.max())) + 1
    _, i_s, i_r = np.intersect1d(gs * span + os_, gr * span + or_, return_indices=True)
    return Messages(
        send_rank=sends["rank"][i_s].astype(np.int64),
        send_index=sends["index"][i_s].astype(np.int64),
        recv_rank=recvs["rank"][i_r].astype(np.int64),
        recv_index=recvs["index"][i_r].astype(np.int64),
        unmatched_sends=int(sends.size - i_s.size),
        unmatched_recvs=int(recvs.size - i_r.size),
    )
