"""Data-parallel gradient reduction: `BucketedAllreduce` against raw mpi4py calls.

The bucketed path is what the runtime runs when a stage's last W is done: the stage's flat
gradient buffer cut into `--bucket-mb` slices, each reduced in place (a persistent allreduce
started every step where the MPI library has them, else one `Iallreduce` per slice), then
`wait`. Raw is `Allreduce(IN_PLACE)` of the whole buffer; "Iallreduce" is one raw `Iallreduce` +
`Wait`; "persistent" one raw `Allreduce_init` request (made once) `Start` + `Wait`, where
available. All reduce float32 in place; before timing, the results are checked bitwise against
the exact sum (integer-valued data sums exactly).
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import make_backend
from hpcpipe.bench.harness import compare, iterations, median
from hpcpipe.bench.sizes import met_from, size_range
from hpcpipe.bench.table import Column, Report
from hpcpipe.config import ConfigError
from hpcpipe.mpi.collectives import BucketedAllreduce, FlatBuffer

__all__ = ["run"]

COLUMNS = [
    Column("bytes", "bytes", "d", 9),
    Column("buckets", "buckets", "d", 7),
    Column("raw_us", "raw us", ".1f", 10),
    Column("nb_us", "Iallreduce us", ".1f", 10),
    Column("persistent_us", "persistent us", ".1f", 10),
    Column("bucketed_us", "bucketed us", ".1f", 11),
    Column("ratio", "ratio", ".3f", 6),
    Column("nb_ratio", "bkt/Iallr", ".3f", 6),
    Column("raw_gbps", "raw GB/s", ".2f", 8),
    Column("bucketed_gbps", "bucketed GB/s", ".2f", 8),
    Column("iters", "calls", "d", 5),
]


def _contribution(rank: int, n: int) -> np.ndarray:
    """Rank `rank`'s integer-valued float32 gradients (any order of summation is exact)."""
    return np.random.default_rng(rank).integers(-64, 64, n).astype(np.float32)


def _check(comm: MPI.Comm, raw_comm: MPI.Comm, reducer: BucketedAllreduce, n: int) -> None:
    """Both paths must produce the exact sum, bitwise, on every rank."""
    expected = sum(_contribution(r, n) for r in range(comm.size))
    flat = FlatBuffer.like(np, {"g": (n,)}, np.float32)
    flat.flat[...] = _contribution(comm.rank, n)
    reducer.start(flat, key="check")
    reducer.wait()
    raw = _contribution(comm.rank, n)
    raw_comm.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)
    ok = bool(np.array_equal(flat.flat, expected) and np.array_equal(raw, expected))
    if not comm.allreduce(int(ok), op=MPI.MIN):
        raise RuntimeError(f"allreduce of {n} float32: a result differs from the exact sum")


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    if comm.size < 2:
        raise ConfigError(
            "hpcpipe bench allreduce", "", "needs at least 2 ranks (mpiexec -n 2 or more)"
        )
    sizes = [s - s % 4 or 4 for s in size_range(args.min_bytes, args.max_bytes, args.factor)]
    bucket = int(args.bucket_mb * 2**20)
    raw_comm, red_comm = comm.Dup(), comm.Dup()
    reducer = BucketedAllreduce(red_comm, make_backend("cpu", "float32", 0), bucket)
    report = Report(
        "allreduce",
        [
            f"allreduce of float32 gradients on {comm.size} ranks: BucketedAllreduce "
            f"({args.bucket_mb:g} MiB buckets, {reducer.path} reduction of each, then wait) "
            "vs raw Allreduce, one raw Iallreduce + Wait and one raw persistent Start + Wait",
            f"median call of each of {args.repeats} repetitions, methods interleaved; ratios "
            "per repetition; GB/s = buffer bytes / time; results checked bitwise first",
        ],
        COLUMNS,
        params={
            "sizes": sizes,
            "repeats": args.repeats,
            "bucket_bytes": bucket,
            "path": reducer.path,
        },
        stream=comm.rank == 0,
    )
    report.start()
    for size in sizes:
        n = size // 4
        _check(comm, raw_comm, reducer, n)
        flat = FlatBuffer.like(np, {"g": (n,)}, np.float32)  # zeros: the sums stay finite
        raw_buf = np.zeros(n, dtype=np.float32)

        def bucketed(flat: FlatBuffer = flat) -> None:
            reducer.start(flat, key="g")
            reducer.wait()

        def raw(buf: np.ndarray = raw_buf) -> None:
            raw_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def nonblocking(buf: np.ndarray = raw_buf) -> None:
            raw_comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM).Wait()

        calls = iterations(size, args.budget_mib << 20, 2, 500)
        methods = {"raw": raw, "nonblocking": nonblocking, "bucketed": bucketed}
        prequest = (
            raw_comm.Allreduce_init(MPI.IN_PLACE, raw_buf, op=MPI.SUM)
            if reducer.persistent
            else None
        )
        if prequest is not None:

            def persistent(req: MPI.Prequest = prequest) -> None:
                req.Start()
                req.Wait()

            methods["persistent"] = persistent
        times = compare(comm, methods, calls, args.repeats)
        if prequest is not None:
            prequest.Free()
        reducer.free()  # this size's buffers are done with
        t_raw, t_b = median(times["raw"]), median(times["bucketed"])
        report.add(
            {
                "bytes": size,
                "buckets": -(-size // bucket),
                "raw_us": t_raw * 1e6,
                "nb_us": median(times["nonblocking"]) * 1e6,
                "persistent_us": median(times["persistent"]) * 1e6
                if "persistent" in times
                else None,
                "bucketed_us": t_b * 1e6,
                "ratio": median(times["bucketed"] / times["raw"]),
                "nb_ratio": median(times["bucketed"] / times["nonblocking"]),
                "raw_gbps": size / t_raw / 1e9,
                "bucketed_gbps": size / t_b / 1e9,
                "iters": calls,
                "raw_us_all": times["raw"] * 1e6,
                "nb_us_all": times["nonblocking"] * 1e6,
                "bucketed_us_all": times["bucketed"] * 1e6,
            }
        )
    raw_comm.Free()
    red_comm.Free()
    big = [r["ratio"] for r in report.rows if r["bytes"] >= 64 << 10]
    if big:
        since = met_from(report.rows, "ratio", 1.05)
        report.summary |= {"max_ratio_ge_64KiB": max(big), "within_5pct_from_bytes": since}
        report.note(f"buffers >= 64 KiB: bucketed/raw max {max(big):.3f}, median {median(big):.3f}")
        report.target(
            "bucketed / raw, buffers >= 64 KiB (worst size)",
            "<= 1.05",
            f"{max(big):.3f}",
            max(big) <= 1.05,
            f"within 5% from {since} bytes up" if since else "not within 5% at any size",
        )
    return report
