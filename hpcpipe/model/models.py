"""Models as flat lists of pipeline units, their costs, and balanced contiguous partitions.

A model is ``[embedding, block_1, ..., block_L, loss head]``. The position of a unit in this list is
its *global layer index*: it seeds the unit's parameters and names them in checkpoints, so any
partition into stages starts from, and saves to, the same weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.model.blocks import LossHead, ResidualMLP, TransformerBlock
from hpcpipe.model.config import ModelConfig
from hpcpipe.model.layers import Array, Embedding, Module

__all__ = [
    "Params",
    "UnitCost",
    "balance",
    "boundary_shape",
    "build_model",
    "describe",
    "init_params",
    "partition",
    "unit_costs",
]

Params = dict[int, dict[str, Array]]  # global layer index -> parameter name -> array


def build_model(cfg: ModelConfig, moe: Any = None, expert_group: Any = None) -> list[Module]:
    """The pipeline units of the model: embedding, `cfg.layers` residual blocks, loss head.

    `moe` (a `hpcpipe.moe.MoEConfig` with experts > 0) turns every `moe.every`-th gpt block
    into an MoE block; `expert_group` (a `hpcpipe.moe.ExpertGroup`) places experts / ep of each
    block's experts on this rank, None keeps every expert local (single process).
    """
    d, n = cfg.d_model, cfg.layers
    use_moe = moe is not None and moe.experts > 0
    if use_moe and cfg.kind != "gpt":
        raise ValueError(f"kind: = {cfg.kind!r} has no MoE blocks; moe.experts > 0 needs gpt")
    if cfg.kind == "mlp":
        blocks: list[Module] = [ResidualMLP(d, cfg.d_ff, n) for _ in range(n)]
        first = Embedding(cfg.vocab, d)
    elif cfg.kind == "gpt":
        blocks = [
            _moe_block(cfg, moe, expert_group)
            if use_moe and moe.is_moe_block(b)
            else TransformerBlock(d, cfg.n_heads, cfg.d_ff, cfg.seq_len, n)
            for b in range(n)
        ]
        first = Embedding(cfg.vocab, d, seq_len=cfg.seq_len)
    else:
        raise ValueError(f"kind: = {cfg.kind!r} is not a known model (mlp, gpt)")
    return [first, *blocks, LossHead(d, cfg.vocab)]


def _moe_block(cfg: ModelConfig, moe: Any, expert_group: Any) -> Module:
    from hpcpipe.moe.layer import MoELayer, MoETransformerBlock  # moe builds on model layers

    layer = MoELayer(
        cfg.d_model,
        moe.d_ff_expert or cfg.d_ff,
        moe.experts,
        top_k=moe.top_k,
        capacity_factor=moe.capacity_factor,
        dropless=moe.dropless,
        aux_loss_coef=moe.aux_loss_coef,
        z_loss_coef=moe.z_loss_coef,
        n_blocks=cfg.layers,
        group=expert_group,
    )
    return MoETransformerBlock(cfg.d_model, cfg.n_heads, cfg.seq_len, cfg.layers, layer)


def boundary_shape(cfg: ModelConfig, batch: int) -> tuple[int, int, int]:
    """Shape of every activation passed between units (and so between stages)."""
    return (batch, cfg.seq_len, cfg.d_model)


def init_params(
    units: Sequence[Module],
    seed: int,
    xp: Any = np,
    dtype: Any = "float32",
    indices: Iterable[int] | None = None,
) -> Params:
    """Parameters of the units at `indices` (default: all), keyed by global layer index."""
    chosen = range(len(units)) if indices is None else indices
    return {i: units[i].init(seed, i, xp, dtype) for i in chosen}


@dataclass(frozen=True)
class UnitCost:
    """Cost estimate of one unit: parameter count and approximate forward FLOPs per token."""

    params: int
    flops: int


def unit_costs(units: Sequence[Module]) -> list[UnitCost]:
    return [UnitCost(u.n_params, u.flops_per_token()) for u in units]


def balance(
    weights: Sequence[float], n_stages: int, scale: Sequence[float] | None = None
) -> list[range]:
    """Split `weights` into `n_stages` contiguous, non-empty ranges minimising the heaviest one.

    `scale` (per stage, default all 1) multiplies a stage's weight: the time per unit of weight
    on the rank that holds it, so a rank measured twice as slow is given half the work.
    Exact dynamic programme; among partitions with the same heaviest stage it prefers the one with
    the smaller sum of squared stage weights (flatter), then the earlier split points.
    """
    n = len(weights)
    if n_stages < 1:
        raise ValueError(f"n_stages = {n_stages} must be >= 1")
    if n_stages > n:
        raise ValueError(f"cannot split {n} units into {n_stages} non-empty stages")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("unit weights must be finite and >= 0")
    k = np.ones(n_stages) if scale is None else np.asarray(scale, dtype=np.float64)
    if k.shape != (n_stages,) or np.any(k <= 0) or not np.all(np.isfinite(k)):
        raise ValueError(f"scale must give {n_stages} finite numbers > 0")
    prefix = np.concatenate(([0.0], np.cumsum(w)))
    worst = np.full((n_stages + 1, n + 1), np.inf)
    squares = np.full((n_stages + 1, n + 1), np.inf)
    cut = np.zeros((n_stages + 1, n + 1), dtype=np.int64)
    worst[0, 0] = squares[0, 0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            j = np.arange(s - 1, i)
            seg = (prefix[i] - prefix[j]) * k[s - 1]
            m = np.maximum(worst[s - 1, j], seg)
            q = squares[s - 1, j] + seg * seg
            best = np.lexsort((j, q, m))[0]
            worst[s, i], squares[s, i], cut[s, i] = m[best], q[best], j[best]
    bounds = [n]
    for s in range(n_stages, 0, -1):
        bounds.append(int(cut[s, bounds[-1]]))
    bounds.reverse()
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def balance_placement(
    weights: Sequence[float],
    n_stages: int,
    stages_of_rank: Sequence[Sequence[int]],
    rank_scale: Sequence[float] | None = None,
) -> list[range]:
    """Contiguous stages whose *rank* loads are balanced, for placements with several stages per
    rank (V shapes hold stages r and 2p-1-r; interleaved r, r+p, ...).

    Balancing each stage alone can leave a V's middle ranks with twice the work of rank 0 (whose
    two chunks hold the light embedding and loss head). Starting from the per-stage optimum, this
    moves single stage boundaries while that lowers the heaviest rank (then the sum of squared
    rank loads); a rank's load is the sum of its stages' weights, times its `rank_scale` (time
    per unit of weight on that rank, default 1).
    """
    owner = np.empty(n_stages, dtype=np.int64)
    for r, row in enumerate(stages_of_rank):
        owner[list(row)] = r
    k = (
        np.ones(len(stages_of_rank))
        if rank_scale is None
        else np.asarray(rank_scale, dtype=np.float64)
    )
    if k.shape != (len(stages_of_rank),):
        raise ValueError(f"rank_scale must give {len(stages_of_rank)} numbers, one per rank")
    ranges = balance(weights, n_stages, k[owner])
    if all(len(row) == 1 for row in stages_of_rank):
        return ranges  # one stage per rank: the per-stage optimum is the rank optimum
    w = np.asarray(weights, dtype=np.float64)
    prefix = np.concatenate(([0.0], np.cumsum(w)))
    bounds = [rg.start for rg in ranges] + [len(w)]

    def score(b: list[int]) -> tuple[float, float]:
        stage = prefix[b[1:]] - prefix[b[:-1]]
        load = np.bincount(owner, weights=stage, minlength=len(stages_of_rank)) * k
        return float(load.max()), float((load * load).sum())

    best = score(bounds)
    improved = True
    while improved:
        improved = False
        for i in range(1, n_stages):
            for step in (-1, 1):
                trial = list(bounds)
                trial[i] += step
                if not trial[i - 1] < trial[i] < trial[i + 1]:
                    continue  # every stage keeps at least one unit
                cand = score(trial)
                if cand < best:
                    bounds, best, improved = trial, cand, True
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def partition(
    units: Sequence[Module],
    n_stages: int,
    by: str | Sequence[int] = "flops",
    stages_of_rank: Sequence[Sequence[int]] | None = None,
    rank_scale: Sequence[float] | None = None,
) -> list[range]:
    """Contiguous unit ranges, one per stage: balanced by "params" or "flops", or explicit sizes.

    Explicit sizes are the number of units of each stage, e.g. ``[2, 3, 3, 2]`` for 10 units.
    With `stages_of_rank` (the schedule's placement) the balance is over ranks, not stages;
    `rank_scale` (with it) is each rank's time per unit of weight (a rank 2x slower: 2).
    """
    if isinstance(by, str):
        if by not in ("params", "flops"):
            raise ValueError(f"by = {by!r} must be 'params', 'flops' or a list of stage sizes")
        weights = [u.n_params if by == "params" else u.flops_per_token() for u in units]
        if stages_of_rank is not None:
            return balance_placement(weights, n_stages, stages_of_rank, rank_scale)
        return balance(weights, n_stages)
    sizes = [int(s) for s in by]
    if len(sizes) != n_stages:
        raise ValueError(f"explicit partition has {len(sizes)} stages, expected {n_stages}")
    if any(s < 1 for s in sizes) or sum(sizes) != len(units):
        raise ValueError(
            f"explicit partition {sizes} must give every stage >= 1 unit and sum to "
            f"{len(units)} (the model's units)"
        )
    starts = np.concatenate(([0], np.cumsum(sizes))).tolist()
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def describe(units: Sequence[Module], stages: Sequence[range] | None = None) -> str:
    """A table of units (index, type, params, FLOPs/token), with stage totals when given."""
    lines = [f"{'unit':>4}  {'type':<18} {'params':>10} {'flops/tok':>10}"]
    for i, u in enumerate(units):
        lines.append(f"{i:>4}  {type(u).__name__:<18} {u.n_params:>10} {u.flops_per_token():>10}")
    for s, r in enumerate(stages or ()):
        p = sum(units[i].n_params for i in r)
        f = sum(units[i].flops_per_token() for i in r)
        lines.append(f"stage {s}: units {r.start}..{r.stop - 1}  params={p} flops/tok={f}")
    return "\n".join(lines)
