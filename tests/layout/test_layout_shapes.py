"""The search's activation counts are what the units' forward contexts really hold."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.layout.shapes import unit_shapes
from hpcpipe.model import ModelConfig, activation_bytes
from hpcpipe.model.models import build_model
from hpcpipe.moe.config import MoEConfig


def _measured(model: ModelConfig, moe: MoEConfig | None, dtype: str) -> list[float]:
    """Bytes per token each unit's forward context holds on a real microbatch."""
    units = build_model(model, moe)
    rng = np.random.default_rng(0)
    rows = 3
    x = rng.integers(0, model.vocab, (rows, model.seq_len))
    targets = rng.integers(0, model.vocab, (rows, model.seq_len))
    out = []
    for i, unit in enumerate(units):
        params = {
            k: (rng.standard_normal(s) * 0.1).astype(dtype) for k, s in unit.param_shapes().items()
        }
        if i == len(units) - 1:
            x, ctx = unit.forward(params, x, targets)
        else:
            x, ctx = unit.forward(params, x)
        out.append(activation_bytes(ctx) / (rows * model.seq_len))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "kind, d, f, heads, seq, vocab",
    [("gpt", 16, 40, 2, 6, 11), ("gpt", 24, 56, 3, 5, 13), ("mlp", 16, 40, 1, 6, 11)],
)
def test_dense_units_match_their_contexts_exactly(kind, d, f, heads, seq, vocab, dtype):
    model = ModelConfig(
        kind=kind, layers=2, d_model=d, n_heads=heads, d_ff=f, vocab=vocab, seq_len=seq
    )
    size = np.dtype(dtype).itemsize
    predicted = [u.activation_bytes_per_token for u in unit_shapes(model, None, size)]
    assert predicted == _measured(model, None, dtype)


def test_dropless_moe_blocks_match_their_contexts_exactly():
    model = ModelConfig(kind="gpt", layers=2, d_model=16, n_heads=2, d_ff=40, vocab=11, seq_len=6)
    moe = MoEConfig(experts=4, top_k=2, every=1, dropless=True)
    shapes = unit_shapes(model, moe, 8)
    assert [u.moe for u in shapes] == [False, True, True, False]
    assert [u.activation_bytes_per_token for u in shapes] == _measured(model, moe, "float64")


def test_capacity_bounded_moe_stays_under_the_dropless_count():
    model = ModelConfig(kind="gpt", layers=2, d_model=16, n_heads=2, d_ff=40, vocab=11, seq_len=6)
    moe = MoEConfig(experts=4, top_k=2, every=1, capacity_factor=1.0)
    predicted = [u.activation_bytes_per_token for u in unit_shapes(model, moe, 8)]
    measured = _measured(model, moe, "float64")
    assert all(m <= p for m, p in zip(measured, predicted, strict=True))
    assert measured[1] > 0.8 * predicted[1]  # the bound is not loose either


def test_expert_parameters_are_counted_apart_from_the_dense_ones():
    model = ModelConfig(kind="gpt", layers=2, d_model=16, n_heads=2, d_ff=40, vocab=11, seq_len=6)
    moe = MoEConfig(experts=4, top_k=2, every=2, d_ff_expert=24)
    shapes = unit_shapes(model, moe, 4)
    units = build_model(model, moe)
    per_expert = 16 * 24 + 24 + 24 * 16 + 16  # fc and proj with biases
    assert shapes[2].expert_params == 4 * per_expert
    assert [s.params + s.expert_params for s in shapes] == [u.n_params for u in units]
    assert [s.flops_per_token for s in shapes] == [u.flops_per_token() for u in units]
    assert shapes[1].expert_params == 0 and not shapes[1].moe
