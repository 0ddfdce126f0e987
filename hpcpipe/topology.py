"""Hierarchical rank topology: pure arithmetic mapping (pp, dp, ep) coordinates onto nodes.

The world is a grid of `pp x dp` ranks; `ep` splits each data-parallel replica's ranks into
expert groups (ep divides dp), so a rank's ep coordinate is `dp_index % ep` and its "expert data
parallel" group is `dp_index // ep`. `order` lists dims innermost first: the innermost dim gets
consecutive ranks, and consecutive ranks share a node, so listing a bandwidth-hungry dim first
keeps its groups inside a node. No MPI here: a plan for thousands of ranks is built on a laptop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

DIMS: tuple[str, ...] = ("pp", "dp", "ep")
"""The closed vocabulary of parallel axes."""

__all__ = ["DIMS", "RankMap", "TopologyError", "resolve_dims"]


class TopologyError(ValueError):
    """The degrees, world size and node size do not fit together; `dim` names the culprit."""

    def __init__(self, message: str, dim: str = ""):
        self.dim, self.detail = dim, message
        super().__init__(f"{dim} {message}" if dim else message)


def format_ranks(ranks: list[int]) -> str:
    """Sorted ranks written the way Slurm writes node lists ("0-2,5,7-8"): a report about
    thousands of ranks stays one short line."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None], strict=True):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def resolve_dims(world: int, pp: int, dp: int, ep: int) -> dict[str, int]:
    """Fill in dp = 0 ('the rest') and check that the degrees multiply to the world size."""
    if world < 1:
        raise TopologyError(f"world size must be >= 1, got {world}")
    for name, value, low in (("pp", pp, 1), ("dp", dp, 0), ("ep", ep, 1)):
        if value < low:
            raise TopologyError(f"= {value} must be >= {low}", name)
    if world % pp:
        raise TopologyError(f"= {pp} does not divide world size {world}", "pp")
    if dp == 0:
        dp = world // pp
    if pp * dp != world:
        raise TopologyError(
            f"= {dp}: pp * dp = {pp} * {dp} = {pp * dp} does not equal world size {world}", "dp"
        )
    if dp % ep:
        raise TopologyError(
            f"= {ep} does not divide dp = {dp} (expert groups live inside data-parallel replicas)",
            "ep",
        )
    return {"pp": pp, "dp": dp, "ep": ep}


@dataclass(frozen=True)
class RankMap:
    """coords <-> rank, groups per dim and node placement for one world.

    Internally the dp dim is split into (ep, edp): ep = dp_index % ep_size is the position inside
    an expert group, edp = dp_index // ep_size. `order` places the three axes; "ep" and "dp" are
    the two halves of the data-parallel dim, and dp's half (edp) is laid out where "dp" appears.
    """

    world: int
    ranks_per_node: int
    pp: int
    dp: int
    ep: int = 1
    order: tuple[str, ...] = ("ep", "dp", "pp")
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        resolve_dims(self.world, self.pp, self.dp, self.ep)
        if self.pp * self.dp != self.world:
            raise TopologyError(f"pp * dp = {self.pp * self.dp} does not equal world {self.world}")
        if sorted(self.order) != sorted(DIMS):
            raise TopologyError(
                f"order {','.join(self.order)!r} must list each of {','.join(DIMS)} once"
            )
        if self.ranks_per_node < 1:
            raise TopologyError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        extent = {"pp": self.pp, "dp": self.dp // self.ep, "ep": self.ep}
        strides, s = {}, 1
        for d in self.order:
            strides[d] = s
            s *= extent[d]
        object.__setattr__(self, "_strides", strides)

    @classmethod
    def build(
        cls,
        world: int,
        ranks_per_node: int,
        pp: int = 1,
        dp: int = 0,
        ep: int = 1,
        order: str | tuple[str, ...] = "ep,dp,pp",
    ) -> RankMap:
        """Resolve dp = 0 to the rest of the world and parse a comma-separated order."""
        dims = resolve_dims(world, pp, dp, ep)
        if isinstance(order, str):
            order = tuple(d.strip() for d in order.split(","))
        return cls(
            world=world, ranks_per_node=min(ranks_per_node, world) or world, order=order, **dims
        )

    @property
    def dims(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep}

    @property
    def nodes(self) -> int:
        return -(-self.world // self.ranks_per_node)

    # ------------------------------------------------------------ coordinates

    def coords(self, rank: int) -> dict[str, int]:
        """{'pp': stage, 'dp': replica index, 'ep': position in the expert group}."""
        self._check_rank(rank)
        st = self._strides
        pp = rank // st["pp"] % self.pp
        ep = rank // st["ep"] % self.ep
        edp = rank // st["dp"] % (self.dp // self.ep)
        return {"pp": pp, "dp": edp * self.ep + ep, "ep": ep}

    def rank(self, coords: dict[str, int]) -> int:
        pp, dp = coords["pp"], coords["dp"]
        if not (0 <= pp < self.pp and 0 <= dp < self.dp):
            raise TopologyError(f"coords {coords} out of range for pp={self.pp}, dp={self.dp}")
        if "ep" in coords and coords["ep"] != dp % self.ep:
            raise TopologyError(f"coords {coords}: ep must equal dp % {self.ep}")
        st = self._strides
        return pp * st["pp"] + (dp % self.ep) * st["ep"] + (dp // self.ep) * st["dp"]

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    # ------------------------------------------------------------ groups

    def group(self, rank: int, dim: str) -> tuple[int, ...]:
        """Ranks that share every coordinate with `rank` except `dim`, in coordinate order.

        pp: the pipeline (all stages of one replica); dp: all replicas of this stage (gradient
        allreduce); ep: the expert group (all-to-all), inside the dp group.
        """
        self._check_dim(dim)
        c = self.coords(rank)
        if dim == "pp":
            return tuple(self.rank({"pp": s, "dp": c["dp"]}) for s in range(self.pp))
        if dim == "dp":
            return tuple(self.rank({"pp": c["pp"], "dp": d}) for d in range(self.dp))
        base = c["dp"] - c["ep"]
        return tuple(self.rank({"pp": c["pp"], "dp": base + e}) for e in range(self.ep))

    def expert_data_group(self, rank: int) -> tuple[int, ...]:
        """Replicas of this rank's experts: same stage and ep position, every expert group.

        Expert parameters are sharded over ep, so their gradients are reduced over this group
        (dp / ep ranks) instead of the whole dp group.
        """
        c = self.coords(rank)
        return tuple(
            self.rank({"pp": c["pp"], "dp": g * self.ep + c["ep"]})
            for g in range(self.dp // self.ep)
        )

    def group_index(self, rank: int, dim: str) -> int:
        """A colour that is equal for exactly the ranks of one `dim` group (for Comm.Split)."""
        return min(self.group(rank, dim))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every distinct group of `dim`, by lowest member (vectorised: fast at 4k ranks)."""
        self._check_dim(dim)
        table = self._coord_table
        if dim == "pp":
            key = table["dp"]
            inner = table["pp"]
        elif dim == "dp":
            key = table["pp"]
            inner = table["dp"]
        else:
            key = table["pp"] * self.dp + (table["dp"] - table["ep"])
            inner = table["ep"]
        ranks = np.arange(self.world)
        order = np.lexsort((inner, key))
        sorted_keys = key[order]
        cuts = np.flatnonzero(np.diff(sorted_keys)) + 1
        out = [tuple(int(r) for r in g) for g in np.split(ranks[order], cuts)]
        return sorted(out, key=lambda g: min(g))

    def crosses_nodes(self, dim: str) -> bool:
        """True when at least one group of `dim` spans more than one node."""
        nodes = np.arange(self.world) // self.ranks_per_node
        return any(len(set(nodes[list(g)].tolist())) > 1 for g in self.groups(dim))

    def node_span(self, dim: str) -> int:
        """The largest number of nodes any one group of `dim` touches."""
        nodes = np.arange(self.world) // self.ranks_per_node
        return max(len(set(nodes[list(g)].tolist())) for g in self.groups(dim))

    def check_intra_node(self, dims: tuple[str, ...]) -> list[str]:
        """Messages for each dim that should stay inside a node but does not."""
        problems = []
        for dim in dims:
            if self.dims[dim] > 1 and self.crosses_nodes(dim):
                problems.append(
                    f"{dim} groups (size {self.dims[dim]}) cross nodes of {self.ranks_per_node} "
                    f"ranks (up to {self.node_span(dim)} nodes per group); put '{dim}' first in "
                    "topology.order or choose a degree that divides ranks_per_node"
                )
        return problems

    # ------------------------------------------------------------ description

    @cached_property
    def _coord_table(self) -> dict[str, np.ndarray]:
        r = np.arange(self.world)
        st = self._strides
        pp = r // st["pp"] % self.pp
        ep = r // st["ep"] % self.ep
        edp = r // st["dp"] % (self.dp // self.ep)
        return {"pp": pp, "dp": edp * self.ep + ep, "ep": ep}

    def describe(self, max_rows: int = 16) -> str:
        """The layout table `hpcpipe plan` prints: groups per dim, node crossing, ranks per node."""
        lines = [
            f"world {self.world} = pp {self.pp} x dp {self.dp} (ep {self.ep} inside dp); "
            f"{self.nodes} node(s) of {self.ranks_per_node} rank(s); order "
            f"{','.join(self.order)} (innermost first)",
            "",
            f"{'dim':<4} {'size':>6} {'groups':>7} {'stride':>7} {'nodes/group':>12}  "
            "crosses nodes  example group (rank 0)",
        ]
        for dim in DIMS:
            size = self.dims[dim]
            groups = self.groups(dim)
            g0 = groups[0]
            stride = g0[1] - g0[0] if len(g0) > 1 else 0
            span = self.node_span(dim)
            example = ",".join(map(str, g0[:8])) + (",..." if len(g0) > 8 else "")
            lines.append(
                f"{dim:<4} {size:>6} {len(groups):>7} {stride:>7} {span:>12}  "
                f"{'yes' if span > 1 else 'no':<13}  [{example}]"
            )
        lines.append("")
        per_node = Counter(r // self.ranks_per_node for r in range(self.world))
        counts = Counter(per_node.values())
        lines.append(
            "ranks per node: " + ", ".join(f"{n} node(s) x {c}" for c, n in sorted(counts.items()))
        )
        stages = (
            self._coord_table["pp"].reshape(self.nodes, -1)
            if (self.world % self.ranks_per_node == 0)
            else None
        )
        if stages is not None:
            uniq = [len(set(row.tolist())) for row in stages]
            lines.append(f"pipeline stages per node: min {min(uniq)}, max {max(uniq)}")
        lines.append("")
        lines.append(f"{'rank':>6} {'node':>5} {'local':>5} {'pp':>4} {'dp':>4} {'ep':>4}")
        shown = range(min(self.world, max_rows))
        for r in shown:
            c = self.coords(r)
            lines.append(
                f"{r:>6} {self.node_of(r):>5} {self.local_rank(r):>5} "
                f"{c['pp']:>4} {c['dp']:>4} {c['ep']:>4}"
            )
        if self.world > max_rows:
            lines.append(f"{'...':>6} ({self.world - max_rows} more ranks)")
        return "\n".join(lines)

    # ------------------------------------------------------------ checks

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise TopologyError(f"rank {rank} out of range for world size {self.world}")

    @staticmethod
    def _check_dim(dim: str) -> None:
        if dim not in DIMS:
            raise TopologyError(f"unknown dim {dim!r}; dims are {', '.join(DIMS)}")
