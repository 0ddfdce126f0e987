"""Shared test helpers: start real `mpiexec` jobs, always bounded by a timeout."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
INPUTS = ROOT / "inputs"


@cache
def mpiexec_command() -> list[str]:
    """The launcher: $HPCPIPE_MPIEXEC, else the mpiexec beside this Python, else on PATH.

    Open MPI refuses root and more ranks than cores unless told; its flags are added only when
    the launcher is Open MPI.
    """
    if os.environ.get("HPCPIPE_MPIEXEC"):
        cmd = shlex.split(os.environ["HPCPIPE_MPIEXEC"])
    else:
        beside = Path(sys.executable).parent / "mpiexec"
        found = str(beside) if beside.exists() else shutil.which("mpiexec")
        if found is None:
            why = "no mpiexec found: install the 'mpich' extra or set HPCPIPE_MPIEXEC"
            if os.environ.get("CI"):  # CI installs one: its absence is a broken lane, not a skip
                pytest.fail(f"CI must run the MPI tests: {why}")
            pytest.skip(why)
        cmd = [found]
    try:
        version = subprocess.run(
            [*cmd, "--version"], capture_output=True, text=True, timeout=30, env=clean_environ()
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        extra = ["--oversubscribe"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            extra.append("--allow-run-as-root")
        cmd = [*cmd, *extra]
    return cmd


# What a launcher or an MPI runtime puts in a process's environment (Slurm, Hydra's PMI, Open
# MPI's ORTE/PMIx): a child started with them joins, or refuses, the parent's job instead of
# starting its own. User tuning (OMPI_MCA_btl=..., PMIX_MCA_gds=..., MPIR_CVAR_...) is kept.
_LAUNCHER_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
_RUNTIME_MCA = ("OMPI_MCA_ess", "OMPI_MCA_orte_", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir")


def _from_launcher(key: str) -> bool:
    if key.startswith(("OMPI_MCA_", "PMIX_MCA_")):  # tuning (PMIX_MCA_gds=hash in containers)
        return key.startswith(_RUNTIME_MCA)  # ... but not the keys a launch sets
    if key.startswith("OMPI_"):
        return True  # OMPI_COMM_WORLD_RANK, OMPI_UNIVERSE_SIZE, OMPI_COMMAND, ...
    return key.startswith(_LAUNCHER_PREFIXES)


def clean_environ() -> dict[str, str]:
    """The environment every test launch gets: this process's, without what a launcher put
    there (pytest may run inside an allocation or under mpiexec, whose task counts would rightly
    contradict a test's own mpiexec -n).

    Always pass it (env=clean_environ()): with env=None a child inherits the C-level
    environment, where an MPI initialised in this process (Open MPI's singleton sets PMIX_* by
    setenv, unseen by os.environ) makes the child's mpiexec fail without a word."""
    return {k: v for k, v in os.environ.items() if not _from_launcher(k)}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_mpi(
    n: int,
    args: list[str],
    *,
    timeout: float = 120,
    env: dict | None = None,
    cwd: Path | None = None,
) -> Result:
    """`mpiexec -n N python -m hpcpipe ARGS`; a hang becomes a test failure after `timeout`."""
    import time

    full_env = {**clean_environ(), **(env or {})}
    cmd = [*mpiexec_command(), "-n", str(n), sys.executable, "-m", "hpcpipe", *args]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"mpiexec -n {n} {' '.join(args)} did not finish in {timeout}s (hang?)\n"
            f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}"
        )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


def run_json_driver(ranks: int, script: Path, *args: str, timeout: float = 120) -> list[dict]:
    """`mpiexec -n RANKS python SCRIPT ARGS` that must succeed; the JSON lines it printed."""
    import json

    proc = subprocess.run(
        [*mpiexec_command(), "-n", str(ranks), sys.executable, str(script), *args],
        cwd=ROOT,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def run_cli(args: list[str], *, timeout: float = 60, cwd: Path | None = None) -> Result:
    """`python -m hpcpipe ARGS` without a launcher (plan, trace, bad-input paths)."""
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hpcpipe", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


@pytest.fixture
def mpirun():
    """Fixture form of `run_mpi`: `mpirun(4, ["run", deck])`."""
    return run_mpi


@pytest.fixture
def cli():
    """Fixture form of `run_cli`."""
    return run_cli


@cache
def launched_h5py_is_parallel() -> bool:
    """Whether h5py has MPI under the launcher (Debian's h5py picks its MPI build only there)."""
    cmd = [
        *mpiexec_command(),
        "-n",
        "1",
        sys.executable,
        "-c",
        "import h5py; print(h5py.get_config().mpi)",
    ]
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=60, env=clean_environ()
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.strip().endswith("True")


@pytest.fixture
def parallel_h5py():
    """Skip unless h5py is built with parallel HDF5 (fail instead where the lane requires it)."""
    if not launched_h5py_is_parallel():
        why = "h5py under mpiexec is serial (h5py.get_config().mpi is False)"
        if os.environ.get("HPCPIPE_REQUIRE_PARALLEL_H5PY"):
            pytest.fail(f"this lane requires parallel HDF5: {why}")
        pytest.skip(why)


def read_params(run: Path) -> dict[str, Any]:
    """Every array of a run's params.h5 (`train.save_params`), by its path in the file."""
    import h5py

    out: dict[str, Any] = {}

    def take(name: str, item: Any) -> None:
        if isinstance(item, h5py.Dataset):
            out[name] = item[()]

    with h5py.File(run / "params.h5") as f:
        f.visititems(take)
    return out


def read_losses(run: Path) -> Any:
    """The per-step (or per-update) losses of a run's metrics.h5."""
    import h5py

    with h5py.File(run / "metrics.h5") as f:
        return f["loss"][()]
