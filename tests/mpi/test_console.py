"""Every rank's log line reaches the merged output whole, also with PYTHONUNBUFFERED=1."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, clean_environ, mpiexec_command

from hpcpipe.console import say

LINE = "step {i} loss=2.9059 tok/s=12162 bubble=40.3% mem=0.38MiB live_mb=2 gnorm=1.606"


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushes += 1


def test_say_hands_the_stream_one_string_per_line(monkeypatch):
    out, err = _Recorder(), _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    say("a line")
    say("a warning", err=True)
    assert out.writes == ["a line\n"] and out.flushes == 1
    assert err.writes == ["a warning\n"] and err.flushes == 1


@pytest.mark.mpi
def test_lines_of_two_ranks_never_interleave_unbuffered():
    """`print` under PYTHONUNBUFFERED=1 writes text and newline apart and lines of two ranks
    could be spliced (seen in CI); `say` writes each line once."""
    n = 3000
    code = (
        "from mpi4py import MPI\n"
        "from hpcpipe.console import say\n"
        "r = MPI.COMM_WORLD.rank\n"
        f"for i in range({n}):\n"
        f"    say(f'[rank {{r}}] ' + {LINE!r}.format(i=i))\n"
    )
    launcher = mpiexec_command()
    if "--oversubscribe" in launcher:  # what mpiexec_command adds for Open MPI only
        pytest.skip(
            "Open MPI forwards each rank's output in read-sized chunks and splits lines "
            "whatever the program writes (--tag-output too, seen with 4.1); its users keep "
            "rank output apart with --output-filename. MPICH's Hydra and srun forward writes "
            "whole, which this checks"
        )
    proc = subprocess.run(
        [*launcher, "-n", "2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**clean_environ(), "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    expected = {f"[rank {r}] " + LINE.format(i=i) for r in (0, 1) for i in range(n)}
    broken = [ln for ln in lines if ln not in expected]
    assert not broken, broken[:5]
    assert len(lines) == 2 * n
