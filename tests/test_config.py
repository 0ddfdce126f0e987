"""Input decks: valid decks load into frozen sections; bad input names the file and key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpcpipe.cli import main
from hpcpipe.config import ConfigError, dump_toml, load_config

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    deck = tmp_path / "deck.toml"
    deck.write_text(text)
    return deck


def test_every_shipped_deck_loads():
    decks = sorted((ROOT / "inputs").glob("*.toml"))
    assert decks, "inputs/ holds no decks"
    for deck in decks:
        load_config(deck)


def test_defaults_and_frozen_sections():
    cfg = load_config(None)
    assert cfg.run.workload == "train" and cfg.train.verify
    assert cfg.topology.pp == 2 and cfg.pipeline.schedule == "zb-v"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.steps = 3  # type: ignore[misc]


def test_overrides_use_toml_values(tmp_path):
    deck = write(tmp_path, "[topology]\npp = 2\n")
    cfg = load_config(
        deck,
        [
            "topology.pp=4",
            "run.output=runs/x",
            "topology.intra_node=['ep','dp']",
            "device.kind=cpu",
        ],
    )
    assert cfg.topology.pp == 4
    assert cfg.run.output == "runs/x"
    assert cfg.topology.intra_node == ("ep", "dp")


def test_resolved_deck_round_trips(tmp_path):
    cfg = load_config(ROOT / "inputs" / "topology_tiny.toml")
    again = load_config(write(tmp_path, dump_toml(cfg)))
    assert again.as_dict() == cfg.as_dict()


BAD_DECKS = [
    # (deck text, overrides, substrings expected in the message)
    ("[topology]\npp = 'two'\n", [], ["topology.pp = 'two' must be an integer"]),
    ("[topology]\npp = 0\n", [], ["topology.pp = 0 must be >= 1"]),
    ("[topology]\nppp = 2\n", [], ["topology.ppp is not a known key", "accepts: cross_node"]),
    ("[topolgy]\npp = 2\n", [], ["topolgy is not a known section", "[topology]"]),
    ("[device]\nkind = 'tpu'\n", [], ["device.kind = 'tpu' is not one of 'cpu', 'cuda'"]),
    ("[device]\ncuda_aware = 'maybe'\n", [], ["device.cuda_aware = 'maybe'"]),
    ("[topology]\norder = 'dp,pp'\n", [], ["topology.order", "must list each of pp,dp,ep"]),
    ("[topology]\ndp = 4\nep = 3\n", [], ["topology.ep", "must divide dp = 4"]),
    ("[run]\nsteps = -1\n", [], ["run.steps = -1 must be >= 1"]),
    ("[run]\nworkload = 'dance'\n", [], ["run.workload = 'dance' is not one of"]),
    ("[run]\nsteps = 1.5\n", [], ["run.steps = 1.5 must be an integer"]),
    ("[topology]\nintra_node = 'ep'\n", [], ["topology.intra_node = 'ep' must be a list"]),
    ("[topology]\nintra_node = ['xp']\n", [], ["topology.intra_node", "'xp' is not one of"]),
    ("[run\nsteps = 1\n", [], ["is not valid TOML"]),
    ("run = 3\n", [], ["run = 3 must be a table"]),
    ("", ["topology.pp"], ["must look like section.key=value"]),
    ("", ["pp=2"], ["must be section.key"]),
    ("", ["topology.pp=x"], ["topology.pp = 'x' must be an integer", "(with --set)"]),
]


@pytest.mark.parametrize(("text", "overrides", "expected"), BAD_DECKS)
def test_bad_deck_names_file_and_key(tmp_path, capsys, text, overrides, expected):
    deck = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(deck, overrides)
    message = str(info.value)
    for piece in expected:
        assert piece in message, message
    # and through the CLI: exit code 2, one ERROR line, no traceback
    args = ["plan", str(deck), "--world", "4"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: ") and "Traceback" not in err
    assert expected[0] in err


@pytest.mark.parametrize("path", ["does/not/exist.toml", "inputs"])
def test_missing_or_directory_deck(capsys, path):
    assert main(["plan", str(ROOT / path), "--world", "4"]) == 2
    err = capsys.readouterr().err
    assert str(ROOT / path) in err


def test_unreadable_deck(tmp_path, capsys):
    deck = write(tmp_path, "[run]\n")
    deck.write_bytes(b"\xff\xfe[run]\n")
    assert main(["plan", str(deck), "--world", "2"]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_plan_world_that_does_not_fit(capsys):
    assert main(["plan", str(ROOT / "inputs" / "topology_tiny.toml"), "--world", "6"]) == 2
    err = capsys.readouterr().err
    assert "topology.dp = 4" in err and "--set topology.dp=0" in err


def test_unknown_command_and_flag_exit_2():
    with pytest.raises(SystemExit) as info:
        main(["fly"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["plan", "--no-such-flag"])
    assert info.value.code == 2


def test_bad_deck_in_a_world_of_one_leaves_mpi_to_the_caller(capsys):
    """Rank 0 exits first after bad input in a multi-rank job (the ranks finalize MPI together
    first, guard.rank_zero_exits_first); in a world of one, such as this process, MPI stays
    usable: a CLI call must not end the MPI of whoever called it."""
    from mpi4py import MPI

    deck = str(ROOT / "inputs" / "topology_tiny.toml")
    assert main(["plan", deck, "--set", 'device.kind="tpu"']) == 2
    assert "device.kind = 'tpu' is not one of" in capsys.readouterr().err
    assert MPI.Is_initialized() and not MPI.Is_finalized()
    assert MPI.COMM_WORLD.allreduce(1) == 1
