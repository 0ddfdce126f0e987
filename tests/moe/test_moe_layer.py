"""The MoE layer and MoE gpt blocks in one process (float64): outputs against a per-token loop,
gradients against finite differences, edge cases with no tokens, seeding, Stage integration."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.model import ModelConfig, Stage, TransformerBlock, build_model
from hpcpipe.moe import (
    LocalExperts,
    MoEConfig,
    MoELayer,
    MoEStats,
    MoETransformerBlock,
    is_expert_param,
    summarize_stats,
)

D, F, E = 6, 5, 4


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form, written out independently of the library."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def make_layer(**kw) -> MoELayer:
    base = {"top_k": 2, "capacity_factor": 1.0, "aux_loss_coef": 0.3, "z_loss_coef": 0.2}
    return MoELayer(D, F, E, **{**base, **kw})


def objective(layer: MoELayer, params, x, dy, weight):
    """<y, dy> + weight * (aux_coef * aux + z_coef * z): what B differentiates."""
    y, ctx = layer.forward(params, x, weight)
    s = ctx["stats"]
    aux = layer.aux_loss_coef * float(s.aux_loss) + layer.z_loss_coef * float(s.z_loss)
    return float((y * dy).sum()) + weight * aux


CASES = {
    "top1-capacity": {"top_k": 1},
    "top2-capacity": {},
    "top2-dropless": {"dropless": True},
    "top1-dropless-no-aux": {"top_k": 1, "dropless": True, "aux_loss_coef": 0.0},
    "top2-all-dropped": {"capacity": 0},
    "top2-capacity-1": {"capacity": 1},
}


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_gradients_match_finite_differences(kw):
    layer = make_layer(**kw)
    params = layer.init(0, 3, np, "float64")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, D))
    dy = rng.standard_normal((2, 5, D))
    w = 0.37
    _, ctx = layer.forward(params, x, w)
    dx, wctx = layer.backward_input(params, ctx, dy)
    grads = layer.backward_weight(params, wctx)
    assert set(grads) == set(params)
    h = 1e-6
    num = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += h
        minus[idx] -= h
        num[idx] = objective(layer, params, plus, dy, w) - objective(layer, params, minus, dy, w)
        num[idx] /= 2 * h
    np.testing.assert_allclose(dx, num, atol=1e-8)
    for name, a in params.items():
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus, minus = dict(params), dict(params)
            plus[name], minus[name] = a.copy(), a.copy()
            plus[name][idx] += h
            minus[name][idx] -= h
            g[idx] = (objective(layer, plus, x, dy, w) - objective(layer, minus, x, dy, w)) / (
                2 * h
            )
        np.testing.assert_allclose(grads[name], g, atol=1e-8, err_msg=name)


def test_output_equals_a_per_token_loop():
    """y[t] = sum over t's kept choices of gate * expert(h[t]); gates renormalised for k = 2."""
    for k in (1, 2):
        layer = make_layer(top_k=k, capacity=2)
        params = layer.init(4, 1, np, "float64")
        h = np.random.default_rng(2).standard_normal((7, D))
        y, ctx = layer.forward(params, h)
        r = ctx["routing"]
        logits = h @ params["router.w"]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        expected = np.zeros_like(h)
        kept = set(zip(r.token.tolist(), r.expert.tolist(), strict=True))
        for t in range(7):
            chosen = np.argsort(-p[t], kind="stable")[:k]
            for e in chosen:
                if (t, int(e)) not in kept:
                    continue
                pe = {
                    n[len(f"experts.{e}.") :]: v
                    for n, v in params.items()
                    if n.startswith(f"experts.{e}.")
                }
                out = gelu(h[t] @ pe["fc.w"] + pe["fc.b"]) @ pe["proj.w"] + pe["proj.b"]
                gate = p[t, e] / p[t, chosen].sum() if k > 1 else p[t, e]
                expected[t] += gate * out
        np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-14)
        dropped_tokens = set(range(7)) - {t for t, _ in kept}
        for t in dropped_tokens:
            assert not y[
                t
            ].any()  # a fully dropped token gets exactly zero (the residual carries it)


def test_experts_without_tokens_and_empty_microbatch():
    layer = make_layer(dropless=True)
    params = layer.init(0, 1, np, "float64")
    params["router.w"][:, 2:] = 0.0
    params["router.w"][:, :2] = 0.0
    params["router.w"][0, 0], params["router.w"][0, 1] = 50.0, 40.0
    h = np.abs(np.random.default_rng(3).standard_normal((6, D))) + 0.5  # h[:, 0] > 0
    y, ctx = layer.forward(params, h)
    assert ctx["routing"].kept.tolist() == [6, 6, 0, 0]
    _dx, wctx = layer.backward_input(params, ctx, np.ones_like(y))
    grads = layer.backward_weight(params, wctx)
    for e in (2, 3):  # present, right shape, exactly zero
        for k in ("fc.w", "fc.b", "proj.w", "proj.b"):
            g = grads[f"experts.{e}.{k}"]
            assert g.shape == params[f"experts.{e}.{k}"].shape and not g.any()
    assert grads["experts.0.fc.w"].any()
    y0, ctx0 = layer.forward(params, np.zeros((0, 3, D)))
    assert y0.shape == (0, 3, D) and float(ctx0["stats"].aux_loss) == 0.0
    dx0, w0 = layer.backward_input(params, ctx0, np.zeros((0, 3, D)))
    assert dx0.shape == (0, 3, D)
    assert all(not g.any() for g in layer.backward_weight(params, w0).values())


class Recording(LocalExperts):
    """All experts local, logging every collective the layer would issue."""

    def __init__(self, experts: int):
        super().__init__(experts)
        self.calls: list[str] = []

    def plan(self, send_expert):
        self.calls.append("counts")
        return super().plan(send_expert)

    def alltoallv(self, rows, exchange, out=None):
        self.calls.append(f"a2a:{rows.shape[1]}")
        return super().alltoallv(rows, exchange)


@pytest.mark.parametrize("capacity", [None, 1, 0])
def test_same_collectives_whatever_the_routing(capacity):
    group = Recording(E)
    layer = MoELayer(D, F, E, top_k=2, capacity_factor=1.0, group=group, capacity=capacity)
    params = layer.init(0, 1, np, "float64")
    _, ctx = layer.forward(params, np.random.default_rng(0).standard_normal((4, D)))
    forward_calls = list(group.calls)
    _, wctx = layer.backward_input(params, ctx, np.ones((4, D)))
    backward_calls = group.calls[len(forward_calls) :]
    layer.backward_weight(params, wctx)
    assert forward_calls == ["counts", f"a2a:{D}", f"a2a:{D}"]
    assert backward_calls == [f"a2a:{D}", f"a2a:{D}"]
    assert len(group.calls) == 5  # W communicates nothing


class Slice:
    """The placement part of an expert group: rank `rank` of `size` holds experts / size."""

    def __init__(self, experts: int, size: int, rank: int):
        self.experts, self.size, self.rank = experts, size, rank

    @property
    def local_experts(self) -> range:
        per = self.experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


def test_expert_weights_identical_in_every_ep_layout():
    cfg = ModelConfig(kind="gpt", layers=2, d_model=8, n_heads=2, d_ff=12, vocab=7, seq_len=4)
    moe = MoEConfig(experts=8, every=1)
    full = build_model(cfg, moe)
    ref = {i: u.init(11, i) for i, u in enumerate(full)}
    for ep in (2, 4, 8):
        seen: dict[tuple[int, str], np.ndarray] = {}
        for r in range(ep):
            units = build_model(cfg, moe, Slice(8, ep, r))
            for i, u in enumerate(units):
                for name, v in u.init(11, i).items():
                    assert np.array_equal(v, ref[i][name]), (ep, r, i, name)
                    seen[(i, name)] = v
        assert seen.keys() == {(i, n) for i, p in ref.items() for n in p}


def test_build_model_places_moe_blocks_and_names_expert_params():
    cfg = ModelConfig(kind="gpt", layers=4, d_model=8, n_heads=2, d_ff=12, vocab=7, seq_len=4)
    units = build_model(cfg, MoEConfig(experts=4, every=2, d_ff_expert=6))
    kinds = [type(u).__name__ for u in units]
    assert kinds[1:5] == ["TransformerBlock", "MoETransformerBlock"] * 2
    names = units[2].param_shapes()
    assert names["moe.experts.3.fc.w"] == (8, 6) and names["moe.router.w"] == (8, 4)
    experts = {n for n in names if is_expert_param(n)}
    assert len(experts) == 4 * 4 and all(n.startswith("moe.experts.") for n in experts)
    assert not is_expert_param("moe.router.w") and not is_expert_param("attn.sa.qkv.w")
    assert not is_expert_param("moe.expertsish.w")
    # experts = 0 is the dense model, weight for weight
    dense, same = build_model(cfg), build_model(cfg, MoEConfig(experts=0))
    for i, (a, b) in enumerate(zip(dense, same, strict=True)):
        assert type(a) is type(b)
        for k, v in a.init(1, i).items():
            assert np.array_equal(v, b.init(1, i)[k])
    assert isinstance(dense[2], TransformerBlock)
    with pytest.raises(ValueError, match="needs gpt"):
        build_model(ModelConfig(kind="mlp"), MoEConfig(experts=2))


def test_stage_passes_the_loss_weight_and_reports_aux_losses():
    """Whole MoE gpt: d(objective)/d(params) by finite differences on sampled entries, with the
    aux terms weighted by each microbatch's loss weight, and Stage.aux_stats per block."""
    cfg = ModelConfig(kind="gpt", layers=2, d_model=8, n_heads=2, d_ff=12, vocab=7, seq_len=4)
    moe = MoEConfig(experts=4, top_k=2, every=1, aux_loss_coef=0.5, z_loss_coef=0.25)
    units = build_model(cfg, moe)
    stage = Stage(units, range(len(units)))
    params = stage.init(0, np, "float64")
    rng = np.random.default_rng(5)
    x, t = rng.integers(0, 7, (2, 4)), rng.integers(0, 7, (2, 4))
    w = 0.25

    def obj(p):
        loss, ctx = stage.forward(p, x, t, loss_weight=w)
        stats = stage.aux_stats(ctx)
        aux = sum(0.5 * float(s.aux_loss) + 0.25 * float(s.z_loss) for s in stats.values())
        return w * float(loss) + w * aux

    _loss, ctx = stage.forward(params, x, t, loss_weight=w)
    stats = stage.aux_stats(ctx)
    assert sorted(stats) == [1, 2] and all(isinstance(s, MoEStats) for s in stats.values())
    assert all(s.tokens == 8 and s.routed.sum() == 16 for s in stats.values())
    _, wctx = stage.backward_input(params, ctx, w)
    grads = stage.backward_weight(params, wctx)
    h = 1e-6
    picks = [
        (1, "moe.router.w"),
        (2, "moe.router.w"),
        (1, "moe.experts.2.fc.w"),
        (2, "moe.ln.g"),
        (1, "attn.sa.qkv.w"),
        (0, "wte"),
    ]
    for i, name in picks:
        a = params[i][name].reshape(-1)
        for j in rng.choice(a.size, size=min(4, a.size), replace=False):
            old = a[j]
            a[j] = old + h
            up = obj(params)
            a[j] = old - h
            down = obj(params)
            a[j] = old
            g = grads[i][name].reshape(-1)[j]
            assert g == pytest.approx((up - down) / (2 * h), abs=1e-8), (i, name, j)
    # the loss weight only scales the aux terms: w = 1 changes the router gradient
    _, ctx1 = stage.forward(params, x, t)
    g1 = stage.backward_weight(params, stage.backward_input(params, ctx1, w)[1])
    assert not np.allclose(g1[1]["moe.router.w"], grads[1]["moe.router.w"])
    figures = summarize_stats(stats.values())
    assert figures["tokens_per_expert_max"] <= 8 and 0 <= figures["dropped_fraction"] < 1
    assert figures["aux_loss"] == pytest.approx(
        np.mean([float(s.aux_loss) for s in stats.values()])
    )
    assert summarize_stats([]) == {}


def test_dense_stage_ignores_the_loss_weight():
    """Dense stage code paths ignore the new keyword: loss_weight has no effect without MoE."""
    cfg = ModelConfig(kind="gpt", layers=2, d_model=8, n_heads=2, d_ff=12, vocab=7, seq_len=4)
    units = build_model(cfg)
    stage = Stage(units, range(len(units)))
    params = stage.init(0, np, "float64")
    x = np.random.default_rng(0).integers(0, 7, (2, 4))
    a, ca = stage.forward(params, x, x)
    b, _cb = stage.forward(params, x, x, loss_weight=0.1)
    assert float(a) == float(b) and stage.aux_stats(ca) == {}
    assert isinstance(units[1], TransformerBlock) and not isinstance(units[1], MoETransformerBlock)


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(D, F, 2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(D, F, 2, top_k=1, capacity_factor=0.0)
    MoELayer(D, F, 2, top_k=1, capacity_factor=0.0, dropless=True)  # no capacity needed
    with pytest.raises(ValueError, match="holds 4 experts"):
        MoELayer(D, F, 2, top_k=1, group=LocalExperts(4))


def test_float32_stays_float32():
    """Rows exchanged between ranks keep the model dtype (MPI row types are built from it)."""
    layer = make_layer(capacity=3)
    params = layer.init(0, 1, np, "float32")
    x = np.random.default_rng(0).standard_normal((2, 4, D)).astype(np.float32)
    y, ctx = layer.forward(params, x, 0.5)
    assert y.dtype == np.float32 and ctx["back"].dtype == np.float32
    dx, wctx = layer.backward_input(params, ctx, np.ones_like(y))
    assert dx.dtype == np.float32
    assert all(g.dtype == np.float32 for g in layer.backward_weight(params, wctx).values())
