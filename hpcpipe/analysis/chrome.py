"""Chrome Trace Event Format export: loads in Perfetto (ui.perfetto.dev) and chrome://tracing.

One process per rank (named with its pipeline/data coordinates) and three threads in it:
compute, communication, step. Each event is a complete (`X`) event; nesting within a thread is
always proper, because asynchronous collectives sit on the communication thread, apart from the
compute they overlap. Each matched message is a flow: `s` on the send, `f` on the receive.
Timestamps are microseconds from the trace's origin (floats, so nanoseconds survive).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpcpipe.analysis.messages import match_messages
from hpcpipe.io.trace import COMM_KINDS, EventKind, Trace

__all__ = ["to_chrome", "write_chrome"]

_THREADS = {0: "compute", 1: "communication", 2: "step"}
_COMM = {int(k) for k in COMM_KINDS}
_NPIPE = 8


def _category(kind: int) -> tuple[str, int]:
    if kind == EventKind.STEP:
        return "step", 2
    if kind in _COMM:
        return "comm", 1
    if kind in (EventKind.CHECKPOINT, EventKind.REPLAN):
        return "io", 2
    return "compute", 0


def _name(kind: int, stage: int, mb: int) -> str:
    k = EventKind(kind)
    if kind < _NPIPE:
        return f"{stage}{k.name}{mb}"
    if k == EventKind.STEP:
        return "step"
    if k == EventKind.EXPERT:
        return f"expert {stage}"
    return k.name if stage < 0 else f"{k.name} s{stage}"


def to_chrome(trace: Trace, steps: Iterable[int] | None = None) -> dict[str, Any]:
    """The trace as a Chrome Trace Event Format object (dict with `traceEvents`)."""
    wanted = None if steps is None else set(steps)
    if wanted is not None and not wanted <= set(trace.steps):
        missing = sorted(wanted - set(trace.steps))
        raise ValueError(f"{trace.path}: steps {missing} are not in the trace {list(trace.steps)}")
    out: list[dict[str, Any]] = []
    topo = trace.topology or {}
    coords = topo.get("coords", {})
    for r in range(trace.num_ranks):
        label = f"rank {r}"
        if coords:
            # pp/dp/ep for training, x/y (the KBA grid) for sweeps
            label += " (" + ", ".join(f"{d} {values[r]}" for d, values in coords.items()) + ")"
        if r < len(trace.hosts) and trace.hosts[r]:
            label += f" on {trace.hosts[r]}"
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": label}})
        out.append(
            {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}}
        )
        for tid, tname in _THREADS.items():
            out.append(
                {"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": tname}}
            )
    names = [k.name for k in EventKind]
    for r, ev in enumerate(trace.events):
        cols = {n: ev[n].tolist() for n in ev.dtype.names}
        for i in range(len(ev)):
            step = cols["step"][i]
            if wanted is not None and step not in wanted:
                continue
            kind, stage, mb = cols["kind"][i], cols["stage"][i], cols["microbatch"][i]
            t0, t1 = cols["t_start"][i], cols["t_end"][i]
            cat, tid = _category(kind)
            args: dict[str, Any] = {"kind": names[kind], "step": step, "row": i}
            if stage >= 0:
                args["stage"] = stage
            if mb >= 0:
                args["microbatch"] = mb
            if cols["bytes"][i]:
                args["bytes"] = cols["bytes"][i]
            if cols["peer"][i] >= 0:
                args["peer"] = cols["peer"][i]
            if cols["value"][i]:
                args["value"] = cols["value"][i]
            out.append(
                {
                    "ph": "X",
                    "name": _name(kind, stage, mb),
                    "cat": cat,
                    "ts": t0 / 1e3,
                    "dur": max(t1 - t0, 0) / 1e3,
                    "pid": r,
                    "tid": tid,
                    "args": args,
                }
            )
    msgs = match_messages(trace)
    for k in range(len(msgs)):
        sr, si = int(msgs.send_rank[k]), int(msgs.send_index[k])
        rr, ri = int(msgs.recv_rank[k]), int(msgs.recv_index[k])
        send, recv = trace.events[sr][si], trace.events[rr][ri]
        if wanted is not None and int(send["step"]) not in wanted:
            continue
        common = {"name": "message", "cat": "message", "id": k}
        out.append(
            {**common, "ph": "s", "ts": int(send["t_start"]) / 1e3, "pid": sr, "tid": 1, "bp": "e"}
        )
        out.append(
            {**common, "ph": "f", "ts": int(recv["t_start"]) / 1e3, "pid": rr, "tid": 1, "bp": "e"}
        )
    return {
        "traceEvents": out,
        "displayTimeUnit": "ns",
        "otherData": {
            "source": str(trace.path),
            "format": f"{trace.attrs.get('format')} v{trace.version}",
            "schedule": trace.schedule.name if trace.schedule is not None else "",
            "ranks": trace.num_ranks,
            "clock_aligned": bool(trace.aligned),
        },
    }


def write_chrome(trace: Trace, path: str | Path, steps: Iterable[int] | None = None) -> int:
    """Write the Chrome JSON to `path`; returns the number of trace events written."""
    doc = to_chrome(trace, steps)
    Path(path).write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    return len(doc["traceEvents"])
