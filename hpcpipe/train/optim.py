"""Optimizers as pure update functions over (nested) dicts of arrays, with explicit state.

State is plain data (a step count and slot trees such as AdamW's m and v) shaped like the
parameters, so it can be sharded over data-parallel ranks (ZeRO-1) and checkpointed as it is.
The elementwise kernels (`adamw_update`, `sgd_update`) work on any array, including flat shards.

Gradient clipping is split in two so a distributed runtime can reduce the partial squared norms
of its ranks first: `grad_sq_norm` (this rank's part) and `clip_scale` (from the reduced total).
The scale is then passed to the update as `grad_scale` instead of rescaling the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.config import option
from hpcpipe.model.layers import array_module
from hpcpipe.train.trees import leaves, tree_map

__all__ = [
    "OptimConfig",
    "OptimState",
    "adamw_update",
    "apply_update",
    "clip_scale",
    "grad_sq_norm",
    "init_state",
    "learning_rate",
    "sgd_update",
]

Array = Any
Tree = Any  # an array, or a Mapping of trees


@dataclass(frozen=True)
class OptimConfig:
    """[optim]: optimizer, learning-rate schedule and gradient clipping."""

    kind: str = option(
        "adamw",
        "adamw (decoupled weight decay) or sgd (momentum, L2 decay)",
        choices=("adamw", "sgd"),
    )
    lr: float = option(1e-3, "peak learning rate", minimum=0.0)
    betas: tuple[float, ...] = option(
        (0.9, 0.95), "AdamW moment decay rates [beta1, beta2]", minimum=0.0, maximum=0.999999
    )
    eps: float = option(1e-8, "AdamW denominator floor", minimum=0.0)
    weight_decay: float = option(
        0.0, "decay of weight matrices (arrays with >= 2 dims)", minimum=0.0
    )
    momentum: float = option(0.9, "SGD momentum (0 = plain SGD)", minimum=0.0, maximum=1.0)
    nesterov: bool = option(False, "SGD Nesterov momentum")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0 = off", minimum=0.0)
    warmup: int = option(0, "steps of linear learning-rate warm-up", minimum=0)
    schedule: str = option(
        "constant",
        "after warm-up: constant, or cosine decay to min_lr_ratio",
        choices=("constant", "cosine"),
    )
    min_lr_ratio: float = option(
        0.1, "cosine schedule floor, as a fraction of lr", minimum=0.0, maximum=1.0
    )

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ValueError(f"betas: = {list(self.betas)} must be two numbers [beta1, beta2]")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov: = true needs momentum > 0")


@dataclass(frozen=True)
class OptimState:
    """Updates applied so far and the slot trees: AdamW {"m", "v"}, SGD {"momentum"} (or none)."""

    step: int
    slots: Mapping[str, Tree]


def _zeros(a: Array) -> Array:
    return array_module(a).zeros_like(a)


def init_state(cfg: OptimConfig, params: Tree) -> OptimState:
    """Zero slots shaped like `params`."""
    if cfg.kind == "adamw":
        return OptimState(0, {"m": tree_map(_zeros, params), "v": tree_map(_zeros, params)})
    if cfg.momentum > 0:
        return OptimState(0, {"momentum": tree_map(_zeros, params)})
    return OptimState(0, {})


def adamw_update(
    p: Array,
    g: Array,
    m: Array,
    v: Array,
    *,
    t: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float | Array,
    grad_scale: float = 1.0,
) -> tuple[Array, Array, Array]:
    """One AdamW step (t counts from 1) -> new (p, m, v). Decay is decoupled: p *= 1 - lr*wd."""
    g = g * grad_scale
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * (g * g)
    mhat = m / (1.0 - beta1**t)
    vhat = v / (1.0 - beta2**t)
    p = p * (1.0 - lr * weight_decay) - lr * mhat / (vhat**0.5 + eps)
    return p, m, v


def sgd_update(
    p: Array,
    g: Array,
    buf: Array | None,
    *,
    lr: float,
    momentum: float,
    weight_decay: float | Array,
    nesterov: bool = False,
    grad_scale: float = 1.0,
) -> tuple[Array, Array | None]:
    """One SGD step with L2 decay and momentum (PyTorch convention); returns new (p, buf)."""
    d = g * grad_scale + weight_decay * p
    if buf is not None:
        buf = momentum * buf + d
        d = d + momentum * buf if nesterov else buf
    return p - lr * d, buf


def _leaf_update(
    cfg: OptimConfig, p: Array, g: Array, slots: dict[str, Array], t: int, lr: float, scale: float
) -> tuple[Array, dict[str, Array]]:
    wd = cfg.weight_decay if p.ndim >= 2 else 0.0  # biases and norm gains are not decayed
    if cfg.kind == "adamw":
        beta1, beta2 = cfg.betas
        p, m, v = adamw_update(
            p,
            g,
            slots["m"],
            slots["v"],
            t=t,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=cfg.eps,
            weight_decay=wd,
            grad_scale=scale,
        )
        return p, {"m": m, "v": v}
    if cfg.kind == "sgd":
        p, buf = sgd_update(
            p,
            g,
            slots.get("momentum"),
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=wd,
            nesterov=cfg.nesterov,
            grad_scale=scale,
        )
        return p, ({} if buf is None else {"momentum": buf})
    raise ValueError(f"optim.kind = {cfg.kind!r} is not a known optimizer")


def apply_update(
    cfg: OptimConfig,
    params: Tree,
    grads: Tree,
    state: OptimState,
    lr: float,
    grad_scale: float = 1.0,
) -> tuple[Tree, OptimState]:
    """New (params, state) after one step at learning rate `lr` with gradients * `grad_scale`.

    Weight decay applies to arrays with two or more dimensions (weight matrices, embeddings).
    """
    t = state.step + 1
    names = list(state.slots)

    def walk(p: Tree, g: Tree, slots: dict[str, Tree]) -> tuple[Tree, dict[str, Tree]]:
        if not isinstance(p, Mapping):
            return _leaf_update(cfg, p, g, slots, t, lr, grad_scale)
        new_p: dict[Any, Tree] = {}
        new_slots: dict[str, dict[Any, Tree]] = {n: {} for n in names}
        for k in p:
            new_p[k], sub = walk(p[k], g[k], {n: slots[n][k] for n in names})
            for n in names:
                new_slots[n][k] = sub[n]
        return new_p, new_slots

    new_params, new_slots = walk(params, grads, dict(state.slots))
    return new_params, OptimState(t, new_slots)


def grad_sq_norm(grads: Tree) -> float:
    """Sum of squared gradient entries (float64): this rank's part of the global norm squared."""
    total = 0.0
    for g in leaves(grads):
        total += float((g.astype(np.float64) ** 2).sum())
    return total


def clip_scale(sq_norm: float, max_norm: float) -> float:
    """Factor bringing the global gradient norm down to `max_norm` (1 when below it, or off).

    A non-finite norm gives NaN, so the caller's NaN check stops the run (no silent clipping).
    """
    if not math.isfinite(sq_norm):
        return math.nan
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(sq_norm) + 1e-6))


def learning_rate(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of step `step` (from 0): linear warm-up, then constant or cosine decay."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total_steps - cfg.warmup, 1)
    frac = min((step - cfg.warmup) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
