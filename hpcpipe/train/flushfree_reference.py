"""The single-process reference of a pipeline without a flush: the same staleness, no MPI.

A flush-free plan (`hpcpipe.schedules.flushfree`) fixes, for every stage s and microbatch j,
the weight version `version[s, j]` that j's forward and backward use on s. Each microbatch's
computation is then a pure function of those versions: run the whole model on weights where
stage s's units hold their version `version[s, j]`. Update k of stage s adds the gradients of
window k (microbatches `k*window .. (k+1)*window - 1`) to version k, the newest, giving version
k + 1. So the windows can be computed in order, each needing only versions already made, and
every flush-free layout must equal this to rounding.

Microbatch j is the (j mod m)-th block of contiguous rows of global batch j div m, m being the
microbatches per global batch, as in synchronous training. An update's objective is the mean
loss over its window's tokens: with window = m, the synchronous step's; with window 1,
PipeDream's update per microbatch. Stages update at different times, so no global gradient
norm exists: `optim.grad_clip` clips each stage's own norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcpipe.model.config import ModelConfig
from hpcpipe.model.models import build_model
from hpcpipe.model.stage import Stage, accumulate
from hpcpipe.train.data import DataConfig, build_dataset
from hpcpipe.train.optim import (
    OptimConfig,
    apply_update,
    clip_scale,
    grad_sq_norm,
    init_state,
    learning_rate,
)
from hpcpipe.train.reference import ReferenceResult, to_host

__all__ = ["train_flush_free_reference"]


def train_flush_free_reference(
    model: ModelConfig,
    data: DataConfig,
    optim: OptimConfig,
    *,
    stage_units: Sequence[range],
    version: np.ndarray,
    window: int,
    microbatches: int,
    seed: int,
    dtype: Any = "float64",
    xp: Any = np,
    moe: Any = None,
) -> ReferenceResult:
    """Train `version.shape[1] // window` updates per stage under the staleness `version`
    (a `FlushFreePlan.version`, or any table with `version[s, j] <= j // window`), with
    `microbatches` microbatches per global batch."""
    version = np.asarray(version, dtype=np.int64)
    n_stages, m = version.shape
    if len(stage_units) != n_stages:
        raise ValueError(f"{len(stage_units)} stage partitions for {n_stages} stages")
    if window < 1 or m % window:
        raise ValueError(f"window = {window} must divide the {m} microbatches")
    updates = m // window
    if microbatches < 1 or data.global_batch % microbatches:
        raise ValueError(
            f"microbatches = {microbatches} must divide the global batch of "
            f"{data.global_batch} rows"
        )
    newest = np.arange(m) // window
    if (version < 0).any() or (version > newest[None, :]).any():
        raise ValueError("a microbatch cannot read a version its own window has not made yet")
    units = build_model(model, moe)
    stage = Stage(units, range(len(units)))
    params = stage.init(seed, xp, dtype)
    owner = {u: s for s, part in enumerate(stage_units) for u in part}
    if sorted(owner) != list(range(len(units))):
        raise ValueError(
            f"stage_units {[list(r) for r in stage_units]} must cover the model's "
            f"{len(units)} units once each"
        )
    parts = [{u: params[u] for u in part} for part in stage_units]
    versions: list[list[dict | None]] = [[part] for part in parts]  # versions[s][k]
    states = [init_state(optim, part) for part in parts]
    ds = build_dataset(data, model, seed)
    result = ReferenceResult([], [], {}, optimal_loss=ds.optimal_loss)
    per = data.global_batch // microbatches
    batch: tuple[int, Any, Any] = (-1, None, None)
    for k in range(updates):
        total: dict | None = None
        loss = 0.0
        for i in range(window):
            j = k * window + i
            if batch[0] != j // microbatches:
                inputs, targets = ds.global_batch(j // microbatches)
                batch = (j // microbatches, xp.asarray(inputs), xp.asarray(targets))
            sl = slice((j % microbatches) * per, (j % microbatches + 1) * per)
            seen = {u: versions[owner[u]][int(version[owner[u], j])][u] for u in owner}
            weight = 1.0 / window  # each microbatch's share of the update's tokens
            mb_loss, ctx = stage.forward(seen, batch[1][sl], batch[2][sl], loss_weight=weight)
            _, wctx = stage.backward_input(seen, ctx, weight)
            grads = stage.backward_weight(seen, wctx)
            total = grads if total is None else accumulate(total, grads)
            loss += weight * float(mb_loss)
        assert total is not None
        sq_total = 0.0
        lr = learning_rate(optim, k, updates)
        for s, part in enumerate(stage_units):
            g = {u: total[u] for u in part}
            sq = grad_sq_norm(g)
            sq_total += sq
            new, states[s] = apply_update(
                optim, versions[s][-1], g, states[s], lr, grad_scale=clip_scale(sq, optim.grad_clip)
            )
            versions[s].append(new)
            oldest = int(version[s, (k + 1) * window :].min()) if k + 1 < updates else k + 1
            for old in range(oldest):  # no later microbatch reads these: free them
                versions[s][old] = None
        if not (math.isfinite(sq_total) and math.isfinite(loss)):
            raise FloatingPointError(
                f"update {k + 1}: loss = {loss}, gradient norm^2 = {sq_total} (not finite); "
                "lower optim.lr or enable optim.grad_clip"
            )
        result.losses.append(loss)
        result.grad_norms.append(math.sqrt(sq_total))
    result.params = to_host({u: versions[owner[u]][-1][u] for u in sorted(owner)})
    return result
