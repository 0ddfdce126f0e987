"""Primitive layers with a split backward: forward (F), backward-input (B), backward-weight (W).

Every layer is a *stateless description* (shapes only). Parameters, saved activations and gradients
are passed in and returned explicitly, so a pipeline stage can keep many microbatches in flight and
run B and W at different times, as zero-bubble schedules need:

    y, ctx = layer.forward(params, x)                 # F: ctx holds what B needs
    dx, wctx = layer.backward_input(params, ctx, dy)  # B: wctx holds what W needs; drop ctx
    grads = layer.backward_weight(params, wctx)       # W: same keys as params

All arithmetic goes through the array module of the inputs (NumPy or CuPy), so the same code runs on
CPU and GPU; parameters are drawn on the host from a generator seeded by (seed, global layer index),
so every partitioning of a model into stages starts from identical weights.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

__all__ = [
    "INIT_STREAM",
    "Array",
    "CausalSelfAttentionCore",
    "Embedding",
    "Gelu",
    "Layer",
    "LayerNorm",
    "Linear",
    "Module",
    "SoftmaxCrossEntropy",
    "activation_bytes",
    "array_module",
]

Array = Any  # numpy.ndarray or cupy.ndarray
INIT_STREAM = 1  # tag of the parameter-init random stream: default_rng([seed, INIT_STREAM, index])


def array_module(a: Array) -> Any:
    """The module (numpy or cupy) that owns `a`, found without importing cupy."""
    mod = type(a).__module__.split(".")[0]
    if mod == "numpy":
        return np
    import sys

    return sys.modules[mod]


def activation_bytes(tree: Any) -> int:
    """Bytes of memory kept alive by a ctx/wctx tree, each underlying buffer counted once."""
    return sum(int(b.nbytes) for b in buffers(tree).values())


def buffers(tree: Any) -> dict[int, Any]:
    """The arrays that own the memory a ctx/wctx tree keeps alive (views resolved to their
    base), by id: what a byte count must count once however many views point into it.

    A loop, not a recursive closure: a closure that calls itself is a reference cycle, and
    the arrays it collected would then live until the cyclic garbage collector runs."""
    seen: dict[int, Any] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif hasattr(node, "nbytes") and hasattr(node, "shape"):
            base = node
            while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
                base = base.base
            seen[id(base)] = base
    return seen


class Module(ABC):
    """What every pipeline unit has: parameter shapes, seeded init, cost, B and W."""

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter, by name (empty for parameter-free layers)."""
        return {}

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    def flops_per_token(self) -> int:
        """Approximate forward FLOPs per token (backward B and W cost about as much each)."""
        return 0

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Float64 host parameters drawn from `rng` (composites draw their children in order)."""
        return {}

    def init(
        self, seed: int, layer_index: int, xp: Any = np, dtype: Any = "float32"
    ) -> dict[str, Array]:
        """Parameters depending only on (seed, global layer index), cast to `dtype` on `xp`."""
        rng = np.random.default_rng([seed, INIT_STREAM, layer_index])
        return {k: xp.asarray(v, dtype=np.dtype(dtype)) for k, v in self.init_host(rng).items()}

    @abstractmethod
    def backward_input(
        self, params: dict[str, Array], ctx: Any, dy: Any
    ) -> tuple[Array | None, Any]:
        """B: gradient with respect to the input, and the context that W will need."""

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        """W: gradients of the parameters (same keys as `params`)."""
        return {}

    def backward(
        self, params: dict[str, Array], ctx: Any, dy: Any
    ) -> tuple[Array | None, dict[str, Array]]:
        """Fused backward (BW): B immediately followed by W."""
        dx, wctx = self.backward_input(params, ctx, dy)
        return dx, self.backward_weight(params, wctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.n_params} params)"


class Layer(Module):
    """A unit that maps an activation (or, for the first unit, token ids) to an activation."""

    @abstractmethod
    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        """F: output and the context that B will need."""


class Linear(Layer):
    """y = x @ w (+ b) over the last axis. W needs the input and the output gradient."""

    def __init__(self, d_in: int, d_out: int, std: float | None = None, bias: bool = True):
        self.d_in, self.d_out, self.bias = d_in, d_out, bias
        self.std = std if std is not None else 1.0 / math.sqrt(d_in)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"w": (self.d_in, self.d_out)}
        if self.bias:
            shapes["b"] = (self.d_out,)
        return shapes

    def flops_per_token(self) -> int:
        return 2 * self.d_in * self.d_out

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {"w": rng.standard_normal((self.d_in, self.d_out)) * self.std}
        if self.bias:
            out["b"] = np.zeros(self.d_out)
        return out

    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        y = x @ params["w"]
        return (y + params["b"] if self.bias else y), x

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        return dy @ params["w"].T, (ctx, dy)

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        x, dy = wctx
        x2 = x.reshape(-1, self.d_in)
        dy2 = dy.reshape(-1, self.d_out)
        grads = {"w": x2.T @ dy2}
        if self.bias:
            grads["b"] = dy2.sum(axis=0)
        return grads


def _scatter_add_rows(xp: Any, n_rows: int, index: Array, values: Array) -> Array:
    """out[index[i]] += values[i], for NumPy and CuPy alike."""
    out = xp.zeros((n_rows, values.shape[-1]), dtype=values.dtype)
    if hasattr(xp, "add") and hasattr(xp.add, "at"):
        xp.add.at(out, index, values)
    else:  # one-hot product: deterministic, and available in every array module
        onehot = (index[:, None] == xp.arange(n_rows)[None, :]).astype(values.dtype)
        out += onehot.T @ values
    return out


class Embedding(Layer):
    """Token embedding, plus learned position embedding when `seq_len` is given.

    Input: integer token ids (batch, T). B has no input gradient (returns None); W scatters the
    output gradient into the rows of the tokens that were looked up.
    """

    def __init__(self, vocab: int, d_model: int, seq_len: int | None = None, std: float = 1.0):
        self.vocab, self.d_model, self.seq_len, self.std = vocab, d_model, seq_len, std

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"wte": (self.vocab, self.d_model)}
        if self.seq_len is not None:
            shapes["wpe"] = (self.seq_len, self.d_model)
        return shapes

    def flops_per_token(self) -> int:
        return self.d_model

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {"wte": rng.standard_normal((self.vocab, self.d_model)) * self.std}
        if self.seq_len is not None:
            out["wpe"] = rng.standard_normal((self.seq_len, self.d_model)) * self.std
        return out

    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        y = params["wte"][x]
        if self.seq_len is not None:
            t = x.shape[-1]
            if t > self.seq_len:
                raise ValueError(f"sequence length {t} exceeds the position table ({self.seq_len})")
            y = y + params["wpe"][:t]
        return y, x

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[None, Any]:
        return None, (ctx, dy)

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        tokens, dy = wctx
        xp = array_module(dy)
        d = self.d_model
        grads = {"wte": _scatter_add_rows(xp, self.vocab, tokens.reshape(-1), dy.reshape(-1, d))}
        if self.seq_len is not None:
            t = tokens.shape[-1]
            dpos = xp.zeros((self.seq_len, d), dtype=dy.dtype)
            dpos[:t] = dy.reshape(-1, t, d).sum(axis=0)
            grads["wpe"] = dpos
        return grads


class LayerNorm(Layer):
    """Normalise the last axis, then scale (g) and shift (b)."""

    def __init__(self, d: int, eps: float = 1e-5):
        self.d, self.eps = d, eps

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"g": (self.d,), "b": (self.d,)}

    def flops_per_token(self) -> int:
        return 8 * self.d

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"g": np.ones(self.d), "b": np.zeros(self.d)}

    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        mu = x.mean(axis=-1, keepdims=True)
        xc = x - mu
        rstd = 1.0 / (((xc * xc).mean(axis=-1, keepdims=True) + self.eps) ** 0.5)
        xhat = xc * rstd
        return xhat * params["g"] + params["b"], (xhat, rstd)

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        xhat, rstd = ctx
        dxhat = dy * params["g"]
        dx = rstd * (
            dxhat
            - dxhat.mean(axis=-1, keepdims=True)
            - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
        )
        return dx, (xhat, dy)

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        xhat, dy = wctx
        dy2 = dy.reshape(-1, self.d)
        return {"g": (dy2 * xhat.reshape(-1, self.d)).sum(axis=0), "b": dy2.sum(axis=0)}


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


class Gelu(Layer):
    """GELU, tanh approximation (as in GPT-2). No parameters, so W is empty."""

    def __init__(self, d: int = 0):
        self.d = d

    def flops_per_token(self) -> int:
        return 10 * self.d

    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        xp = array_module(x)
        t = xp.tanh(_GELU_C * (x + _GELU_A * x * x * x))
        return 0.5 * x * (1.0 + t), (x, t)

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        x, t = ctx
        dt = _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt), None


class CausalSelfAttentionCore(Layer):
    """Causal softmax attention of packed q, k, v: (batch, T, 3*d) -> (batch, T, d). No params.

    Wrapped between a qkv projection and an output projection by `CausalSelfAttention`.
    """

    def __init__(self, d_model: int, n_heads: int, seq_len: int):
        if d_model % n_heads:
            raise ValueError(f"n_heads = {n_heads} must divide d_model = {d_model}")
        self.d_model, self.n_heads, self.seq_len = d_model, n_heads, seq_len

    def flops_per_token(self) -> int:
        # q k^T and att v over the full context (the causal half is not skipped), plus softmax.
        return 4 * self.seq_len * self.d_model + 5 * self.n_heads * self.seq_len

    def forward(self, params: dict[str, Array], x: Array) -> tuple[Array, Any]:
        xp = array_module(x)
        b, t, _ = x.shape
        h, dh = self.n_heads, self.d_model // self.n_heads
        qkv = x.reshape(b, t, 3, h, dh).transpose(2, 0, 3, 1, 4)  # (3, b, h, t, dh)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scale = 1.0 / math.sqrt(dh)
        s = (q @ k.swapaxes(-1, -2)) * scale
        causal = xp.tril(xp.ones((t, t), dtype=bool))
        s = xp.where(causal, s, -xp.inf)
        s = s - s.max(axis=-1, keepdims=True)
        a = xp.exp(s)
        a /= a.sum(axis=-1, keepdims=True)
        y = (a @ v).transpose(0, 2, 1, 3).reshape(b, t, self.d_model)
        return y, (q, k, v, a)

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        q, k, v, a = ctx
        xp = array_module(dy)
        b, h, t, dh = q.shape
        scale = 1.0 / math.sqrt(dh)
        do = dy.reshape(b, t, h, dh).transpose(0, 2, 1, 3)
        dv = a.swapaxes(-1, -2) @ do
        da = do @ v.swapaxes(-1, -2)
        ds = a * (da - (da * a).sum(axis=-1, keepdims=True))  # masked entries have a = 0
        dq = (ds @ k) * scale
        dk = (ds.swapaxes(-1, -2) @ q) * scale
        dx = xp.stack((dq, dk, dv)).transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * self.d_model)
        return dx, None


class SoftmaxCrossEntropy:
    """Mean cross-entropy of logits (..., V) against integer targets (...). Not a pipeline unit."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def flops_per_token(self) -> int:
        return 5 * self.vocab

    def forward(self, logits: Array, targets: Array) -> tuple[Array, Any]:
        """Mean loss (0-d array, left on the device) and the context (probabilities, targets)."""
        xp = array_module(logits)
        z = logits.reshape(-1, self.vocab)
        z = z - z.max(axis=-1, keepdims=True)
        ez = xp.exp(z)
        se = ez.sum(axis=-1, keepdims=True)
        t = targets.reshape(-1)
        rows = xp.arange(t.shape[0])
        loss = (xp.log(se[:, 0]) - z[rows, t]).mean()
        return loss, (ez / se, t, logits.shape)

    def backward(self, ctx: Any, dloss: float) -> Array:
        """Gradient of `dloss * loss` with respect to the logits."""
        p, t, shape = ctx
        xp = array_module(p)
        g = p.copy()
        g[xp.arange(t.shape[0]), t] -= 1.0
        g *= dloss / t.shape[0]
        return g.reshape(shape)
