"""Shared helpers for the benchmark scripts: run `hpcpipe bench` under mpiexec, plot, save.

Each script in benchmarks/ is one published figure: it runs one `hpcpipe bench` subcommand
(the measuring lives in hpcpipe/bench), which prints its table and writes
benchmarks/results/<figure>.json; some also draw benchmarks/results/<figure>.png. Arguments a
script does not know are passed on to the benchmark, e.g. `--repeats 7`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpcpipe._sources import start_log

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
start_log()  # every result records the source files its processes ran (hpcpipe._sources)


def machine_facts() -> dict[str, Any]:
    """Where a pure-computation figure ran: Python, NumPy, cores and the load at the start."""
    import platform

    import numpy as np

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def mpiexec() -> list[str]:
    """$HPCPIPE_MPIEXEC, else the mpiexec beside this Python, else the one on PATH."""
    if os.environ.get("HPCPIPE_MPIEXEC"):
        return os.environ["HPCPIPE_MPIEXEC"].split()
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        sys.exit("no mpiexec: install hpcpipe[mpich] or set HPCPIPE_MPIEXEC")
    return [found]


def run_hpcpipe(
    n: int, args: list[str], timeout: float = 1800, env: dict[str, str] | None = None
) -> str:
    """`mpiexec -n N python -m hpcpipe ARGS` (with `env` added to the environment); exits with
    the job's output if it fails."""
    cmd = [*mpiexec(), "-n", str(n), sys.executable, "-m", "hpcpipe", *args]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def bench(
    figure: str, ranks: int, name: str, args: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """`mpiexec -n RANKS hpcpipe bench NAME ARGS --json results/FIGURE.json`, its table shown
    as it is measured; returns the JSON it wrote."""
    out = RESULTS / f"{figure}.json"
    rel = out.relative_to(ROOT)
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "hpcpipe", "bench", name]
    cmd += [*args, "--json", str(rel)]
    print(f"$ mpiexec -n {ranks} hpcpipe bench {name} {' '.join([*args, '--json', str(rel)])}")
    sys.stdout.flush()
    proc = subprocess.run(
        cmd, cwd=ROOT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, check=False
    )
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return json.loads(out.read_text(encoding="utf-8"))


def pyplot() -> Any:
    """matplotlib.pyplot on a file backend (exits with hpcpipe's message if it is missing)."""
    from hpcpipe.config import ConfigError
    from hpcpipe.plotting import pyplot as plotting_pyplot

    try:
        return plotting_pyplot("benchmarks", "figure")
    except ConfigError as exc:
        sys.exit(f"ERROR: {exc}")


def save_figure(fig: Any, figure: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{figure}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# wrote {path.relative_to(ROOT)}")
    return path


def save_json(name: str, payload: dict[str, Any]) -> Path:
    """Write results/NAME.json, stamped with the commit and date it was measured on."""
    from hpcpipe.bench.table import provenance

    payload = {**payload, "measured": provenance()}
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
