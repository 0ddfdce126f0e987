"""The single-process reference trainer: no MPI, no pipeline. It is the oracle for every layout.

One step: take the global batch, split it into microbatches of contiguous rows, run every unit as a
single stage (F, then B and W) on each, accumulate the gradients of the objective

    loss = mean over every token of the global batch
         = sum_k (tokens_k / tokens) * mean loss of microbatch k,

clip the global norm, apply the optimizer. A pipelined, data-parallel run computes the same sums in
another order, so its parameters must match these to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcpipe.model.config import ModelConfig
from hpcpipe.model.models import Params, build_model
from hpcpipe.model.stage import Stage, accumulate
from hpcpipe.train.data import DataConfig, Dataset, build_dataset
from hpcpipe.train.optim import (
    OptimConfig,
    apply_update,
    clip_scale,
    grad_sq_norm,
    init_state,
    learning_rate,
)

__all__ = ["ReferenceResult", "loss_and_grads", "to_host", "train_reference"]


def to_host(params: Params) -> dict[int, dict[str, np.ndarray]]:
    """A NumPy copy of a parameter (or gradient) tree, wherever it lives."""
    return {
        i: {k: (v.get() if hasattr(v, "get") else np.array(v)) for k, v in p.items()}
        for i, p in params.items()
    }


def loss_and_grads(
    stage: Stage, params: Params, inputs: Any, targets: Any, microbatches: int = 1
) -> tuple[float, Params]:
    """Mean loss over all tokens of (inputs, targets) and its gradients, by microbatches of rows."""
    rows = inputs.shape[0]
    if microbatches < 1 or rows % microbatches:
        raise ValueError(f"microbatches = {microbatches} must divide the {rows} rows of the batch")
    per = rows // microbatches
    total: Params | None = None
    loss = 0.0
    for k in range(microbatches):
        sl = slice(k * per, (k + 1) * per)
        weight = per / rows  # this microbatch's share of the global batch's tokens
        mb_loss, ctx = stage.forward(params, inputs[sl], targets[sl], loss_weight=weight)
        _, wctx = stage.backward_input(params, ctx, weight)
        grads = stage.backward_weight(params, wctx)
        total = grads if total is None else accumulate(total, grads)
        loss += weight * float(mb_loss)
    assert total is not None
    return loss, total


@dataclass
class ReferenceResult:
    """What the oracle reports: per-step losses and norms, final parameters, chosen gradients."""

    losses: list[float]
    grad_norms: list[float]
    params: dict[int, dict[str, np.ndarray]]
    grads: dict[int, dict[int, dict[str, np.ndarray]]] = field(default_factory=dict)
    optimal_loss: float | None = None


def train_reference(
    model: ModelConfig,
    data: DataConfig,
    optim: OptimConfig,
    *,
    steps: int,
    seed: int,
    microbatches: int = 1,
    dtype: Any = "float64",
    xp: Any = np,
    record_grads: Collection[int] = (),
    dataset: Dataset | None = None,
    on_step: Callable[[int, float], None] | None = None,
    moe: Any = None,
) -> ReferenceResult:
    """Train `steps` optimizer steps from the seeded init; return losses and final parameters.

    `record_grads` lists steps whose accumulated (unclipped) gradients are returned. `dataset`
    replaces the one built from `data` (tests use it to reuse a chain); `on_step(step, loss)` is
    called after every step. `moe` (a `hpcpipe.moe.MoEConfig`) adds MoE blocks with every
    expert local, the oracle for expert-parallel runs.
    """
    units = build_model(model, moe)
    stage = Stage(units, range(len(units)))
    params = stage.init(seed, xp, dtype)
    ds = dataset if dataset is not None else build_dataset(data, model, seed)
    state = init_state(optim, params)
    result = ReferenceResult([], [], {}, optimal_loss=ds.optimal_loss)
    for step in range(steps):
        inputs, targets = ds.global_batch(step)
        loss, grads = loss_and_grads(
            stage, params, xp.asarray(inputs), xp.asarray(targets), microbatches
        )
        sq = grad_sq_norm(grads)
        if not (math.isfinite(sq) and math.isfinite(loss)):
            raise FloatingPointError(
                f"step {step + 1}: loss = {loss}, gradient norm^2 = {sq} (not finite); "
                "lower optim.lr or enable optim.grad_clip"
            )
        if step in record_grads:
            result.grads[step] = to_host(grads)
        params, state = apply_update(
            optim,
            params,
            grads,
            state,
            learning_rate(optim, step, steps),
            grad_scale=clip_scale(sq, optim.grad_clip),
        )
        result.losses.append(loss)
        result.grad_norms.append(math.sqrt(sq))
        if on_step is not None:
            on_step(step, loss)
    result.params = to_host(params)
    return result
