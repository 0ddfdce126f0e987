"""Kernel and solver against exact answers: a cell-by-cell reference, slab transmission,
particle balance, the infinite-medium limit, non-convergence. One process, no launcher."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.kernel import sweep_domain
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.parallel import KBASweeper
from hpcpipe.sweep.plan import build_plan
from hpcpipe.sweep.quadrature import OCTANTS
from hpcpipe.sweep.solver import ConvergenceError, LocalCells, SerialSweeper, solve
from hpcpipe.sweep.workload import run_sweep

TWO_GROUP = dict(
    nx=3,
    ny=4,
    nz=2,
    lengths=(3.0, 2.0, 4.0),
    groups=2,
    sigma_t=((1.0, 2.0), (8.0, 12.0)),
    sigma_s=(((0.3, 0.4), (0.0, 1.5)), ((1.0, 2.0), (0.0, 6.0))),
    source=((1.0, 0.2), (0.0, 0.0)),
    boxes=((1.0, 3.0, 0.0, 1.0, 0.0, 4.0),),
    box_materials=(1,),
    incident_faces=("x-", "z+"),
    incident_flux=(2.0, 0.5),
)


def _solve(cfg: SweepConfig, sweeper=None, **kw):
    problem = build_problem(cfg)
    cells = LocalCells(problem)
    result = solve(
        problem,
        cells,
        sweeper or SerialSweeper(problem),
        tolerance=kw.pop("tolerance", cfg.tolerance),
        max_iterations=kw.pop("max_iterations", cfg.max_iterations),
        **kw,
    )
    return problem, result


def _reference_sweep(problem, q, sigma_t):
    """Cell by cell, direction by direction, group by group: the textbook loops."""
    mesh, quad = problem.mesh, problem.quadrature
    nx, ny, nz = mesh.shape
    dx, dy, dz = mesh.spacing
    groups = problem.groups
    q = q.reshape(nx, ny, nz, groups)
    st = sigma_t.reshape(nx, ny, nz, groups)
    phi = np.zeros((nx, ny, nz, groups))
    outflow, inflow = np.zeros(groups), np.zeros(groups)
    fixups = 0
    for octant in range(8):
        sx, sy, sz = OCTANTS[octant]
        xs = range(nx) if sx > 0 else range(nx - 1, -1, -1)
        ys = range(ny) if sy > 0 else range(ny - 1, -1, -1)
        zs = range(nz) if sz > 0 else range(nz - 1, -1, -1)
        for n in range(quad.per_octant):
            mu, eta, xi, w = quad.mu[n], quad.eta[n], quad.xi[n], quad.weights[n]
            a, b, c = mu / dx, eta / dy, xi / dz
            for g in range(groups):
                bx = problem.incident[0 if sx > 0 else 1, g]
                by = problem.incident[2 if sy > 0 else 3, g]
                bz = problem.incident[4 if sz > 0 else 5, g]
                fx = {(j, k): bx for j in range(ny) for k in range(nz)}
                fy = {(i, k): by for i in range(nx) for k in range(nz)}
                fz = {(i, j): bz for i in range(nx) for j in range(ny)}
                inflow[g] += w * (mu * bx * ny * nz * dy * dz + eta * by * nx * nz * dx * dz)
                inflow[g] += w * xi * bz * nx * ny * dx * dy
                for i in xs:
                    for j in ys:
                        for k in zs:
                            ins = (fx[j, k], fy[i, k], fz[i, j])
                            src, sig = q[i, j, k, g], st[i, j, k, g]
                            if problem.scheme == "step":
                                psi = (src + a * ins[0] + b * ins[1] + c * ins[2]) / (
                                    sig + a + b + c
                                )
                                outs = [psi, psi, psi]
                            else:
                                fixed = [False, False, False]
                                while True:
                                    num, den = src, sig
                                    for coef, inc, f in zip((a, b, c), ins, fixed, strict=True):
                                        num += (coef if f else 2 * coef) * inc
                                        den += 0.0 if f else 2 * coef
                                    psi = num / den
                                    outs = [
                                        0.0 if f else 2 * psi - v
                                        for v, f in zip(ins, fixed, strict=True)
                                    ]
                                    new = [o < 0 for o in outs]
                                    if not problem.fixup or not any(new):
                                        break
                                    fixups += 1
                                    fixed = [f or n for f, n in zip(fixed, new, strict=True)]
                            phi[i, j, k, g] += w * psi
                            fx[j, k], fy[i, k], fz[i, j] = outs
                outflow[g] += w * mu * sum(fx.values()) * dy * dz
                outflow[g] += w * eta * sum(fy.values()) * dx * dz
                outflow[g] += w * xi * sum(fz.values()) * dx * dy
    return phi.reshape(-1, groups), outflow, inflow, fixups


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize("scheme", ["dd", "step"])
def test_kernel_matches_cell_by_cell_reference(scheme, kernel):
    problem = build_problem(SweepConfig(**TWO_GROUP, scheme=scheme))
    cells = LocalCells(problem)
    q = cells.source(np.full((cells.cells, 2), 0.7))
    phi, outflow, inflow = sweep_domain(np, problem, q, cells.sigma_t, kernel)
    ref_phi, ref_out, ref_in, fixups = _reference_sweep(problem, q, cells.sigma_t)
    if scheme == "dd":
        assert fixups > 0  # the thick material-1 cells do produce negative faces
    np.testing.assert_allclose(phi, ref_phi, rtol=1e-13, atol=0)
    np.testing.assert_allclose(outflow, ref_out, rtol=1e-13)
    np.testing.assert_allclose(inflow, ref_in, rtol=1e-13)
    assert (phi >= 0).all()


def _slab(sigma_t: float, scheme: str) -> SweepConfig:
    # 6 cells along x; y and z so wide that their faces carry no weight (a 1-D slab), S2 so
    # every direction sees the same tau = sigma_t dx / |mu|
    return SweepConfig(
        nx=6,
        ny=1,
        nz=1,
        lengths=(3.0, 1e13, 1e13),
        sigma_t=((sigma_t,),),
        sigma_s=(((0.0,),),),
        source=((0.0,),),
        order=2,
        scheme=scheme,
        incident_faces=("x-",),
        incident_flux=(2.0,),
        tolerance=0.0,
        max_iterations=2,
    )


@pytest.mark.parametrize("sigma_t", [0.4, 1.0, 2.2])
def test_pure_absorber_transmission_diamond_difference(sigma_t):
    _, res = _solve(_slab(sigma_t, "dd"), max_iterations=1)
    tau = sigma_t * 0.5 / (1 / math.sqrt(3))
    assert tau < 2
    t = (1 - tau / 2) / (1 + tau / 2)
    phi = res.phi[:, 0]
    # half the S2 weight points into +x; the DD cell average is (in + out) / 2
    expected = 0.5 * 2.0 * t ** np.arange(6) * (1 + t) / 2
    np.testing.assert_allclose(phi, expected, rtol=1e-10)
    np.testing.assert_allclose(phi[1:] / phi[:-1], t, rtol=1e-10)


@pytest.mark.parametrize("sigma_t", [0.4, 6.0])
def test_pure_absorber_transmission_step(sigma_t):
    _, res = _solve(_slab(sigma_t, "step"), max_iterations=1)
    tau = sigma_t * 0.5 * math.sqrt(3)
    expected = 0.5 * 2.0 * (1 / (1 + tau)) ** np.arange(1, 7)
    np.testing.assert_allclose(res.phi[:, 0], expected, rtol=1e-10)


def test_fixup_zeroes_the_negative_face_and_keeps_the_balance():
    sigma_t = 6.0  # tau = 5.2: plain DD would transmit a negative flux
    _, res = _solve(_slab(sigma_t, "dd"), max_iterations=1)
    tau = sigma_t * 0.5 * math.sqrt(3)
    assert res.phi[0, 0] == pytest.approx(0.5 * 2.0 / tau, rel=1e-10)
    assert np.abs(res.phi[1:, 0]).max() <= 1e-10 * res.phi[0, 0]
    assert res.balance.relative_error < 1e-12


@pytest.mark.parametrize("scatter", [0.0, 1.0])
@pytest.mark.parametrize("scheme", ["dd", "step"])
def test_particle_balance(scatter, scheme):
    kw = dict(TWO_GROUP)
    kw["sigma_s"] = tuple(
        tuple(tuple(v * scatter for v in row) for row in m) for m in TWO_GROUP["sigma_s"]
    )
    cfg = SweepConfig(**kw, scheme=scheme, fixup=True, tolerance=1e-14, max_iterations=400)
    _, res = _solve(cfg)
    assert res.converged
    if scatter == 0:  # no scattering: the first sweep is exact, the second confirms it
        assert res.iterations == 2
    else:  # source iteration converges at the rate of the scattering ratio: many sweeps
        assert 10 < res.iterations < 400
    b = res.balance
    assert b.source > 0 and b.inflow > 0 and b.absorption > 0 and b.outflow > 0
    assert b.relative_error < 1e-10


def _infinite(c: float) -> SweepConfig:
    # incident flux equal to the infinite-medium answer on every face: the exact solution is
    # uniform, and the centre is 8 mean free paths from the boundary
    q, st = 1.0, 1.0
    return SweepConfig(
        nx=8,
        ny=8,
        nz=8,
        lengths=(16.0, 16.0, 16.0),
        sigma_t=((st,),),
        sigma_s=(((c * st,),),),
        source=((q,),),
        incident_faces=("x-", "x+", "y-", "y+", "z-", "z+"),
        incident_flux=(q / (st - c * st),),
        tolerance=1e-12,
        max_iterations=400,
    )


@pytest.mark.parametrize("c", [0.5, 0.8])
def test_infinite_medium_limit_and_iteration_rate(c):
    _, res = _solve(_infinite(c))
    assert res.converged
    np.testing.assert_allclose(res.phi, 1.0 / (1.0 - c), rtol=1e-10)
    ratio = res.history[1:] / res.history[:-1]
    # the error shrinks by about c per source iteration (a little faster: the boundary
    # holds the exact flux, so some error leaks out)
    early = ratio[4:16]
    assert np.all(early > 0.9 * c) and np.all(early < c + 0.01), early


def test_scattering_above_total_does_not_converge_and_says_why(tmp_path):
    cfg = SweepConfig(
        nx=4,
        ny=4,
        nz=4,
        lengths=(40.0, 40.0, 40.0),
        sigma_t=((1.0,), (1.0,)),
        sigma_s=(((1.2,),), ((0.5,),)),
        source=((1.0,), (1.0,)),
        max_iterations=25,
    )
    with pytest.raises(ConvergenceError) as err:
        run_sweep(cfg, MPI.COMM_SELF, tmp_path / "run", log=lambda _m: None)
    msg = str(err.value)
    assert "did not converge" in msg and "after 25 iterations" in msg
    assert "material 0 group 0 (c=1.2)" in msg and "sigma_s must be < sigma_t" in msg
    assert "diverging" in msg
    assert "material 1" not in msg
    assert (tmp_path / "run" / "flux.h5").exists()  # written before the error, for a look


def test_slow_convergence_suggests_more_iterations():
    _, res = _solve(_infinite(0.8), max_iterations=5)
    assert not res.converged
    assert "raise sweep.max_iterations" in res.message


@pytest.mark.parametrize("kernel", ["numpy", "numba"])
@pytest.mark.parametrize(
    "z_block,angle_block,quadrature,order",
    [(0, 0, "level-symmetric", 4), (1, 1, "level-symmetric", 4), (2, 2, "product", 4)],
)
def test_blocked_single_rank_executor_equals_serial(
    z_block, angle_block, quadrature, order, kernel
):
    cfg = SweepConfig(
        **TWO_GROUP,
        quadrature=quadrature,
        order=order,
        tolerance=1e-13,
        max_iterations=200,
        kernel=kernel,
    )
    problem, ref = _solve(cfg)
    plan = build_plan(1, 1, problem.mesh.shape, problem.quadrature.per_octant, z_block, angle_block)
    sweeper = KBASweeper(problem, plan, MPI.COMM_SELF)
    _, got = _solve(cfg, sweeper)
    assert got.iterations == ref.iterations
    np.testing.assert_allclose(got.phi, ref.phi, rtol=1e-13, atol=0)
    assert 0 < got.efficiency <= 1


def test_the_source_into_a_buffer_equals_a_fresh_one_and_abs_max_equals_abs_then_max():
    """The solver's reused buffers change no bit: `source(phi, out=q)` writes what
    `source(phi)` returns (over whatever q held before), and max |x| taken as
    max(max x, -min x) is np.abs(x).max(), NaN included."""
    from hpcpipe.sweep.solver import _abs_max

    problem = build_problem(SweepConfig(**TWO_GROUP))
    cells = LocalCells(problem)
    phi = np.random.default_rng(3).random((cells.cells, 2))
    q = np.full((cells.cells, 2), np.nan)
    assert cells.source(phi, out=q) is q
    np.testing.assert_array_equal(q, cells.source(phi))
    for a in (phi - 0.5, -phi, phi, np.array([[-3.0, 2.0]]), np.array([[1.0, np.nan]])):
        want = float(np.abs(a).max())
        got = _abs_max(a)
        assert got == want or (math.isnan(got) and math.isnan(want))
