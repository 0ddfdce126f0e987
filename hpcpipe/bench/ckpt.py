"""Checkpoint write and read bandwidth against plain h5py and the disk's raw sequential rate.

The state is `--tensors` float32 tensors per rank, `--size-mib` in all, split evenly across
the ranks (each rank writes its own share, as pipeline stages do). Per repetition every method
runs once, the order rotated, so drift and order effects (caches below the OS) hit each alike:

  raw         rank 0 writes the whole state as one file: numpy tofile + fsync; reads it back
              with preadv into preallocated arrays (the other ranks sleep meanwhile)
  h5py        rank 0 writes the whole state with plain h5py, one dataset per tensor, + fsync
  checkpoint  save_checkpoint on every rank (CRC32, index, fsync, rename, latest), and
              load_checkpoint of each rank's own slices; "resharded" loads a column half of
              every tensor instead, which must read (and checksum) every stored slice

Bandwidth = state bytes / wall time (the slowest rank for the collective methods). Reads are
cold: after each write the files' pages are dropped from the page cache
(posix_fadvise DONTNEED), so reads come from the disk or its cache below the OS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from mpi4py import MPI

from hpcpipe.bench.harness import median
from hpcpipe.bench.table import Column, Report
from hpcpipe.config import ConfigError
from hpcpipe.io.checkpoint import ShardSpec, block_index, load_checkpoint, save_checkpoint
from hpcpipe.mpi.idle import idle_barrier

__all__ = ["run"]

COLUMNS = [
    Column("method", "method", "", 44, "<"),
    Column("write_gbps", "write GB/s", ".2f", 10),
    Column("write_best", "best", ".2f", 5),
    Column("write_pct", "% raw", ".0f", 5),
    Column("read_gbps", "read GB/s", ".2f", 9),
    Column("read_best", "best", ".2f", 5),
    Column("read_pct", "% raw", ".0f", 5),
]


def drop_cache(path: Path) -> None:
    """Evict a file's (clean) pages, or every file's under a directory, from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_state(rank: int, size: int, total_bytes: int, tensors: int) -> dict[str, np.ndarray]:
    """This rank's tensors: `tensors` float32 (rows x 1024) arrays, total/size bytes in all."""
    rows = max(1, total_bytes // size // tensors // (4 * 1024))
    rng = np.random.default_rng(rank)
    return {
        f"stage{rank}/t{i:02d}": rng.random((rows, 1024), dtype=np.float32) for i in range(tensors)
    }


def timed(comm: MPI.Comm, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """(wall time, result) of a collective step: barrier, run, barrier; the slowest rank."""
    comm.Barrier()
    t0 = time.perf_counter()
    result = fn(*args)
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX), result


def rank0_only(comm: MPI.Comm, fn: Callable[..., Any], *args: Any) -> float:
    """Wall time of a single-process method run on rank 0 while the others sleep."""
    elapsed = 0.0
    idle_barrier(comm)
    if comm.rank == 0:
        t0 = time.perf_counter()
        fn(*args)
        elapsed = time.perf_counter() - t0
    idle_barrier(comm)
    return comm.bcast(elapsed, root=0)


def raw_write(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as fh:
        for a in arrays:
            a.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())


def raw_read(path: Path, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """preadv straight into preallocated arrays: the disk's sequential read rate."""
    out = [np.empty_like(a) for a in arrays]
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for o in out:
            view = memoryview(o.reshape(-1).view(np.uint8))
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if not got:
                    raise EOFError(f"{path}: ended after {offset + done} bytes")
                done += got
            offset += done
    finally:
        os.close(fd)
    return out


def h5_write(path: Path, state: dict[str, np.ndarray]) -> None:
    with h5py.File(path, "w") as f:
        for name, a in state.items():
            f.create_dataset(name, data=a)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def h5_read(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in names}


def measure(comm: MPI.Comm, work: Path, total: int, tensors: int, repeats: int) -> dict[str, Any]:
    """Seconds per repetition of each method, and the state's size in bytes."""
    mine = make_state(comm.rank, comm.size, total, tensors)
    full: dict[str, np.ndarray] = {}
    if comm.rank == 0:  # the single-process baselines write the whole state from rank 0
        for r in range(comm.size):
            full.update(mine if r == 0 else make_state(r, comm.size, total, tensors))
    shapes = comm.bcast({k: a.shape for k, a in full.items()} if comm.rank == 0 else None, root=0)
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes.values())
    specs = {k: ShardSpec(k, a.shape, a.dtype) for k, a in mine.items()}
    held = {k: (specs[k], a) for k, a in mine.items()}
    columns = {
        k: ShardSpec(k, s, np.float32, block_index(s, 1, comm.size, comm.rank))
        for k, s in shapes.items()
    }
    raw, h5 = work / "raw.bin", work / "plain.h5"
    ckpts = work / "checkpoints"
    keys = ("raw_write", "raw_read", "h5py_write", "h5py_read")
    times: dict[str, list[float]] = {k: [] for k in keys}
    times |= {"ckpt_write": [], "ckpt_read": [], "ckpt_read_resharded": []}
    arrays = list(full.values())

    def run_raw(_: int) -> None:
        times["raw_write"].append(rank0_only(comm, raw_write, raw, arrays))
        if comm.rank == 0:
            drop_cache(raw)
        times["raw_read"].append(rank0_only(comm, raw_read, raw, arrays))
        if comm.rank == 0:
            raw.unlink()

    def run_h5py(_: int) -> None:
        times["h5py_write"].append(rank0_only(comm, h5_write, h5, full))
        if comm.rank == 0:
            drop_cache(h5)
        times["h5py_read"].append(rank0_only(comm, h5_read, h5, list(full)))
        if comm.rank == 0:
            h5.unlink()

    def run_checkpoint(step: int) -> None:
        seconds, step_dir = timed(
            comm, lambda: save_checkpoint(comm, ckpts, step, held, writer=True)
        )
        times["ckpt_write"].append(seconds)
        if comm.rank == 0:
            drop_cache(step_dir)
        seconds, got = timed(comm, load_checkpoint, step_dir, specs)
        times["ckpt_read"].append(seconds)
        if not all(np.array_equal(got[k], a) for k, a in mine.items()):
            raise RuntimeError(f"rank {comm.rank}: the loaded state differs from the saved one")
        del got
        if comm.rank == 0:
            drop_cache(step_dir)
        times["ckpt_read_resharded"].append(timed(comm, load_checkpoint, step_dir, columns)[0])
        idle_barrier(comm)
        if comm.rank == 0:
            shutil.rmtree(step_dir)

    methods = [run_raw, run_h5py, run_checkpoint]
    for repeat in range(repeats):  # rotate the order: each method runs first, second, ...
        k = repeat % len(methods)
        for method in methods[k:] + methods[:k]:
            method(repeat + 1)
    idle_barrier(comm)
    return {"bytes": nbytes, "seconds": times}


def run(comm: MPI.Comm, args: argparse.Namespace) -> Report:
    if args.size_mib < 1 or args.tensors < 1:
        raise ConfigError("--size-mib/--tensors", "", "must both be >= 1")
    base = args.dir or tempfile.gettempdir()
    if comm.rank == 0:
        work = Path(tempfile.mkdtemp(prefix="hpcpipe_bench_ckpt_", dir=base))
    work = Path(comm.bcast(str(work) if comm.rank == 0 else None, root=0))
    try:
        result = measure(comm, work, args.size_mib * 2**20, args.tensors, args.repeats)
    finally:
        idle_barrier(comm)
        if comm.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    nbytes, seconds = result["bytes"], result["seconds"]

    def gbps(key: str, best: bool = False) -> float:
        return nbytes / (min(seconds[key]) if best else median(seconds[key])) / 1e9

    report = Report(
        "ckpt",
        [
            f"checkpoint bandwidth: {nbytes / 2**30:.2f} GiB of state ({args.tensors} float32 "
            f"tensors per rank), {comm.size} ranks, {args.repeats} runs per method, cold reads",
            "GB/s: median and best run; % raw compares medians",
        ],
        COLUMNS,
        params={"state_bytes": nbytes, "tensors_per_rank": args.tensors, "repeats": args.repeats},
    )
    rows = [
        ("raw: tofile + fsync / preadv, 1 process", "raw_write", "raw_read"),
        ("plain h5py, 1 process", "h5py_write", "h5py_read"),
        (f"hpcpipe checkpoint, {comm.size} ranks", "ckpt_write", "ckpt_read"),
        (f"  resharded read (column halves), {comm.size} ranks", None, "ckpt_read_resharded"),
    ]
    raw_w, raw_r = gbps("raw_write"), gbps("raw_read")
    for label, w, r in rows:
        row: dict[str, Any] = {"method": label, "write_gbps": None, "write_best": None}
        row["write_pct"] = None
        if w is not None:
            row |= {
                "write_gbps": gbps(w),
                "write_best": gbps(w, True),
                "write_pct": 100 * gbps(w) / raw_w,
                "write_s": seconds[w],
            }
        row |= {
            "read_gbps": gbps(r),
            "read_best": gbps(r, True),
            "read_pct": 100 * gbps(r) / raw_r,
            "read_s": seconds[r],
        }
        report.add(row)
    report.summary |= {
        "write_vs_raw": gbps("ckpt_write") / raw_w,
        "read_vs_raw": gbps("ckpt_read") / raw_r,
    }
    report.note(
        f"checkpoint / raw (medians): write {gbps('ckpt_write') / raw_w:.2f}, read "
        f"{gbps('ckpt_read') / raw_r:.2f}"
    )
    return report
