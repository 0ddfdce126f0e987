"""The MoE layer and the MoE transformer block, with the F / B / W split of every other unit.

    y, ctx = layer.forward(params, h, loss_weight)   # route, dispatch, experts, combine
    dh, wctx = layer.backward_input(params, ctx, dy)  # B: reverse exchanges, router gradient
    grads = layer.backward_weight(params, wctx)       # W: router and local expert weights

F issues: counts `Alltoall`, tokens `Alltoallv`, outputs `Alltoallv` back. B issues: output
gradients `Alltoallv` (same direction as the tokens), input gradients `Alltoallv` back. W has no
communication: each rank computes the weight gradients of its own experts from the rows it
received, summed over every source rank of the group.

The microbatch's auxiliary losses enter the objective as
`loss_weight * (aux_loss_coef * experts * sum_i f_i P_i + z_loss_coef * mean(lse^2))`, with
`loss_weight` the microbatch's share of the global batch (the same weight as its mean
cross-entropy), so per-microbatch gradients sum to the gradient of the global objective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.backend import active_backend
from hpcpipe.model.blocks import Chain, Residual, _out_std, _sub
from hpcpipe.model.layers import (
    Array,
    Gelu,
    Layer,
    LayerNorm,
    Linear,
    _scatter_add_rows,
    array_module,
)
from hpcpipe.model.steps import Steps, run
from hpcpipe.moe.plan import LocalExperts
from hpcpipe.moe.router import (
    aux_loss_grad,
    expert_capacity,
    gate_grad,
    load_balancing_loss,
    route,
    z_loss,
)

__all__ = [
    "EXPERT_STREAM",
    "MoELayer",
    "MoEStats",
    "MoETransformerBlock",
    "is_expert_param",
    "summarize_stats",
]

EXPERT_STREAM = 2  # expert e of a unit draws from default_rng([key, EXPERT_STREAM, e])


def is_expert_param(name: str) -> bool:
    """True for an expert's parameter (a dotted name with an `experts` component, such as
    `moe.experts.3.fc.w`): its gradient is reduced over the expert-data-parallel group (same
    pp and ep coordinates), not the whole data-parallel group."""
    return "experts" in name.split(".")


@dataclass(frozen=True)
class MoEStats:
    """What one MoE layer saw in one microbatch on this rank (losses unscaled by coefficients)."""

    aux_loss: Any  # 0-d array: experts * sum_i f_i P_i
    z_loss: Any  # 0-d array: mean(logsumexp(logits)^2)
    routed: np.ndarray  # (E,) assignments per expert before dropping
    kept: np.ndarray  # (E,) after dropping
    tokens: int
    top_k: int
    capacity: int

    @property
    def dropped_fraction(self) -> float:
        n = self.tokens * self.top_k
        return float(self.routed.sum() - self.kept.sum()) / n if n else 0.0


def summarize_stats(stats: Iterable[MoEStats]) -> dict[str, float]:
    """Figures for one step's log line: tokens per expert (kept, per layer and microbatch:
    min/mean/max), dropped fraction, and mean aux / z losses."""
    stats = list(stats)
    if not stats:
        return {}
    kept = np.concatenate([s.kept for s in stats]).astype(np.float64)
    routed = sum(int(s.routed.sum()) for s in stats)
    total = sum(s.tokens * s.top_k for s in stats)
    # the losses are device scalars: one copy for all of them, not two per layer and microbatch
    losses = _scalars([s.aux_loss for s in stats] + [s.z_loss for s in stats])
    return {
        "tokens_per_expert_min": float(kept.min()),
        "tokens_per_expert_mean": float(kept.mean()),
        "tokens_per_expert_max": float(kept.max()),
        "dropped_fraction": (routed - float(kept.sum())) / total if total else 0.0,
        "aux_loss": float(np.mean(losses[: len(stats)])),
        "z_loss": float(np.mean(losses[len(stats) :])),
    }


def _expert_mlp(d_model: int, d_ff: int, n_blocks: int) -> Chain:
    return Chain(
        [
            ("fc", Linear(d_model, d_ff)),
            ("act", Gelu(d_ff)),
            ("proj", Linear(d_ff, d_model, std=_out_std(d_ff, n_blocks))),
        ]
    )


class MoELayer(Layer):
    """Router + experts on (..., d_model) activations; the output excludes the residual.

    `group` is an `ExpertGroup` (this rank holds `group.local_experts`) or None for every
    expert local. `capacity` fixes the per-expert capacity instead of deriving it from
    `capacity_factor` (0 drops every assignment).
    """

    uses_loss_weight = True

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        dropless: bool = False,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        n_blocks: int = 1,
        group: Any = None,
        capacity: int | None = None,
    ):
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k = {top_k} must be in 1..experts = {experts}")
        if not dropless and capacity is None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor = {capacity_factor} must be > 0 in drop mode")
        self.d_model, self.d_ff, self.experts, self.top_k = d_model, d_ff, experts, top_k
        self.capacity_factor, self.dropless, self.fixed_capacity = (
            capacity_factor,
            dropless,
            capacity,
        )
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.group = group if group is not None else LocalExperts(experts)
        if self.group.experts != experts:
            raise ValueError(f"the expert group holds {self.group.experts} experts, not {experts}")
        self.router = Linear(d_model, experts, std=1.0 / math.sqrt(d_model), bias=False)
        self.expert = _expert_mlp(d_model, d_ff, n_blocks)

    @property
    def local_experts(self) -> range:
        return self.group.local_experts

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"router.w": (self.d_model, self.experts)}
        for e in self.local_experts:
            for k, s in self.expert.param_shapes().items():
                shapes[f"experts.{e}.{k}"] = s
        return shapes

    def flops_per_token(self) -> int:
        return self.router.flops_per_token() + self.top_k * self.expert.flops_per_token()

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Router from the unit's stream; expert e from its own stream keyed by a draw of the
        unit's stream and the *global* e, so any ep layout holds identical experts."""
        out = {f"router.{k}": v for k, v in self.router.init_host(rng).items()}
        key = int(rng.integers(0, 2**63 - 1))
        for e in self.local_experts:
            erng = np.random.default_rng([key, EXPERT_STREAM, e])
            for k, v in self.expert.init_host(erng).items():
                out[f"experts.{e}.{k}"] = v
        return out

    def capacity(self, tokens: int) -> int | None:
        """Per (microbatch, expert) capacity; None when dropless."""
        if self.fixed_capacity is not None:
            return self.fixed_capacity
        if self.dropless:
            return None
        return expert_capacity(tokens, self.top_k, self.experts, self.capacity_factor)

    # ------------------------------------------------------------------ F

    def forward(
        self, params: dict[str, Array], x: Array, loss_weight: float = 1.0
    ) -> tuple[Array, Any]:
        return run(self.forward_steps(params, x, loss_weight))

    def forward_steps(
        self, params: dict[str, Array], x: Array, loss_weight: float = 1.0
    ) -> Steps[tuple[Array, Any]]:
        """`forward` as steps (`hpcpipe.model.steps`): the count exchange, the dispatch and
        the combine are yielded, so an overlapped pair's other half computes meanwhile."""
        xp = array_module(x)
        shape = x.shape
        h = x.reshape(-1, self.d_model)
        n = h.shape[0]
        logits = h @ params["router.w"]
        m = logits.max(axis=1, keepdims=True) if n else logits[:, :1]
        ez = xp.exp(logits - m)
        se = ez.sum(axis=1, keepdims=True)
        lse = (m + xp.log(se))[:, 0]
        p = ez / se
        routing = route(_host(p), self.top_k, self.capacity(n))
        topk = _dev(xp, routing.topk)
        tok, slot = _dev(xp, routing.token), _dev(xp, routing.slot)
        p_top = p[xp.arange(n)[:, None], topk]
        gates = p_top / p_top.sum(axis=1, keepdims=True) if self.top_k > 1 else p_top
        gate = gates[tok, slot]  # (n_kept,) in dispatch order

        plan = yield self.group.plan_op(routing.kept)
        recv = yield self.group.alltoallv_op(h[tok], plan.forward)
        out, expert_ctx = self._experts_forward(params, recv, plan)
        back = yield self.group.alltoallv_op(out, plan.backward)
        y = _scatter_rows(xp, n, tok, gate[:, None] * back)
        stats = MoEStats(
            aux_loss=load_balancing_loss(p, routing),
            z_loss=z_loss(lse),
            routed=routing.routed,
            kept=routing.kept,
            tokens=n,
            top_k=self.top_k,
            capacity=routing.capacity,
        )
        ctx = {
            "h": h,
            "p": p,
            "lse": lse,
            "gate": gate,
            "back": back,
            "experts": expert_ctx,
            "routing": routing,
            "plan": plan,
            "loss_weight": float(loss_weight),
            "stats": stats,
            "shape": shape,
        }
        return y.reshape(shape), ctx

    def _experts_forward(
        self, params: dict[str, Array], recv: Array, plan: Any
    ) -> tuple[Array, Any]:
        """Each local expert on its contiguous rows; outputs back in receive order."""
        xp = array_module(recv)
        rows = _gather(xp, recv, plan.expert_order)
        out = xp.empty_like(rows)
        ctxs = []
        for j, e in enumerate(self.local_experts):
            lo, hi = plan.expert_offsets[j], plan.expert_offsets[j + 1]
            out[lo:hi], c = self.expert.forward(_sub(params, f"experts.{e}"), rows[lo:hi])
            ctxs.append(c)
        return _scatter(xp, out, plan.expert_order), ctxs

    # ------------------------------------------------------------------ B

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        return run(self.backward_input_steps(params, ctx, dy))

    def backward_input_steps(
        self, params: dict[str, Array], ctx: Any, dy: Array
    ) -> Steps[tuple[Array, Any]]:
        """`backward_input` as steps: both gradient exchanges are yielded."""
        xp = array_module(dy)
        h, p, lse, routing, plan = ctx["h"], ctx["p"], ctx["lse"], ctx["routing"], ctx["plan"]
        n = h.shape[0]
        w = ctx["loss_weight"]
        dy = dy.reshape(-1, self.d_model)
        tok, slot = _dev(xp, routing.token), _dev(xp, routing.slot)
        dy_rows = dy[tok]
        # expert path: gradient of each returned row goes back to its expert's rank
        d_out = yield self.group.alltoallv_op(ctx["gate"][:, None] * dy_rows, plan.forward)
        d_recv, expert_wctx = self._experts_backward(params, ctx["experts"], d_out, plan)
        d_rows = yield self.group.alltoallv_op(d_recv, plan.backward)
        dh = _scatter_rows(xp, n, tok, d_rows)
        # router path: gates, load balancing, z-loss -> logits
        dgate = xp.zeros((n, self.top_k), dtype=dy.dtype)
        dgate[tok, slot] = (dy_rows * ctx["back"]).sum(axis=1)
        dp = gate_grad(p, _dev(xp, routing.topk), dgate, normalize=self.top_k > 1)
        if self.aux_loss_coef:
            dp = dp + (w * self.aux_loss_coef) * aux_loss_grad(p, routing)[None, :]
        dlogits = p * (dp - (dp * p).sum(axis=1, keepdims=True))
        if self.z_loss_coef and n:
            dlogits = dlogits + (w * self.z_loss_coef * 2.0 / n) * lse[:, None] * p
        dh = dh + dlogits @ params["router.w"].T
        return dh.reshape(ctx["shape"]), {"h": h, "dlogits": dlogits, "experts": expert_wctx}

    def _experts_backward(
        self, params: dict[str, Array], ctxs: list[Any], d_out: Array, plan: Any
    ) -> tuple[Array, list[Any]]:
        xp = array_module(d_out)
        rows = _gather(xp, d_out, plan.expert_order)
        d_rows = xp.empty_like(rows)
        wctxs = []
        for j, e in enumerate(self.local_experts):
            lo, hi = plan.expert_offsets[j], plan.expert_offsets[j + 1]
            sub = _sub(params, f"experts.{e}")
            d_rows[lo:hi], wc = self.expert.backward_input(sub, ctxs[j], rows[lo:hi])
            wctxs.append(wc)
        return _scatter(xp, d_rows, plan.expert_order), wctxs

    # ------------------------------------------------------------------ W

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        grads = {"router.w": wctx["h"].T @ wctx["dlogits"]}
        for j, e in enumerate(self.local_experts):
            sub = _sub(params, f"experts.{e}")
            for k, g in self.expert.backward_weight(sub, wctx["experts"][j]).items():
                grads[f"experts.{e}.{k}"] = g
        return grads

    @staticmethod
    def stats(ctx: Any) -> MoEStats:
        return ctx["stats"]


class MoETransformerBlock(Layer):
    """Pre-LN decoder block whose MLP is an MoE layer: x + attn(ln1(x)), then x + moe(ln2(x)).

    Parameters: `attn.*` (as in `TransformerBlock`), `moe.ln.*`, `moe.router.w` and
    `moe.experts.<global e>.*` for the experts this rank holds. `forward` takes the
    microbatch's `loss_weight` (`uses_loss_weight`); `aux_stats(ctx)` reads what it routed.
    """

    uses_loss_weight = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        seq_len: int,
        n_blocks: int,
        moe: MoELayer,
    ):
        from hpcpipe.model.blocks import CausalSelfAttention

        self.attn = Residual(
            Chain(
                [
                    ("ln", LayerNorm(d_model)),
                    ("sa", CausalSelfAttention(d_model, n_heads, seq_len, n_blocks)),
                ]
            )
        )
        self.ln = LayerNorm(d_model)
        self.moe = moe

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {f"attn.{k}": s for k, s in self.attn.param_shapes().items()}
        shapes.update({f"moe.ln.{k}": s for k, s in self.ln.param_shapes().items()})
        shapes.update({f"moe.{k}": s for k, s in self.moe.param_shapes().items()})
        return shapes

    def flops_per_token(self) -> int:
        return self.attn.flops_per_token() + self.ln.flops_per_token() + self.moe.flops_per_token()

    def init_host(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {f"attn.{k}": v for k, v in self.attn.init_host(rng).items()}
        out.update({f"moe.ln.{k}": v for k, v in self.ln.init_host(rng).items()})
        out.update({f"moe.{k}": v for k, v in self.moe.init_host(rng).items()})
        return out

    def forward(
        self, params: dict[str, Array], x: Array, loss_weight: float = 1.0
    ) -> tuple[Array, Any]:
        return run(self.forward_steps(params, x, loss_weight))

    def forward_steps(
        self, params: dict[str, Array], x: Array, loss_weight: float = 1.0
    ) -> Steps[tuple[Array, Any]]:
        """`forward` as steps: the MoE layer's exchanges are yielded."""
        x, c_attn = self.attn.forward(_sub(params, "attn"), x)
        h, c_ln = self.ln.forward(_sub(params, "moe.ln"), x)
        y, c_moe = yield from self.moe.forward_steps(_sub(params, "moe"), h, loss_weight)
        return x + y, [c_attn, c_ln, c_moe]

    def backward_input(self, params: dict[str, Array], ctx: Any, dy: Array) -> tuple[Array, Any]:
        return run(self.backward_input_steps(params, ctx, dy))

    def backward_input_steps(
        self, params: dict[str, Array], ctx: Any, dy: Array
    ) -> Steps[tuple[Array, Any]]:
        """`backward_input` as steps: the MoE layer's exchanges are yielded."""
        c_attn, c_ln, c_moe = ctx
        dh, w_moe = yield from self.moe.backward_input_steps(_sub(params, "moe"), c_moe, dy)
        dx, w_ln = self.ln.backward_input(_sub(params, "moe.ln"), c_ln, dh)
        dx, w_attn = self.attn.backward_input(_sub(params, "attn"), c_attn, dy + dx)
        return dx, [w_attn, w_ln, w_moe]

    def backward_weight(self, params: dict[str, Array], wctx: Any) -> dict[str, Array]:
        w_attn, w_ln, w_moe = wctx
        grads = {
            f"attn.{k}": g
            for k, g in self.attn.backward_weight(_sub(params, "attn"), w_attn).items()
        }
        grads.update(
            {
                f"moe.ln.{k}": g
                for k, g in self.ln.backward_weight(_sub(params, "moe.ln"), w_ln).items()
            }
        )
        grads.update(
            {f"moe.{k}": g for k, g in self.moe.backward_weight(_sub(params, "moe"), w_moe).items()}
        )
        return grads

    def aux_stats(self, ctx: Any) -> MoEStats:
        """The routing figures of the microbatch whose F produced `ctx`."""
        return MoELayer.stats(ctx[2])


def _host(a: Any) -> np.ndarray:
    """Router probabilities to the host for `route` (by design: routing decisions are made
    by host NumPy, so every layout makes exactly the same ones; the all-to-all counts are host
    integers anyway). One counted copy per MoE layer and microbatch."""
    if type(a) is np.ndarray:
        return a
    backend = active_backend()
    if backend is not None and backend.on_gpu:
        return backend.to_host(a)
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _scalars(values: list[Any]) -> list[float]:
    """Device scalars to floats in one counted copy (plain floats on the host)."""
    backend = active_backend()
    if values and backend is not None and backend.on_gpu and type(values[0]) is not np.ndarray:
        return backend.scalars(values)
    return [float(v) for v in values]


def _dev(xp: Any, a: np.ndarray) -> Any:
    return a if xp is np else xp.asarray(a)


def _scatter_rows(xp: Any, n: int, index: Any, rows: Any) -> Any:
    """out[index[r]] += rows[r]: a token's k expert contributions summed in expert order."""
    return _scatter_add_rows(xp, n, index, rows)


def _gather(xp: Any, rows: Any, order: np.ndarray | None) -> Any:
    """rows[order]: received rows regrouped by local expert (None: already grouped)."""
    return rows if order is None else rows[_dev(xp, order)]


def _scatter(xp: Any, rows: Any, order: np.ndarray | None) -> Any:
    """Inverse of `_gather`: rows by local expert back into receive order."""
    if order is None:
        return rows
    out = xp.empty_like(rows)
    out[_dev(xp, order)] = rows
    return out
