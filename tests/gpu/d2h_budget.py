"""How many device-to-host copies one training step may make on one rank: the runtime's promise,
stated once for the fake-device tests (CPU CI) and the real-GPU tests."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hpcpipe.schedules.ir import Kind


def expected_d2h(trainer: Any, staged: bool) -> dict[str, int]:
    """The copies one step of this rank may make, by cause (the bound the tests state).

    - the loss, once per step, on the rank holding the last stage (summed on the device);
    - the squared gradient norms, once per step (all buffers in one copy);
    - MoE: the router probabilities once per MoE layer and microbatch (routing is a host
      decision by design) and the step's aux/z losses once;
    - staged only: each pipeline message sent, each allreduce bucket and each MoE all-to-all.
    """
    runner = trainer.runner
    m = runner.schedule.num_microbatches
    moe_layers = sum(
        1 for st in runner.stages.values() for u in st.units if hasattr(u, "aux_stats")
    )
    out = {
        "loss": int(any(st.is_last for st in runner.stages.values())),
        "norms": 1,
        "routing": moe_layers * m,
        "moe_stats": int(moe_layers > 0),
    }
    if staged:
        out["sends"] = sum(1 for a in runner.actions if a.kind in (Kind.SEND_F, Kind.SEND_B))
        per = max(1, runner.reducer.bucket_bytes // np.dtype(runner.backend.dtype).itemsize)
        buckets = 0
        for s in runner.stages:
            for reducer, buffers in (
                (runner.reducer, runner.grads),
                (runner.expert_reducer, runner.expert_grads),
            ):
                size = buffers[s].flat.size
                if reducer.comm.size > 1 and size:
                    buckets += math.ceil(size / per)
        out["allreduce_buckets"] = buckets
        out["alltoall"] = 4 * moe_layers * m if trainer.group is not None else 0
        if trainer.group is not None and trainer.group.size == 1:
            out["alltoall"] = 0
    return out
