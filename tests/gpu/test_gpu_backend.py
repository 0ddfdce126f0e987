"""Real GPU, one process: CuPy backend selection, staging through pinned memory and the copy
stream, layers / MoE / sweep kernel on the device equal to NumPy, with no host copies in the
layers. Skipped, with the reason, where CuPy or a CUDA device is missing."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import require_cuda

cupy = require_cuda()

from mpi4py import MPI  # noqa: E402

import hpcpipe.backend as backend_module  # noqa: E402
from hpcpipe.backend import make_backend  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu(monkeypatch):
    """A staged CuPy backend (the active one), restored afterwards."""
    monkeypatch.setattr(backend_module, "_ACTIVE", None)
    return make_backend("cuda", "float64", 0, "off")


def test_backend_selects_cupy_on_a_device(gpu):
    assert gpu.xp is cupy and gpu.on_gpu and gpu.device_id == 0
    assert gpu.staged and "device=cuda:0 mpi_buffers=staged" in gpu.describe()
    assert cupy.cuda.Device().id == 0


def test_staging_round_trip_through_pinned_memory_and_the_copy_stream(gpu):
    x = cupy.arange(1 << 20, dtype=cupy.float64)
    for step in range(3):
        copy = gpu.stage_out(x * (step + 1), "out")
        host = copy.wait()
        assert np.array_equal(host, np.arange(1 << 20, dtype=np.float64) * (step + 1))
        back = cupy.empty_like(x)
        gpu.stage_in(back, host, "in")
        assert bool(cupy.array_equal(back, x * (step + 1)))  # ordered after the copy
    assert gpu.pinned_allocations == 1  # one slot, reused from round to round
    assert gpu.transfers.d2h == 3 and gpu.transfers.h2d == 3


def test_gpt_layers_on_the_device_equal_numpy_without_host_copies(gpu):
    from d2h_monitor import D2HMonitor, available

    from hpcpipe.model import ModelConfig, Stage, build_model

    cfg = ModelConfig(kind="gpt", layers=2, d_model=32, n_heads=4, d_ff=64, vocab=17, seq_len=8)
    units = build_model(cfg)
    stage = Stage(units, range(len(units)))
    rng = np.random.default_rng(0)
    x, t = rng.integers(0, 17, size=(4, 8)), rng.integers(0, 17, size=(4, 8))
    out = {}
    for xp in (np, cupy):
        params = stage.init(3, xp, "float64")

        def step(xp=xp, params=params):
            loss, ctx = stage.forward(params, xp.asarray(x), xp.asarray(t))
            _, wctx = stage.backward_input(params, ctx, 0.5)
            return loss, stage.backward_weight(params, wctx)

        if xp is cupy and available() is None:
            with D2HMonitor(cupy.ndarray, cupy.asnumpy, library=cupy) as mon:
                loss, grads = step()
                cupy.cuda.get_current_stream().synchronize()
            assert mon.count == 0, dict(mon.sites)
        else:
            loss, grads = step()
        out["host" if xp is np else "device"] = (loss, grads)
    assert float(out["device"][0]) == pytest.approx(float(out["host"][0]), rel=1e-12)
    for i, g in out["host"][1].items():
        for k, v in g.items():
            got = cupy.asnumpy(out["device"][1][i][k])
            np.testing.assert_allclose(got, v, rtol=1e-9, atol=1e-12, err_msg=f"{i} {k}")


def test_moe_layer_on_the_device_equals_numpy(gpu):
    from hpcpipe.moe import MoELayer

    layer = MoELayer(8, 12, 4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.3, z_loss_coef=0.2)
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((3, 5, 8)), rng.standard_normal((3, 5, 8))
    res = {}
    for xp in (np, cupy):
        params = layer.init(7, 0, xp, "float64")
        gpu.transfers.reset()
        y, ctx = layer.forward(params, xp.asarray(x), 0.5)
        dh, wctx = layer.backward_input(params, ctx, xp.asarray(dy))
        grads = layer.backward_weight(params, wctx)
        if xp is cupy:
            assert gpu.transfers.d2h == 1  # the router probabilities, once per forward
        host = cupy.asnumpy if xp is cupy else np.asarray
        res["host" if xp is np else "device"] = (
            host(y),
            host(dh),
            {k: host(v) for k, v in grads.items()},
        )
    np.testing.assert_allclose(res["device"][0], res["host"][0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res["device"][1], res["host"][1], rtol=1e-10, atol=1e-12)
    for k, v in res["host"][2].items():
        np.testing.assert_allclose(res["device"][2][k], v, rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize(("scheme", "fixup"), [("dd", True), ("step", False)])
def test_cuda_sweep_kernel_equals_the_numpy_kernel_on_the_device(gpu, scheme, fixup):
    """One launch per block against the hyperplane kernel on the same CuPy arrays: every
    outgoing face bit for bit, phi to the last bit of a sum; blocks with more (j, k) rows than
    a thread block has threads, starting inside the z range, every octant, the fix-up firing."""
    from hpcpipe.sweep.kernel import angle_block, block_order, sweep_block
    from hpcpipe.sweep.quadrature import level_symmetric

    quad = level_symmetric(6)
    shape, nz, groups = (9, 40, 30), 60, 3
    cells = shape[0] * shape[1] * nz
    rng = np.random.default_rng(11)
    q = cupy.asarray(rng.random((cells, groups)))
    sigma_t = cupy.asarray(rng.choice([0.5, 9.0, 20.0], (cells, groups)))
    outs = {}
    for kernel in ("numpy", "cuda"):
        phi = cupy.zeros((cells, groups))
        faces = []
        for octant in range(8):
            order = block_order(cupy, shape, nz, octant, kernel)
            angles = angle_block(cupy, quad, 0, quad.per_octant, (0.4, 0.3, 0.2), scheme)
            for z0 in (0, 30):
                seed = np.random.default_rng(octant * 100 + z0)
                fx, fy, fz = (
                    cupy.asarray(seed.random((n, quad.per_octant, groups)))
                    for n in (shape[1] * shape[2], shape[0] * shape[2], shape[0] * shape[1])
                )
                sweep_block(
                    cupy, order, z0, angles, q, sigma_t, phi, fx, fy, fz, scheme, fixup, kernel
                )
                faces += [cupy.asnumpy(f) for f in (fx, fy, fz)]
        outs[kernel] = (cupy.asnumpy(phi), faces)
    (want_phi, want), (phi, got) = outs["numpy"], outs["cuda"]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(phi, want_phi, rtol=1e-14, atol=0)
    if fixup:  # it fired: a fixed face is exactly 0 (random incoming faces never are)
        assert any((f == 0.0).any() for f in want)


def test_sweep_on_the_device_equals_numpy_to_round_off(gpu):
    from pathlib import Path

    from hpcpipe.config import load_config
    from hpcpipe.sweep.mesh import build_problem
    from hpcpipe.sweep.parallel import KBASweeper
    from hpcpipe.sweep.plan import plan_for
    from hpcpipe.sweep.solver import LocalCells, solve

    deck = Path(__file__).resolve().parents[2] / "inputs" / "sweep_tiny.toml"
    cfg = load_config(deck, ["sweep.sigma_t=[[10.0, 15.0], [20.0, 40.0]]"]).sweep
    problem = build_problem(cfg)
    plan = plan_for(cfg, problem)
    phis = {}
    for xp in (np, cupy):
        sweeper = KBASweeper(problem, plan, MPI.COMM_SELF, xp=xp)
        cells = LocalCells(problem, sweeper.x_cells, sweeper.y_cells, xp=xp)
        result = solve(problem, cells, sweeper, tolerance=0.0, max_iterations=5)
        phis["host" if xp is np else "device"] = result.phi
        sweeper.free()
    scale = np.abs(phis["host"]).max()
    assert np.abs(phis["device"] - phis["host"]).max() <= 1e-12 * scale
