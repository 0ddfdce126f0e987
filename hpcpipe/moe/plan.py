"""Dispatch plans: who sends how many token rows to whom, flat or in two phases. Pure NumPy.

A plan is built on every rank from the per-expert counts exchanged at the start of a dispatch,
then drives four all-to-alls (tokens out, expert outputs back in F; output gradients out, input
gradients back in B). Building it needs no MPI, so the two-phase (hierarchical) algorithm is
checked in one process against the flat exchange it replaces.

Hierarchical all-to-all, for an expert group of `nodes x L` ranks (L on each node):

1. intra-node: rank (a, i) sends to its node mate (a, j) every block it holds for the ranks
   with local index j on all nodes, ordered by node;
2. local regroup of the received blocks from (source mate, node) to (node, source mate) order;
3. inter-node: rank (a, j) sends to (b, j) the blocks of all its node mates for (b, j).

Rank (b, j) then holds the blocks from (a, i) ordered node-major, which is the flat receive
order whenever ep ranks are numbered node-major (the usual layout); otherwise one final regroup
puts them in ep-rank order. Intra-node first (rather than inter-node first) means that the
last phase lands in the final layout, so one regroup is needed instead of two, and each rank
sends `nodes - 1` aggregated inter-node messages instead of `nodes x L - L` small ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from hpcpipe.model.steps import Operation, immediate

__all__ = [
    "DispatchPlan",
    "Exchange",
    "HierarchicalPlan",
    "LocalExperts",
    "NodeLayout",
    "RowCounts",
    "block_index",
    "build_dispatch_plan",
    "hierarchical_plan",
]


def block_index(sizes: Sequence[int] | np.ndarray, order: Sequence[int] | np.ndarray) -> np.ndarray:
    """Row indices that gather the blocks of a buffer (block b has sizes[b] rows, blocks stored
    in index order) in the new block order `order`."""
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    order = np.asarray(order, dtype=np.int64)
    if order.size == 0:
        return np.zeros(0, dtype=np.int64)
    lens = sizes[order]
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # arange inside each selected block: global position minus the block's output start
    out_starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    owner = np.repeat(np.arange(order.size), lens)
    return starts[order][owner] + np.arange(total, dtype=np.int64) - out_starts[owner]


@dataclass(frozen=True)
class NodeLayout:
    """The node of every rank of one expert group (any ids), grouped node-major."""

    node_of: tuple[int, ...]
    members: tuple[tuple[int, ...], ...] = field(init=False)
    """ep ranks per node, nodes in order of their lowest ep rank, ranks ascending."""

    def __post_init__(self) -> None:
        nodes: dict[int, list[int]] = {}
        for r, n in enumerate(self.node_of):
            nodes.setdefault(int(n), []).append(r)
        object.__setattr__(self, "members", tuple(tuple(m) for m in nodes.values()))

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> int:
        return len(self.members)

    @property
    def uniform(self) -> bool:
        """Every node holds the same number of the group's ranks (two-phase exchange needs it)."""
        return len({len(m) for m in self.members}) == 1

    @property
    def local_size(self) -> int:
        return len(self.members[0])

    @property
    def node_major(self) -> bool:
        """ep ranks are numbered node by node (then the last phase needs no regroup)."""
        return [r for m in self.members for r in m] == list(range(self.size))

    def position(self, rank: int) -> tuple[int, int]:
        """(node index, local index) of ep rank `rank`."""
        for a, m in enumerate(self.members):
            if rank in m:
                return a, m.index(rank)
        raise ValueError(f"rank {rank} is not in this expert group of {self.size}")


@dataclass(frozen=True)
class RowCounts:
    """Rows per peer of one side of an all-to-all, as MPI wants them (counts, displacements)."""

    counts: tuple[int, ...]
    displs: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, rows: np.ndarray) -> RowCounts:
        rows = np.asarray(rows, dtype=np.int64)
        displs = np.concatenate(([0], np.cumsum(rows)[:-1])) if rows.size else rows
        return cls(tuple(rows.tolist()), tuple(int(d) for d in displs), int(rows.sum()))


@dataclass(frozen=True)
class HierarchicalPlan:
    """One rank's two-phase exchange, in rows: gather, intra-node a2a, gather, inter-node a2a.
    A gather that would keep every row in place is None (no copy)."""

    index1: np.ndarray | None  # rows of the flat send buffer, in phase-1 send order
    send1: np.ndarray  # (L,) rows to each node mate
    recv1: np.ndarray  # (L,) rows from each node mate
    index2: np.ndarray | None  # rows of the phase-1 receive buffer, in phase-2 send order
    send2: np.ndarray  # (nodes,) rows to the rank with my local index on each node
    recv2: np.ndarray  # (nodes,)
    final: np.ndarray | None  # rows of the phase-2 receive buffer in ep-rank order

    @cached_property
    def send1_spec(self) -> RowCounts:
        return RowCounts.of(self.send1)

    @cached_property
    def recv1_spec(self) -> RowCounts:
        return RowCounts.of(self.recv1)

    @cached_property
    def send2_spec(self) -> RowCounts:
        return RowCounts.of(self.send2)

    @cached_property
    def recv2_spec(self) -> RowCounts:
        return RowCounts.of(self.recv2)


def _moving(index: np.ndarray) -> np.ndarray | None:
    """`index`, or None when it is the identity gather."""
    return None if np.array_equal(index, np.arange(index.size)) else index


def hierarchical_plan(
    layout: NodeLayout, me: int, node_send: np.ndarray, recv: np.ndarray
) -> HierarchicalPlan:
    """Plan of ep rank `me`. node_send[i, d]: rows node mate i (local index) sends to ep rank d
    in the flat exchange; recv[s]: rows `me` receives from ep rank s."""
    if not layout.uniform:
        raise ValueError(
            f"hierarchical all-to-all needs the same number of group ranks on every node, got "
            f"{[len(m) for m in layout.members]}"
        )
    node_send = np.asarray(node_send, dtype=np.int64)
    recv = np.asarray(recv, dtype=np.int64)
    members = np.asarray(layout.members, dtype=np.int64)  # (nodes, L)
    nodes, local = members.shape
    _, i_me = layout.position(me)
    # phase 1 send: flat blocks (by dest rank) regrouped to (local index j, node b)
    dest_order = members.T.reshape(-1)  # j-major, then b
    index1 = block_index(node_send[i_me], dest_order)
    send1 = node_send[i_me][members.T].sum(axis=1)  # (L,)
    # phase 1 recv: from mate i, blocks (i, b) with sizes node_send[i, members[b, i_me]]
    sizes1 = node_send[:, members[:, i_me]]  # (L, nodes), i-major
    recv1 = sizes1.sum(axis=1)
    # phase 2 send: regroup (i, b) -> (b, i)
    order2 = (np.arange(local)[None, :] * nodes + np.arange(nodes)[:, None]).reshape(-1)
    index2 = block_index(sizes1.reshape(-1), order2)
    send2 = sizes1.sum(axis=0)  # (nodes,)
    # phase 2 recv: from (b, i_me) the blocks of (b, i) for i, i.e. recv[members[b, i]]
    sizes2 = recv[members]  # (nodes, L), b-major
    recv2 = sizes2.sum(axis=1)
    final = None
    if not layout.node_major:
        pos = np.empty(layout.size, dtype=np.int64)
        pos[members.reshape(-1)] = np.arange(layout.size)
        final = _moving(block_index(sizes2.reshape(-1), pos))
    return HierarchicalPlan(_moving(index1), send1, recv1, _moving(index2), send2, recv2, final)


@dataclass(frozen=True)
class Exchange:
    """One all-to-all of token rows: rows to and from every ep rank, and its two-phase plan."""

    send: np.ndarray  # (P,) rows to each ep rank
    recv: np.ndarray  # (P,) rows from each ep rank
    hierarchical: HierarchicalPlan | None = None

    @cached_property
    def send_spec(self) -> RowCounts:
        return RowCounts.of(self.send)

    @cached_property
    def recv_spec(self) -> RowCounts:
        return RowCounts.of(self.recv)

    @property
    def rows_out(self) -> int:
        return int(self.send.sum())

    @property
    def rows_in(self) -> int:
        return int(self.recv.sum())


@dataclass(frozen=True)
class DispatchPlan:
    """The exchanges of one MoE layer for one microbatch, and how received rows map to experts.

    `forward` moves tokens (and, in B, output gradients) from sources to expert owners;
    `backward` moves expert outputs (and, in B, input gradients) back. `recv_expert[s, j]`:
    rows from ep rank s for local expert j; received rows are ordered by s, then j, and
    `expert_order` regroups them by expert (j, then s) so that local expert j owns the
    contiguous rows `expert_offsets[j]:expert_offsets[j + 1]`.
    """

    forward: Exchange
    backward: Exchange
    recv_expert: np.ndarray  # (P, local experts)
    expert_order: np.ndarray | None  # receive-buffer rows in expert order; None = already
    expert_offsets: tuple[int, ...]  # (local experts + 1,)

    def describe(self) -> str:
        p, el = self.recv_expert.shape
        return (
            f"dispatch: {p} ep rank(s) x {el} local expert(s); rows out "
            f"{self.forward.send.tolist()} in {self.forward.recv.tolist()}; per local expert "
            f"{self.recv_expert.sum(axis=0).tolist()}"
            + (" (two-phase)" if self.forward.hierarchical is not None else "")
        )


def build_dispatch_plan(
    send_expert: np.ndarray,
    recv_expert: np.ndarray,
    *,
    layout: NodeLayout | None = None,
    me: int = 0,
    node_counts: np.ndarray | None = None,
) -> DispatchPlan:
    """Plan from this rank's per-expert send counts (E,) and received counts (P, E/P).

    For the two-phase exchange give the `layout`, this rank's ep rank `me` and `node_counts`
    (L, 2P): every node mate's rows sent to and received from each ep rank.
    """
    recv_expert = np.asarray(recv_expert, dtype=np.int64)
    p, el = recv_expert.shape
    send = np.asarray(send_expert, dtype=np.int64).reshape(p, el).sum(axis=1)
    recv = recv_expert.sum(axis=1)
    fwd_h = bwd_h = None
    if layout is not None:
        if node_counts is None:
            raise ValueError("a two-phase plan needs the node mates' counts (node_counts)")
        mates = np.asarray(node_counts, dtype=np.int64)
        fwd_h = hierarchical_plan(layout, me, mates[:, :p], recv)
        bwd_h = hierarchical_plan(layout, me, mates[:, p:], send)
    order = None
    if p > 1 and el > 1:  # blocks (s, j) are stored s-major; experts want them j-major
        order = block_index(recv_expert.reshape(-1), np.arange(p * el).reshape(p, el).T.ravel())
    offsets = (0, *np.cumsum(recv_expert.sum(axis=0)).tolist())
    return DispatchPlan(
        Exchange(send, recv, fwd_h), Exchange(recv, send, bwd_h), recv_expert, order, offsets
    )


class LocalExperts:
    """All experts on this process: the exchange is the identity (the single-process oracle)."""

    size = 1
    rank = 0
    hierarchical = False

    def __init__(self, experts: int):
        if experts < 1:
            raise ValueError(f"experts = {experts} must be >= 1")
        self.experts = experts

    @property
    def local_experts(self) -> range:
        return range(self.experts)

    def plan(self, send_expert: np.ndarray) -> DispatchPlan:
        return build_dispatch_plan(send_expert, np.asarray(send_expert)[None, :])

    def alltoallv(self, rows: Any, exchange: Exchange, out: Any = None) -> Any:
        if out is None:
            return rows
        out[...] = rows
        return out

    def plan_op(self, send_expert: np.ndarray) -> Operation:
        """`plan` as a step a layer yields (`hpcpipe.model.steps`): nothing to wait for."""
        return Operation(self.plan, immediate(self.plan), send_expert)

    def alltoallv_op(self, rows: Any, exchange: Exchange) -> Operation:
        """`alltoallv` as a step a layer yields: nothing to wait for."""
        return Operation(self.alltoallv, immediate(self.alltoallv), rows, exchange)

    def __repr__(self) -> str:
        return f"LocalExperts({self.experts})"
