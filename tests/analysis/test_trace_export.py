"""Chrome Trace Event Format export (checked structurally) and the timeline PNG."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np
import pytest
from trace_synth import V_SHAPE, one_f_one_b, write_synthetic

from hpcpipe.analysis import to_chrome, write_chrome
from hpcpipe.io.trace import EventKind, read_trace
from hpcpipe.schedules.simulate import CostModel
from hpcpipe.topology import RankMap

COSTS = CostModel(t_f=1000, t_b=1200, t_w=800, comm_latency=250)


@pytest.fixture
def trace(tmp_path):
    rankmap = RankMap.build(2, 2, pp=2, dp=1)
    from hpcpipe.io.trace import topology_metadata

    path, _ = write_synthetic(
        tmp_path / "v.h5", V_SHAPE, COSTS, steps=2, topology=topology_metadata(rankmap)
    )
    return read_trace(path)


def _check_structure(doc: dict, trace) -> list[dict]:
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in {"X", "M", "s", "f"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    xs = [e for e in events if e["ph"] == "X"]
    for e in xs:
        for key in ("name", "ts", "dur", "pid", "tid"):
            assert key in e, e
        assert isinstance(e["ts"], float | int) and e["dur"] >= 0
    names = {(e["pid"], e["name"]) for e in events if e["ph"] == "M"}
    for r in range(trace.num_ranks):
        assert (r, "process_name") in names and (r, "thread_name") in names
    flows = defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[e["id"]].append(e)
    for fid, pair in flows.items():
        assert sorted(e["ph"] for e in pair) == ["f", "s"], fid
        assert len({(e["cat"], e["name"]) for e in pair}) == 1
    # complete events on one thread must nest properly (Perfetto's rule)
    by_thread = defaultdict(list)
    for e in xs:
        by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for a, b in spans:
            while stack and stack[-1] <= a + 1e-9:
                stack.pop()
            assert not stack or b <= stack[-1] + 1e-9, (a, b, stack[-1])
            stack.append(b)
    return xs


def test_chrome_json_is_structurally_valid(trace, tmp_path):
    out = tmp_path / "t.json"
    n = write_chrome(trace, out)
    doc = json.loads(out.read_text())
    assert len(doc["traceEvents"]) == n
    xs = _check_structure(doc, trace)
    assert len(xs) == sum(len(e) for e in trace.events)
    sends = sum(
        int(np.isin(e["kind"], [EventKind.SEND_F, EventKind.SEND_B]).sum()) for e in trace.events
    )
    assert Counter(e["ph"] for e in doc["traceEvents"])["s"] == sends > 0
    names = {e["name"] for e in xs}
    assert {"0F0", "3B1", "2W0", "0SEND_F0", "1RECV_F1", "3SEND_B0", "step"} <= names
    labels = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert labels[0].startswith("rank 0 (pp 0, dp 0")
    first = min(e["ts"] for e in xs)
    assert first == 0.0
    f0 = next(e for e in xs if e["name"] == "0F0" and e["args"]["step"] == 0)
    assert f0["dur"] == pytest.approx(1.0) and f0["cat"] == "compute" and f0["tid"] == 0


def test_chrome_step_filter(trace):
    doc = to_chrome(trace, steps=[1])
    xs = _check_structure(doc, trace)
    assert {e["args"]["step"] for e in xs} == {1}
    with pytest.raises(ValueError, match="steps"):
        to_chrome(trace, steps=[7])


def test_timeline_png_is_written(trace, tmp_path):
    from hpcpipe.analysis.plots import plot_timeline

    out = plot_timeline(trace, tmp_path / "v.png", arrows=True)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    other = plot_timeline(trace, tmp_path / "s0.png", step=0, title="first step")
    assert other.stat().st_size > 10_000
    with pytest.raises(ValueError, match="step 5"):
        plot_timeline(trace, tmp_path / "x.png", step=5)


def test_timeline_of_many_ranks(tmp_path):
    from hpcpipe.analysis.plots import plot_timeline

    path, _ = write_synthetic(tmp_path / "big.h5", one_f_one_b(50, 2), CostModel())
    out = plot_timeline(read_trace(path), tmp_path / "big.png")
    assert out.stat().st_size > 10_000
