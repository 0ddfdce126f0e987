"""Pipelined training actually learns: it gets within 5% of the data's best achievable loss."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "gpt_pp4.toml")


def test_zbv_training_reaches_the_entropy_rate(mpirun, tmp_path):
    r = mpirun(
        2,
        [
            "run",
            DECK,
            "--set",
            f"run.output={tmp_path}",
            "--set",
            "topology.pp=2",
            "--set",
            "run.steps=300",
            "--set",
            "run.log_every=100",
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.output
    optimal = float(re.search(r"optimal_loss=(\d+\.\d+)", r.stdout).group(1))
    with h5py.File(tmp_path / "metrics.h5") as f:
        loss = f["loss"][()]
    final = float(np.mean(loss[-20:]))
    assert loss[0] > 3 * optimal  # it started far away ...
    assert final < 1.05 * optimal, (final, optimal)  # ... and ends within 5% of the optimum
