"""Dispatch plans without MPI: the two-phase exchange, simulated for every rank of a group,
delivers exactly the flat all-to-all's buffers, for any counts (zeros included) and layouts."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.moe.plan import (
    NodeLayout,
    RowCounts,
    block_index,
    build_dispatch_plan,
    hierarchical_plan,
)


def test_block_index_regroups_blocks():
    buf = np.arange(9)  # blocks of 2, 0, 3, 4 rows: [0 1] [] [2 3 4] [5 6 7 8]
    assert buf[block_index([2, 0, 3, 4], [3, 0, 1, 2])].tolist() == [5, 6, 7, 8, 0, 1, 2, 3, 4]
    assert block_index([2, 0, 3, 4], [1]).size == 0
    assert block_index([0, 0], [1, 0]).size == 0


def test_node_layout():
    lay = NodeLayout((7, 7, 3, 3))
    assert lay.members == ((0, 1), (2, 3)) and lay.uniform and lay.node_major
    assert lay.position(3) == (1, 1) and lay.local_size == 2 and lay.nodes == 2
    odd = NodeLayout((0, 1, 0, 1))
    assert odd.members == ((0, 2), (1, 3)) and odd.uniform and not odd.node_major
    assert not NodeLayout((0, 0, 0, 1)).uniform
    with pytest.raises(ValueError, match="not in this expert group"):
        lay.position(9)


def send_buffers(counts: np.ndarray) -> list[np.ndarray]:
    """Rank s's flat send buffer: rows (s, d, i) grouped by destination d."""
    p = counts.shape[0]
    return [
        np.array(
            [(s, d, i) for d in range(p) for i in range(counts[s, d])], dtype=np.int64
        ).reshape(-1, 3)
        for s in range(p)
    ]


def flat(counts: np.ndarray, bufs: list[np.ndarray]) -> list[np.ndarray]:
    p = counts.shape[0]
    out = []
    for d in range(p):
        parts = []
        for s in range(p):
            start = int(counts[s, :d].sum())
            parts.append(bufs[s][start : start + counts[s, d]])
        out.append(np.concatenate(parts))
    return out


def take(rows: np.ndarray, index: np.ndarray | None) -> np.ndarray:
    return rows if index is None else rows[index]


def alltoallv(ranks: list[int], sends: dict[int, np.ndarray], counts: dict[int, np.ndarray]):
    """One Alltoallv among `ranks` (in communicator order): sends[r] split by counts[r]."""
    out = {}
    for j, dst in enumerate(ranks):
        parts = []
        for src in ranks:
            start = int(counts[src][:j].sum())
            parts.append(sends[src][start : start + counts[src][j]])
        out[dst] = np.concatenate(parts)
    return out


def two_phase(layout: NodeLayout, counts: np.ndarray, bufs: list[np.ndarray]) -> list[np.ndarray]:
    p = counts.shape[0]
    plans = {}
    for me in range(p):
        a, _ = layout.position(me)
        mates = layout.members[a]
        plans[me] = hierarchical_plan(layout, me, counts[list(mates)], counts[:, me])
    for me, h in plans.items():  # what the receiver expects is what the sender sends
        a, i = layout.position(me)
        for jj, mate in enumerate(layout.members[a]):
            assert h.send1[jj] == plans[mate].recv1[i]
    mid = {}
    for mates in layout.members:
        mid.update(
            alltoallv(
                list(mates),
                {r: take(bufs[r], plans[r].index1) for r in mates},
                {r: plans[r].send1 for r in mates},
            )
        )
    last = {}
    for i in range(layout.local_size):
        cross = [m[i] for m in layout.members]
        last.update(
            alltoallv(
                cross,
                {r: take(mid[r], plans[r].index2) for r in cross},
                {r: plans[r].send2 for r in cross},
            )
        )
    return [take(last[r], plans[r].final) for r in range(p)]


LAYOUTS = {
    "2x4": (0, 0, 0, 0, 1, 1, 1, 1),
    "4x2": (0, 0, 1, 1, 2, 2, 3, 3),
    "8x1": tuple(range(8)),
    "1x8": (0,) * 8,
    "round-robin": (0, 1, 0, 1, 0, 1, 0, 1),
    "3x2-shuffled": (5, 2, 2, 9, 5, 9),
}


@pytest.mark.parametrize("node_of", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("fill", ["random", "sparse", "empty", "one-hot"])
def test_two_phase_delivers_the_flat_result(node_of, fill):
    layout = NodeLayout(node_of)
    p = layout.size
    rng = np.random.default_rng(len(node_of) + len(fill))
    counts = {
        "random": rng.integers(0, 5, (p, p)),
        "sparse": rng.integers(0, 5, (p, p)) * (rng.random((p, p)) < 0.3),
        "empty": np.zeros((p, p), dtype=np.int64),
        "one-hot": np.eye(p, dtype=np.int64)[[1] * p] * 3,  # everybody sends only to rank 1
    }[fill]
    bufs = send_buffers(counts)
    expected = flat(counts, bufs)
    got = two_phase(layout, counts, bufs)
    for d in range(p):
        assert np.array_equal(got[d], expected[d]), (d, got[d], expected[d])
        assert got[d].shape == (int(counts[:, d].sum()), 3)


def test_trivial_phases_copy_nothing_and_counts_are_mpi_ready():
    counts = np.arange(16).reshape(4, 4)
    one_per_node = hierarchical_plan(NodeLayout((0, 1, 2, 3)), 2, counts[[2]], counts[:, 2])
    one_node = hierarchical_plan(NodeLayout((0,) * 4), 2, counts, counts[:, 2])
    for h in (one_per_node, one_node):
        assert h.index1 is None and h.index2 is None and h.final is None
    two = hierarchical_plan(NodeLayout((0, 0, 1, 1)), 1, counts[:2], counts[:, 1])
    assert two.index1 is not None and two.index2 is not None
    # rank 1 sends 4, 5, 6, 7 rows to ranks 0..3: to local index 0 (ranks 0, 2) and 1 (1, 3)
    assert two.send1_spec == RowCounts((10, 12), (0, 10), 22)
    spec = RowCounts.of(np.array([2, 0, 3]))
    assert spec.counts == (2, 0, 3) and spec.displs == (0, 2, 2) and spec.total == 5
    assert RowCounts.of(np.zeros(0, dtype=np.int64)) == RowCounts((), (), 0)


def test_non_uniform_layout_is_refused():
    with pytest.raises(ValueError, match="same number of group ranks on every node"):
        hierarchical_plan(NodeLayout((0, 0, 1)), 0, np.zeros((2, 3)), np.zeros(3))


def test_dispatch_plan_maps_rows_to_local_experts():
    # 2 ep ranks x 2 local experts; rank 1's view: rows from rank 0 for experts 2, 3 then
    # rows from rank 1 for experts 2, 3
    send = np.array([1, 0, 2, 1])  # this rank sends 1 row to expert 0, 2 to 2, 1 to 3
    recv = np.array([[3, 1], [2, 1]])
    plan = build_dispatch_plan(send, recv)
    assert plan.forward.send.tolist() == [1, 3] and plan.forward.recv.tolist() == [4, 3]
    assert plan.backward.send.tolist() == [4, 3] and plan.backward.recv.tolist() == [1, 3]
    assert plan.expert_order.tolist() == [0, 1, 2, 4, 5, 3, 6]
    assert plan.expert_offsets == (0, 5, 7)
    one = build_dispatch_plan(np.array([2, 1]), np.array([[2], [4]]))  # one local expert
    assert one.expert_order is None and one.expert_offsets == (0, 6)
    assert plan.forward.rows_in == 7 and "2 ep rank(s) x 2 local expert(s)" in plan.describe()
    with pytest.raises(ValueError, match="node mates"):
        build_dispatch_plan(send, recv, layout=NodeLayout((0, 1)), me=1)
