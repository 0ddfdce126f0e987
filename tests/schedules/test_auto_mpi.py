"""The runtime runs what the schedule search returns: `schedule = "auto"` over real MPI equals
the single-process reference, and the measured activation peaks match the prediction (which
the search kept within the budget)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

INPUTS = Path(__file__).resolve().parents[2] / "inputs"


@pytest.mark.parametrize(
    ("deck", "budget"),
    [("train_tiny.toml", "3"), ("train_auto.toml", "2.5")],
    ids=["even-budget3", "uneven-budget2.5"],
)
def test_auto_schedule_matches_reference(mpirun, tmp_path, deck, budget):
    r = mpirun(
        4,
        [
            "run",
            str(INPUTS / deck),
            "--set",
            f"run.output={tmp_path}",
            "--set",
            "pipeline.schedule=auto",
            "--set",
            f"pipeline.memory_budget={budget}",
            "--set",
            "topology.pp=4",
            "--set",
            "topology.dp=1",
            "--set",
            "model.layers=14",
            "--set",
            "pipeline.microbatches=8",
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "schedule=auto" in r.stdout, r.output
    assert "verify OK" in r.stdout, r.output
    found = re.search(r"activations: peak live .* counted \[([^\]]*)\], planned \[\1\]\n", r.stdout)
    assert found, r.stdout
    measured = [float(x) for x in found.group(1).split(",")]
    assert len(measured) == 4 and max(measured) <= float(budget) + 1e-9
