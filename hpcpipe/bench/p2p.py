"""Ping-pong between ranks 0 and 1: the pipeline transport (`Mailbox`) against raw mpi4py.

One timed call is a round of `ROUND` ping-pongs, like one pipeline step of `ROUND` microbatches
through the two-stage `ping_pong` schedule: the mailbox path starts each planned persistent
receive (`post_recv`), sends with `send` (an Isend of the producer's array), waits for the reply
(`wait_recv`) and completes its sends once at the end of the round (`drain`), exactly the calls
the interpreter makes. Raw mpi4py three ways: blocking `Send`/`Recv`; "pers", persistent
`Send_init`/`Recv_init` requests started and waited (the floor for a persistent transport); and
"nb", the nonblocking calls the transport made before it was persistent (Irecv, Isend, Wait,
Waitall per round). Latency is half a round trip, bandwidth bytes / latency (one direction).

Device mode (`args.device = "cuda"`, 2 ranks, any number of GPUs): the same mailbox round on
device buffers, once handing them to MPI directly (CUDA-aware MPI; skipped with the reason when
the library is not, unless `args.cuda_aware = "on"`) and once staged through pinned host
buffers on the copy stream, next to raw Send/Recv of host buffers: bandwidth per message size,
device -> device direct vs staged (defaults 1 MiB .. 256 MiB).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcpipe.backend import Backend, make_backend
from hpcpipe.bench.harness import compare, iterations, median
from hpcpipe.bench.sizes import met_from, size_range
from hpcpipe.bench.table import Column, Report
from hpcpipe.config import ConfigError
from hpcpipe.mpi.p2p import Mailbox
from hpcpipe.schedules import validate
from hpcpipe.schedules.messages import ping_pong, plan_messages

__all__ = ["run"]

ROUND = 8  # ping-pongs per timed call: one "step" of 8 microbatches, one drain

COLUMNS = [
    Column("bytes", "bytes", "d", 9),
    Column("raw_us", "raw us", ".2f", 10),
    Column("pers_us", "pers us", ".2f", 10),
    Column("nb_us", "nb us", ".2f", 10),
    Column("mailbox_us", "mailbox us", ".2f", 10),
    Column("extra_us", "extra us", ".2f", 9),
    Column("ratio", "ratio", ".3f", 6),
    Column("pers_ratio", "mbox/pers", ".3f", 9),
    Column("raw_mbps", "raw MB/s", ".0f", 9),
    Column("mailbox_mbps", "mailbox MB/s", ".0f", 9),
    Column("iters", "calls", "d", 5),
]


def _methods(
    comm: MPI.Comm, sbuf: np.ndarray, rbuf: np.ndarray
) -> tuple[dict[str, Callable[[], None]], Callable[[], None], Callable[[], None]]:
    """The ways to run one round (each leaves the last message received in `rbuf`'s place:
    raw ones in `rbuf`, the mailbox in its own buffer, copied to `rbuf` by `check`), and a
    cleanup that frees their requests and communicators."""
    raw_comm, pers_comm, nb_comm, box_comm = comm.Dup(), comm.Dup(), comm.Dup(), comm.Dup()
    rank = comm.rank
    peer = 1 - rank
    mailbox = _mailbox(box_comm, make_backend("cpu", "uint8", 0), sbuf.size, rank)
    psend = pers_comm.Send_init(sbuf, dest=peer, tag=7)
    precv = pers_comm.Recv_init(rbuf, source=peer, tag=7)

    def raw() -> None:
        for _ in range(ROUND):
            if rank == 0:
                raw_comm.Send(sbuf, dest=1, tag=7)
                raw_comm.Recv(rbuf, source=1, tag=7)
            else:
                raw_comm.Recv(rbuf, source=0, tag=7)
                raw_comm.Send(sbuf, dest=0, tag=7)

    def persistent() -> None:
        for _ in range(ROUND):
            precv.Start()
            if rank == 0:
                psend.Start()
                precv.Wait()
            else:
                precv.Wait()
                psend.Start()
            psend.Wait()

    def nonblocking() -> None:  # the transport's calls before it was persistent
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

    def box() -> None:
        _mailbox_round(mailbox, rank, sbuf, ROUND)

    def check() -> None:
        rbuf[...] = _mailbox_round(mailbox, rank, sbuf, ROUND)

    def free() -> None:
        mailbox.free()
        psend.Free()
        precv.Free()
        for c in (raw_comm, pers_comm, nb_comm, box_comm):
            c.Free()

    methods = {"raw": raw, "persistent": persistent, "nonblocking": nonblocking, "mailbox": box}
    return methods, check, free  # type: ignore[return-value]


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    if comm.size != 2:
        raise ConfigError(
            "hpcpipe bench p2p", "", f"runs on exactly 2 ranks (mpiexec -n 2), not {comm.size}"
        )
    if getattr(args, "device", "cpu") == "cuda":
        return run_device(comm, args)
    sizes = size_range(args.min_bytes, args.max_bytes, args.factor)
    report = Report(
        "p2p",
        [
            "p2p ping-pong, ranks 0 <-> 1: hpcpipe Mailbox (planned persistent receives, "
            f"Isend, drain per round of {ROUND}) vs raw mpi4py: blocking Send/Recv (raw), "
            "persistent Send_init/Recv_init (pers), Irecv/Isend (nb)",
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
        methods, check, free = _methods(comm, sbuf, rbuf)
        for name, fn in methods.items():  # each path must deliver the peer's bytes
            rbuf[...] = 0
            (check if name == "mailbox" else fn)()
            if not np.all(rbuf == peer + 1):
                raise RuntimeError(f"p2p: {size}-byte {name} message arrived corrupted")
        n = iterations(2 * ROUND * size, args.budget_mib << 20, 3, 200)
        times = compare(comm, methods, n, args.repeats, warmup=1)
        free()
        one_way = {k: v / (2 * ROUND) for k, v in times.items()}
        raw, box = median(one_way["raw"]), median(one_way["mailbox"])
        nb, pers = median(one_way["nonblocking"]), median(one_way["persistent"])
        report.add(
            {
                "bytes": size,
                "raw_us": raw * 1e6,
                "pers_us": pers * 1e6,
                "nb_us": nb * 1e6,
                "mailbox_us": box * 1e6,
                "extra_us": median(one_way["mailbox"] - one_way["raw"]) * 1e6,
                "ratio": median(one_way["mailbox"] / one_way["raw"]),
                "pers_ratio": median(one_way["mailbox"] / one_way["persistent"]),
                "raw_mbps": size / raw / 1e6,
                "mailbox_mbps": size / box / 1e6,
                "iters": n,
                "raw_us_all": one_way["raw"] * 1e6,
                "pers_us_all": one_way["persistent"] * 1e6,
                "nb_us_all": one_way["nonblocking"] * 1e6,
                "mailbox_us_all": one_way["mailbox"] * 1e6,
            }
        )
    _summarize(report)
    return report


def _summarize(report: Report) -> None:
    """The transport targets: <= 5% over raw at >= 64 KiB, <= 0.5 us extra below."""
    big = [r["ratio"] for r in report.rows if r["bytes"] >= 64 << 10]
    small = [r["extra_us"] for r in report.rows if r["bytes"] < 64 << 10]
    if big:
        worst = max(big)
        since = met_from(report.rows, "ratio", 1.05)
        report.summary |= {"max_ratio_ge_64KiB": worst, "within_5pct_from_bytes": since}
        report.note(f"messages >= 64 KiB: mailbox/raw max {worst:.3f}, median {median(big):.3f}")
        report.target(
            "mailbox / raw, messages >= 64 KiB (worst size)",
            "<= 1.05",
            f"{worst:.3f}",
            worst <= 1.05,
            f"within 5% from {since} bytes up" if since else "not within 5% at any size",
        )
    if small:
        worst = max(small)
        report.summary["max_extra_us_lt_64KiB"] = worst
        report.note(
            f"messages < 64 KiB: extra latency max {worst:.2f} us, median {median(small):.2f} us"
        )
        report.target(
            "extra latency, messages < 64 KiB (worst size)",
            "<= 0.5 us",
            f"{worst:.2f} us",
            worst <= 0.5,
        )


# ---------------------------------------------------------------------------- device buffers

DEVICE_ROUND = 2  # ping-pongs per timed call on the device (each staging slot is pinned memory)

DEVICE_COLUMNS = [
    Column("bytes", "bytes", "d", 10),
    Column("host_us", "host us", ".1f", 9),
    Column("direct_us", "direct us", ".1f", 10),
    Column("staged_us", "staged us", ".1f", 10),
    Column("host_gbps", "host GB/s", ".2f", 9),
    Column("direct_gbps", "direct GB/s", ".2f", 11),
    Column("staged_gbps", "staged GB/s", ".2f", 11),
    Column("staged_vs_direct", "staged/direct", ".2f", 13),
    Column("iters", "calls", "d", 5),
]


def _device_backends(comm: MPI.Comm, setting: str) -> tuple[Backend, Backend | None, str]:
    """(staged backend, direct backend or None, why direct is or is not measured)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = node.rank
    node.Free()
    found = make_backend("cuda", "uint8", local_rank, setting)
    staged = Backend("cuda", found.xp, found.dtype, found.device_id, False, "staged (benchmark)")
    direct = found if found.cuda_aware else None
    return staged, direct, found.cuda_aware_reason


def _host_round(
    comm: MPI.Comm, sbuf: np.ndarray, rbuf: np.ndarray
) -> tuple[Callable[[], None], Callable[[], None]]:
    """DEVICE_ROUND blocking ping-pongs of host buffers (what MPI itself costs), a cleanup."""
    raw_comm = comm.Dup()
    rank = comm.rank

    def host() -> None:
        for _ in range(DEVICE_ROUND):
            if rank == 0:
                raw_comm.Send(sbuf, dest=1, tag=7)
                raw_comm.Recv(rbuf, source=1, tag=7)
            else:
                raw_comm.Recv(rbuf, source=0, tag=7)
                raw_comm.Send(sbuf, dest=0, tag=7)

    return host, raw_comm.Free


def _device_round(
    comm: MPI.Comm, backend: Backend, sbuf: Any, rbuf: Any
) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """One mailbox round of DEVICE_ROUND ping-pongs on device buffers, ending when the data is
    usable on the device (the last staged copy included); the same round leaving the last
    message in `rbuf`, for the correctness check; a cleanup."""
    box_comm = comm.Dup()
    mailbox = _mailbox(box_comm, backend, sbuf.size, comm.rank)
    rank = comm.rank

    def box() -> None:
        _mailbox_round(mailbox, rank, sbuf, DEVICE_ROUND)
        backend.record_event().synchronize()

    def check() -> None:
        rbuf[...] = _mailbox_round(mailbox, rank, sbuf, DEVICE_ROUND)
        backend.record_event().synchronize()

    def free() -> None:
        mailbox.free()
        box_comm.Free()

    return box, check, free


def run_device(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    """Ping-pong bandwidth of device buffers: CUDA-aware direct vs staged vs host buffers."""
    staged, direct, reason = _device_backends(comm, getattr(args, "cuda_aware", "auto"))
    xp = staged.xp
    sizes = size_range(args.min_bytes, args.max_bytes, args.factor)
    report = Report(
        "p2p-device",
        [
            f"p2p ping-pong of device buffers on GPU {staged.device_id}, ranks 0 <-> 1: hpcpipe "
            f"Mailbox, rounds of {DEVICE_ROUND}, direct (device pointers to MPI) vs staged "
            "(pinned host buffers, copy stream) vs raw Send/Recv of host buffers",
            f"direct: {'measured' if direct is not None else 'not measured'} ({reason})",
            f"one-way time = round trip / 2, median call of each repetition, median of "
            f"{args.repeats} repetitions",
        ],
        DEVICE_COLUMNS,
        params={
            "sizes": sizes,
            "repeats": args.repeats,
            "round": DEVICE_ROUND,
            "cuda_aware": direct is not None,
            "cuda_aware_reason": reason,
            "device": staged.device_id,
        },
        stream=comm.rank == 0,
    )
    report.start()
    peer = 1 - comm.rank
    for size in sizes:
        host_s = np.full(size, comm.rank + 1, dtype=np.uint8)
        host_r = np.zeros(size, dtype=np.uint8)
        dev_s = xp.full(size, comm.rank + 1, dtype=np.uint8)
        dev_r = xp.zeros(size, dtype=np.uint8)
        host, free = _host_round(comm, host_s, host_r)
        methods: dict[str, Callable[[], None]] = {"host": host}
        checks: dict[str, Callable[[], None]] = {"host": host}
        frees = [free]
        for name, backend in (("staged", staged), ("direct", direct)):
            if backend is not None:
                methods[name], checks[name], free = _device_round(comm, backend, dev_s, dev_r)
                frees.append(free)
        for name, fn in checks.items():  # every path must deliver the peer's bytes
            dev_r[...] = 0
            host_r[...] = 0
            fn()
            got = host_r if name == "host" else staged.to_host(dev_r)
            if not np.all(got == peer + 1):
                raise RuntimeError(f"p2p device: {size}-byte {name} message arrived corrupted")
        n = iterations(2 * DEVICE_ROUND * size, args.budget_mib << 20, 3, 100)
        times = compare(comm, methods, n, args.repeats, warmup=1)
        for free in frees:
            free()
        one_way = {k: median(v / (2 * DEVICE_ROUND)) for k, v in times.items()}
        row: dict[str, Any] = {"bytes": size, "iters": n}
        for name in ("host", "direct", "staged"):
            t = one_way.get(name, float("nan"))
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_gbps"] = size / t / 1e9 if t == t and t > 0 else float("nan")
        row["staged_vs_direct"] = row["staged_us"] / row["direct_us"]
        report.add(row)
        del dev_s, dev_r
    if direct is None:
        report.note(f"direct path not measured: {reason} (device.cuda_aware = on forces it)")
    else:
        ratios = [r["staged_vs_direct"] for r in report.rows]
        report.summary["staged_vs_direct_median"] = median(ratios)
        report.note(f"staged / direct time, median over sizes: {median(ratios):.2f}")
    return report


def _mailbox(comm: MPI.Comm, backend: Backend, size: int, rank: int) -> Mailbox:
    """The mailbox of `rank` in the two-stage `ping_pong` pipeline, for messages of `size`
    bytes; receives posted one action ahead, as `_mailbox_round` runs them."""
    plan = plan_messages(validate(ping_pong(ROUND)), rank, lookahead=1)
    return Mailbox(comm, backend, plan, (size,), np.uint8)


def _mailbox_round(mailbox: Mailbox, rank: int, sbuf: Any, rounds: int) -> Any:
    """`rounds` ping-pongs through the pipeline Mailbox: rank 0 holds stage 0, rank 1 stage 1,
    F goes 0 -> 1 and B comes back, as in a two-stage pipeline. Returns the last message."""
    got = None
    for mb in range(rounds):  # message mb is send, receive number mb on both ranks
        mailbox.post_recv(mb)
        if rank == 0:
            mailbox.send(sbuf, mb)
            got = mailbox.wait_recv(mb)
        else:
            got = mailbox.wait_recv(mb)
            mailbox.send(sbuf, mb)
    mailbox.drain()
    return got
