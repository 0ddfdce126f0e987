"""RankMap arithmetic, checked exhaustively over small worlds against brute-force definitions."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpipe.topology import DIMS, RankMap, TopologyError, resolve_dims

ORDERS = [",".join(p) for p in itertools.permutations(DIMS)]


def shapes(max_world: int = 12):
    for world in range(1, max_world + 1):
        for pp in range(1, world + 1):
            if world % pp:
                continue
            dp = world // pp
            for ep in range(1, dp + 1):
                if dp % ep == 0:
                    yield world, pp, dp, ep


def check_map(m: RankMap) -> None:
    coords = [m.coords(r) for r in range(m.world)]
    # round trip and bijection
    assert [m.rank(c) for c in coords] == list(range(m.world))
    assert len({(c["pp"], c["dp"]) for c in coords}) == m.world
    for c in coords:
        assert c["ep"] == c["dp"] % m.ep
    for dim in DIMS:
        groups = m.groups(dim)
        # groups partition the world, each of the dim's size
        assert sorted(r for g in groups for r in g) == list(range(m.world))
        assert all(len(g) == m.dims[dim] for g in groups)
        for g in groups:
            cs = [coords[r] for r in g]
            # members agree on every other coordinate (brute-force definition of a group)
            if dim == "pp":
                assert len({c["dp"] for c in cs}) == 1
                assert [c["pp"] for c in cs] == list(range(m.pp))
            elif dim == "dp":
                assert len({c["pp"] for c in cs}) == 1
                assert [c["dp"] for c in cs] == list(range(m.dp))
            else:
                assert len({c["pp"] for c in cs}) == 1
                assert len({c["dp"] // m.ep for c in cs}) == 1
                assert [c["ep"] for c in cs] == list(range(m.ep))
            for r in g:
                assert m.group(r, dim) == g
        # an ep group lies inside the dp group of each member
        if dim == "ep":
            for g in groups:
                assert set(g) <= set(m.group(g[0], "dp"))
    # node crossing agrees with a brute-force check
    for dim in DIMS:
        brute = any(len({r // m.ranks_per_node for r in g}) > 1 for g in m.groups(dim))
        assert m.crosses_nodes(dim) == brute


@pytest.mark.parametrize("order", ORDERS)
def test_rankmap_exhaustive_small_worlds(order):
    for world, pp, dp, ep in shapes():
        for rpn in sorted({1, 2, 3, 4, world}):
            check_map(RankMap.build(world, rpn, pp=pp, dp=dp, ep=ep, order=order))


@settings(max_examples=60, deadline=None)
@given(
    pp=st.sampled_from([1, 2, 3, 4, 8]),
    edp=st.integers(1, 16),
    ep=st.sampled_from([1, 2, 4]),
    order=st.sampled_from(ORDERS),
    rpn=st.sampled_from([1, 4, 8, 16]),
)
def test_rankmap_random_shapes(pp, edp, ep, order, rpn):
    dp = edp * ep
    check_map(RankMap.build(pp * dp, rpn, pp=pp, dp=dp, ep=ep, order=order))


def test_innermost_dim_gets_consecutive_ranks():
    m = RankMap.build(16, 4, pp=2, dp=8, ep=4, order="ep,dp,pp")
    assert m.group(0, "ep") == (0, 1, 2, 3)
    assert m.group(0, "pp") == (0, 8)
    assert not m.crosses_nodes("ep")
    assert m.crosses_nodes("pp")
    m = RankMap.build(16, 4, pp=4, dp=4, ep=1, order="pp,ep,dp")
    assert m.group(0, "pp") == (0, 1, 2, 3)
    assert not m.crosses_nodes("pp") and m.crosses_nodes("dp")


def test_intra_node_check_names_dim_and_fix():
    m = RankMap.build(16, 2, pp=2, dp=8, ep=4)
    (msg,) = m.check_intra_node(("ep", "pp"))[:1]
    assert "ep groups (size 4) cross nodes of 2 ranks" in msg
    assert "topology.order" in msg
    assert RankMap.build(16, 4, pp=2, dp=8, ep=4).check_intra_node(("ep",)) == []


def test_dp_zero_takes_the_rest():
    assert resolve_dims(24, 3, 0, 2) == {"pp": 3, "dp": 8, "ep": 2}


@pytest.mark.parametrize(
    ("world", "pp", "dp", "ep", "dim", "text"),
    [
        (8, 3, 0, 1, "pp", "does not divide world size 8"),
        (8, 2, 3, 1, "dp", "does not equal world size 8"),
        (8, 2, 4, 3, "ep", "does not divide dp = 4"),
        (8, 0, 0, 1, "pp", "must be >= 1"),
    ],
)
def test_bad_degrees_name_the_dim(world, pp, dp, ep, dim, text):
    with pytest.raises(TopologyError) as info:
        resolve_dims(world, pp, dp, ep)
    assert info.value.dim == dim and text in str(info.value)


def test_large_world_layout_and_description():
    m = RankMap.build(4096, 8, pp=8, dp=0, ep=4)
    assert m.dp == 512 and m.nodes == 512
    text = m.describe(max_rows=4)
    assert "world 4096 = pp 8 x dp 512" in text
    assert "(4092 more ranks)" in text
    assert m.check_intra_node(("ep",)) == []
    assert m.node_span("pp") == 8
    assert len(m.groups("ep")) == 1024


def test_coords_out_of_range_rejected():
    m = RankMap.build(4, 2, pp=2)
    with pytest.raises(TopologyError):
        m.coords(4)
    with pytest.raises(TopologyError):
        m.rank({"pp": 2, "dp": 0})


def test_expert_data_groups_partition_each_dp_group():
    for world, pp, dp, ep in shapes():
        m = RankMap.build(world, 2, pp=pp, dp=dp, ep=ep)
        for r in range(world):
            g = m.expert_data_group(r)
            assert len(g) == dp // ep and r in g
            assert set(g) <= set(m.group(r, "dp"))
            assert {m.coords(x)["ep"] for x in g} == {m.coords(r)["ep"]}
