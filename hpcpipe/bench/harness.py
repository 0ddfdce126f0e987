"""Timing on MPI, OSU style: warm-up, barrier, timed loop, the slowest rank, medians.

Methods that a table compares run interleaved in the same job (each repetition rotates their
order), so drift and the load of other processes hit them alike and their ratio is measured per
repetition; each repetition's figure is its median call, and the reported figure is the median
over repetitions. Ranks that have nothing to do wait in `hpcpipe.mpi.idle.idle_barrier`, which
sleeps instead of spinning in MPI, so they leave their core to the ranks being timed.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["compare", "iterations", "machine", "median"]


def iterations(nbytes: int, budget: int, lo: int, hi: int) -> int:
    """Calls per timed loop: about `budget` bytes moved, within [lo, hi]."""
    return int(min(hi, max(lo, budget // max(1, nbytes))))


def compare(
    comm: MPI.Comm,
    methods: Mapping[str, Callable[[], Any]],
    iters: int,
    repeats: int,
    warmup: int = 2,
) -> dict[str, np.ndarray]:
    """Seconds per call of each method: the median call of each repetition, shape (repeats,).

    Every method is warmed up first; then each repetition runs every method's timed loop
    (barrier, `iters` calls, each timed), rotating the order from one repetition to the next.
    A call lasts until its slowest rank is done; the median over the calls of a loop drops the
    calls that another process's time slice happened to hit (a mean would be dominated by them
    on a shared machine).
    """
    names = list(methods)
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    spent = np.zeros((len(names), repeats, iters))
    clock = time.perf_counter
    for r in range(repeats):
        k0 = r % len(names)
        for k in [*range(k0, len(names)), *range(k0)]:
            fn, out = methods[names[k]], spent[k, r]
            comm.Barrier()
            t0 = clock()
            for i in range(iters):
                fn()
                t1 = clock()
                out[i] = t1 - t0
                t0 = t1
    comm.Allreduce(MPI.IN_PLACE, spent, op=MPI.MAX)
    return {name: np.median(spent[k], axis=1) for k, name in enumerate(names)}


def median(values: Any) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.median(arr)) if arr.size else float("nan")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def machine(comm: MPI.Comm) -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, software, load (rank 0's view)."""
    import mpi4py

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "system": f"{platform.system()} {'.'.join(platform.release().split('.')[:2])}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "ranks": comm.size,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
