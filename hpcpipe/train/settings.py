"""[train]: how the pipeline runtime executes (not what it computes: that is [model], [data],
[optim] and [pipeline])."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.config import option

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """[train]: partitioning, transport and verification settings of the training runtime."""

    partition: str = option(
        "flops", "how units are split into stages: by flops or params", choices=("flops", "params")
    )
    stage_units: tuple[int, ...] = option(
        (), "explicit units per stage (overrides partition)", minimum=1
    )
    bucket_mb: float = option(
        4.0, "data-parallel allreduce bucket size in MiB", minimum=0.001, maximum=2.0**20
    )
    recv_lookahead: int = option(8, "receives posted this many actions ahead", minimum=1)
    sends: str = option(
        "nonblocking",
        "pipeline sends: nonblocking (Isend, completed at the step's end) or blocking "
        "(Ssend: returns once the receive is posted; the plan is proved deadlock-free for "
        "recv_lookahead before the run, or the deck is refused with the lookahead that works)",
        choices=("nonblocking", "blocking"),
    )
    verify: bool = option(
        False,
        "at the end, rerun on rank 0 with the single-process reference "
        "trainer and compare losses and every parameter",
    )
    verify_rtol: float = option(
        0.0,
        "per-tensor relative tolerance for verify; 0 = by dtype (1e-10 float64, 1e-5 float32)",
        minimum=0.0,
    )
    save_params: bool = option(False, "write the final parameters to <output>/params.h5")
