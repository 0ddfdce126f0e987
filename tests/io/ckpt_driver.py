"""Run under mpiexec by the checkpoint tests: save or load the test state on N ranks.

    mpiexec -n 4 python tests/io/ckpt_driver.py save ROOT STEP [--scheme zero] [--keep K]
    mpiexec -n 3 python tests/io/ckpt_driver.py load ROOT
    mpiexec -n 4 python tests/io/ckpt_driver.py errors ROOT

Each rank prints one JSON line per action. The state mimics a training run on pp x dp ranks
(dp innermost): per-stage parameters written once per stage, ZeRO-sharded optimizer state,
experts placed round-robin (non-contiguous slices of one tensor on one rank), a scalar, bool,
complex and empty tensors. `global_tensors` is the oracle every load is compared with.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpcpipe.io.checkpoint import (
    CheckpointError,
    ShardSpec,
    block_index,
    load_checkpoint,
    save_checkpoint,
)

EXPERTS = 4


def layout(size: int) -> tuple[int, int]:
    """(pp, dp) for a world of `size` ranks: two stages when the world splits evenly."""
    pp = 2 if size % 2 == 0 else 1
    return pp, size // pp


def global_tensors(size: int, seed: int = 7) -> dict[str, np.ndarray]:
    """The whole state, as one process would hold it."""
    rng = np.random.default_rng(seed)
    pp, _ = layout(size)
    out: dict[str, np.ndarray] = {}
    for p in range(pp):
        out[f"stage{p}/w"] = rng.standard_normal((9, 6)).astype(np.float32)
        out[f"stage{p}/b"] = rng.standard_normal(6)
        out[f"stage{p}/adam_m"] = rng.standard_normal((9, 6)).astype(np.float32)
    out["experts/w1"] = rng.standard_normal((EXPERTS, 3, 5)).astype(np.float32)
    out["step_count"] = np.array(1234, dtype=np.int64)
    out["mask"] = rng.random((7, 3)) > 0.5
    out["cplx"] = (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex64)
    out["empty"] = np.zeros((0, 4), dtype=np.float32)
    return out


def _piece(name: str, full: np.ndarray, index: tuple[slice, ...]) -> tuple[ShardSpec, np.ndarray]:
    spec = ShardSpec(name, full.shape, full.dtype, index)
    return spec, full[spec.index]


def holdings(
    rank: int, size: int, scheme: str
) -> tuple[bool, dict[str, tuple[ShardSpec, np.ndarray]]]:
    """(writer, tensors) of one rank.

    zero: every rank writes; parameters come from dp rank 0 only, optimizer state is sharded
    by rows over dp. replica: only dp rank 0 writes; every rank passes everything (replicas'
    tensors must be ignored). overlap: every rank writes its replicated parameters (an error).
    """
    full = global_tensors(size)
    _, dp = layout(size)
    stage, dp_rank = divmod(rank, dp)
    writer = scheme in ("zero", "overlap") or dp_rank == 0
    writers = [r for r in range(size) if scheme in ("zero", "overlap") or r % dp == 0]
    mine: dict[str, tuple[ShardSpec, np.ndarray]] = {}
    for name in (f"stage{stage}/w", f"stage{stage}/b"):
        if dp_rank == 0 or scheme in ("replica", "overlap"):
            mine[name] = _piece(name, full[name], ())
    name = f"stage{stage}/adam_m"
    if scheme == "zero":
        mine[name] = _piece(name, full[name], block_index((9, 6), 0, dp, dp_rank))
    else:
        mine[name] = _piece(name, full[name], ())
    if rank in writers:
        i, w = writers.index(rank), len(writers)
        for e in range(i, EXPERTS, w):
            mine[f"expert{e}"] = _piece("experts/w1", full["experts/w1"], (slice(e, e + 1),))
        if i == 0:
            mine["step_count"] = _piece("step_count", full["step_count"], ())
            mine["empty"] = _piece("empty", full["empty"], ())
        if i == w - 1:
            mine["mask"] = _piece("mask", full["mask"], ())
        mine["cplx"] = _piece("cplx", full["cplx"], block_index((5,), 0, w, i))
    return writer, mine


def _emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def _save(comm, args: argparse.Namespace) -> int:
    writer, mine = holdings(comm.rank, comm.size, args.scheme)
    attrs = {"world": comm.size, "scheme": args.scheme, "rng": bytes([comm.rank, 0, 255])}
    try:
        path = save_checkpoint(
            comm,
            args.root,
            args.step,
            mine,
            writer=writer,
            attrs=attrs,
            keep=args.keep,
            layout=args.layout,
        )
    except CheckpointError as exc:
        if not args.report_errors:
            raise
        # one JSON line per rank: tracebacks of several ranks interleave character by character
        _emit(rank=comm.rank, error=f"{type(exc).__name__}: {exc}")
        return 1
    _emit(rank=comm.rank, path=str(path))
    return 0


def _load(comm, args: argparse.Namespace) -> int:
    """Each rank loads a column block of every 2-d tensor, a strided view of the 3-d one and
    the rest whole, as a rank of a differently sized job would."""
    full = global_tensors(args.saved_world)
    wanted = {}
    for name, arr in full.items():
        if arr.ndim == 2:
            index = block_index(arr.shape, 1, comm.size, comm.rank)
        elif arr.ndim == 3:
            index = (slice(comm.rank % 2, None, 2), slice(None), slice(1, 5, 3))
        else:
            index = ()
        wanted[name] = ShardSpec(name, arr.shape, arr.dtype, index)
    got = load_checkpoint(args.root, wanted)
    bad = [k for k, spec in wanted.items() if not np.array_equal(got[k], full[k][spec.index])]
    _emit(rank=comm.rank, loaded=sorted(got), mismatched=bad)
    return 1 if bad else 0


def _errors(comm, args: argparse.Namespace) -> int:
    """Saves that must fail on every rank alike (so no rank hangs) and leave nothing behind."""
    cases = {}
    writer, mine = holdings(comm.rank, comm.size, "overlap")
    cases["overlap"] = (writer, mine)
    writer, mine = holdings(comm.rank, comm.size, "zero")
    if comm.rank == comm.size - 1:
        spec, arr = mine["cplx"]
        mine = {**mine, "cplx": (spec, arr.astype(np.complex128))}
    cases["dtype"] = (writer, mine)
    writer, mine = holdings(comm.rank, comm.size, "zero")
    if comm.rank == 1:
        mine = {k: v for k, v in mine.items() if not k.startswith("expert")}
    cases["hole"] = (writer, mine)
    for step, (case, (writer, mine)) in enumerate(cases.items(), start=args.step):
        try:
            save_checkpoint(comm, args.root, step, mine, writer=writer, keep=1)
            _emit(rank=comm.rank, case=case, error=None)
        except CheckpointError as exc:
            _emit(rank=comm.rank, case=case, error=str(exc))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=("save", "load", "errors"))
    parser.add_argument("root")
    parser.add_argument("step", nargs="?", type=int, default=1)
    parser.add_argument("--scheme", default="zero", choices=("zero", "replica"))
    parser.add_argument("--keep", type=int, default=0)
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--saved-world", type=int, default=4)
    parser.add_argument(
        "--report-errors", action="store_true", help="save: a CheckpointError as a JSON record"
    )
    args = parser.parse_args()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return {"save": _save, "load": _load, "errors": _errors}[args.action](comm, args)


if __name__ == "__main__":
    sys.exit(main())
