"""A traced 4-rank pipeline run: the trace holds exactly the schedule, and every tool reads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcpipe.analysis import match_messages
from hpcpipe.io.trace import EventKind, read_trace

pytestmark = pytest.mark.mpi

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "train_tiny.toml")


@pytest.mark.parametrize(("schedule", "dp"), [("zb-v", 1), ("1f1b", 2)])
def test_trace_of_real_run(mpirun, cli, tmp_path, schedule, dp):
    pp = 4 // dp
    r = mpirun(
        4,
        [
            "run",
            DECK,
            "--set",
            f"run.output={tmp_path}",
            "--set",
            f"topology.pp={pp}",
            "--set",
            f"topology.dp={dp}",
            "--set",
            f"pipeline.schedule={schedule}",
            "--set",
            "trace.enabled=true",
            "--set",
            "pipeline.microbatches=4",
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.output
    trace = read_trace(tmp_path / "trace.h5")
    assert len(trace.events) == 4
    for w in range(4):
        expected = trace.schedule.rank_strings(trace.pipeline_rank(w))
        for step in trace.steps:
            # exactly the schedule's actions, in the schedule's order, on every rank and step
            assert trace.rank_actions(w, step) == expected
    messages = match_messages(trace)
    assert messages.unmatched_sends == 0 and messages.unmatched_recvs == 0
    assert len(messages) > 0
    # each stage's gradient reduction: one event per step from its last W to its completion
    for w in range(4):
        ev = trace.events[w]
        red = ev[ev["kind"] == EventKind.ALLREDUCE]
        stages = trace.schedule.stages_of_rank[trace.pipeline_rank(w)]
        assert red.size == (len(stages) * len(trace.steps) if dp > 1 else 0), w
        for step in trace.steps:
            mine = ev[ev["step"] == step]
            for row in red[red["step"] == step]:
                w = mine[
                    np.isin(mine["kind"], [EventKind.W, EventKind.BW])
                    & (mine["stage"] == row["stage"])
                ]
                last = w[np.argmax(w["t_start"])]  # started at the end of its stage's last W
                assert last["t_start"] <= row["t_start"] <= last["t_end"] <= row["t_end"]
                assert row["bytes"] > 0

    s = cli(["trace", "summary", str(tmp_path / "trace.h5")])
    assert s.returncode == 0, s.output
    assert "pipeline bubble: measured" in s.stdout and "0 unmatched sends" in s.stdout
    assert ("gradient reductions: in flight" in s.stdout) == (dp > 1), s.stdout
    e = cli(["trace", "export", str(tmp_path / "trace.h5"), "--chrome", str(tmp_path / "t.json")])
    assert e.returncode == 0, e.output
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {ev["ph"] for ev in events} >= {"X", "M", "s", "f"}
    p = cli(["trace", "plot", str(tmp_path / "trace.h5"), "--png", str(tmp_path / "t.png")])
    assert p.returncode == 0, p.output
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
