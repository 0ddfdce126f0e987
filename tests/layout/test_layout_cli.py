"""`hpcpipe plan --search` as a user runs it: the table, the chosen deck, bad input."""

from __future__ import annotations

from conftest import INPUTS

from hpcpipe.config import load_config

DECK = str(INPUTS / "layout_moe_gpt32.toml")


def test_search_at_4096_ranks_explains_its_choice(cli):
    r = cli(["plan", DECK, "--search", "--world", "4096", "--top", "3"])
    assert r.returncode == 0, r.output
    out = r.stdout
    assert "layout search: world 4096 (512 node(s) of 8 ranks)" in out
    assert "left out:" in out and "memory" in out and "needs" in out
    rows = [line for line in out.splitlines() if line[:3].strip() in ("1", "2", "3")]
    assert len(rows) == 3
    assert "chosen: pp" in out and "--set pipeline.schedule=" in out


def test_the_written_deck_runs_the_chosen_layout(cli, tmp_path):
    chosen = tmp_path / "chosen.toml"
    r = cli(["plan", DECK, "--search", "--world", "512", "--write-deck", str(chosen)])
    assert r.returncode == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("chosen: "))
    cfg = load_config(chosen)
    topo, pipe = cfg.topology, cfg.pipeline
    label = (
        f"pp{topo.pp} dp{topo.dp} ep{topo.ep} [{topo.order}] {pipe.schedule}"
        + (f"(v={pipe.virtual_stages})" if pipe.virtual_stages else "")
        + f" m={pipe.microbatches};"
    )
    assert line.startswith(f"chosen: {label}")
    again = cli(["plan", str(chosen), "--world", "512"])
    assert again.returncode == 0, again.output
    assert f"world 512 = pp {topo.pp} x dp {topo.dp}" in again.stdout


def test_search_needs_a_world(cli):
    r = cli(["plan", DECK, "--search"])
    assert r.returncode == 2
    assert "--world" in r.stderr


def test_write_deck_needs_search(cli, tmp_path):
    r = cli(["plan", DECK, "--world", "8", "--write-deck", str(tmp_path / "x.toml")])
    assert r.returncode == 2
    assert "--write-deck" in r.stderr and "--search" in r.stderr


def test_bad_machine_key_exits_2_naming_it(cli):
    r = cli(["plan", DECK, "--search", "--world", "64", "--set", "machine.memory_gb=80"])
    assert r.returncode == 2
    assert "machine.memory_gb" in r.stderr and "memory_gib" in r.stderr


def test_a_sweep_deck_is_not_searched(cli):
    r = cli(["plan", str(INPUTS / "sweep_tiny.toml"), "--search", "--world", "4"])
    assert r.returncode == 2
    assert "run.workload" in r.stderr


def test_nothing_fits_says_so(cli):
    r = cli(["plan", DECK, "--search", "--world", "8", "--set", "machine.memory_gib=1"])
    assert r.returncode == 1, r.output
    assert "no layout fits" in r.stdout and "memory" in r.stdout


def test_a_searched_schedule_is_written_as_csv_beside_the_deck(cli, tmp_path):
    from hpcpipe.schedules.report import load_schedule

    deck = str(INPUTS / "layout_tiny.toml")
    chosen = tmp_path / "chosen.toml"
    r = cli(["plan", deck, "--search", "--world", "8", "--auto", "2", "--write-deck", str(chosen)])
    assert r.returncode == 0, r.output
    assert " auto " in r.stdout  # the searched schedule is in the table
    cfg = load_config(chosen)
    if "chosen: " in r.stdout and " auto m=" in r.stdout.split("chosen: ")[1].splitlines()[0]:
        assert cfg.pipeline.schedule == "csv"
        assert cfg.pipeline.schedule_csv == str(chosen.with_suffix(".schedule.csv"))
        sched = load_schedule(cfg.pipeline, cfg.topology.pp, str(chosen))
        assert sched.num_microbatches == cfg.pipeline.microbatches
    else:
        assert cfg.pipeline.schedule != "csv"


def test_ranks_per_node_flag_wins_over_the_machine_key(cli):
    tiny = str(INPUTS / "layout_tiny.toml")  # [machine] ranks_per_node = 4
    r = cli(["plan", tiny, "--search", "--world", "8", "--ranks-per-node", "8", "--top", "1"])
    assert r.returncode == 0, r.output
    assert "world 8 (1 node(s) of 8 ranks)" in r.stdout


def test_a_world_beyond_the_search_is_bad_input(cli):
    r = cli(["plan", DECK, "--search", "--world", str(1 << 40)])
    assert r.returncode == 2
    assert "--world" in r.stderr and "at most" in r.stderr


def test_cross_node_error_keeps_the_intra_node_dims_inside(cli):
    sets = ["--set", "topology.cross_node='error'", "--set", "topology.intra_node=['ep']"]
    r = cli(["plan", DECK, "--search", "--world", "4096", "--top", "3", *sets])
    assert r.returncode == 0, r.output
    assert "intra_node" in r.stdout
    table = r.stdout.split("across nodes\n", 1)[1].split("\n\n")[0]
    assert all("ep" not in line.split()[-1].split(",") for line in table.splitlines())
