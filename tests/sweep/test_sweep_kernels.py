"""The compiled (numba) and NumPy sweep kernels agree: every outgoing face bit for bit, phi to
the last bit of a sum, on every octant, on blocks that start inside the rank's z range, with
the fix-up firing; and the deck's `kernel` key resolves as documented. One process."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import cuda_emulation
import numpy as np
import pytest

from hpcpipe.config import ConfigError, load_config
from hpcpipe.sweep import compiled, cuda_kernel
from hpcpipe.sweep.checks import check_kernel
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.kernel import angle_block, block_order, resolve_kernel, sweep_block
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.solver import LocalCells

TINY = Path(__file__).resolve().parents[2] / "inputs" / "sweep_tiny.toml"

# thick cells (sigma_t dx / mu up to ~20) so that plain diamond difference goes negative
THICK = SweepConfig(
    nx=5,
    ny=4,
    nz=6,
    lengths=(5.0, 2.0, 3.0),
    groups=3,
    sigma_t=((0.5, 1.0, 2.0), (9.0, 14.0, 20.0)),
    sigma_s=(((0.1, 0.1, 0.0), (0.0, 0.5, 0.2), (0.0, 0.0, 1.0)),) * 2,
    source=((1.0, 0.5, 0.2), (0.0, 0.0, 0.0)),
    boxes=((2.0, 5.0, 0.0, 1.0, 0.0, 3.0),),
    box_materials=(1,),
    order=6,
)


def _thick(groups: int) -> SweepConfig:
    """THICK with `groups` groups, its three repeated (block-diagonal scattering): a cell's
    3 x groups elements per angle block pick the numba kernel's fix-up path (vectors of 4
    when a multiple of 4, and more than 63 of them at 100 groups)."""
    if groups == 3:
        return THICK
    tile = [g % 3 for g in range(groups)]
    return dataclasses.replace(
        THICK,
        groups=groups,
        sigma_t=tuple(tuple(row[g] for g in tile) for row in THICK.sigma_t),
        sigma_s=tuple(
            tuple(
                tuple(m[g % 3][h % 3] if g // 3 == h // 3 else 0.0 for h in range(groups))
                for g in range(groups)
            )
            for m in THICK.sigma_s
        ),
        source=tuple(tuple(row[g] for g in tile) for row in THICK.source),
    )


def _sweep_blocks(problem, kernel: str, fixup: bool, scheme: str, xp=np):
    """All octants over the rank's z range in two z-blocks and two angle blocks (z0 > 0 for
    the second block); returns phi and every block's outgoing faces. `xp` is what the kernel
    is handed (the arrays are NumPy's)."""
    nx, ny, nz = problem.mesh.shape
    cells = LocalCells(problem)
    rng = np.random.default_rng(7)
    q = cells.source(rng.random((cells.cells, problem.groups)))
    phi = np.zeros((cells.cells, problem.groups))
    n = problem.quadrature.per_octant
    half = n // 2
    faces = []
    for octant in range(8):
        order = block_order(np, (nx, ny, nz // 2), nz, octant, kernel)
        for start, stop in ((0, half), (half, n)):
            angles = angle_block(np, problem.quadrature, start, stop, problem.mesh.spacing, scheme)
            shape = (stop - start, problem.groups)
            fz = rng.random((nx * ny, *shape))  # incoming z faces differ per angle block
            for z0 in (0, nz // 2) if octant < 4 else (nz // 2, 0):
                fx = rng.random((ny * (nz // 2), *shape))
                fy = rng.random((nx * (nz // 2), *shape))
                sweep_block(
                    xp, order, z0, angles, q, cells.sigma_t, phi, fx, fy, fz, scheme, fixup, kernel
                )
                faces += [fx, fy, fz.copy()]
    return phi, faces


@pytest.mark.parametrize("groups", [3, 4, 100])
@pytest.mark.parametrize(("scheme", "fixup"), [("dd", True), ("dd", False), ("step", False)])
def test_compiled_kernel_equals_numpy_kernel(scheme, fixup, groups):
    problem = build_problem(_thick(groups))
    ref_phi, ref_faces = _sweep_blocks(problem, "numpy", fixup, scheme)
    phi, faces = _sweep_blocks(problem, "numba", fixup, scheme)
    for got, want in zip(faces, ref_faces, strict=True):
        np.testing.assert_array_equal(got, want)  # bit for bit: the same operations per element
    # phi: the sums over directions differ in order; their round-off is relative to the terms,
    # which shows on a phi that cancels (no fix-up: some phi < 0)
    np.testing.assert_allclose(phi, ref_phi, rtol=1e-14, atol=1e-14 * np.abs(ref_phi).max())
    if scheme == "dd":
        negative = min(f.min() for f in ref_faces)
        assert (negative >= 0) if fixup else (negative < 0)  # the fix-up did fire


@pytest.mark.parametrize("one_direction_per_launch", [False, True])
@pytest.mark.parametrize(("scheme", "fixup"), [("dd", True), ("dd", False), ("step", False)])
def test_cuda_kernel_source_equals_numpy_kernel_run_on_the_host(
    scheme, fixup, one_direction_per_launch, monkeypatch
):
    """The CUDA kernel's source, compiled for the host (tests/sweep/cuda_emulation.py), through
    cuda_kernel.py's own wrapper: every face bit for bit, phi to the last bit of a sum; also
    with the scratch too small for more than one direction per launch (large blocks)."""
    if one_direction_per_launch:
        monkeypatch.setattr(cuda_kernel, "SCRATCH_VALUES", 1)
    if cuda_emulation.compiler() is None:
        if os.environ.get("CI"):  # CI installs one: its absence is a broken lane, not a skip
            pytest.fail("CI must check the CUDA kernel's source: no C++ compiler found")
        pytest.skip("no C++ compiler to run the CUDA kernel's source on the host")
    problem = build_problem(THICK)
    ref_phi, ref_faces = _sweep_blocks(problem, "numpy", fixup, scheme)
    emulated = cuda_emulation.HostEmulation()
    phi, faces = _sweep_blocks(problem, "cuda", fixup, scheme, xp=emulated)
    for got, want in zip(faces, ref_faces, strict=True):
        np.testing.assert_array_equal(got, want)
    # one direction per launch adds each direction to phi on its own: round-off of the order
    # of the largest terms, which shows relative to a phi that cancels (no fix-up: phi < 0)
    atol = 1e-14 * float(np.abs(ref_phi).max()) if one_direction_per_launch else 0.0
    np.testing.assert_allclose(phi, ref_phi, rtol=1e-14, atol=atol)


def test_auto_kernel_is_numba_when_installed_else_numpy(monkeypatch):
    assert compiled.available()  # a core dependency: CI and the quick start have it
    assert resolve_kernel("auto") == "numba"
    assert resolve_kernel("numpy") == "numpy"
    assert resolve_kernel("auto", xp=object()) == "numpy"  # a stand-in for CuPy: array kernel
    assert resolve_kernel("auto", xp=None) == "cuda"  # a GPU run being planned
    assert resolve_kernel("cuda", xp=None) == "cuda"
    with pytest.raises(ValueError, match="the cuda kernel runs on CuPy arrays"):
        resolve_kernel("cuda")
    monkeypatch.setattr("hpcpipe.sweep.kernel.compiled_available", lambda: False)
    assert resolve_kernel("auto") == "numpy"
    with pytest.raises(ValueError, match="numba is not installed here: pip install numba"):
        resolve_kernel("numba")


def test_deck_kernel_errors_name_the_key(monkeypatch):
    config = load_config(TINY, ["sweep.kernel=numba"])
    check_kernel(config.sweep, "cpu", config.source)  # installed: fine
    with pytest.raises(ConfigError) as info:
        check_kernel(config.sweep, "cuda", config.source)
    assert info.value.key == "sweep.kernel" and "runs on host arrays" in str(info.value)
    monkeypatch.setattr("hpcpipe.sweep.kernel.compiled_available", lambda: False)
    with pytest.raises(ConfigError, match="numba is not installed"):
        check_kernel(config.sweep, "cpu", config.source)
    config = load_config(TINY, ["sweep.kernel=cuda"])
    check_kernel(config.sweep, "cuda", config.source)  # a GPU run: fine
    with pytest.raises(ConfigError) as info:
        check_kernel(config.sweep, "cpu", config.source)
    assert info.value.key == "sweep.kernel" and "runs on CuPy arrays" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["sweep.kernel=fortran"])
    assert info.value.key == "sweep.kernel"


def test_prepare_compiles_the_one_signature_a_sweep_uses(tmp_path):
    """`prepare` compiles ahead of the first iteration exactly what the solver then calls: a
    whole run (numba kernel, fix-up on) adds no specialisation of its own, so no compile is left
    to land inside the first iteration's watchdog."""
    pytest.importorskip("numba")
    from mpi4py import MPI

    from hpcpipe.sweep._numba_kernels import sweep_block_loops
    from hpcpipe.sweep.workload import run_sweep

    seconds, _ = compiled.prepare()
    assert seconds >= 0
    prepared = list(sweep_block_loops.signatures)
    assert len(prepared) >= 1
    messages: list[str] = []
    cfg = load_config(TINY, ["sweep.kernel='numba'"]).sweep
    run_sweep(cfg, MPI.COMM_SELF, tmp_path / "run", log=messages.append)
    assert list(sweep_block_loops.signatures) == prepared
    assert any(m.startswith("sweep kernel: numba loops ") for m in messages), messages
