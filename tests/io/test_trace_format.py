"""The HDF5 trace format: round trip, metadata, clock alignment, and refusal of bad files."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpcpipe.io.trace import (
    EVENT_DTYPE,
    FORMAT_NAME,
    FORMAT_VERSION,
    ClockSample,
    EventKind,
    Recorder,
    TraceFormatError,
    read_trace,
    save_trace,
    topology_metadata,
)
from hpcpipe.schedules.ir import Schedule, to_csv
from hpcpipe.topology import RankMap

SCHED = Schedule.from_actions([["0F0", "0BW0"], ["1F0", "1BW0"]], name="two")


def _events(rank: int, n: int = 4, base: int = 0) -> np.ndarray:
    rec = Recorder(rank, capacity=2)
    for i in range(n):
        rec.begin_step(i // 2)
        rec.record(EventKind.F, rank, i, base + 10 * i, base + 10 * i + 5, peer=rank)
    return np.array(rec.events)


def _write(path, events, meta=None, **kw):
    return save_trace(path, events, meta or {"schedule": SCHED}, **kw)


def test_round_trip_keeps_events_and_metadata(tmp_path):
    rankmap = RankMap.build(4, 2, pp=2, dp=2, order="dp,ep,pp")
    meta = {
        "schedule": SCHED,
        "topology": rankmap,
        "config": "[run]\nsteps = 2\n",
        "workload": "train",
        "extra": {"a": [1, 2]},
    }
    path = _write(tmp_path / "t.h5", [_events(r) for r in range(4)], meta)
    tr = read_trace(path)
    assert tr.num_ranks == 4 and tr.version == FORMAT_VERSION and tr.steps == (0, 1)
    assert tr.attrs["format"] == FORMAT_NAME and tr.attrs["workload"] == "train"
    assert json.loads(tr.attrs["extra"]) == {"a": [1, 2]}
    assert tr.config == "[run]\nsteps = 2\n"
    assert tr.schedule.rank_strings(1) == ["1F0", "1BW0"] and tr.schedule.name == "two"
    assert tr.topology == topology_metadata(rankmap)
    assert [tr.pipeline_rank(r) for r in range(4)] == [rankmap.coords(r)["pp"] for r in range(4)]
    for r in range(4):
        np.testing.assert_array_equal(tr.events[r]["microbatch"], np.arange(4))
        np.testing.assert_array_equal(tr.events[r]["t_end"] - tr.events[r]["t_start"], 5)
    assert tr.rank_actions(2, 1) == ["2F2", "2F3"]
    assert tr.table.size == 16 and set(tr.table["rank"].tolist()) == {0, 1, 2, 3}


def test_reserved_metadata_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        _write(tmp_path / "t.h5", [_events(0)], {"version": 7})
    assert not (tmp_path / "t.h5").exists()


def test_offsets_align_ranks_and_drift_is_interpolated(tmp_path):
    # rank 1's clock is 5 s ahead at local time 0 and gains 1 us per second after that
    true = [_events(0, base=10**9), _events(1, base=10**9)]
    raw1 = true[1].copy()
    for f in ("t_start", "t_end"):
        raw1[f] = true[1][f] + 5 * 10**9 + true[1][f] // 10**6
    clocks = [
        [ClockSample(0, 0, 100)],
        [ClockSample(5 * 10**9, 5 * 10**9, 100), ClockSample(7 * 10**9, 5 * 10**9 + 2000, 100)],
    ]
    tr = read_trace(_write(tmp_path / "t.h5", [true[0], raw1], clocks=clocks))
    assert tr.aligned
    for f in ("t_start", "t_end"):
        np.testing.assert_allclose(tr.events[1][f], tr.events[0][f], atol=2)
    unaligned = read_trace(_write(tmp_path / "u.h5", [true[0], raw1]))
    assert not unaligned.aligned
    assert unaligned.events[1]["t_start"][0] - unaligned.events[0]["t_start"][0] > 10**9


def test_an_empty_rank_is_fine(tmp_path):
    tr = read_trace(_write(tmp_path / "t.h5", [_events(0), np.zeros(0, EVENT_DTYPE)]))
    assert tr.num_ranks == 2 and tr.events[1].size == 0 and tr.rank_actions(1, 0) == []


# ---------------------------------------------------------------- bad files


def _valid(tmp_path):
    return _write(tmp_path / "good.h5", [_events(0), _events(1)])


def _expect(path, *fragments):
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    for frag in fragments:
        assert frag in str(info.value), str(info.value)
    assert str(path) in str(info.value)
    return info.value


def test_missing_and_directory(tmp_path):
    _expect(tmp_path / "nope.h5", "no such file")
    _expect(tmp_path, "is a directory")


def test_not_hdf5(tmp_path):
    bad = tmp_path / "text.h5"
    bad.write_text("step,loss\n1,2.0\n")
    _expect(bad, "is not an HDF5 file")


def test_truncated_file(tmp_path):
    good = _valid(tmp_path)
    data = good.read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(data[: len(data) // 2])
    err = _expect(cut)
    assert "HDF5" in err.why or "damaged" in err.why


def test_foreign_hdf5_without_format(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(3))
    _expect(path, "not an hpcpipe trace", "no 'format' attribute")


def test_other_hpcpipe_file(tmp_path):
    path = tmp_path / "metrics.h5"
    with h5py.File(path, "w") as f:
        f.attrs["format"], f.attrs["version"] = "hpcpipe-metrics", 1
    _expect(path, "'hpcpipe-metrics' file, not an hpcpipe trace")


def test_newer_version(tmp_path):
    path = _valid(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["version"] = FORMAT_VERSION + 1
    _expect(path, f"version {FORMAT_VERSION + 1}", "upgrade hpcpipe")


def test_missing_rank(tmp_path):
    path = _valid(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["ranks"] = 3
    _expect(path, "incomplete", "ranks/2/events")


def test_wrong_event_table(tmp_path):
    path = _valid(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["ranks/1/events"]
        f["ranks/1"].create_dataset("events", data=np.arange(4.0))
    _expect(path, "ranks/1/events is not an event table")


def test_damaged_schedule_attribute(tmp_path):
    path = _valid(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["schedule"] = to_csv(SCHED).replace("0BW0", "0ZZ0")
    tr = read_trace(path)
    with pytest.raises(TraceFormatError, match="schedule"):
        _ = tr.schedule
