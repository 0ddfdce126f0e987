"""Formats do not depend on the MPI: checkpoints move between MPI libraries and file layouts.

The Open MPI lane of CI (Debian's mpi4py and parallel h5py) runs these with
HPCPIPE_OTHER_MPIEXEC / HPCPIPE_OTHER_PYTHON pointing at the embedded-MPICH environment, so a
checkpoint written under one MPI is resumed under the other.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import clean_environ

pytestmark = pytest.mark.mpi

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "train_tiny.toml")
OTHER = os.environ.get("HPCPIPE_OTHER_PYTHON")


def sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


@pytest.mark.skipif(
    not OTHER,
    reason="needs a second MPI environment (HPCPIPE_OTHER_PYTHON, set by the Open MPI lane of CI)",
)
def test_checkpoint_from_another_mpi_resumes_here(mpirun, tmp_path):
    launcher = shlex.split(os.environ.get("HPCPIPE_OTHER_MPIEXEC", "mpiexec"))
    first = subprocess.run(
        [
            *launcher,
            "-n",
            "4",
            OTHER,
            "-m",
            "hpcpipe",
            "run",
            DECK,
            *sets(
                f"run.output={tmp_path}",
                "run.steps=3",
                "checkpoint.every=3",
                "checkpoint.layout=shards",
            ),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        env=clean_environ(),
    )
    assert first.returncode == 0, first.stdout + first.stderr
    r = mpirun(
        2,
        ["run", DECK, "--resume", *sets(f"run.output={tmp_path}", "run.steps=5", "topology.dp=1")],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    assert "resumed from" in r.stdout and "verify OK" in r.stdout


def test_shared_file_checkpoint_written_collectively(mpirun, cli, tmp_path, parallel_h5py):
    r = mpirun(
        4,
        [
            "run",
            DECK,
            *sets(
                f"run.output={tmp_path}",
                "run.steps=3",
                "checkpoint.every=3",
                "checkpoint.layout=shared",
            ),
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.output
    step = tmp_path / "checkpoints" / "step_000003"
    assert sorted(p.name for p in step.iterdir()) == ["data.h5", "index.h5"]
    v = cli(["ckpt", "verify", str(step)])
    assert v.returncode == 0, v.output
    r = mpirun(
        2,
        ["run", DECK, "--resume", *sets(f"run.output={tmp_path}", "run.steps=5", "topology.dp=1")],
        timeout=180,
    )
    assert r.returncode == 0 and "verify OK" in r.stdout, r.output
