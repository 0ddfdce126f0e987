"""Shared by the real-GPU tests: skip cleanly, with the reason, where CuPy or a device is missing,
and start the GPU MPI driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def cuda_skip_reason() -> str | None:
    """None when CuPy and at least one CUDA device are usable here, else why not."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed (pip install 'hpcpipe[gpu]'): {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device, no libcuda
        return f"CuPy cannot reach a CUDA device: {type(exc).__name__}: {exc}"
    if count < 1:
        return "no CUDA device is visible (cupy.cuda.runtime.getDeviceCount() = 0)"
    return None


def require_cuda() -> Any:
    """The cupy module, or skip the calling test module with the reason.

    With HPCPIPE_TEST_ARRAY_MODULE=fake_device set, the fake device stands in for CuPy (and the
    GPU drivers use it too): how these tests themselves are checked on a machine without one.
    """
    stand_in = os.environ.get("HPCPIPE_TEST_ARRAY_MODULE")
    if stand_in:
        import importlib

        return importlib.import_module(stand_in)
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'hpcpipe[gpu]')")
    why = cuda_skip_reason()
    if why:
        pytest.skip(why, allow_module_level=True)
    import cupy

    return cupy


def cuda_aware_mpi() -> tuple[bool, str]:
    """Whether the MPI under the launcher takes device buffers (the backend's own detection),
    honouring HPCPIPE_GPU_CUDA_AWARE=on|off for a library that cannot tell."""
    forced = os.environ.get("HPCPIPE_GPU_CUDA_AWARE", "auto")
    from mpi4py import MPI  # noqa: F401  (initialises MPI so the library is loaded)

    from hpcpipe.backend import detect_cuda_aware

    return detect_cuda_aware(forced)


def run_gpu_driver(ranks: int, case: str, timeout: float = 240) -> list[dict]:
    """`mpiexec -n RANKS python gpu_driver.py CASE`: rank 0's JSON lines."""
    from conftest import clean_environ, mpiexec_command

    cmd = [*mpiexec_command(), "-n", str(ranks), sys.executable, str(HERE / "gpu_driver.py"), case]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=clean_environ()
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"gpu_driver {case} on {ranks} ranks did not finish in {timeout}s\n{exc.stderr}"
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
