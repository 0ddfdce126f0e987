"""Routing of one microbatch: top-k choice, per-expert capacity, token dropping, auxiliary losses.

Pure host-side NumPy on the router probabilities of *one* microbatch on *one* rank. Nothing here
looks at other microbatches or other ranks, so a single-process run over the same microbatches
makes exactly the same decisions (same choices, same drops) as any parallel layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Routing",
    "aux_loss_grad",
    "expert_capacity",
    "gate_grad",
    "load_balancing_loss",
    "route",
    "z_loss",
]


def expert_capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """ceil(tokens * top_k / experts * capacity_factor): assignments one expert keeps.

    Rounded to 9 decimals before the ceiling so that binary noise in the factor (1.1 is not
    exactly 1.1) cannot add a slot.
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor = {capacity_factor} must be > 0 in drop mode")
    return math.ceil(round(tokens * top_k / experts * capacity_factor, 9))


@dataclass(frozen=True)
class Routing:
    """The kept (token, expert) assignments of one microbatch, in dispatch order.

    Dispatch order is by expert (ascending global index), then by token index, so the rows for
    the experts of ep rank r form one contiguous block (rank r holds a contiguous expert range).
    """

    topk: np.ndarray  # (N, k) chosen experts per token, most probable first
    token: np.ndarray  # (n_kept,) token of each kept assignment
    slot: np.ndarray  # (n_kept,) which of the token's k choices it is (0 = most probable)
    expert: np.ndarray  # (n_kept,) its expert
    routed: np.ndarray  # (E,) assignments per expert before dropping
    kept: np.ndarray  # (E,) assignments per expert after dropping
    capacity: int  # per-expert capacity used (N for dropless)

    @property
    def tokens(self) -> int:
        return int(self.topk.shape[0])

    @property
    def dropped(self) -> int:
        return int(self.routed.sum() - self.kept.sum())


def route(probs: np.ndarray, top_k: int, capacity: int | None) -> Routing:
    """Choose the top-k experts of every token and keep at most `capacity` per expert.

    Ties between equal probabilities go to the lower expert index (choice) and to the lower
    token index (keeping). An expert over capacity drops the assignments with the lowest router
    probability. `capacity=None` is dropless.
    """
    probs = np.asarray(probs, dtype=np.float64)
    n, e = probs.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k = {top_k} must be in 1..{e} (the number of experts)")
    topk = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    tok = np.repeat(np.arange(n, dtype=np.int64), top_k)
    slot = np.tile(np.arange(top_k, dtype=np.int64), n)
    exp = topk.reshape(-1).astype(np.int64)
    routed = np.bincount(exp, minlength=e)
    if capacity is None or capacity >= n:
        keep = np.ones(tok.shape, dtype=bool)
    else:
        # by expert, then probability descending, then token: a rank within each expert
        order = np.lexsort((tok, -probs[tok, exp], exp))
        sorted_exp = exp[order]
        starts = np.searchsorted(sorted_exp, np.arange(e))
        rank = np.arange(order.size) - starts[sorted_exp]
        keep = np.zeros(tok.shape, dtype=bool)
        keep[order[rank < max(capacity, 0)]] = True
    tok, slot, exp = tok[keep], slot[keep], exp[keep]
    order = np.lexsort((tok, exp))
    return Routing(
        topk=topk,
        token=tok[order],
        slot=slot[order],
        expert=exp[order],
        routed=routed,
        kept=np.bincount(exp, minlength=e),
        capacity=n if capacity is None else int(capacity),
    )


def load_balancing_loss(probs: Any, routing: Routing) -> Any:
    """experts * sum_i f_i * P_i; f_i = share of top-k assignments (before dropping) to expert i,
    P_i = mean router probability of expert i. Equals 1 for perfectly uniform routing."""
    n, e = probs.shape
    if n == 0:
        return probs.sum() * 0.0
    f = routing.routed / (n * routing.topk.shape[1])
    xp_f = _like(probs, f)
    return e * (xp_f * probs.mean(axis=0)).sum()


def aux_loss_grad(probs: Any, routing: Routing) -> Any:
    """d(load-balancing loss)/d(probs[t, i]) = experts * f_i / N, the same row (E,) for every
    token t: f counts discrete choices, so only the mean probabilities P_i carry a gradient."""
    n, e = probs.shape
    f = routing.routed / (max(n, 1) * routing.topk.shape[1])
    return _like(probs, e * f / max(n, 1))


def z_loss(lse: Any) -> Any:
    """mean over tokens of logsumexp(logits)^2: keeps router logits small (ST-MoE)."""
    if lse.shape[0] == 0:
        return lse.sum() * 0.0
    return (lse * lse).mean()


def gate_grad(probs: Any, topk: Any, dgate: Any, normalize: bool) -> Any:
    """d(loss)/d(probs) from d(loss)/d(gate) of every token's top-k choices (N, k).

    Gates are the chosen probabilities, divided by their sum over the k choices when
    `normalize`: g_j = p_j / S, so dL/dp_j = (dL/dg_j - sum_m dL/dg_m g_m) / S for chosen j.
    Dropped choices have dL/dg = 0 but still enter S, as in the forward pass.
    """
    xp = _xp(probs)
    rows = xp.arange(probs.shape[0])[:, None]
    dp = xp.zeros_like(probs)
    if normalize:
        p_top = probs[rows, topk]
        s = p_top.sum(axis=1, keepdims=True)
        g = p_top / s
        d_top = (dgate - (dgate * g).sum(axis=1, keepdims=True)) / s
    else:
        d_top = dgate
    dp[rows, topk] = d_top
    return dp


def _xp(a: Any) -> Any:
    from hpcpipe.model.layers import array_module

    return array_module(a)


def _like(a: Any, host: np.ndarray) -> Any:
    """`host` on the array module and in the dtype of `a`."""
    return _xp(a).asarray(host, dtype=a.dtype)
