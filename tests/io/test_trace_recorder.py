"""Recorder, event kinds and the [trace] deck section: pure, one process."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.config import ConfigError, load_config
from hpcpipe.io.trace import EVENT_DTYPE, EventKind, Recorder
from hpcpipe.io.trace_config import TraceConfig
from hpcpipe.schedules.ir import Kind


def test_event_kinds_share_the_schedule_codes():
    for k in Kind:
        assert EventKind(int(k)).name == k.name
    assert len({int(k) for k in EventKind}) == len(EventKind)


def test_record_keeps_every_field_in_order():
    rec = Recorder(3, capacity=8)
    rec.begin_step(5)
    rec.record(EventKind.SEND_F, 2, 7, 100, 250, nbytes=4096, peer=4, value=1.5)
    rec.record(EventKind.F, 1, 0, 300, 400)
    ev = rec.events
    assert len(rec) == 2 and ev.dtype == EVENT_DTYPE
    first = ev[0]
    assert (first["step"], first["kind"], first["stage"], first["microbatch"]) == (5, 4, 2, 7)
    assert (first["t_start"], first["t_end"], first["bytes"], first["peer"]) == (100, 250, 4096, 4)
    assert first["value"] == 1.5
    assert (ev[1]["peer"], ev[1]["bytes"], ev[1]["value"]) == (-1, 0, 0.0)


def test_full_buffer_doubles_and_drops_nothing():
    rec = Recorder(0, capacity=4)
    for i in range(37):
        rec.record(EventKind.F, 0, i, i, i + 1)
    assert len(rec) == 37
    assert rec.capacity == 64 and rec.grown == 4
    np.testing.assert_array_equal(rec.events["microbatch"], np.arange(37))
    rec.clear()
    assert len(rec) == 0 and rec.capacity == 64


def test_disabled_recorder_never_turns_on_and_allocates_nothing():
    rec = Recorder(0, capacity=1 << 20, enabled=False)
    assert not rec.enabled and rec.capacity == 0
    assert rec.begin_step(0) is False and not rec.enabled


def test_step_selection_switches_enabled():
    rec = Recorder(0, steps=[1, 3])
    assert [rec.begin_step(s) for s in range(5)] == [False, True, False, True, False]
    assert rec.step == 4


def test_now_is_the_nanosecond_monotonic_clock():
    a = Recorder.now()
    b = Recorder.now()
    assert isinstance(a, int) and b >= a


def test_bad_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        Recorder(0, capacity=0)


def test_trace_section_from_a_deck(tmp_path):
    cfg = load_config(None, ["trace.enabled=true", "trace.steps=[2, 3]", "trace.capacity=128"])
    tc = cfg.trace
    assert isinstance(tc, TraceConfig)
    assert tc.steps == (2, 3) and tc.capacity == 128
    assert tc.resolve_path("runs/x") == tc.resolve_path("runs/x/") and str(
        tc.resolve_path("runs/x")
    ).endswith("trace.h5")
    rec = tc.recorder(1)
    assert rec.rank == 1 and rec.capacity == 128
    assert [rec.begin_step(s) for s in range(4)] == [False, False, True, True]
    off = load_config(None).trace.recorder(0)
    assert not off.enabled and not off.begin_step(0)
    explicit = TraceConfig(path=str(tmp_path / "t.h5"))
    assert explicit.resolve_path("ignored") == tmp_path / "t.h5"


@pytest.mark.parametrize(
    "override,key",
    [
        ("trace.capacity=0", "trace.capacity"),
        ("trace.enabled=1", "trace.enabled"),
        ("trace.steps=[-1]", "trace.steps"),
        ("trace.bogus=1", "trace.bogus"),
    ],
)
def test_trace_section_rejects_bad_values(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_float_times_are_refused_loudly():
    import struct

    rec = Recorder(0, capacity=4)
    with pytest.raises(struct.error):
        rec.record(EventKind.F, 0, 0, 1.5, 2.5)  # seconds from perf_counter(): wrong clock
    rec.record(EventKind.F, 0, 0, np.int64(7), np.int64(9), nbytes=np.int64(3))
    assert len(rec) == 1 and rec.events["t_end"][0] == 9


def test_action_peers_of_a_lowered_schedule():
    from hpcpipe.io.trace import action_peers
    from hpcpipe.schedules.ir import Schedule

    sched = Schedule.from_actions(
        [
            ["0F0", "0SEND_F0", "0RECV_B0", "0BW0"],
            ["1RECV_F0", "1F0", "1BW0", "1SEND_B0"],
        ]
    )
    assert action_peers(sched, 0).tolist() == [-1, 1, 1, -1]
    assert action_peers(sched, 1).tolist() == [0, -1, -1, 0]
    assert action_peers(sched, 1, to_world=[5, 7]).tolist() == [5, -1, -1, 5]
