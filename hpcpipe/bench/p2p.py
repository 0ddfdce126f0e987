"""Ping-pong between ranks 0 and 1: the pipeline transport (`Mailbox`) against raw Send/Recv.

One timed call is a round of `ROUND` ping-pongs on the same two buffers, like one pipeline step
of `ROUND` microbatches: the mailbox path pre-posts each receive (`post_recv`), starts each send
(`send`, an Isend), waits for the reply (`wait_recv`) and completes its sends once at the end of
the round (`drain`), exactly the calls the interpreter makes; the raw path is blocking
`Send`/`Recv`, and "nb" makes the mailbox's MPI calls (pre-posted Irecv, Isend, Wait,
Waitall per round) straight from mpi4py, which splits the mailbox's cost into MPI's (nb / raw)
and hpcpipe's own Python (mailbox / nb). Latency is half a round trip, bandwidth bytes /
latency (one direction).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import make_backend
from hpcpipe.bench.harness import compare, iterations, median
from hpcpipe.bench.sizes import met_from, size_range
from hpcpipe.bench.table import Column, Report
from hpcpipe.config import ConfigError
from hpcpipe.mpi.p2p import BACKWARD, FORWARD, Mailbox

__all__ = ["run"]

ROUND = 8  # ping-pongs per timed call: one "step" of 8 microbatches, one drain

COLUMNS = [
    Column("bytes", "bytes", "d", 9),
    Column("raw_us", "raw us", ".2f", 10),
    Column("nb_us", "nb us", ".2f", 10),
    Column("mailbox_us", "mailbox us", ".2f", 10),
    Column("extra_us", "extra us", ".2f", 9),
    Column("ratio", "ratio", ".3f", 6),
    Column("nb_ratio", "mbox/nb", ".3f", 7),
    Column("raw_mbps", "raw MB/s", ".0f", 9),
    Column("mailbox_mbps", "mailbox MB/s", ".0f", 9),
    Column("iters", "calls", "d", 5),
]


def _methods(
    comm: MPI.Comm, sbuf: np.ndarray, rbuf: np.ndarray
) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """The two ways to run one round, and a cleanup that frees their communicators."""
    raw_comm, nb_comm, box_comm = comm.Dup(), comm.Dup(), comm.Dup()
    rank = comm.rank
    mailbox = Mailbox(box_comm, make_backend("cpu", "uint8", 0), n_stages=2)

    def target() -> np.ndarray:
        return rbuf

    def raw() -> None:
        for _ in range(ROUND):
            if rank == 0:
                raw_comm.Send(sbuf, dest=1, tag=7)
                raw_comm.Recv(rbuf, source=1, tag=7)
            else:
                raw_comm.Recv(rbuf, source=0, tag=7)
                raw_comm.Send(sbuf, dest=0, tag=7)

    def nonblocking() -> None:  # the mailbox's MPI calls without the mailbox
        sends = []
        for _ in range(ROUND):
            if rank == 0:
                recv = nb_comm.Irecv(rbuf, source=1, tag=7)
                sends.append(nb_comm.Isend(sbuf, dest=1, tag=7))
                recv.Wait()
            else:
                recv = nb_comm.Irecv(rbuf, source=0, tag=7)
                recv.Wait()
                sends.append(nb_comm.Isend(sbuf, dest=0, tag=7))
        MPI.Request.Waitall(sends)

    def box() -> None:  # rank 0 holds stage 0, rank 1 stage 1: F goes 0 -> 1, B comes back
        for mb in range(ROUND):
            if rank == 0:
                mailbox.post_recv(target, 1, 0, mb, BACKWARD)
                mailbox.send(sbuf, 1, 1, mb, FORWARD)
                mailbox.wait_recv(0, mb, BACKWARD)
            else:
                mailbox.post_recv(target, 0, 1, mb, FORWARD)
                mailbox.wait_recv(1, mb, FORWARD)
                mailbox.send(sbuf, 0, 0, mb, BACKWARD)
        mailbox.drain()

    def free() -> None:
        for c in (raw_comm, nb_comm, box_comm):
            c.Free()

    return {"raw": raw, "nonblocking": nonblocking, "mailbox": box}, free


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    if comm.size != 2:
        raise ConfigError(
            "hpcpipe bench p2p", "", f"runs on exactly 2 ranks (mpiexec -n 2), not {comm.size}"
        )
    sizes = size_range(args.min_bytes, args.max_bytes, args.factor)
    report = Report(
        "p2p",
        [
            "p2p ping-pong, ranks 0 <-> 1: hpcpipe Mailbox (pre-posted Irecv, Isend, drain per "
            f"round of {ROUND}) vs raw Send/Recv, and vs the same nonblocking calls without "
            "the mailbox (nb)",
            f"one-way latency = round trip / 2: the median call of each repetition, median of "
            f"{args.repeats} repetitions, methods interleaved; extra and ratio are mailbox - raw "
            "and mailbox / raw per repetition",
        ],
        COLUMNS,
        params={"sizes": sizes, "repeats": args.repeats, "round": ROUND},
        stream=comm.rank == 0,
    )
    report.start()
    peer = 1 - comm.rank
    for size in sizes:
        sbuf = np.full(size, comm.rank + 1, dtype=np.uint8)
        rbuf = np.zeros(size, dtype=np.uint8)
        methods, free = _methods(comm, sbuf, rbuf)
        for fn in methods.values():  # each path must deliver the peer's bytes
            rbuf[...] = 0
            fn()
            if not np.all(rbuf == peer + 1):
                raise RuntimeError(f"p2p: {size}-byte message arrived corrupted")
        n = iterations(2 * ROUND * size, args.budget_mib << 20, 3, 200)
        times = compare(comm, methods, n, args.repeats, warmup=1)
        free()
        one_way = {k: v / (2 * ROUND) for k, v in times.items()}
        raw, box = median(one_way["raw"]), median(one_way["mailbox"])
        nb = median(one_way["nonblocking"])
        report.add(
            {
                "bytes": size,
                "raw_us": raw * 1e6,
                "nb_us": nb * 1e6,
                "mailbox_us": box * 1e6,
                "extra_us": median(one_way["mailbox"] - one_way["raw"]) * 1e6,
                "ratio": median(one_way["mailbox"] / one_way["raw"]),
                "nb_ratio": median(one_way["mailbox"] / one_way["nonblocking"]),
                "raw_mbps": size / raw / 1e6,
                "mailbox_mbps": size / box / 1e6,
                "iters": n,
                "raw_us_all": one_way["raw"] * 1e6,
                "nb_us_all": one_way["nonblocking"] * 1e6,
                "mailbox_us_all": one_way["mailbox"] * 1e6,
            }
        )
    _summarize(report)
    return report


def _summarize(report: Report) -> None:
    """The transport targets: <= 5% over raw at >= 64 KiB, <= 20 us extra below."""
    big = [r["ratio"] for r in report.rows if r["bytes"] >= 64 << 10]
    small = [r["extra_us"] for r in report.rows if r["bytes"] < 64 << 10]
    if big:
        worst = max(big)
        since = met_from(report.rows, "ratio", 1.05)
        report.summary |= {"max_ratio_ge_64KiB": worst, "within_5pct_from_bytes": since}
        report.note(
            f"messages >= 64 KiB: mailbox/raw max {worst:.3f}, median {median(big):.3f} "
            f"(target <= 1.05: {'met' if worst <= 1.05 else 'MISSED'}; "
            + (f"within 5% from {since} bytes up)" if since else "not within 5% at any size)")
        )
    if small:
        worst = max(small)
        report.summary["max_extra_us_lt_64KiB"] = worst
        report.note(
            f"messages < 64 KiB: extra latency max {worst:.2f} us, median {median(small):.2f} us "
            f"(target <= 20 us: {'met' if worst <= 20 else 'MISSED'})"
        )
