"""Real mpiexec runs: the KBA executor equals the serial sweep on 2x1, 1x2, 2x2, 3x2 and 4x2
ranks with several z- and angle-block sizes and the three octant orders, and `hpcpipe run` on a
sweep deck end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import clean_environ, mpiexec_command, run_mpi

from hpcpipe.config import load_config
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.output import read_flux
from hpcpipe.sweep.solver import LocalCells, SerialSweeper, solve

pytestmark = pytest.mark.mpi

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY = ROOT / "inputs" / "sweep_tiny.toml"


@pytest.mark.parametrize(
    "ranks,layouts", [(2, {(2, 1), (1, 2)}), (4, {(2, 2)}), (6, {(3, 2)}), (8, {(4, 2)})]
)
def test_parallel_sweep_equals_serial(ranks, layouts):
    cmd = [*mpiexec_command(), "-n", str(ranks), sys.executable, str(HERE / "sweep_mpi_check.py")]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=clean_environ()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {tuple(r["layout"]) for r in records} == layouts
    assert {r["physics"] for r in records} == {
        "tiny",
        "thick-fixup",
        "thick-fixup-numpy-kernel",
        "step-product-all-faces",
    }
    assert {r["kernel"] for r in records} == {"numba", "numpy"}  # the default and the fallback
    assert {r["order"] for r in records} == {"nearest", "yx", "xy"}  # per-rank and shared orders
    assert len({r["tasks_per_octant"] for r in records}) >= 4  # several blockings really ran
    for r in records:
        assert r["max_rel_diff"] < 1e-12, r
        assert r["outflow_rel_diff"] < 1e-12, r
        assert 0 < r["efficiency"] <= 1, r


def test_cli_run_writes_the_serial_answer(tmp_path):
    out = tmp_path / "run"
    res = run_mpi(
        2,
        ["run", str(TINY), "--set", "sweep.py=2", "--set", f"run.output={out}"],
        timeout=120,
    )
    assert res.returncode == 0, res.output
    done = [ln for ln in res.stdout.splitlines() if ln.startswith("sweep done")]
    assert len(done) == 1 and "converged=true" in done[0], res.stdout
    fields = dict(kv.split("=") for kv in done[0].split()[2:])
    assert float(fields["balance"]) < 1e-9
    # M = 6 tasks per octant; on 1 x 2 ranks the auto (nearest) order starts each rank at
    # its own corners: 8M stages, no fill (one corner at a time, yx or xy: 8M + 2)
    assert float(fields["predicted"]) == pytest.approx(1.0, abs=1e-3)
    phi, attrs = read_flux(out / "flux.h5")
    assert attrs["ranks"] == 2 and (out / "flux.xmf").exists() and (out / "config.toml").exists()
    cfg = load_config(TINY).sweep
    problem = build_problem(cfg)
    ref = solve(
        problem,
        LocalCells(problem),
        SerialSweeper(problem),
        tolerance=cfg.tolerance,
        max_iterations=cfg.max_iterations,
    )
    assert attrs["iterations"] == ref.iterations
    np.testing.assert_allclose(phi.reshape(-1, problem.groups), ref.phi, rtol=1e-12)


def test_cli_a_kernel_that_cannot_run_is_exit_2_naming_the_key(tmp_path):
    sets = ["--set", "device.kind='cuda'", "--set", "sweep.kernel='numba'"]
    res = run_mpi(1, ["run", str(TINY), *sets, "--set", f"run.output={tmp_path}"], timeout=60)
    assert res.returncode == 2, res.output
    assert "sweep.kernel = 'numba': the numba kernel runs on host arrays" in res.stderr


def test_cli_rank_grid_must_match_the_world(tmp_path):
    res = run_mpi(2, ["run", str(TINY), "--set", f"run.output={tmp_path}"], timeout=60)
    assert res.returncode == 2, res.output
    assert "sweep.px * sweep.py = 1 * 1 = 1 ranks, but this run has 2" in res.stderr
    assert "mpiexec -n 1" in res.stderr
