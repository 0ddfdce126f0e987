"""Sweep checkpoints over real mpiexec: bitwise resume on the same rank grid, round-off resume
on another grid (2 x 2 -> 4 x 1, 2 x 2 -> 1 x 1), and the time-limit signal then --resume."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import run_mpi

from hpcpipe.sweep.output import read_flux

pytestmark = pytest.mark.mpi

TINY = str(Path(__file__).resolve().parents[2] / "inputs" / "sweep_tiny.toml")
GRID_2X2 = ["sweep.px=2", "sweep.py=2"]


def sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def history(run: Path) -> np.ndarray:
    with h5py.File(run / "flux.h5") as f:
        return f["history/dphi"][()]


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """An uninterrupted 2 x 2 run with a checkpoint every 10 iterations (30 in all)."""
    out = tmp_path_factory.mktemp("sweep-full")
    r = run_mpi(
        4,
        ["run", TINY, *sets(*GRID_2X2, f"run.output={out}", "checkpoint.every=10")],
        timeout=120,
    )
    assert r.returncode == 0, r.output
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        "step_000010",
        "step_000020",
        "step_000030",
    ]
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    return out


def test_resume_on_the_same_grid_is_bitwise(full, tmp_path):
    r = run_mpi(
        4,
        [
            "run",
            TINY,
            "--resume",
            str(full / "checkpoints" / "step_000010"),
            *sets(*GRID_2X2, f"run.output={tmp_path}"),
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.output
    assert "resumed from" in r.stdout and "at iteration 10 (written by a 2 x 2 run)" in r.stdout
    a, attrs_a = read_flux(full / "flux.h5")
    b, attrs_b = read_flux(tmp_path / "flux.h5")
    assert attrs_b["iterations"] == attrs_a["iterations"] == 30
    assert np.array_equal(a, b)
    assert np.array_equal(history(full), history(tmp_path))


@pytest.mark.parametrize(
    ("ranks", "grid"),
    [
        (4, ["sweep.px=4", "sweep.py=1"]),
        # one rank, and directions summed as whole octants: another order of the angular sums
        (1, ["sweep.px=1", "sweep.py=1", "sweep.angle_block=0"]),
    ],
)
def test_resume_on_another_grid_matches_to_round_off(full, tmp_path, ranks, grid):
    r = run_mpi(
        ranks,
        [
            "run",
            TINY,
            "--resume",
            str(full / "checkpoints" / "step_000020"),
            *sets(*grid, f"run.output={tmp_path}"),
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.output
    assert "at iteration 20 (written by a 2 x 2 run)" in r.stdout
    a, _ = read_flux(full / "flux.h5")
    b, attrs = read_flux(tmp_path / "flux.h5")
    assert attrs["iterations"] == 30 and attrs["ranks"] == ranks
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(history(tmp_path)[:20], history(full)[:20])


def test_time_limit_signal_stops_checkpoints_and_resumes(full, tmp_path):
    r = run_mpi(
        4,
        ["run", TINY, *sets(*GRID_2X2, f"run.output={tmp_path}")],
        env={"HPCPIPE_INJECT_FAULT": "rank=1,at=sweep-iteration:2,kind=usr1"},
        timeout=120,
    )
    assert r.returncode == 0, r.output
    assert "stopping on signal after iteration 2/200" in r.stdout, r.stdout
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    status = json.loads((tmp_path / "status.json").read_text())
    assert status == {"state": "preempted", "step": 2, "checkpoint": str(checkpoint)}
    assert not (tmp_path / "flux.h5").exists()
    r = run_mpi(
        4, ["run", TINY, "--resume", *sets(*GRID_2X2, f"run.output={tmp_path}")], timeout=120
    )
    assert r.returncode == 0, r.output
    assert "at iteration 2 (written by a 2 x 2 run)" in r.stdout
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"
    a, _ = read_flux(full / "flux.h5")
    b, _ = read_flux(tmp_path / "flux.h5")
    assert np.array_equal(a, b)
