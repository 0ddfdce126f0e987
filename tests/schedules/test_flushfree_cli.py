"""`hpcpipe plan --flush-free`: the deck's schedule as a stream, and the errors that name a key."""

from __future__ import annotations

import re

import pytest
from conftest import INPUTS

DECK = str(INPUTS / "train_tiny.toml")
PP4 = ["--world", "4", "--set", "topology.pp=4", "--set", "pipeline.schedule=1f1b"]


def test_2bw_prints_versions_delay_and_a_steady_state_above_the_flushed_step(cli, tmp_path):
    png = tmp_path / "stream.png"
    r = cli(["plan", DECK, *PP4, "--set", "pipeline.microbatches=8", "--flush-free", "2bw",
             "--png", str(png)])  # fmt: skip
    assert r.returncode == 0, r.output
    assert "weight versions held per stage" in r.stdout
    versions = re.search(r"microbatches read\): \[([\d, ]+)\]", r.stdout).group(1)
    assert [int(v) for v in versions.split(",")] == [2, 2, 2, 1]
    found = re.search(r"steady state: ([\d.]+) of the no-bubble bound.*m=8: ([\d.]+)", r.stdout)
    stream, flushed = float(found.group(1)), float(found.group(2))
    assert stream >= 0.97 and flushed < stream
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_stash_keeps_a_version_per_microbatch_in_flight(cli):
    r = cli(["plan", DECK, *PP4, "--flush-free", "stash"])
    assert r.returncode == 0, r.output
    assert "held per stage (the newest and those in-flight microbatches read): [4, 3, 2, 1]" in (
        r.stdout
    )


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["--set", "pipeline.microbatches=2"], "pipeline.microbatches = 2: 1f1b without a flush"),
        (["--set", "pipeline.schedule=auto"], "pipeline.schedule = 'auto': --flush-free streams"),
        (["--compare"], "--compare: compares flushed steps"),
        (["--csv", "x.csv"], "--csv: writes a flushed step's schedule"),
    ],
)
def test_what_cannot_be_streamed_exits_2_naming_the_key(cli, extra, key):
    r = cli(["plan", DECK, *PP4, *extra, "--flush-free", "2bw"])
    assert r.returncode == 2, r.output
    assert key in r.stderr


def test_a_sweep_deck_has_no_pipeline_to_stream(cli):
    r = cli(["plan", str(INPUTS / "sweep_tiny.toml"), "--flush-free", "2bw"])
    assert r.returncode == 2 and "--flush-free: compares pipeline schedules" in r.stderr
