"""Shared helpers for the benchmark scripts: launch hpcpipe under mpiexec, save results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def mpiexec() -> list[str]:
    """$HPCPIPE_MPIEXEC, else the mpiexec beside this Python, else the one on PATH."""
    if os.environ.get("HPCPIPE_MPIEXEC"):
        return os.environ["HPCPIPE_MPIEXEC"].split()
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        sys.exit("no mpiexec: install hpcpipe[mpich] or set HPCPIPE_MPIEXEC")
    return [found]


def run_hpcpipe(n: int, args: list[str], timeout: float = 1800) -> str:
    """`mpiexec -n N python -m hpcpipe ARGS`; exits with the job's output if it fails."""
    cmd = [*mpiexec(), "-n", str(n), sys.executable, "-m", "hpcpipe", *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def save_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


def machine() -> dict[str, Any]:
    import platform

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": platform.system(),
    }
