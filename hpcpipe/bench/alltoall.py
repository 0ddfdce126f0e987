"""MoE token exchange: `ExpertGroup` dispatch, flat and two-phase, against raw `Alltoallv`.

Each rank sends `size` bytes to every rank (rows of 128 float64, one expert per rank), the
message pattern of one dispatch with uniform routing. Methods, all on the same buffers:

    raw       comm.Alltoallv on preallocated buffers, counts computed once
    pers      an MPI-4 persistent Alltoallv_init over the same buffers and counts, started and
              waited per call: what a dispatch could gain if its counts were fixed (they are
              not: routing changes them every step, so the MoE path cannot use it; measured to
              know the price of that; absent where the MPI library has no persistent collectives)
    flat      ExpertGroup.alltoallv(rows, plan.forward, out=recv): the exchange every dispatch
              issues four times (tokens, outputs; gradients out and back)
    dispatch  ExpertGroup.plan(counts) + alltoallv into a fresh buffer: a whole F dispatch
              step (counts Alltoall, plan, tokens), as the MoE layer runs it
    2-phase   flat's call with the two-phase exchange over 2 virtual nodes

Every method's received rows are checked bitwise against raw's before timing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from hpcpipe.bench.harness import compare, iterations, median
from hpcpipe.bench.sizes import met_from, size_range
from hpcpipe.bench.table import Column, Report
from hpcpipe.config import ConfigError
from hpcpipe.mpi.experts import ExpertGroup

__all__ = ["run"]

WIDTH = 128  # float64 per row: 1 KiB rows
METHODS = ("raw", "pers", "flat", "dispatch", "2-phase")

COLUMNS = [
    Column("bytes", "bytes/peer", "d", 10),
    Column("raw_us", "raw us", ".1f", 9),
    Column("pers_us", "pers us", ".1f", 9),
    Column("flat_us", "flat us", ".1f", 9),
    Column("dispatch_us", "dispatch us", ".1f", 9),
    Column("two_phase_us", "2-phase us", ".1f", 9),
    Column("flat_ratio", "flat/raw", ".3f", 8),
    Column("two_phase_ratio", "2-phase/raw", ".3f", 8),
    Column("dispatch_ratio", "dispatch/raw", ".3f", 8),
    Column("raw_mbps", "raw MB/s", ".0f", 8),
    Column("flat_mbps", "flat MB/s", ".0f", 8),
]


def _exchanges(
    comm: MPI.Comm, flat: ExpertGroup, two: ExpertGroup, size: int
) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """The exchanges of one buffer pair (raises if any receives other bytes than raw), and a
    cleanup for the persistent request."""
    p = comm.size
    rows = max(1, size // (WIDTH * 8))
    counts = np.full(p, rows, dtype=np.int64)  # one expert per rank
    send = np.random.default_rng(comm.rank).standard_normal((p * rows, WIDTH))
    recv = np.empty_like(send)
    elems = [rows * WIDTH] * p
    displs = [i * rows * WIDTH for i in range(p)]
    plan, plan2 = flat.plan(counts), two.plan(counts)

    spec = ([send, (elems, displs), MPI.DOUBLE], [recv, (elems, displs), MPI.DOUBLE])

    def raw() -> None:
        comm.Alltoallv(*spec)

    try:
        request = comm.Alltoallv_init(*spec)
    except (AttributeError, NotImplementedError):  # mpi4py 3, or an MPI-3 library
        request = None

    def pers() -> None:
        request.Start()
        request.Wait()

    def a2a() -> None:
        flat.alltoallv(send, plan.forward, out=recv)

    def dispatch() -> object:
        return flat.alltoallv(send, flat.plan(counts).forward)

    def two_phase() -> None:
        two.alltoallv(send, plan2.forward, out=recv)

    raw()
    expected = recv.copy()
    recv[...] = 0
    if request is not None:
        pers()
    outs = (
        *((recv.copy(),) if request is not None else ()),
        flat.alltoallv(send, plan.forward),
        dispatch(),
        two.alltoallv(send, plan2.forward),
    )
    same = all(np.array_equal(out, expected) for out in outs)
    if not comm.allreduce(int(same), op=MPI.MIN):
        raise RuntimeError(f"alltoall: {size} bytes/peer: a method received other rows than raw")
    fns = dict(zip(METHODS, (raw, pers, a2a, dispatch, two_phase), strict=True))
    if request is None:
        del fns["pers"]
        return fns, lambda: None
    return fns, request.Free


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    p = comm.size
    if p < 2 or p % 2:
        raise ConfigError(
            "hpcpipe bench alltoall", "", f"needs an even number of ranks >= 2, not {p}"
        )
    sizes = [
        max(1, s // (WIDTH * 8)) * WIDTH * 8
        for s in size_range(args.min_bytes, args.max_bytes, args.factor)
    ]
    report = Report(
        "alltoall",
        [
            f"MoE dispatch all-to-all on {p} ranks, {WIDTH * 8}-byte rows, one expert per rank: "
            "ExpertGroup flat / dispatch (counts + plan + rows) / two-phase (2 virtual nodes) "
            "vs raw Alltoallv and persistent Alltoallv_init (pers, fixed counts)",
            f"one exchange: median call of each of {args.repeats} repetitions, methods interleaved;"
            " ratios per repetition; MB/s = bytes sent to other ranks / latency; received rows "
            "checked bitwise against raw first",
        ],
        COLUMNS,
        params={"sizes": sizes, "repeats": args.repeats, "row_bytes": WIDTH * 8},
        stream=comm.rank == 0,
    )
    report.start()
    flat = ExpertGroup(comm, p)
    two = ExpertGroup(comm, p, node=comm.rank * 2 // p, hierarchical=True, virtual_nodes=True)
    for size in sorted(set(sizes)):
        fns, free = _exchanges(comm, flat, two, size)
        calls = iterations(p * size, args.budget_mib << 20, 2, 200)
        t = compare(comm, fns, calls, args.repeats)
        free()
        lat = {m: median(t[m]) for m in fns}
        report.add(
            {
                "bytes": size,
                "raw_us": lat["raw"] * 1e6,
                "pers_us": lat.get("pers", float("nan")) * 1e6,
                "flat_us": lat["flat"] * 1e6,
                "dispatch_us": lat["dispatch"] * 1e6,
                "two_phase_us": lat["2-phase"] * 1e6,
                "flat_ratio": median(t["flat"] / t["raw"]),
                "two_phase_ratio": median(t["2-phase"] / t["raw"]),
                "dispatch_ratio": median(t["dispatch"] / t["raw"]),
                "raw_mbps": (p - 1) * size / lat["raw"] / 1e6,
                "flat_mbps": (p - 1) * size / lat["flat"] / 1e6,
                "iters": calls,
                "us_all": {m: t[m] * 1e6 for m in fns},
            }
        )
    flat.free()
    two.free()
    big = [r["flat_ratio"] for r in report.rows if r["bytes"] >= 64 << 10]
    if big:
        since = met_from(report.rows, "flat_ratio", 1.05)
        report.summary |= {"max_flat_ratio_ge_64KiB": max(big), "within_5pct_from_bytes": since}
        report.note(f">= 64 KiB per peer: flat/raw max {max(big):.3f}, median {median(big):.3f}")
        report.target(
            "flat / raw, >= 64 KiB per peer (worst size)",
            "<= 1.05",
            f"{max(big):.3f}",
            max(big) <= 1.05,
            f"within 5% from {since} bytes up" if since else "not within 5% at any size",
        )
    return report
