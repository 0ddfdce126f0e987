"""Mixture-of-Experts: routing, expert placement, dispatch/combine and hierarchical all-to-all.

`MoEConfig` is the deck's [moe] section. `build_model(cfg, moe=..., expert_group=...)` (in
`hpcpipe.model`) builds gpt models whose MoE blocks are `MoETransformerBlock`s. `ExpertGroup`
(part of the MPI layer, `hpcpipe.mpi.experts`, loaded on first use) holds the expert-parallel
communicator; without one every expert is local. Routing (`route`) and dispatch plans
(`build_dispatch_plan`) are pure NumPy. See docs/moe.md.
"""

from typing import Any

from hpcpipe.moe.config import MoEConfig, check_moe
from hpcpipe.moe.layer import (
    MoELayer,
    MoEStats,
    MoETransformerBlock,
    is_expert_param,
    summarize_stats,
)
from hpcpipe.moe.plan import DispatchPlan, LocalExperts, NodeLayout, build_dispatch_plan
from hpcpipe.moe.router import Routing, expert_capacity, route

__all__ = [
    "DispatchPlan",
    "ExpertGroup",
    "LocalExperts",
    "MoEConfig",
    "MoELayer",
    "MoEStats",
    "MoETransformerBlock",
    "NodeLayout",
    "Routing",
    "build_dispatch_plan",
    "check_moe",
    "expert_capacity",
    "is_expert_param",
    "route",
    "summarize_stats",
]


def __getattr__(name: str) -> Any:
    if name == "ExpertGroup":  # keeps `import hpcpipe.moe` free of MPI initialisation
        from hpcpipe.mpi.experts import ExpertGroup

        return ExpertGroup
    raise AttributeError(f"module 'hpcpipe.moe' has no attribute {name!r}")
