"""Composite layers built from the primitives, keeping the B/W split of every part.

A composite's parameters are one flat dict whose keys are dotted paths (``attn.sa.qkv.w``), so
they map directly onto checkpoint paths; its ctx and wctx are the lists of its children's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcpipe.model.layers import (
    Array,
    CausalSelfAttentionCore,
    Gelu,
    Layer,
    LayerNorm,
    Linear,
    Module,
    SoftmaxCrossEntropy,
)

__all__ = [
    "CausalSelfAttention",
    "Chain",
    "LossHead",
    "Residual",
    "ResidualMLP",
    "TransformerBlock",
]


def _sub(params: dict[str, Array], name: str) -> dict[str, Array]:
    prefix = name + "."
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


class Chain(Layer):
    """Children applied in order; parameters namespaced by child name."""

    def __init__(self, children: Sequence[tuple[str, Layer]]):
        self.children = list(children)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            f"{name}.{k}": s
            for name, child in self.children
            for k, s in child.param_shapes().items()
        }

    def flops_per_token(self) -> int:
        return sum(child.flops_per_token() for _, child in self.children)

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {
            f"{name}.{k}": v
            for name, child in self.children
            for k, v in child.init_host(rng).items()
        }

    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        ctxs = []
        for name, child in self.children:
            x, ctx = child.forward(_sub(params, name), x)
            ctxs.append(ctx)
        return x, ctxs

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        wctxs: list[Any] = [None] * len(self.children)
        for i in reversed(range(len(self.children))):
            name, child = self.children[i]
            dy, wctxs[i] = child.backward_input(_sub(params, name), ctx[i], dy)
        return dy, wctxs

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        grads = {}
        for (name, child), w in zip(self.children, wctx, strict=True):
            for k, g in child.backward_weight(_sub(params, name), w).items():
                grads[f"{name}.{k}"] = g
        return grads


class Residual(Layer):
    """y = x + inner(x). B adds the skip gradient; the inner parameters keep their names."""

    def __init__(self, inner: Layer):
        self.inner = inner

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.inner.param_shapes()

    def flops_per_token(self) -> int:
        return self.inner.flops_per_token()

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return self.inner.init_host(rng)

    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        h, ctx = self.inner.forward(params, x)
        return x + h, ctx

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        dx, wctx = self.inner.backward_input(params, ctx, dy)
        return dy + dx, wctx

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        return self.inner.backward_weight(params, wctx)


def _out_std(d_in: int, n_blocks: int) -> float:
    """Residual-branch output projections shrink with depth so the residual stream stays O(1)."""
    return 1.0 / math.sqrt(d_in) / math.sqrt(2.0 * max(n_blocks, 1))


class CausalSelfAttention(Chain):
    """Multi-head causal self-attention: qkv projection -> attention core -> output projection.

    The qkv projection has no bias: a key bias has an identically zero gradient (softmax ignores
    a shift shared by a row), so Adam would turn its rounding noise into updates that differ
    between layouts that sum gradients in different orders.
    """

    def __init__(self, d_model: int, n_heads: int, seq_len: int, n_blocks: int = 1):
        super().__init__(
            [
                ("qkv", Linear(d_model, 3 * d_model, bias=False)),
                ("core", CausalSelfAttentionCore(d_model, n_heads, seq_len)),
                ("out", Linear(d_model, d_model, std=_out_std(d_model, n_blocks))),
            ]
        )


def _mlp(d_model: int, d_ff: int, n_blocks: int) -> list[tuple[str, Layer]]:
    return [
        ("ln", LayerNorm(d_model)),
        ("fc", Linear(d_model, d_ff)),
        ("act", Gelu(d_ff)),
        ("proj", Linear(d_ff, d_model, std=_out_std(d_ff, n_blocks))),
    ]


class ResidualMLP(Chain):
    """Pre-LN residual MLP block: x + proj(gelu(fc(ln(x)))). Acts on each token independently."""

    def __init__(self, d_model: int, d_ff: int, n_blocks: int = 1):
        super().__init__([("mlp", Residual(Chain(_mlp(d_model, d_ff, n_blocks))))])


class TransformerBlock(Chain):
    """Pre-LN decoder block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, seq_len: int, n_blocks: int = 1):
        attn = Chain(
            [
                ("ln", LayerNorm(d_model)),
                ("sa", CausalSelfAttention(d_model, n_heads, seq_len, n_blocks)),
            ]
        )
        super().__init__(
            [("attn", Residual(attn)), ("mlp", Residual(Chain(_mlp(d_model, d_ff, n_blocks))))]
        )


class LossHead(Module):
    """Last pipeline unit: final LayerNorm -> vocabulary projection -> mean softmax cross-entropy.

    ``forward(params, x, targets) -> (loss, ctx)`` returns the mean over this microbatch's tokens
    as a 0-d array. ``backward_input(params, ctx, dloss)`` starts from the scalar weight of that
    loss in the objective: with the objective = mean over every token of the global batch, a
    microbatch of n tokens out of N gets ``dloss = n / N``, so summed microbatch gradients equal
    the global ones.
    """

    def __init__(self, d_model: int, vocab: int):
        self.d_model, self.vocab = d_model, vocab
        self.body = Chain([("ln", LayerNorm(d_model)), ("proj", Linear(d_model, vocab))])
        self.loss = SoftmaxCrossEntropy(vocab)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.body.param_shapes()

    def flops_per_token(self) -> int:
        return self.body.flops_per_token() + self.loss.flops_per_token()

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return self.body.init_host(rng)

    def logits(self, params: dict[str, Array], x: Array) -> Array:
        """Inference path: the logits only, no context kept."""
        return self.body.forward(params, x)[0]

    def forward(self, params: dict[str, Array], x: Array, targets: Array) -> tuple[Array, Any]:
        logits, body_ctx = self.body.forward(params, x)
        loss, loss_ctx = self.loss.forward(logits, targets)
        return loss, (body_ctx, loss_ctx)

    def backward_input(
        self, params: dict[str, Array], ctx: Any, dy: Any = 1.0
    ) -> tuple[Array, Any]:
        body_ctx, loss_ctx = ctx
        dlogits = self.loss.backward(loss_ctx, float(dy))
        return self.body.backward_input(params, body_ctx, dlogits)

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        return self.body.backward_weight(params, wctx)
