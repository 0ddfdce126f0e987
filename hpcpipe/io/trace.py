"""Trace events: recording in the runtime, clock alignment, and the HDF5 trace format.

Recording is built for a hot loop. A `Recorder` appends rows to a preallocated NumPy structured
array (it doubles when full; nothing is ever dropped), and the runtime guards every hook with
one attribute test, so a disabled recorder costs a branch per action::

    if rec.enabled:
        rec.record(EventKind.F, stage, mb, t0, rec.now())

Times are `time.perf_counter_ns()` integers (CLOCK_MONOTONIC on Linux: one clock per node,
nanosecond resolution, about 50-100 ns to read, never steps backwards). Clocks of different
nodes run apart, so `estimate_offsets` measures each rank's offset against rank 0 by ping-pong
(the round trip with the smallest latency wins), once when tracing starts and again when the
trace is written; readers interpolate between the samples, which also removes linear drift.

Files (format `hpcpipe-trace`, version 1, documented in docs/formats.md) hold one dataset per
rank, `/ranks/<r>/events`, with raw local times; the run's metadata (config TOML, topology,
schedule CSV, clock samples) sits in attributes. Serial h5py has no parallel writer, so
`write_trace` gathers the events to rank 0 (or, for large traces, has every rank write a
temporary file that rank 0 merges) and publishes the file by atomic rename. Nothing here imports
MPI (the clock ping-pong is in hpcpipe.mpi.clock): the reader and the analysis run without it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.io.space import ensure_space

__all__ = [
    "CLOCK",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "EVENT_DTYPE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PIPELINE_KINDS",
    "RECV_KINDS",
    "SEND_KINDS",
    "ClockSample",
    "EventKind",
    "Recorder",
    "Trace",
    "TraceFormatError",
    "action_peers",
    "read_trace",
    "save_trace",
    "topology_metadata",
    "write_trace",
]

FORMAT_NAME = "hpcpipe-trace"
FORMAT_VERSION = 1
CLOCK = "time.perf_counter_ns"


class EventKind(IntEnum):
    """What an event measured. Codes 0-7 equal `hpcpipe.schedules.ir.Kind`.

    Field use per kind (stage / microbatch / bytes / peer / value), see docs/formats.md:
    F, B, W, BW: the action's stage and microbatch. SEND_F, SEND_B: the sending stage, bytes,
    peer = receiving world rank; RECV_F, RECV_B: the receiving stage, the wait for the data, peer
    = sending world rank (the same convention as the schedule's actions). SEND, RECV: any other
    point-to-point message (sweep faces, halos); stage and microbatch are a tag both sides share.
    WAIT: completing outstanding requests. ALLREDUCE, ALLTOALL: from start to completion (may
    overlap compute), bytes sent; a pipeline's ALLREDUCE is one stage's gradients (value 1:
    expert gradients), seen complete at the next check between actions. EXPERT: stage =
    global expert id, value = tokens processed.
    STEP: the whole step; bytes = the rank's peak live memory in it, value = the loss (optional).
    REPLAN: moving layers to a new partition ([replan]); bytes sent, value = predicted gain.
    """

    F = 0
    B = 1
    W = 2
    BW = 3
    SEND_F = 4
    RECV_F = 5
    SEND_B = 6
    RECV_B = 7
    WAIT = 8
    ALLREDUCE = 9
    ALLTOALL = 10
    OPTIMIZER = 11
    CHECKPOINT = 12
    SWEEP_BLOCK = 13
    STEP = 14
    EXPERT = 15
    SEND = 16
    RECV = 17
    REPLAN = 18

    def __str__(self) -> str:
        return self.name


PIPELINE_KINDS = tuple(EventKind(k) for k in range(8))
"""The schedule's action kinds: what `Trace.rank_actions` lists."""
COMPUTE_KINDS = (
    EventKind.F,
    EventKind.B,
    EventKind.W,
    EventKind.BW,
    EventKind.OPTIMIZER,
    EventKind.SWEEP_BLOCK,
    EventKind.EXPERT,
)
SEND_KINDS = (EventKind.SEND_F, EventKind.SEND_B, EventKind.SEND)
RECV_KINDS = (EventKind.RECV_F, EventKind.RECV_B, EventKind.RECV)
COMM_KINDS = (*SEND_KINDS, *RECV_KINDS, EventKind.WAIT, EventKind.ALLREDUCE, EventKind.ALLTOALL)

EVENT_DTYPE = np.dtype(
    [
        ("t_start", "<i8"),  # ns, the rank's local clock (see CLOCK)
        ("t_end", "<i8"),
        ("bytes", "<i8"),
        ("value", "<f8"),
        ("step", "<i4"),
        ("stage", "<i4"),
        ("microbatch", "<i4"),
        ("peer", "<i4"),  # world rank, -1 when none
        ("kind", "u1"),
    ],
    align=True,
)
"""One row per event; aligned fields make the per-event row store measurably cheaper."""

# The row layout of EVENT_DTYPE for struct.pack_into: one C call per event, about twice as fast
# as assigning a tuple to a structured-array row.
_ROW = struct.Struct("<qqqdiiiiB" + "x" * (EVENT_DTYPE.itemsize - 49))
assert _ROW.size == EVENT_DTYPE.itemsize
_ROW_SIZE = _ROW.size
_pack_row = _ROW.pack_into

_CLOCK_DTYPE = np.dtype([("local_ns", "<i8"), ("offset_ns", "<i8"), ("rtt_ns", "<i8")])
_RESERVED = {"format", "version", "clock", "time_unit", "ranks", "created", "hpcpipe_version"}


class TraceFormatError(ValueError):
    """A file that is not a readable hpcpipe trace; the message names the file and a fix."""

    def __init__(self, path: str | Path, why: str):
        self.path, self.why = str(path), why
        super().__init__(f"{path}: {why}")


@dataclass(frozen=True)
class ClockSample:
    """One offset measurement: this rank's clock minus rank 0's, at local time `local_ns`."""

    local_ns: int
    offset_ns: int
    rtt_ns: int


class Recorder:
    """Events of one rank in a growable, preallocated structured array.

    `enabled` is the one attribute the runtime tests before each hook. `begin_step(step)` sets
    the step stamped on later events and switches `enabled` off for steps not selected by
    `steps` (None records every step); a recorder built with `enabled=False` never turns on.
    """

    __slots__ = (
        "_buf",
        "_cap",
        "_mem",
        "_n",
        "_on",
        "clock",
        "enabled",
        "grown",
        "rank",
        "step",
        "steps",
    )

    now = staticmethod(time.perf_counter_ns)
    """The clock every hook must use for t0/t1 (see CLOCK)."""

    def __init__(
        self,
        rank: int,
        capacity: int = 1 << 16,
        enabled: bool = True,
        steps: Iterable[int] | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 event, got {capacity}")
        self.rank = int(rank)
        self._on = bool(enabled)
        self.enabled = self._on
        self.steps = None if steps is None else frozenset(int(s) for s in steps)
        self.step = 0
        self._set_buffer(np.zeros(capacity if self._on else 0, dtype=EVENT_DTYPE))
        self._n = 0
        self.grown = 0
        self.clock: list[ClockSample] = []

    def begin_step(self, step: int) -> bool:
        """Stamp later events with `step`; returns (and sets) whether this step is recorded."""
        self.step = step
        self.enabled = self._on and (self.steps is None or step in self.steps)
        return self.enabled

    def record(
        self,
        kind: int,
        stage: int,
        microbatch: int,
        t0: int,
        t1: int,
        nbytes: int = 0,
        peer: int = -1,
        value: float = 0.0,
    ) -> None:
        """Append one event (times from `Recorder.now`). Call only under `if rec.enabled:`."""
        n = self._n
        if n == self._cap:
            self._grow()
        _pack_row(
            self._mem,
            n * _ROW_SIZE,
            t0,
            t1,
            nbytes,
            value,
            self.step,
            stage,
            microbatch,
            peer,
            kind,
        )
        self._n = n + 1

    def _set_buffer(self, buf: np.ndarray) -> None:
        self._buf = buf
        self._cap = buf.shape[0]
        self._mem = memoryview(buf).cast("B")  # what record() packs rows into

    def _grow(self) -> None:
        bigger = np.zeros(2 * self._cap or 1024, dtype=EVENT_DTYPE)
        bigger[: self._n] = self._buf[: self._n]
        self._set_buffer(bigger)
        self.grown += 1

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def events(self) -> np.ndarray:
        """The recorded events (a view: copy it before recording more)."""
        return self._buf[: self._n]

    def clear(self) -> None:
        """Forget the events (after writing them), keep the buffer and the clock samples."""
        self._n = 0

    def align_clock(self, comm: Any, rounds: int = 8) -> ClockSample:
        """Collective on `comm`: measure and keep this rank's clock offset against rank 0."""
        from hpcpipe.mpi.clock import estimate_offsets

        sample = ClockSample(*estimate_offsets(comm, rounds))
        self.clock.append(sample)
        return sample


def action_peers(schedule: Any, rank: int, to_world: Any = None) -> np.ndarray:
    """Peer of each action of `rank` in a lowered `schedule`: for SEND_F/RECV_F/SEND_B/RECV_B
    the rank at the other end (as a world rank through `to_world`, see `world_ranks`), else -1.
    Computed once, so the runtime's hook only indexes it by action position."""
    lo, hi = int(schedule.offsets[rank]), int(schedule.offsets[rank + 1])
    kinds = schedule.kinds[lo:hi].astype(np.int64)
    stages = schedule.stages[lo:hi].astype(np.int64)
    shift = np.zeros(kinds.size, dtype=np.int64)
    shift[(kinds == EventKind.SEND_F) | (kinds == EventKind.RECV_B)] = 1
    shift[(kinds == EventKind.RECV_F) | (kinds == EventKind.SEND_B)] = -1
    rank_of_stage = np.asarray(schedule.rank_of_stage)
    other = np.clip(stages + shift, 0, rank_of_stage.size - 1)
    peers = rank_of_stage[other]
    if to_world is not None:
        peers = np.asarray(to_world, dtype=np.int64)[peers]
    return np.where(shift != 0, peers, -1)


def topology_metadata(rankmap: Any) -> dict[str, Any]:
    """A RankMap as JSON-able data: degrees plus every world rank's coordinates and node."""
    coords = [rankmap.coords(r) for r in range(rankmap.world)]
    return {
        "world": rankmap.world,
        "ranks_per_node": rankmap.ranks_per_node,
        "dims": dict(rankmap.dims),
        "order": list(rankmap.order),
        "coords": {d: [c[d] for c in coords] for d in ("pp", "dp", "ep")},
        "node": [rankmap.node_of(r) for r in range(rankmap.world)],
    }


def device_metadata() -> dict[str, Any]:
    """Where the arrays lived and how device buffers reached MPI (root attributes `device`,
    `cuda_aware`, `cuda_aware_reason`), so a trace says whether messages were staged."""
    from hpcpipe.backend import active_backend

    backend = active_backend()
    if backend is None:
        return {"device": "cpu", "cuda_aware": False, "cuda_aware_reason": "cpu run"}
    return {
        "device": f"cuda:{backend.device_id}",
        "cuda_aware": bool(backend.cuda_aware),
        "cuda_aware_reason": backend.cuda_aware_reason,
    }


def _attr_value(key: str, value: Any) -> Any:
    """Metadata item -> HDF5 attribute: Schedule -> CSV, RankMap -> JSON, Config -> TOML."""
    if key in _RESERVED:
        raise ValueError(f"metadata key {key!r} is reserved by the trace format")
    if hasattr(value, "stages_of_rank") and hasattr(value, "kinds"):
        from hpcpipe.schedules.ir import to_csv

        return to_csv(value)
    if hasattr(value, "coords") and hasattr(value, "dims"):
        return json.dumps(topology_metadata(value))
    if hasattr(value, "sections") and hasattr(value, "as_dict"):
        from hpcpipe.config import dump_toml

        return dump_toml(value)
    if isinstance(value, str | bool | int | float | np.integer | np.floating):
        return value
    try:
        return json.dumps(value)
    except TypeError as exc:
        raise TypeError(f"metadata[{key!r}] cannot be stored in a trace: {exc}") from None


def _clock_array(samples: Iterable[ClockSample]) -> np.ndarray:
    return np.array([(c.local_ns, c.offset_ns, c.rtt_ns) for c in samples], dtype=_CLOCK_DTYPE)


def _as_events(events: Any) -> np.ndarray:
    arr = np.asarray(events)
    names = arr.dtype.names or ()
    missing = [n for n in EVENT_DTYPE.names if n not in names]
    if missing or arr.ndim != 1:
        raise ValueError(f"events must be a 1-D structured array with fields {EVENT_DTYPE.names}")
    out = np.zeros(arr.shape[0], dtype=EVENT_DTYPE)
    for n in EVENT_DTYPE.names:
        out[n] = arr[n]
    return out


def _rank_part(recorder: Recorder) -> dict[str, Any]:
    return {
        "events": np.array(recorder.events),
        "clock": _clock_array(recorder.clock),
        "host": socket.gethostname(),
        "grown": recorder.grown,
    }


def _write_rank(group: Any, part: Mapping[str, Any]) -> None:
    group.create_dataset(
        "events", data=part["events"], maxshape=(None,), chunks=True, fletcher32=True
    )
    group.attrs["clock"] = part["clock"]
    group.attrs["host"] = part["host"]
    group.attrs["grown"] = part["grown"]


def _save(path: Path, size: int, metadata: Mapping[str, Any], fill: Any) -> None:
    """Write root attributes, let `fill(ranks_group)` add the ranks, publish by rename."""
    import h5py

    from hpcpipe import __version__

    attrs = {key: _attr_value(key, value) for key, value in metadata.items()}
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    ensure_space(path.parent, 0, f"trace {path}")  # HDF5 crashes on a full disk
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT_NAME
            f.attrs["version"] = FORMAT_VERSION
            f.attrs["clock"] = CLOCK
            f.attrs["time_unit"] = "ns"
            f.attrs["ranks"] = size
            f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            f.attrs["hpcpipe_version"] = __version__
            for key, value in attrs.items():
                f.attrs[key] = value
            fill(f.create_group("ranks"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_trace(
    path: str | Path,
    events: Iterable[Any],
    metadata: Mapping[str, Any] | None = None,
    *,
    clocks: Iterable[Iterable[ClockSample]] | None = None,
    hosts: Iterable[str] | None = None,
) -> Path:
    """Write a trace from per-rank event arrays in one process, atomically.

    What rank 0 of `write_trace` does; also how converted or synthetic traces are made (times
    are each rank's local clock; `clocks` gives each rank's offset samples, default none).
    """
    path = Path(path)
    evs = [_as_events(e) for e in events]
    clk = [_clock_array(c) for c in clocks] if clocks is not None else [_clock_array([])] * len(evs)
    hst = list(hosts) if hosts is not None else [""] * len(evs)
    if len(clk) != len(evs) or len(hst) != len(evs):
        raise ValueError(f"{len(evs)} ranks of events but {len(clk)} clocks and {len(hst)} hosts")
    parts = [
        {"events": e, "clock": c, "host": h, "grown": 0}
        for e, c, h in zip(evs, clk, hst, strict=True)
    ]

    def fill(ranks: Any) -> None:
        for r, part in enumerate(parts):
            _write_rank(ranks.create_group(str(r)), part)

    _save(path, len(parts), metadata or {}, fill)
    return path


def write_trace(
    comm: Any,
    path: str | Path,
    recorder: Recorder,
    metadata: Mapping[str, Any] | None = None,
    *,
    gather_limit: int = 256 << 20,
) -> Path:
    """Collective: align clocks once more and write every rank's events to one HDF5 file.

    `metadata` (read on rank 0) becomes root attributes: `config` (Config or TOML text),
    `topology` (RankMap or dict), `schedule` (Schedule or CSV text), any scalars, and JSON for
    other data. Up to `gather_limit` bytes of events in total are gathered to rank 0; beyond
    that each rank writes a temporary file next to `path` and rank 0 merges them. The file
    appears under its name only when complete (atomic rename), so it can be rewritten at every
    checkpoint. Every rank raises OSError when the write failed anywhere.
    """
    import h5py

    from hpcpipe.mpi.idle import idle_bcast

    path = Path(path)
    recorder.align_clock(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    part = _rank_part(recorder)
    total = comm.allreduce(int(part["events"].nbytes))
    error: str | None = None
    shard = path.with_name(f".{path.name}.rank{rank}.tmp")
    gathered = total <= gather_limit
    if gathered:
        parts = comm.gather(part, root=0)
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with h5py.File(shard, "w") as f:
                _write_rank(f.create_group("rank"), part)
        except Exception as exc:
            error = f"rank {rank}: cannot write {shard}: {type(exc).__name__}: {exc}"
        errors = [e for e in comm.gather(error, root=0) or [] if e]
        error = "; ".join(errors) or None

    def fill(ranks: Any) -> None:
        if gathered:
            for r, p in enumerate(parts):
                _write_rank(ranks.create_group(str(r)), p)
            return
        for r in range(size):
            name = path.with_name(f".{path.name}.rank{r}.tmp")
            with h5py.File(name, "r") as src:
                src.copy(src["rank"], ranks, name=str(r))

    if rank == 0 and error is None:
        try:
            _save(path, size, {**device_metadata(), **(metadata or {})}, fill)
        except Exception as exc:
            error = f"cannot write {path}: {type(exc).__name__}: {exc}"
    if not gathered:
        comm.Barrier()  # rank 0 has read every shard (or failed): each rank removes its own
        shard.unlink(missing_ok=True)
    error = idle_bcast(error, comm, root=0)  # rank 0 may spend a while writing the file
    if error:
        raise OSError(f"write_trace: {error}")
    return path


# ---------------------------------------------------------------- reading


def _text(value: Any) -> Any:
    return value.decode("utf-8") if isinstance(value, bytes) else value


@dataclass(frozen=True, eq=False)
class Trace:
    """A trace file in memory, times aligned to rank 0's clock and rebased to start at 0.

    `events[r]` is rank r's structured array (EVENT_DTYPE, times in ns on the common clock,
    rows in recording order); `attrs` holds every root attribute. `config`, `topology` and
    `schedule` are the metadata the runtime wrote (None when absent).
    """

    path: Path
    version: int
    attrs: Mapping[str, Any]
    events: tuple[np.ndarray, ...]
    clock: tuple[np.ndarray, ...]
    hosts: tuple[str, ...]
    origin_ns: int = 0
    aligned: bool = True

    @property
    def num_ranks(self) -> int:
        return len(self.events)

    @cached_property
    def steps(self) -> tuple[int, ...]:
        """Every step that has events, ascending."""
        found = set()
        for ev in self.events:
            found.update(np.unique(ev["step"]).tolist())
        return tuple(sorted(found))

    @property
    def config(self) -> str | None:
        return self.attrs.get("config")

    def _json_attr(self, name: str) -> dict[str, Any] | None:
        text = self.attrs.get(name)
        if text is None:
            return None
        try:
            return json.loads(text)
        except (TypeError, ValueError) as exc:
            raise TraceFormatError(self.path, f"attribute {name!r} is not JSON: {exc}") from None

    @cached_property
    def topology(self) -> dict[str, Any] | None:
        return self._json_attr("topology")

    @cached_property
    def schedule(self) -> Any:
        """The schedule the run executed (a `Schedule`), or None when not recorded."""
        text = self.attrs.get("schedule")
        if not text:
            return None
        from hpcpipe.schedules.ir import from_csv

        try:
            return from_csv(text, source=f"{self.path}:schedule")
        except ValueError as exc:
            raise TraceFormatError(self.path, f"attribute 'schedule' is damaged: {exc}") from None

    @cached_property
    def memory(self) -> dict[str, Any] | None:
        """The run's memory report (`predicted_peak_bytes` per pipeline rank, ...), if any."""
        return self._json_attr("memory")

    def pipeline_rank(self, rank: int) -> int:
        """The schedule's rank (pp coordinate) that world rank `rank` executed."""
        topo = self.topology
        if topo and "coords" in topo:
            return int(topo["coords"]["pp"][rank])
        return rank

    @cached_property
    def _rows_by_step(self) -> tuple[dict[int, np.ndarray], ...]:
        out = []
        for ev in self.events:
            order = np.argsort(ev["step"], kind="stable")
            steps, first = np.unique(ev["step"][order], return_index=True)
            parts = np.split(order, first[1:]) if steps.size else []
            out.append({int(s): p for s, p in zip(steps.tolist(), parts, strict=True)})
        return tuple(out)

    def step_rows(self, rank: int, step: int) -> np.ndarray:
        """Row indices (recording order) of rank `rank`'s events in `step`."""
        return self._rows_by_step[rank].get(step, np.zeros(0, dtype=np.int64))

    def step_events(self, rank: int, step: int) -> np.ndarray:
        """Rank `rank`'s events of `step` (a copy), in recording order."""
        return self.events[rank][self.step_rows(rank, step)]

    def rank_actions(self, rank: int, step: int) -> list[str]:
        """The schedule actions rank `rank` recorded in `step`, in order, as '2F0', '1SEND_F3'."""
        ev = self.step_events(rank, step)
        ev = ev[ev["kind"] < len(PIPELINE_KINDS)]
        names = [k.name for k in EventKind]
        return [
            f"{s}{names[k]}{mb}"
            for k, s, mb in zip(
                ev["kind"].tolist(), ev["stage"].tolist(), ev["microbatch"].tolist(), strict=True
            )
        ]

    @cached_property
    def table(self) -> np.ndarray:
        """All ranks' events in one array with `rank` and `index` (row within the rank) columns."""
        dtype = np.dtype(
            [*((n, EVENT_DTYPE[n]) for n in EVENT_DTYPE.names), ("rank", "<i4"), ("index", "<i8")]
        )
        out = np.zeros(sum(len(e) for e in self.events), dtype=dtype)
        lo = 0
        for r, ev in enumerate(self.events):
            hi = lo + len(ev)
            for n in EVENT_DTYPE.names:
                out[n][lo:hi] = ev[n]
            out["rank"][lo:hi] = r
            out["index"][lo:hi] = np.arange(len(ev))
            lo = hi
        return out


def _offsets_at(clock: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Offset of this rank's clock at local times `t`: linear between samples (drift)."""
    if clock.size == 0:
        return np.zeros(t.shape, dtype=np.int64)
    if clock.size == 1:
        return np.full(t.shape, int(clock["offset_ns"][0]), dtype=np.int64)
    order = np.argsort(clock["local_ns"])
    x = clock["local_ns"][order].astype(np.float64)
    y = clock["offset_ns"][order].astype(np.float64)
    slope = (y[-1] - y[0]) / (x[-1] - x[0]) if x[-1] > x[0] else 0.0
    inside = np.interp(t.astype(np.float64), x, y)
    before = y[0] + slope * (t - x[0])
    after = y[-1] + slope * (t - x[-1])
    out = np.where(t < x[0], before, np.where(t > x[-1], after, inside))
    return np.rint(out).astype(np.int64)


def _fail(path: Path, why: str) -> TraceFormatError:
    return TraceFormatError(path, why)


def read_trace(path: str | Path) -> Trace:
    """Load and check a trace: format name, version, every rank's dataset and its fields.

    Raises TraceFormatError, naming the file and what is wrong, for missing, foreign,
    truncated or damaged files and for a format version newer than this reader.
    """
    import h5py

    path = Path(path)
    if not path.exists():
        raise _fail(path, "no such file")
    if path.is_dir():
        raise _fail(path, "is a directory; give the trace file (usually <run.output>/trace.h5)")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        if "truncated" in str(exc):
            raise _fail(
                path, f"is truncated: a partial copy of an HDF5 file ({exc}); copy it again"
            ) from None
        raise _fail(path, f"is not an HDF5 file, or is damaged ({exc})") from None
    try:
        with f:
            return _read_open(path, f)
    except TraceFormatError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise _fail(path, f"is damaged: {type(exc).__name__}: {exc}") from None


def _read_events(path: Path, ds: Any, key: str) -> np.ndarray:
    """One rank's event table, checked: a 1-D table with every field of the expected kind,
    readable (HDF5 verifies Fletcher32 checksums where the table has them) and with no event
    ending before it starts. Raw (local) times are returned."""
    names = getattr(getattr(ds, "dtype", None), "names", None) or ()
    missing = [n for n in EVENT_DTYPE.names if n not in names]
    if not hasattr(ds, "shape") or missing:
        raise _fail(
            path,
            f"{key} is not an event table (missing fields {missing}); expected the fields "
            f"{list(EVENT_DTYPE.names)} (docs/formats.md)",
        )
    if ds.ndim != 1:
        raise _fail(path, f"{key} has shape {ds.shape}; an event table is 1-D (one row per event)")
    for n in EVENT_DTYPE.names:
        have, want = ds.dtype[n], EVENT_DTYPE[n]
        kinds = "iuf" if want.kind == "f" else "iu"
        if have.kind not in kinds or have.shape:
            raise _fail(
                path,
                f"{key} field {n!r} is {have}, expected {want} (not written by an hpcpipe "
                "trace writer, or damaged)",
            )
    try:
        raw = ds[()]
    except (OSError, ValueError, RuntimeError) as exc:
        raise _fail(
            path,
            f"{key} cannot be read ({type(exc).__name__}: {exc}): the file is damaged (a "
            "flipped byte or a partial copy); record the run again",
        ) from None
    ev = np.zeros(raw.shape[0], dtype=EVENT_DTYPE)
    for n in EVENT_DTYPE.names:
        ev[n] = raw[n]
    backwards = np.flatnonzero(ev["t_end"] < ev["t_start"])
    if backwards.size:
        i = int(backwards[0])
        raise _fail(
            path,
            f"{key} row {i} ends before it starts (t_start={int(ev['t_start'][i])}, "
            f"t_end={int(ev['t_end'][i])}): the event table is damaged",
        )
    return ev


def _read_open(path: Path, f: Any) -> Trace:
    fmt = _text(f.attrs.get("format"))
    if fmt is None:
        raise _fail(
            path,
            "is an HDF5 file but not an hpcpipe trace (no 'format' attribute); traces are "
            "written by runs with [trace] enabled = true, as <run.output>/trace.h5",
        )
    if fmt != FORMAT_NAME:
        raise _fail(path, f"is a {fmt!r} file, not an hpcpipe trace ({FORMAT_NAME!r})")
    try:
        version = int(f.attrs["version"])
    except (KeyError, TypeError, ValueError):
        raise _fail(path, "has no valid format 'version' attribute") from None
    if version > FORMAT_VERSION:
        raise _fail(
            path,
            f"has trace format version {version}, newer than this hpcpipe reads "
            f"({FORMAT_VERSION}): upgrade hpcpipe to read it",
        )
    if version < 1:
        raise _fail(path, f"has an invalid trace format version {version}")
    attrs = {k: _text(v) for k, v in f.attrs.items()}
    try:
        size = int(attrs["ranks"])
    except (KeyError, TypeError, ValueError):
        raise _fail(path, "has no valid 'ranks' attribute") from None
    if size < 0:
        raise _fail(path, f"has an invalid 'ranks' attribute ({size})")
    events, clocks, hosts = [], [], []
    for r in range(size):
        key = f"ranks/{r}/events"
        if key not in f:
            raise _fail(path, f"is incomplete: {key} is missing ({size} ranks expected)")
        ev = _read_events(path, f[key], key)
        grp = f[f"ranks/{r}"]
        clock = np.asarray(grp.attrs.get("clock", np.zeros(0, dtype=_CLOCK_DTYPE)))
        if clock.size and (clock.dtype.names is None or "offset_ns" not in clock.dtype.names):
            raise _fail(path, f"ranks/{r} has a damaged 'clock' attribute")
        if clock.size:
            clock = clock.astype(_CLOCK_DTYPE)
            for n in ("t_start", "t_end"):
                ev[n] = ev[n] - _offsets_at(clock, ev[n])
        events.append(ev)
        clocks.append(clock)
        hosts.append(str(_text(grp.attrs.get("host", ""))))
    starts = [int(ev["t_start"].min()) for ev in events if ev.size]
    origin = min(starts) if starts else 0
    for ev in events:
        ev["t_start"] -= origin
        ev["t_end"] -= origin
    return Trace(
        path=path,
        version=version,
        attrs=attrs,
        events=tuple(events),
        clock=tuple(clocks),
        hosts=tuple(hosts),
        origin_ns=origin,
        aligned=all(c.size for c in clocks) if size > 1 else True,
    )
