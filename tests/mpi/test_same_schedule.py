"""Every rank runs the same schedule: ranks started with different ones (an MPMD launch, as a
mismatched deck or schedule file on some nodes would give) stop at start with exit 2 and name
which ranks run what, instead of hanging on a message nobody sends."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, clean_environ, mpiexec_command

from hpcpipe.schedules import build_schedule, lower
from hpcpipe.topology import format_ranks

pytestmark = pytest.mark.mpi


def test_fingerprint_follows_the_actions_not_the_name():
    a, b = lower(build_schedule("1f1b", 2, 4)), lower(build_schedule("1f1b", 2, 4))
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 16
    assert a.fingerprint() != lower(build_schedule("gpipe", 2, 4)).fingerprint()
    assert a.fingerprint() != lower(build_schedule("1f1b", 2, 6)).fingerprint()
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_ranks_with_different_schedules_stop_at_start(tmp_path):
    def part(schedule: str) -> list[str]:
        return [
            "-n", "1", sys.executable, "-m", "hpcpipe", "run", "inputs/train_tiny.toml",
            "--set", f"pipeline.schedule='{schedule}'", "--set", "run.steps=2",
            "--set", f"run.output='{tmp_path / 'run'}'",
        ]  # fmt: skip

    cmd = [*mpiexec_command(), *part("1f1b"), ":", *part("gpipe")]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=clean_environ(), capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "pipeline.schedule differs between ranks (ranks 0 run schedule" in out, out
    assert "ranks 1 run schedule" in out and "every rank must read the same deck" in out, out
