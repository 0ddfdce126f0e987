"""What each pipeline unit of a deck's model weighs: parameters, FLOPs and saved activations.

The layout search needs these for models far too large to build, so they are computed from
the unit descriptions (`build_model` allocates nothing) and, for activations, from what each
unit's forward keeps for its backward. Activation counts follow the forward code exactly
(tests compare them with `activation_bytes` of real contexts): a change to what a layer saves
must change them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["UnitShape", "unit_shapes"]

INDEX_BYTES = 8
"""Token ids and targets are int64 on every backend."""


@dataclass(frozen=True)
class UnitShape:
    """One pipeline unit: `params` replicated over dp, `expert_params` (all experts of an MoE
    block) sharded over ep, forward FLOPs and saved bytes per token, all-to-all rounds."""

    name: str
    params: int
    expert_params: int
    flops_per_token: int
    activation_bytes_per_token: int
    moe: bool


def _saved_elements(unit: Any, model: Any, moe: Any) -> tuple[int, int]:
    """(floats, int64s) one token leaves in the unit's forward context."""
    kind = type(unit).__name__
    d, f, t, h = model.d_model, model.d_ff, model.seq_len, model.n_heads
    attention = 6 * d + 1 + h * t  # ln (x-hat, 1/std), qkv input, q k v, scores, out input
    if kind == "Embedding":
        return 0, 1  # the ids
    if kind == "TransformerBlock":
        return attention + 2 * d + 1 + 3 * f, 0  # + ln, fc input, gelu input and tanh, proj in
    if kind == "ResidualMLP":
        return 2 * d + 1 + 3 * f, 0
    if kind == "MoETransformerBlock":
        k, experts, fe = moe.top_k, moe.experts, moe.d_ff_expert or f
        # ln; router input, probabilities, log-sum-exp, gates; each routed row: its returned
        # copy and the expert MLP's fc input, gelu input, tanh and proj input (dropless bound)
        routed = k * (d + d + 3 * fe)
        return attention + (d + 1) + d + experts + 1 + k + routed, 0
    if kind == "LossHead":
        return 2 * d + 1 + model.vocab, 1  # ln, proj input, probabilities; the targets
    raise ValueError(f"no activation model for pipeline unit {kind}")


def unit_shapes(model: Any, moe: Any, dtype_bytes: int) -> list[UnitShape]:
    """The deck's units ([model], [moe]) as the search sees them."""
    from hpcpipe.model.models import build_model

    units = build_model(model, moe if moe is not None and moe.enabled else None)
    out = []
    for u in units:
        is_moe = type(u).__name__ == "MoETransformerBlock"
        expert = u.moe.expert.n_params * moe.experts if is_moe else 0
        floats, ints = _saved_elements(u, model, moe)
        out.append(
            UnitShape(
                name=type(u).__name__,
                params=u.n_params - expert,
                expert_params=expert,
                flops_per_token=u.flops_per_token(),
                activation_bytes_per_token=floats * dtype_bytes + ints * INDEX_BYTES,
                moe=is_moe,
            )
        )
    return out
