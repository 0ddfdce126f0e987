"""Recorder + clock offsets + write_trace on 4 real MPI ranks (mpiexec, bounded by timeouts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_environ, mpiexec_command

from hpcpipe.analysis.messages import match_messages
from hpcpipe.io.trace import EventKind, read_trace

pytestmark = pytest.mark.mpi

DRIVER = Path(__file__).resolve().parent / "trace_mpi_driver.py"
RANKS, STEPS, MICROBATCHES = 4, 3, 4


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace_mpi")
    cmd = [*mpiexec_command(), "-n", str(RANKS), sys.executable, str(DRIVER), str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=clean_environ()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    return out, report


def test_every_rank_is_written_with_its_events(written):
    out, report = written
    assert report["grown"] >= 2  # capacity 4 could not hold a rank's events
    for name, samples in (("gather.h5", 2), ("shard.h5", 3)):
        tr = read_trace(out / name)
        assert tr.num_ranks == RANKS and tr.steps == tuple(range(STEPS))
        assert tr.attrs["workload"] == "trace-test"
        for w in range(RANKS):
            ev = tr.events[w]
            pos = RANKS - 1 - w  # the driver's chain runs on reversed world ranks
            per_step = MICROBATCHES * (1 + (pos > 0) + (pos < RANKS - 1)) + 1
            assert ev.size == per_step * STEPS, (name, w)
            assert np.all(ev["t_end"] >= ev["t_start"])
            step_ev = ev[ev["kind"] == EventKind.STEP]
            assert step_ev.size == STEPS and np.all(step_ev["bytes"] == 1 << 20)
            assert tr.clock[w].size == samples
        assert report["events"] == tr.events[0].size


def test_both_writers_store_the_same_events(written):
    out, _ = written
    a, b = read_trace(out / "gather.h5"), read_trace(out / "shard.h5")
    for w in range(RANKS):
        for field in ("kind", "stage", "microbatch", "peer", "bytes", "step"):
            np.testing.assert_array_equal(a.events[w][field], b.events[w][field])


def test_clock_offsets_are_within_half_a_round_trip(written):
    out, _ = written
    tr = read_trace(out / "shard.h5")
    assert np.all(tr.clock[0]["offset_ns"] == 0)
    for w in range(1, RANKS):
        c = tr.clock[w]
        assert np.all(c["rtt_ns"] > 0)
        # one node shares one monotonic clock: the true offset is 0, the error <= rtt / 2
        assert np.all(np.abs(c["offset_ns"]) <= c["rtt_ns"] // 2 + 1), c


def test_messages_match_and_respect_causality(written):
    out, _ = written
    tr = read_trace(out / "gather.h5")
    msgs = match_messages(tr)
    assert len(msgs) == STEPS * MICROBATCHES * (RANKS - 1)
    assert msgs.unmatched_sends == msgs.unmatched_recvs == 0
    for k in range(len(msgs)):
        send = tr.events[msgs.send_rank[k]][msgs.send_index[k]]
        recv = tr.events[msgs.recv_rank[k]][msgs.recv_index[k]]
        assert msgs.send_rank[k] == recv["peer"] and msgs.recv_rank[k] == send["peer"]
        assert recv["t_end"] >= send["t_start"]


def test_a_failed_write_raises_everywhere_and_leaves_nothing(written):
    out, report = written
    assert report["failed_everywhere"]
    leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert leftovers == []
