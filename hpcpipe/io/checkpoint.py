"""HDF5 checkpoints: sharded, atomic, checksummed, and loadable on a different layout.

The library knows tensors, not models. Each rank describes what it holds with a `ShardSpec`
(the slice of a global tensor); `save_checkpoint` is collective over a communicator and writes
the held slices of the ranks that pass `writer=True`; `load_checkpoint` reads any slicing of the
global tensors, so a run restarts on other pp/dp/ep degrees by asking for what it now owns.
Format and protocol: docs/formats.md.

MPI is never imported here: the communicator is passed in (or None for one process).
"""

from __future__ import annotations

import datetime
import shutil
import socket
import traceback
import uuid
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcpipe import __version__
from hpcpipe.faults import maybe_fail
from hpcpipe.io.ckpt_format import (
    FORMAT_VERSION,
    INDEX_FILE,
    LIBVER,
    SHARD_FORMAT,
    SHARED_FILE,
    CheckpointError,
    ShardEntry,
    ShardSpec,
    SliceEntry,
    TensorEntry,
    block_index,
    box_volume,
    crc32,
    first_overlap,
    format_box,
    set_attr,
    write_index,
)
from hpcpipe.io.ckpt_read import (
    convert_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    read_attrs,
    verify_checkpoint,
)
from hpcpipe.io.ckpt_store import (
    fsync_path,
    install,
    latest_checkpoint,
    resolve_checkpoint,
    rotate,
    step_name,
    write_latest,
)
from hpcpipe.io.space import ensure_space

__all__ = [
    "FORMAT_VERSION",
    "LAYOUTS",
    "CheckpointError",
    "ShardSpec",
    "block_index",
    "convert_checkpoint",
    "inspect_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "read_attrs",
    "resolve_checkpoint",
    "resolve_layout",
    "save_checkpoint",
    "verify_checkpoint",
]

LAYOUTS = ("auto", "shards", "shared")
SHARED_AUTO_MIN_WRITERS = 256
"""`layout="auto"` picks one shared file from this many writers up (when h5py is parallel):
below it, a file per writer is faster and simpler; above it, thousands of files strain the
parallel file system's metadata servers."""


class _SelfComm:
    """A one-process stand-in for a communicator (`comm=None`)."""

    rank = 0
    size = 1

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def gather(self, obj: Any, root: int = 0) -> list[Any]:
        return [obj]

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


@dataclass(frozen=True)
class _Slice:
    """One slice a writer holds, checked against its spec, ready to write."""

    spec: ShardSpec
    array: np.ndarray
    dataset: str

    def meta(self, crc: int) -> tuple:
        """What rank 0 needs for the index (small and picklable)."""
        s = self.spec
        return (s.name, s.global_shape, s.dtype.str, s.start, s.stop, self.dataset, crc)


def resolve_layout(layout: str, writers: int) -> str:
    """The layout ("shards" or "shared") that `layout` means for this h5py and writer count."""
    parallel = bool(h5py.get_config().mpi)
    if layout not in LAYOUTS:
        raise CheckpointError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "auto":
        return "shared" if parallel and writers >= SHARED_AUTO_MIN_WRITERS else "shards"
    if layout == "shared" and not parallel:
        raise CheckpointError(
            "layout 'shared' needs h5py built against parallel HDF5 (h5py.get_config().mpi is "
            "False here); use layout 'shards' or 'auto'"
        )
    return layout


def _to_numpy(value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) and hasattr(value, "get"):  # CuPy: copy to the host
        value = value.get()
    return np.asarray(value)


def _prepare(rank: int, tensors: Mapping[str, tuple[ShardSpec, Any]]) -> list[_Slice]:
    """Check each held array against its spec (nothing is cast)."""
    out = []
    for k, (key, item) in enumerate(tensors.items()):
        try:
            spec, value = item
        except (TypeError, ValueError):
            raise CheckpointError(f"tensors[{key!r}] must be a (ShardSpec, array) pair") from None
        if not isinstance(spec, ShardSpec):
            raise CheckpointError(f"tensors[{key!r}][0] is a {type(spec).__name__}, not ShardSpec")
        if not spec.is_box:
            raise CheckpointError(
                f"saved slices must have step 1, got {spec.index}", tensor=spec.name
            )
        array = _to_numpy(value)
        if array.dtype != spec.dtype:
            raise CheckpointError(
                f"array (key {key!r}) is {array.dtype} but the spec says {spec.dtype}; convert "
                "it first (nothing is cast silently)",
                tensor=spec.name,
            )
        if array.shape != spec.shape:
            raise CheckpointError(
                f"array (key {key!r}) has shape {array.shape} but the slice "
                f"{format_box(spec.start, spec.stop)} has shape {spec.shape}",
                tensor=spec.name,
            )
        array = np.require(array, requirements="C")  # keeps 0-d arrays 0-d
        out.append(_Slice(spec, array, f"r{rank:06d}/s{k:06d}"))
    return out


def _set_slice_attrs(ds: h5py.Dataset, name: str, start: tuple, stop: tuple, crc: int) -> None:
    set_attr(ds.attrs, "tensor", name)
    ds.attrs["start"] = np.asarray(start, dtype="<i8")
    ds.attrs["stop"] = np.asarray(stop, dtype="<i8")
    ds.attrs["crc32"] = np.uint32(crc)


def _shard_attrs(f: h5py.File, step: int, checkpoint_id: str, rank: int) -> None:
    set_attr(f.attrs, "format", SHARD_FORMAT)
    f.attrs["format_version"] = np.int64(FORMAT_VERSION)
    set_attr(f.attrs, "checkpoint_id", checkpoint_id)
    f.attrs["step"] = np.int64(step)
    f.attrs["rank"] = np.int64(rank)


def _write_shard(
    tmp: Path, rank: int, step: int, checkpoint_id: str, slices: list[_Slice], fsync: bool
) -> tuple[str, int, list[tuple]]:
    """One writer's shard file; returns (file name, size in bytes, slice metadata).

    The CRC32s are computed on a helper thread while the main thread writes (zlib releases
    the GIL), so checksumming costs little wall time on top of the I/O.
    """
    name = f"shard_{rank:06d}.h5"
    path = tmp / name
    ensure_space(tmp, sum(int(s.array.nbytes) for s in slices), f"shard {path}", len(slices))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc32") as pool:
        pending = [pool.submit(crc32, s.array) for s in slices]
        with h5py.File(path, "w", libver=LIBVER) as f:
            _shard_attrs(f, step, checkpoint_id, rank)
            datasets = []
            for k, s in enumerate(slices):
                datasets.append(f.create_dataset(s.dataset, data=s.array))
                if k == 0:
                    f.flush()
                    maybe_fail("checkpoint", rank)  # fault tests: die with a partial shard
            if not slices:
                maybe_fail("checkpoint", rank)
            crcs = [p.result() for p in pending]
            for ds, s, crc in zip(datasets, slices, crcs, strict=True):
                _set_slice_attrs(ds, s.spec.name, s.spec.start, s.spec.stop, crc)
    if fsync:
        fsync_path(path)
    return name, path.stat().st_size, [s.meta(c) for s, c in zip(slices, crcs, strict=True)]


def _write_shared(
    comm: Any,
    tmp: Path,
    step: int,
    checkpoint_id: str,
    slices: list[_Slice],
    metas: list[list[tuple]],
    fsync: bool,
) -> None:
    """Every rank creates every dataset of the one shared file (HDF5 needs creation to be
    collective), then each writer fills its own independently."""
    path = tmp / SHARED_FILE
    with h5py.File(path, "w", driver="mpio", comm=comm, libver=LIBVER) as f:
        _shard_attrs(f, step, checkpoint_id, -1)
        mine = {}
        for rank, rank_metas in enumerate(metas):
            for name, _gshape, dtype, start, stop, dataset, crc in rank_metas:
                shape = tuple(b - a for a, b in zip(start, stop, strict=True))
                ds = f.create_dataset(dataset, shape=shape, dtype=np.dtype(dtype))
                _set_slice_attrs(ds, name, start, stop, crc)
                if rank == comm.rank:
                    mine[dataset] = ds
        for k, s in enumerate(slices):
            if s.array.size:
                mine[s.dataset][...] = s.array
            if k == 0:
                maybe_fail("checkpoint", comm.rank)
        if fsync:
            f.flush()  # H5Fflush: MPI_File_sync on every rank of the communicator


def _shared_space_problem(tmp: Path, metas: list[list[tuple]]) -> str | None:
    """Why the one shared file cannot fit in `tmp` (None if it can): HDF5 crashes on ENOSPC."""
    total = sum(
        int(np.prod([b - a for a, b in zip(start, stop, strict=True)])) * np.dtype(dtype).itemsize
        for rank_metas in metas
        for _name, _gshape, dtype, start, stop, _dataset, _crc in rank_metas
    )
    count = sum(len(rank_metas) for rank_metas in metas)
    try:
        ensure_space(tmp, total, f"shared checkpoint file {tmp / SHARED_FILE}", count)
    except OSError as exc:
        return _describe_failure(0, exc)
    return None


def _shards_space_problem(tmp: Path, sizes: list[tuple[int, int]], final: Path) -> str | None:
    """Why all shards together cannot fit in `tmp` (None if they can), said for the whole
    checkpoint: the writers' shard files share the directory's file system."""
    from hpcpipe.io.space import HEADROOM_BYTES

    writers = sum(1 for nbytes, count in sizes if count)
    total = sum(nbytes for nbytes, _ in sizes) + HEADROOM_BYTES * max(0, writers - 1)
    count = sum(c for _, c in sizes)
    try:
        ensure_space(tmp, total, f"checkpoint {final} ({writers} shard file(s) together)", count)
    except OSError as exc:
        return _describe_failure(0, exc)
    return None


def _attrs_bytes(attrs: Mapping[str, Any] | None) -> int:
    """Rough size of the index's attributes (the tables are covered by the headroom)."""
    return sum(len(str(v)) for v in (attrs or {}).values())


def _describe_failure(rank: int, exc: BaseException) -> str:
    if isinstance(exc, CheckpointError | OSError):
        return f"rank {rank} on {socket.gethostname()}: {exc}"
    tb = traceback.format_exception_only(exc)[-1].strip()
    return f"rank {rank} on {socket.gethostname()}: {tb}"


def _build_tensors(
    metas: list[tuple[int, int, list[tuple]]],
) -> list[TensorEntry]:
    """Global tensor table from every writer's slices; refuses inconsistent, overlapping or
    incomplete coverage, so a checkpoint that is written can always be loaded whole."""
    groups: dict[str, list[tuple[int, int, tuple]]] = defaultdict(list)
    for rank, shard, rank_metas in metas:
        for meta in rank_metas:
            groups[meta[0]].append((rank, shard, meta))
    tensors = []
    for name in sorted(groups):
        entries = groups[name]
        _, _, (_, gshape, dtype, *_rest) = entries[0]
        for rank, _, meta in entries:
            if (meta[1], meta[2]) != (gshape, dtype):
                raise CheckpointError(
                    f"ranks disagree on the global tensor: rank {entries[0][0]} says "
                    f"{np.dtype(dtype)}{list(gshape)}, rank {rank} says "
                    f"{np.dtype(meta[2])}{list(meta[1])}",
                    tensor=name,
                )
        boxes = [(meta[3], meta[4]) for _, _, meta in entries]
        clash = first_overlap(boxes)
        if clash is not None:
            (ra, _, ma), (rb, _, mb) = entries[clash[0]], entries[clash[1]]
            raise CheckpointError(
                f"written twice: rank {ra} {format_box(ma[3], ma[4])} overlaps rank {rb} "
                f"{format_box(mb[3], mb[4])} (pass writer=False on data-parallel replicas, or "
                "leave replicated tensors out of the other ranks' mappings)",
                tensor=name,
            )
        covered = sum(box_volume(a, b) for a, b in boxes)
        total = int(np.prod(gshape, dtype=np.int64))
        if covered != total:
            raise CheckpointError(
                f"the writers hold {covered} of its {total} elements: some slice has no writer "
                f"(writer ranks: {sorted({r for r, _, _ in entries})})",
                tensor=name,
            )
        slices = tuple(
            SliceEntry(shard, meta[5], tuple(meta[3]), tuple(meta[4]), int(meta[6]))
            for _, shard, meta in entries
        )
        tensors.append(TensorEntry(name, tuple(gshape), np.dtype(dtype), slices))
    return tensors


def save_checkpoint(
    comm: Any,
    root: Path | str,
    step: int,
    tensors: Mapping[str, tuple[ShardSpec, Any]],
    *,
    writer: bool,
    attrs: Mapping[str, Any] | None = None,
    keep: int = 0,
    layout: str = "auto",
    fsync: bool = True,
) -> Path:
    """Write checkpoint `root/step_NNNNNN/` collectively; returns its path on every rank.

    Every rank of `comm` calls this (None: a single process). Ranks with `writer=True` write the
    slices in `tensors` (key: any local label; value: (ShardSpec, NumPy or CuPy array)); the
    others' `tensors` are ignored. Together the writers must hold every element of every tensor
    exactly once. `attrs` (rank 0's are used) go to the index: str, bytes, numbers, arrays, or
    JSON-able containers. `keep` > 0 keeps that many complete checkpoints, deleting older ones
    only after this one is complete (0 keeps all). `layout` is "auto", "shards" or "shared"
    (see docs/formats.md); `fsync=False` skips the durability syncs, for throwaway runs. The
    arrays must not change until it returns. Any rank's failure raises CheckpointError on
    every rank and leaves the previous checkpoints untouched.
    """
    comm = _SelfComm() if comm is None else comm
    root = Path(root)
    rank = comm.rank
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    step = int(step)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise CheckpointError(f"keep must be a non-negative integer (0 = keep all), got {keep!r}")
    final = root / step_name(step)
    tmp = final.with_name(final.name + ".tmp")
    writers = sum(comm.allgather(bool(writer)))
    chosen = resolve_layout(layout, writers)  # the same answer (or error) on every rank
    if chosen == "shared" and isinstance(comm, _SelfComm):
        raise CheckpointError("layout 'shared' needs an MPI communicator, not comm=None")

    # 1. rank 0 makes a fresh temporary directory and names the checkpoint
    prepared: tuple[str, str] | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            prepared = ("ok", uuid.uuid4().hex)
        except OSError as exc:
            prepared = ("error", f"cannot create {tmp}: {exc}")
    status, checkpoint_id = comm.bcast(prepared, root=0)
    if status != "ok":
        raise CheckpointError(checkpoint_id)

    # 2. writers check, checksum and write their slices; failures are reported, not raised,
    #    so that every rank reaches the next collective
    slices: list[_Slice] = []
    local: tuple[str, Any]
    try:
        if not tmp.is_dir():
            raise CheckpointError(
                f"{tmp} is not visible from this rank: the checkpoint directory must be on a "
                "file system shared by all ranks"
            )
        slices = _prepare(rank, tensors) if writer else []
        local = ("ok", None)
    except Exception as exc:
        local = ("error", _describe_failure(rank, exc))

    if chosen == "shared":
        if local[0] == "ok":
            local = ("ok", [s.meta(crc32(s.array)) for s in slices])
        everyone = comm.allgather(local)
        errors = [o[1] for o in everyone if o[0] != "ok"]
        if errors:
            if rank == 0:
                _discard(tmp)
            raise CheckpointError(f"checkpoint {final} not written: " + "; ".join(errors))
        metas = [o[1] for o in everyone]
        # rank 0 decides for all: the file's creation is collective, so no rank may bail alone
        problem = _shared_space_problem(tmp, metas) if rank == 0 else None
        problem = comm.bcast(problem, root=0)
        if problem:
            if rank == 0:
                _discard(tmp)
            raise CheckpointError(f"checkpoint {final} not written: {problem}")
        _write_shared(comm, tmp, step, checkpoint_id, slices, metas, fsync)
        shard_meta = [(r, 0, m) for r, m in enumerate(metas)]
        outcomes = comm.gather(("ok", None), root=0)
    else:
        # one space check for all shards together, before any is written: each rank's alone
        # would pass while the shards together overflow the shared file system (HDF5 then
        # dies with SIGSEGV on ENOSPC instead of raising)
        mine = (sum(int(s.array.nbytes) for s in slices), len(slices)) if writer else (0, 0)
        sizes = comm.allgather(mine if local[0] == "ok" else (0, 0))
        problem = None
        if rank == 0:
            problem = _shards_space_problem(tmp, sizes, final)
        problem = comm.bcast(problem, root=0)
        if problem:
            if rank == 0:
                _discard(tmp)
            raise CheckpointError(f"checkpoint {final} not written: {problem}")
        if local[0] == "ok" and writer:
            try:
                local = ("ok", _write_shard(tmp, rank, step, checkpoint_id, slices, fsync))
            except Exception as exc:
                local = ("error", _describe_failure(rank, exc))
        outcomes = comm.gather(local, root=0)
        shard_meta = []

    # 3. rank 0 checks the whole, writes the index, and commits (rename, latest, rotation)
    result: tuple[str, str] | None = None
    if rank == 0:
        result = _commit(
            _Commit(comm.size, root, tmp, final, step, checkpoint_id, chosen, keep, fsync),
            outcomes,
            shard_meta,
            attrs or {},
        )
    status, message = comm.bcast(result, root=0)
    if status != "ok":
        raise CheckpointError(message)
    return final


def _discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class _Commit:
    world_size: int
    root: Path
    tmp: Path
    final: Path
    step: int
    checkpoint_id: str
    layout: str
    keep: int
    fsync: bool


def _commit(
    c: _Commit,
    outcomes: list[tuple[str, Any]],
    shard_meta: list[tuple[int, int, list[tuple]]],
    attrs: Mapping[str, Any],
) -> tuple[str, str]:
    """Rank 0: index, durability, rename, `latest`, rotation. Never raises (the other ranks
    wait for its answer)."""
    errors = [o[1] for o in outcomes if o[0] != "ok"]
    if errors:
        _discard(c.tmp)
        return ("error", f"checkpoint {c.final} not written: " + "; ".join(errors))
    try:
        if c.layout == "shared":
            shards = [ShardEntry(SHARED_FILE, -1, (c.tmp / SHARED_FILE).stat().st_size)]
            metas = shard_meta
        else:
            shards, metas = [], []
            for rank, (_, written) in enumerate(outcomes):
                if written is not None:
                    name, size, rank_metas = written
                    metas.append((rank, len(shards), rank_metas))
                    shards.append(ShardEntry(name, rank, size))
        ensure_space(c.tmp, _attrs_bytes(attrs), f"checkpoint index {c.tmp / INDEX_FILE}")
        write_index(
            c.tmp / INDEX_FILE,
            step=c.step,
            checkpoint_id=c.checkpoint_id,
            layout=c.layout,
            world_size=c.world_size,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            code_version=__version__,
            shards=shards,
            tensors=_build_tensors(metas),
            attrs=attrs,
        )
        if c.fsync:
            fsync_path(c.tmp / INDEX_FILE)
            fsync_path(c.tmp)
        maybe_fail("checkpoint-commit", 0)  # fault tests: die with a complete .tmp
        install(c.tmp, c.final, fsync=c.fsync)
        write_latest(c.root, c.final.name, fsync=c.fsync)
    except Exception as exc:
        _discard(c.tmp)
        why = str(exc) if isinstance(exc, CheckpointError) else _describe_failure(0, exc)
        return ("error", f"checkpoint {c.final} not written: {why}")
    rotate(c.root, c.final, c.keep)
    return ("ok", str(c.final))
