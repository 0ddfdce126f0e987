"""Bad [async] decks exit 2 naming the key, before any rank starts (`run --dry-run`)."""

from __future__ import annotations

from pathlib import Path

import pytest

DECK = str(Path(__file__).resolve().parents[2] / "inputs" / "train_tiny.toml")
LOCAL = ["--set", "async.mode=local"]


@pytest.mark.parametrize(
    ("extra", "key", "why"),
    [
        (
            ["--set", "async.average_every=4"],
            "async.average_every",
            "read with async.mode = 'local'",
        ),
        (["--set", "async.delay=1"], "async.delay", "read with async.mode = 'local'"),
        ([*LOCAL, "--set", "async.versions=2"], "async.versions", "async.mode = 'stash' only"),
        ([*LOCAL, "--set", "async.delay=2"], "async.delay", "one of"),
        ([*LOCAL, "--set", "async.average_every=0"], "async.average_every", ">= 1"),
        (
            [
                *LOCAL,
                "--set",
                "async.average_every=4",
                "--set",
                "checkpoint.every=6",
                "--set",
                "run.steps=12",
            ],
            "checkpoint.every",
            "not a multiple of async.average_every = 4",
        ),
        ([*LOCAL, "--set", "replan.enabled=true"], "replan.enabled", "not re-planned"),
    ],
)
def test_bad_async_keys_exit_2_naming_the_key(cli, extra, key, why):
    r = cli(["run", DECK, "--dry-run", "--world", "4", *extra])
    assert r.returncode == 2, r.output
    assert key in r.stderr and why in r.stderr, r.stderr


def test_a_good_local_deck_passes_the_dry_run(cli):
    r = cli(["run", DECK, "--dry-run", "--world", "4", *LOCAL, "--set", "async.delay=1"])
    assert r.returncode == 0, r.output


@pytest.mark.parametrize(
    "extra",
    [
        [*LOCAL, "--set", "async.average_every=4"],
        ["--set", "async.mode=2bw", "--set", "async.flush_every=4", "--set", "topology.pp=4"],
    ],
    ids=["local", "2bw"],
)
def test_a_checkpoint_at_the_runs_end_only_needs_no_cadence(cli, extra):
    """checkpoint.every >= run.steps writes the last step's checkpoint alone, which always
    ends a round and drains a stream: no multiple of the cadence is asked for."""
    sets = ["--set", "run.steps=6", "--set", "checkpoint.every=6"]
    r = cli(["run", DECK, "--dry-run", "--world", "4", *extra, *sets])
    assert r.returncode == 0, r.output
