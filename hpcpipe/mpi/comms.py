"""Group communicators built from a pure RankMap, and node discovery.

Nodes are found with `Split_type(COMM_TYPE_SHARED)`; a `ranks_per_node` override instead cuts
the world into virtual nodes of consecutive ranks, so hierarchical code paths (intra-node then
inter-node exchanges) are testable on one machine.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from mpi4py import MPI

from hpcpipe.topology import DIMS, RankMap


@dataclass(frozen=True)
class NodeInfo:
    """Where this rank sits: which node, its local rank, and whether placement is block-wise."""

    node: int
    local_rank: int
    ranks_per_node: int
    nodes: int
    uniform: bool
    """Every node holds the same number of consecutive world ranks (what RankMap assumes)."""
    virtual: bool
    hostname: str


def discover_nodes(world: MPI.Comm, ranks_per_node: int = 0) -> tuple[NodeInfo, MPI.Comm]:
    """Find the node layout; returns this rank's NodeInfo and a communicator of its node."""
    host = socket.gethostname()
    if ranks_per_node > 0:
        node_comm = world.Split(world.rank // ranks_per_node, world.rank)
        nodes = -(-world.size // ranks_per_node)
        info = NodeInfo(
            world.rank // ranks_per_node,
            node_comm.rank,
            ranks_per_node,
            nodes,
            world.size % ranks_per_node == 0,
            True,
            host,
        )
        return info, node_comm
    node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    leader = node_comm.allreduce(world.rank, op=MPI.MIN)
    leaders = sorted(set(world.allgather(leader)))
    sizes = world.allgather(node_comm.size)
    # Block placement: this node's ranks are leader .. leader + size - 1.
    members = node_comm.allgather(world.rank)
    block = members == list(range(leader, leader + node_comm.size))
    uniform = world.allreduce(int(block), op=MPI.MIN) == 1 and len(set(sizes)) == 1
    info = NodeInfo(
        leaders.index(leader), node_comm.rank, node_comm.size, len(leaders), uniform, False, host
    )
    return info, node_comm


@dataclass
class Comms:
    """The world, this rank's node, and one communicator per parallel dim, by axis name."""

    world: MPI.Comm
    node: MPI.Comm
    node_info: NodeInfo
    rankmap: RankMap
    _groups: dict[str, MPI.Comm] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    def group(self, dim: str) -> MPI.Comm:
        """The communicator of `dim` ('pp', 'dp', 'ep'); its rank order is coordinate order."""
        try:
            return self._groups[dim]
        except KeyError:
            raise KeyError(f"unknown dim {dim!r}; dims are {', '.join(DIMS)}") from None

    @property
    def alone(self) -> MPI.Comm:
        """This rank by itself: a reduction over it is a no-op (replicas that keep their own
        gradients)."""
        return MPI.COMM_SELF

    @property
    def expert_dp(self) -> MPI.Comm:
        """Ranks holding replicas of this rank's experts (same pp and ep coordinates)."""
        return self._groups["edp"]

    def free(self) -> None:
        for comm in self._groups.values():
            comm.Free()
        self._groups.clear()
        if self.node != MPI.COMM_NULL:
            self.node.Free()


def build_comms(
    world: MPI.Comm, rankmap: RankMap, node_comm: MPI.Comm, node_info: NodeInfo
) -> Comms:
    """One `Comm.Split` per dim, keyed by coordinate so group rank == coordinate along the dim."""
    if rankmap.world != world.size:
        raise ValueError(f"RankMap is for {rankmap.world} ranks but the world has {world.size}")
    coords = rankmap.coords(world.rank)
    groups = {}
    for dim in DIMS:
        colour = rankmap.group_index(world.rank, dim)
        key = coords["pp"] if dim == "pp" else coords["dp"] if dim == "dp" else coords["ep"]
        groups[dim] = world.Split(colour, key)
    groups["edp"] = world.Split(min(rankmap.expert_data_group(world.rank)), coords["dp"])
    return Comms(world=world, node=node_comm, node_info=node_info, rankmap=rankmap, _groups=groups)
