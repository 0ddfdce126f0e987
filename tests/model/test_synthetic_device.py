"""The synthetic device (`[device] synthetic_us_per_row`): units that last a modelled time with
their real arithmetic inside it, so that pipelines of more ranks than cores can be timed. Only
lower bounds on durations are asserted: a loaded machine makes sleeps late, never early."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcpipe.config import load_config
from hpcpipe.model.models import build_model
from hpcpipe.model.stage import Stage, modelled_unit_ns

ROOT = Path(__file__).resolve().parents[2]
DECK = ROOT / "inputs" / "replan_synthetic.toml"


def _model():
    cfg = load_config(DECK, [])
    return cfg, build_model(cfg.model, cfg.moe)


def test_modelled_times_follow_the_units_flops():
    _, units = _model()
    ns = modelled_unit_ns(units, 500.0, rows=2)
    flops = [u.flops_per_token() for u in units]
    heaviest = int(np.argmax(flops))
    assert ns[heaviest] == 1_000_000  # 500 us per row x 2 rows
    for i, f in enumerate(flops):
        assert abs(ns[i] - 1e6 * f / flops[heaviest]) <= 1
    assert ns[0] < ns[1] and ns[len(units) - 1] < ns[1]  # embedding, head lighter than blocks


def _run_stage(stage, params, x, targets):
    y, ctx = stage.forward(params, x, targets)
    dx, wctx = stage.backward_input(params, ctx, 0.5)
    return y, dx, stage.backward_weight(params, wctx)


def test_a_synthetic_stage_computes_the_same_and_lasts_at_least_its_modelled_time():
    cfg, units = _model()
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.model.vocab, size=(2, cfg.model.seq_len))
    targets = rng.integers(0, cfg.model.vocab, size=(2, cfg.model.seq_len))
    real = Stage(units, range(len(units)))
    params = real.init(1, np, "float64")
    expected = _run_stage(real, params, x, targets)

    synthetic = Stage(units, range(len(units)))
    synthetic.modelled_ns = modelled_unit_ns(units, 100.0, rows=2)
    synthetic.unit_ns = {}
    got = _run_stage(synthetic, params, x, targets)
    np.testing.assert_array_equal(got[0], expected[0])
    for i, grads in expected[2].items():
        for name, g in grads.items():
            np.testing.assert_array_equal(got[2][i][name], g)
    for kind in "FBW":
        for i, want in synthetic.modelled_ns.items():
            assert synthetic.unit_ns[(kind, i)] >= want, (kind, i)

    synthetic.unit_ns, synthetic.slowdown = {}, 2.0  # a slow rank: the modelled time stretched
    _run_stage(synthetic, params, x, targets)
    block = 1
    assert synthetic.unit_ns[("F", block)] >= 2 * synthetic.modelled_ns[block]
