"""Checkpoint write and read bandwidth against plain h5py and the disk's raw sequential rate.

    mpiexec -n 2 python benchmarks/ckpt_bandwidth.py                  # 1 GiB, 6 runs
    mpiexec -n 2 python benchmarks/ckpt_bandwidth.py --size-mib 256 --repeats 5 --dir /scratch

The state is `--tensors` float32 tensors per rank, `--size-mib` in all, split evenly across the
ranks (each rank writes its own half, as pipeline stages do). Measured in the same run,
interleaved, with the order rotated each repeat, so drift and order effects (caches below the
OS) hit every method alike:

  raw         rank 0 writes the whole state as one file: numpy tofile + fsync; reads it
              back with preadv into preallocated arrays
  h5py        rank 0 writes the whole state with plain h5py, one dataset per tensor, + fsync
  checkpoint  save_checkpoint on every rank (CRC32, index, fsync, rename, latest), and
              load_checkpoint of each rank's own slices; "resharded" loads a column half of
              every tensor instead, which must read (and checksum) every stored slice.
              Like the baselines' files, old checkpoints are deleted outside the timing.

Bandwidth = state bytes / wall time (the slowest rank for the collective methods). Reads are
cold: after each write the files' pages are dropped from the page cache with
posix_fadvise(DONTNEED), so reads come from the disk (or its cache below the OS).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from mpi4py import MPI

from hpcpipe.io.checkpoint import ShardSpec, block_index, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "ckpt_bandwidth.json"


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


def timed(comm: MPI.Comm, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(wall time, result) of a collective step: barrier, run, barrier; the slowest rank."""
    comm.Barrier()
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX), result


def rank0_only(comm: MPI.Comm, fn: Callable[..., Any], *args: Any) -> float:
    """Wall time of a single-process method run on rank 0 while the others wait."""
    elapsed = 0.0
    comm.Barrier()
    if comm.rank == 0:
        t0 = time.perf_counter()
        fn(*args)
        elapsed = time.perf_counter() - t0
    return comm.bcast(elapsed, root=0)


def raw_write(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as fh:
        for a in arrays:
            a.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())


def raw_read(path: Path, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """preadv straight into preallocated arrays: the disk's sequential read rate (on Linux
    this was the fastest of readinto, np.fromfile and preadv)."""
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


def measure(args: argparse.Namespace, comm: MPI.Comm, work: Path) -> dict[str, list[float]]:
    total = args.size_mib * 2**20
    mine = make_state(comm.rank, comm.size, total, args.tensors)
    full: dict[str, np.ndarray] = {}
    if comm.rank == 0:  # the single-process baselines write the whole state from rank 0
        for r in range(comm.size):
            full.update(mine if r == 0 else make_state(r, comm.size, total, args.tensors))
    shapes = comm.bcast({k: a.shape for k, a in full.items()} if comm.rank == 0 else None, root=0)
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes.values())
    specs = {k: ShardSpec(k, a.shape, a.dtype) for k, a in mine.items()}
    tensors = {k: (specs[k], a) for k, a in mine.items()}
    columns = {
        k: ShardSpec(k, s, np.float32, block_index(s, 1, comm.size, comm.rank))
        for k, s in shapes.items()
    }
    raw, h5 = work / "raw.bin", work / "plain.h5"
    ckpts = work / "checkpoints"
    times: dict[str, list[float]] = {
        "raw_write": [],
        "raw_read": [],
        "h5py_write": [],
        "h5py_read": [],
        "ckpt_write": [],
        "ckpt_read": [],
        "ckpt_read_resharded": [],
    }
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
        seconds, step_dir = timed(comm, save_checkpoint, comm, ckpts, step, tensors, writer=True)
        times["ckpt_write"].append(seconds)
        if comm.rank == 0:
            drop_cache(step_dir)
        seconds, got = timed(comm, load_checkpoint, step_dir, specs)
        times["ckpt_read"].append(seconds)
        if not all(np.array_equal(got[k], a) for k, a in mine.items()):
            raise SystemExit(f"rank {comm.rank}: loaded state differs from the saved state")
        del got
        if comm.rank == 0:
            drop_cache(step_dir)
        times["ckpt_read_resharded"].append(timed(comm, load_checkpoint, step_dir, columns)[0])
        if comm.rank == 0:
            shutil.rmtree(step_dir)

    methods = [run_raw, run_h5py, run_checkpoint]
    for repeat in range(args.repeats):  # rotate the order: each method runs first, second, ...
        k = repeat % len(methods)
        for method in methods[k:] + methods[:k]:
            method(repeat + 1)
    comm.Barrier()
    return {"bytes": nbytes, **times}


def report(args: argparse.Namespace, comm: MPI.Comm, result: dict) -> dict:
    """Print the table (median and best run per method) and return the JSON payload."""
    nbytes = result["bytes"]

    def gbps(key: str, pick=statistics.median) -> float:
        return nbytes / pick(result[key]) / 1e9

    rows = [
        ("raw: tofile + fsync / preadv, 1 process", "raw_write", "raw_read"),
        ("plain h5py, 1 process", "h5py_write", "h5py_read"),
        (f"hpcpipe checkpoint, {comm.size} ranks", "ckpt_write", "ckpt_read"),
        (f"  resharded read (column halves), {comm.size} ranks", None, "ckpt_read_resharded"),
    ]
    raw_w, raw_r = gbps("raw_write"), gbps("raw_read")
    print(
        f"checkpoint bandwidth: {nbytes / 2**30:.2f} GiB of state ({args.tensors} float32 "
        f"tensors per rank), {comm.size} ranks, {args.repeats} runs, cold reads"
    )
    print("GB/s: median (best run); % raw compares medians")
    head = f"{'method':<48} {'write GB/s':>13} {'% raw':>6} {'read GB/s':>13} {'% raw':>6}"
    print(head)
    print("-" * len(head))
    table = []
    for label, w, r in rows:
        entry: dict[str, Any] = {"method": label.strip()}
        cells = []
        for key, raw in ((w, raw_w), (r, raw_r)):
            if key is None:
                cells.append(f"{'':>13} {'':>6}")
                continue
            med, best = gbps(key), gbps(key, min)
            cells.append(f"{med:6.2f} ({best:4.2f}) {100 * med / raw:5.0f}%")
            kind = "write" if key == w else "read"
            entry |= {f"{kind}_gbps": med, f"{kind}_gbps_best": best}
        print(f"{label:<48} {cells[0]} {cells[1]}")
        table.append(entry)
    return {
        "benchmark": "ckpt_bandwidth",
        "state_bytes": nbytes,
        "ranks": comm.size,
        "tensors_per_rank": args.tensors,
        "repeats": args.repeats,
        "table": table,
        "write_vs_raw": gbps("ckpt_write") / raw_w,
        "read_vs_raw": gbps("ckpt_read") / raw_r,
        "seconds": {k: v for k, v in result.items() if k != "bytes"},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "h5py": h5py.version.version,
            "hdf5": h5py.version.hdf5_version,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "load_average": os.getloadavg(),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="state size in all (MiB)")
    parser.add_argument("--tensors", type=int, default=8, help="tensors per rank")
    parser.add_argument("--repeats", type=int, default=6, help="runs per method")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=str(RESULTS), help="where the JSON goes")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        import tempfile

        base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
        work = Path(tempfile.mkdtemp(prefix="ckpt_bandwidth_", dir=base))
    work = Path(comm.bcast(str(work) if comm.rank == 0 else None, root=0))
    try:
        result = measure(args, comm, work)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    if comm.rank == 0:
        payload = report(args, comm, result)
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
