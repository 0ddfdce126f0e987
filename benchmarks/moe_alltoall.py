"""MoE dispatch all-to-all against raw mpi4py Alltoallv on the same buffers (OSU style).

    python benchmarks/moe_alltoall.py                       # 2 and 4 ranks, via mpiexec
    python benchmarks/moe_alltoall.py --ranks 4 --json out.json

Each rank sends `size` bytes to every rank (rows of 128 float64, one expert per rank). Per size,
rank 0 prints the latency of one exchange and the per-rank bandwidth (bytes sent to the other
ranks / latency) for the methods below. After a warm-up the methods run interleaved call by
call, so that they share the machine's noise; each call is timed after a barrier, lasts until
its slowest rank is done, and the latency is the median over calls (robust to the spikes of a
shared machine, where a mean is dominated by them).


    raw       comm.Alltoallv on preallocated buffers, counts computed once
    a2a       ExpertGroup.alltoallv(rows, plan.forward, out=recv): the exchange every dispatch
              issues four times (tokens, outputs; gradients out and back)
    dispatch  ExpertGroup.plan(counts) + alltoallv into a fresh buffer: a whole F dispatch
              step (counts Alltoall, plan, tokens), as the MoE layer runs it
    2-phase   a2a with the two-phase exchange over 2 virtual nodes

overhead = a2a / raw - 1 (target <= 5% at >= 64 KiB per peer). Every method's received buffer
is checked bitwise against raw's. On an oversubscribed machine the figures partly measure the
machine (ranks share cores; MPICH polls while it waits).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WIDTH = 128  # float64 per row: 1 KiB rows
SIZES = [1 << k for k in range(10, 23)]  # bytes per peer: 1 KiB .. 4 MiB
METHODS = ("raw", "a2a", "dispatch", "2-phase")


def iterations(size: int) -> int:
    return int(min(200, max(10, (8 << 20) // (size * 4))))


def exchanges(comm, flat, two, size: int, rng: np.random.Generator):
    """The four exchanges on one pair of buffers, and whether they all receive raw's bytes."""
    from mpi4py import MPI

    p = comm.size
    rows = size // (WIDTH * 8)
    counts = np.full(p, rows, dtype=np.int64)  # one expert per rank
    send = rng.standard_normal((p * rows, WIDTH))
    recv = np.empty_like(send)
    elems = [rows * WIDTH] * p
    displs = [i * rows * WIDTH for i in range(p)]
    plan, plan2 = flat.plan(counts), two.plan(counts)

    def raw() -> None:
        comm.Alltoallv([send, (elems, displs), MPI.DOUBLE], [recv, (elems, displs), MPI.DOUBLE])

    def a2a() -> None:
        flat.alltoallv(send, plan.forward, out=recv)

    def dispatch() -> None:
        flat.alltoallv(send, flat.plan(counts).forward)

    def two_phase() -> None:
        two.alltoallv(send, plan2.forward, out=recv)

    raw()
    expected = recv.copy()
    outs = (
        flat.alltoallv(send, plan.forward),
        flat.alltoallv(send, flat.plan(counts).forward),
        two.alltoallv(send, plan2.forward),
    )
    same = all(np.array_equal(out, expected) for out in outs)
    return dict(zip(METHODS, (raw, a2a, dispatch, two_phase), strict=True)), same


def worker(repeat: int) -> None:
    """Run under mpiexec: rank 0 prints one JSON line per message size."""
    from mpi4py import MPI

    from hpcpipe.moe.group import ExpertGroup

    comm = MPI.COMM_WORLD
    p, me = comm.size, comm.rank
    flat = ExpertGroup(comm, p)
    two = ExpertGroup(comm, p, node=me * 2 // p, hierarchical=True, virtual_nodes=True)
    rng = np.random.default_rng(me)
    for size in SIZES:
        fns, same = exchanges(comm, flat, two, size, rng)
        same = bool(comm.allreduce(int(same), op=MPI.MIN))
        n = iterations(size) * repeat
        for fn in fns.values():  # warm-up
            fn()
            fn()
        spent = np.zeros((len(METHODS), n))
        for it in range(n):  # interleaved call by call: every method sees the same noise;
            for k, fn in enumerate(fns.values()):  # a barrier keeps one call's skew out
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                spent[k, it] = time.perf_counter() - t0
        slowest = np.empty_like(spent)
        comm.Allreduce(spent, slowest, op=MPI.MAX)  # a call lasts until its last rank is done
        if me == 0:
            lat = {m: float(np.median(slowest[k])) for k, m in enumerate(METHODS)}
            rec = {
                "ranks": p,
                "bytes_per_peer": size,
                "iterations": n,
                "identical": same,
                "latency_us": {m: lat[m] * 1e6 for m in METHODS},
                "bandwidth_MBps": {m: (p - 1) * size / lat[m] / 1e6 for m in METHODS},
                "overhead": lat["a2a"] / lat["raw"] - 1.0,
                "dispatch_overhead": lat["dispatch"] / lat["raw"] - 1.0,
            }
            print(json.dumps(rec), flush=True)
    flat.free()
    two.free()


def table(records: list[dict]) -> str:
    head = (
        f"{'ranks':>5} {'bytes/peer':>10} "
        + " ".join(f"{m + ' us':>12}" for m in METHODS)
        + f" {'raw MB/s':>9} {'a2a MB/s':>9} {'a2a ovh':>8} {'disp ovh':>8} {'same':>5}"
    )
    lines = [head]
    for r in records:
        lines.append(
            f"{r['ranks']:>5} {r['bytes_per_peer']:>10} "
            + " ".join(f"{r['latency_us'][m]:>12.1f}" for m in METHODS)
            + f" {r['bandwidth_MBps']['raw']:>9.0f} {r['bandwidth_MBps']['a2a']:>9.0f}"
            f" {r['overhead'] * 100:>7.1f}% {r['dispatch_overhead'] * 100:>7.1f}%"
            f" {'yes' if r['identical'] else 'NO':>5}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="process counts")
    ap.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="timed calls per size, in units of "
        "the base count (200 calls for small messages, down to 10 for 4 MiB)",
    )
    ap.add_argument("--json", default="benchmarks/results/moe_alltoall.json", help="output")
    ap.add_argument("--mpiexec", default=os.environ.get("HPCPIPE_MPIEXEC", ""), help="launcher")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mpiexec run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.repeat)
        return 0
    launcher = args.mpiexec.split() or [str(Path(sys.executable).parent / "mpiexec")]
    records: list[dict] = []
    for n in args.ranks:
        cmd = [*launcher, "-n", str(n), sys.executable, __file__, "--worker"]
        cmd += ["--repeat", str(args.repeat)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return proc.returncode
        records += [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    print(table(records))
    big = [r["overhead"] for r in records if r["bytes_per_peer"] >= 64 << 10]
    if big:
        print(
            f"a2a overhead at >= 64 KiB per peer: max {max(big) * 100:.1f}%, "
            f"median {statistics.median(big) * 100:.1f}%"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"benchmark": "moe_alltoall", "row_bytes": WIDTH * 8, "cpus": os.cpu_count()}
    out.write_text(json.dumps({**meta, "results": records}, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
