"""Reference trainer: microbatching is exact, the pipeline recipe reproduces it, it learns."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.model import ModelConfig, Stage, accumulate, build_model, partition
from hpcpipe.train.data import DataConfig, build_dataset
from hpcpipe.train.optim import OptimConfig, grad_sq_norm
from hpcpipe.train.reference import loss_and_grads, train_reference

GPT = ModelConfig(kind="gpt", layers=3, d_model=16, n_heads=2, d_ff=32, vocab=10, seq_len=8)
DATA = DataConfig(global_batch=8, markov_branching=3)
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.5, warmup=1)


def assert_params_close(a, b, rtol: float) -> None:
    """Per tensor: ||a - b|| <= rtol * ||b|| (elementwise ratios are meaningless near zero)."""
    assert set(a) == set(b)
    for i in a:
        assert set(a[i]) == set(b[i])
        for k in a[i]:
            err = np.linalg.norm(a[i][k] - b[i][k])
            assert err <= rtol * np.linalg.norm(b[i][k]), (i, k, err)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_microbatch_split_matches_whole_batch(kind: str) -> None:
    optim = OptimConfig(kind=kind, lr=3e-3 if kind == "adamw" else 0.05, grad_clip=0.5)
    runs = [train_reference(GPT, DATA, optim, steps=3, seed=4, microbatches=m) for m in (1, 2, 8)]
    for r in runs[1:]:
        np.testing.assert_allclose(r.losses, runs[0].losses, rtol=1e-12)
        assert_params_close(r.params, runs[0].params, rtol=1e-10)


def test_pipeline_recipe_reproduces_reference_gradients() -> None:
    """pp=2 stages x dp=2 shards x 2 microbatches, dloss = tokens share: the reference's gradients.

    This is the arithmetic a pipelined data-parallel step must do; here it runs in one process.
    """
    units = build_model(GPT)
    ref = train_reference(GPT, DATA, OPTIM, steps=1, seed=2, record_grads={0})
    ds = build_dataset(DATA, GPT, seed=2)
    stages = [Stage(units, r) for r in partition(units, 2, by="flops")]
    params = [s.init(2, np, "float64") for s in stages]
    dp, m = 2, 2
    total = {}
    for rank in range(dp):
        x, t = ds.shard(0, rank, dp)
        rows = x.shape[0] // m
        for k in range(m):
            sl = slice(k * rows, (k + 1) * rows)
            h, ctx0 = stages[0].forward(params[0], x[sl])
            _, ctx1 = stages[1].forward(params[1], h, t[sl])
            weight = rows / DATA.global_batch  # this microbatch's share of the global batch
            dh, w1 = stages[1].backward_input(params[1], ctx1, weight)
            _, w0 = stages[0].backward_input(params[0], ctx0, dh)
            for s, p, w in ((stages[1], params[1], w1), (stages[0], params[0], w0)):
                g = s.backward_weight(p, w)
                total = accumulate(total, g) if set(g) <= set(total) else {**total, **g}
    assert_params_close(total, ref.grads[0], rtol=1e-12)
    # the global norm is the sum of each stage's partial squared norm
    partial = [grad_sq_norm({i: total[i] for i in s.indices}) for s in stages]
    assert sum(partial) == pytest.approx(ref.grad_norms[0] ** 2, rel=1e-12)


def test_loss_and_grads_checks_microbatches() -> None:
    units = build_model(GPT)
    stage = Stage(units, range(len(units)))
    x = np.zeros((6, GPT.seq_len), dtype=np.int64)
    with pytest.raises(ValueError, match="must divide the 6 rows"):
        loss_and_grads(stage, stage.init(0, np, "float64"), x, x, microbatches=4)


def test_float32_run_and_determinism() -> None:
    a = train_reference(GPT, DATA, OPTIM, steps=2, seed=1, dtype="float32")
    b = train_reference(GPT, DATA, OPTIM, steps=2, seed=1, dtype="float32")
    assert a.params[3]["mlp.fc.w"].dtype == np.float32
    assert a.losses == b.losses
    assert_params_close(a.params, b.params, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_non_finite_loss_stops_with_the_step() -> None:
    optim = OptimConfig(kind="sgd", lr=1e30, momentum=0.0, grad_clip=0.0)
    with pytest.raises(FloatingPointError, match=r"step \d+: loss = .* \(not finite\)"):
        train_reference(GPT, DATA, optim, steps=4, seed=0, dtype="float32")


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_training_drops_toward_the_entropy_rate(kind: str) -> None:
    """A short run (float32) closes most of the gap between the initial loss and the optimum."""
    model = ModelConfig(kind=kind, layers=2, d_model=32, n_heads=4, d_ff=64, vocab=16, seq_len=16)
    data = DataConfig(global_batch=16, markov_branching=3)
    r = train_reference(model, data, OptimConfig(lr=1e-2), steps=40, seed=0, dtype="float32")
    assert r.optimal_loss is not None
    first, last = r.losses[0], float(np.mean(r.losses[-5:]))
    assert first > 2.0 * r.optimal_loss
    assert last - r.optimal_loss < 0.25 * (first - r.optimal_loss)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "order", "vocab", "lr", "steps"), [("mlp", 1, 16, 1e-2, 200), ("gpt", 2, 8, 2e-2, 400)]
)
def test_training_reaches_entropy_rate(
    kind: str, order: int, vocab: int, lr: float, steps: int
) -> None:
    """Within 5% of the best achievable loss: the entropy rate (order 1), or for order 2 the rate
    plus the share of position 0, which sees one token of context only."""
    model = ModelConfig(
        kind=kind, layers=2, d_model=32, n_heads=4, d_ff=128, vocab=vocab, seq_len=32
    )
    data = DataConfig(global_batch=32, markov_order=order, markov_branching=3)
    optim = OptimConfig(lr=lr, warmup=20, schedule="cosine", min_lr_ratio=0.1)
    ds = build_dataset(data, model, seed=0)
    r = train_reference(model, data, optim, steps=steps, seed=0, dtype="float32", dataset=ds)
    final = float(np.mean(r.losses[-20:]))
    print(
        f"{kind} order {order}: loss {final:.4f} (mean of last 20 steps), entropy rate "
        f"{ds.entropy_rate:.4f}, optimal {r.optimal_loss:.4f}, ratio {final / r.optimal_loss:.4f}"
    )
    assert final <= 1.05 * r.optimal_loss
