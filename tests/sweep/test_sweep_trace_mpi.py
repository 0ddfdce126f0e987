"""A traced 4-rank (2 x 2) sweep: the trace holds the plan's tasks in plan order every
iteration, every face message pairs up, and `hpcpipe trace summary|export|plot` read it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import run_cli, run_mpi

from hpcpipe.analysis import match_messages
from hpcpipe.config import load_config
from hpcpipe.io.trace import EventKind, read_trace
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.plan import build_plan

pytestmark = pytest.mark.mpi

TINY = Path(__file__).resolve().parents[2] / "inputs" / "sweep_tiny.toml"
SETS = ["sweep.px=2", "sweep.py=2", "sweep.tolerance=1e-5", "checkpoint.every=4"]
K = EventKind


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep-trace")
    sets = [*SETS, f"run.output={out}", "trace.enabled=true", "checkpoint.fsync=false"]
    r = run_mpi(4, ["run", str(TINY), *[a for s in sets for a in ("--set", s)]], timeout=120)
    assert r.returncode == 0, r.output
    with h5py.File(out / "flux.h5") as f:
        dphi = f["history/dphi"][()]
    cfg = load_config(TINY, SETS).sweep
    problem = build_problem(cfg)
    plan = build_plan(
        cfg.px,
        cfg.py,
        problem.mesh.shape,
        problem.quadrature.per_octant,
        cfg.z_block,
        cfg.angle_block,
        cfg.octant_order,
    )
    return out, read_trace(out / "trace.h5"), plan, dphi


def test_one_block_event_per_planned_task_in_plan_order(traced):
    _, trace, plan, dphi = traced
    iterations = dphi.size
    assert iterations > 2 and trace.num_ranks == 4
    assert trace.steps == tuple(range(1, iterations + 1))  # trace step = iteration, from 1
    assert trace.attrs["workload"] == "sweep" and trace.attrs["sweep_z_blocks"] == plan.z_blocks
    assert trace.attrs["sweep_order"] == plan.order == "nearest"
    for rank in range(4):
        planned = [(t.octant, t.angle_block * plan.z_blocks + t.z_block) for t in plan.tasks[rank]]
        assert len(planned) == 48
        for step in trace.steps:
            ev = trace.step_events(rank, step)
            blocks = ev[ev["kind"] == K.SWEEP_BLOCK]
            got = list(zip(blocks["stage"].tolist(), blocks["microbatch"].tolist(), strict=True))
            assert got == planned, (rank, step)
            iteration = ev[ev["kind"] == K.STEP]
            assert iteration.size == 1 and iteration["value"][0] == dphi[step - 1]


def test_every_face_send_matches_a_receive(traced):
    _, trace, plan, dphi = traced
    messages = match_messages(trace)
    assert messages.unmatched_sends == 0 and messages.unmatched_recvs == 0
    per_sweep = sum((t.send_x >= 0) + (t.send_y >= 0) for ts in plan.tasks for t in ts)
    assert len(messages) == per_sweep * dphi.size
    tab = trace.table
    first = np.concatenate(([0], np.cumsum([len(e) for e in trace.events])))
    send = tab[first[messages.send_rank] + messages.send_index]
    recv = tab[first[messages.recv_rank] + messages.recv_index]
    assert set(send["kind"].tolist()) == {K.SEND} and set(recv["kind"].tolist()) == {K.RECV}
    assert np.array_equal(send["peer"], recv["rank"]) and np.array_equal(recv["peer"], send["rank"])
    assert np.array_equal(send["bytes"], recv["bytes"]) and send["bytes"].min() > 0
    assert np.array_equal(send["value"], recv["value"])  # the same face: 0 = x, 1 = y
    # the x face goes to the x neighbour (rank +-1 in a 2 x 2 grid), the y face to +-2
    assert set(np.abs(send["peer"] - send["rank"])[send["value"] == 0].tolist()) == {1}
    assert set(np.abs(send["peer"] - send["rank"])[send["value"] == 1].tolist()) == {2}


def test_checkpoints_and_reductions_are_recorded(traced):
    _, trace, _, dphi = traced
    tab = trace.table
    steps = sorted(set(tab["step"][tab["kind"] == K.CHECKPOINT].tolist()))
    expected = sorted({s for s in range(1, dphi.size + 1) if s % 4 == 0} | {dphi.size})
    assert steps == expected
    reductions = Counter(tab["rank"][tab["kind"] == K.ALLREDUCE].tolist())
    assert set(reductions.values()) == {dphi.size + 2}  # one allmax per iteration, 2 sums


def test_trace_tools_read_a_sweep_trace(traced):
    out, trace, _, dphi = traced
    path = str(out / "trace.h5")
    s = run_cli(["trace", "summary", path])
    assert s.returncode == 0, s.output
    assert f"4 ranks, step(s) 1..{dphi.size} ({dphi.size} recorded)" in s.stdout
    matched = len(match_messages(trace))
    assert f"messages: {matched} matched, 0 unmatched sends, 0 unmatched receives" in s.stdout
    e = run_cli(["trace", "export", path, "--chrome", str(out / "t.json")])
    assert e.returncode == 0, e.output
    events = json.loads((out / "t.json").read_text())["traceEvents"]
    assert {ev["ph"] for ev in events} >= {"X", "M", "s", "f"}
    names = {ev["args"]["name"] for ev in events if ev["name"] == "process_name"}
    assert any(n.startswith("rank 3 (x 1, y 1)") for n in names), names
    p = run_cli(["trace", "plot", path, "--png", str(out / "t.png")])
    assert p.returncode == 0, p.output
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
