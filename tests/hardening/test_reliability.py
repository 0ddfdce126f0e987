"""Reliability, round 2: nothing of the user's is ever deleted, every checkpoint is the one it
claims to be. One test (or more) per finding of the red-team pass, numbered as in the issue;
each failed on the code before the fix. Ctrl-C and closed pipes (finding 11) are in
test_interrupts.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import INPUTS, ROOT, clean_environ, mpiexec_command, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_bad_input import tmpfs

from hpcpipe.config import Config, dump_toml, load_config
from hpcpipe.io.checkpoint import ShardSpec, save_checkpoint, verify_checkpoint

TRAIN = str(INPUTS / "train_tiny.toml")
SWEEP = str(INPUTS / "sweep_tiny.toml")


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def train(mpirun, out: Path, *extra: str, n: int = 2, env: dict | None = None):
    args = ["run", TRAIN, *sets(f"run.output='{out}'", "topology.pp=2"), *extra]
    return mpirun(n, args, timeout=120, env=env)


def steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


# ---------------------------------------------------------------- 1: rotation owns its names


@pytest.mark.mpi
def test_1_rotation_deletes_only_the_protocols_own_debris(mpirun, tmp_path):
    mine = tmp_path / "checkpoints" / "results.tmp"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my results")
    r = train(mpirun, tmp_path, *sets("run.steps=3", "checkpoint.every=1", "checkpoint.keep=1"))
    assert r.returncode == 0, r.output
    assert (mine / "notes.txt").read_text() == "my results"
    assert steps(tmp_path) == ["step_000003"]  # the older steps went, the user's folder stays


# ---------------------------------------------------------------- 2: a disk that fills up

SAVE_BIG = """
import json, sys
import numpy as np
from mpi4py import MPI
from hpcpipe.io.checkpoint import CheckpointError, ShardSpec, save_checkpoint
comm = MPI.COMM_WORLD
root, n = sys.argv[1], int(sys.argv[2])
x = np.full(n, comm.rank, dtype=np.float64)
tensors = {"x": (ShardSpec("x", (n * comm.size,), x.dtype,
                           (slice(comm.rank * n, (comm.rank + 1) * n),)), x)}
try:
    save_checkpoint(comm, root, int(sys.argv[3]), tensors, writer=True, fsync=False)
    print(json.dumps({"rank": comm.rank, "ok": True}), flush=True)
except CheckpointError as exc:
    print(json.dumps({"rank": comm.rank, "ok": False, "error": str(exc)}), flush=True)
"""


@pytest.mark.mpi
def test_2_shards_that_only_overflow_together_are_refused_before_any_write(tmp_path):
    with tmpfs(tmp_path / "small", "1m") as mnt:
        root = mnt / "ckpt"

        def save(n: int, step: int) -> list[dict]:
            cmd = [*mpiexec_command(), "-n", "4", sys.executable, "-c", SAVE_BIG, str(root)]
            proc = subprocess.run(
                [*cmd, str(n), str(step)],
                cwd=ROOT,
                env=clean_environ(),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr  # no segfault, no abort
            decoder, text, found = json.JSONDecoder(), proc.stdout, []
            i = text.find("{")
            while i >= 0:  # one JSON object per rank, however the launcher joined the lines
                obj, end = decoder.raw_decode(text, i)
                found.append(obj)
                i = text.find("{", end)
            return found

        assert all(r["ok"] for r in save(1024, 1))  # 8 KiB per shard: fine
        # 300 KiB per rank: each shard alone fits the 1 MiB file system, the four do not
        results = save(300 * 1024 // 8, 2)
        assert len(results) == 4 and not any(r["ok"] for r in results), results
        assert all("No space left on device" in r["error"] for r in results), results
        assert "4 shard file(s) together" in results[0]["error"]
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
        assert verify_checkpoint(root / "step_000001") == []


# ---------------------------------------------------------------- 3: whose checkpoint is it


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 2-step run with a checkpoint after each step."""
    from conftest import run_mpi

    out = tmp_path_factory.mktemp("finished")
    r = train(run_mpi, out, *sets("run.steps=2", "checkpoint.every=1"))
    assert r.returncode == 0, r.output
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


@pytest.mark.mpi
def test_3_resume_refuses_a_checkpoint_of_another_run_and_names_the_override(
    mpirun, tmp_path, finished
):
    out = _copy(finished, tmp_path / "run")
    r = train(mpirun, out, "--resume", *sets("run.steps=4", "run.seed=99", "optim.lr=0.5"))
    assert r.returncode == 2, r.output
    assert "run.seed = 7 there, 99 here" in r.stderr and "optim.lr = 0.01 there" in r.stderr
    assert "--allow-change optim.lr --allow-change run.seed" in r.stderr
    assert steps(out) == ["step_000001", "step_000002"]  # nothing was written
    ok = train(
        mpirun,
        out,
        "--resume",
        "--allow-change",
        "run.seed",
        "--allow-change",
        "optim",
        *sets("run.steps=4", "run.seed=99", "optim.lr=0.5"),
    )
    assert ok.returncode == 0, ok.output
    assert "verify skipped" in ok.stdout and "step 4/4" in ok.stdout


@pytest.mark.mpi
def test_3_another_run_sharing_the_checkpoint_directory_is_refused(mpirun, tmp_path, finished):
    shared = _copy(finished / "checkpoints", tmp_path / "shared")
    r = train(mpirun, tmp_path / "other", *sets("run.steps=2", f"checkpoint.dir='{shared}'"))
    assert r.returncode == 2, r.output
    assert "already holds an earlier run" in r.stderr and "step_000002" in r.stderr
    assert sorted(p.name for p in shared.glob("step_*")) == ["step_000001", "step_000002"]


# ---------------------------------------------------------------- 4, 5: what the index says


@pytest.mark.parametrize("attr", ["optimizer_step", "data_position", "config"])
def test_4_an_edited_index_attribute_fails_verify_and_resume(tmp_path, finished, attr):
    out = _copy(finished, tmp_path / "run")
    step = out / "checkpoints" / "step_000002"
    with h5py.File(step / "index.h5", "r+") as f:
        value = f.attrs[attr]
        del f.attrs[attr]
        f.attrs[attr] = np.int64(1) if attr != "config" else value + b"\n# edited"
    r = run_cli(["ckpt", "verify", str(step)])
    assert r.returncode != 0 and "checksum mismatch" in r.stderr + r.stdout, r.output


@pytest.mark.mpi
def test_4_an_edited_attribute_refuses_the_resume(mpirun, tmp_path, finished):
    out = _copy(finished, tmp_path / "run")
    with h5py.File(out / "checkpoints" / "step_000002" / "index.h5", "r+") as f:
        f.attrs["optimizer_step"] = np.int64(1)
    r = train(mpirun, out, "--resume", *sets("run.steps=4"))
    assert r.returncode == 2 and "index checksum mismatch" in r.stderr, r.output
    assert "older checkpoints here: step_000001" in r.stderr  # finding 6: say what is left
    assert "--resume" in r.stderr and "step_000001" in r.stderr


def test_5_a_step_directory_must_be_named_for_its_step(tmp_path, finished):
    out = _copy(finished, tmp_path / "run")
    ckpts = out / "checkpoints"
    (ckpts / "step_000002").rename(ckpts / "step_000005")
    r = run_cli(["ckpt", "inspect", str(ckpts / "step_000005")])
    assert r.returncode == 2, r.output
    assert "named for step 5 but its index holds step 2" in r.stderr


# ---------------------------------------------------------------- 6: a broken `latest`


@pytest.mark.parametrize("how", ["missing", "loop", "outside", "garbage"])
def test_6_a_broken_latest_is_reported_and_the_newest_complete_step_used(tmp_path, finished, how):
    ckpts = _copy(finished, tmp_path / "run") / "checkpoints"
    latest = ckpts / "latest"
    latest.unlink()
    if how == "missing":
        latest.write_text("step_000009\n")
    elif how == "loop":
        latest.symlink_to("latest")
    elif how == "outside":
        (tmp_path / "elsewhere").write_text("step_000001\n")
        latest.symlink_to(tmp_path / "elsewhere")
    else:
        latest.write_bytes(b"\xff\xfe\x1b[2J")
    r = run_cli(["ckpt", "inspect", str(ckpts)])
    assert r.returncode == 0, r.output
    assert f"WARNING: {latest}" in r.stderr and "step_000002" in r.stderr, r.stderr
    assert "step_000002" in r.stdout.splitlines()[0]
    assert "\x1b" not in r.stderr  # finding 10: file bytes are escaped


@pytest.mark.mpi
def test_6_resume_says_when_it_does_not_follow_latest(mpirun, tmp_path, finished):
    out = _copy(finished, tmp_path / "run")
    (out / "checkpoints" / "latest").write_text("step_000009\n")
    r = train(mpirun, out, "--resume", *sets("run.steps=3"))
    assert r.returncode == 0, r.output
    assert "WARNING: --resume:" in r.stderr and "names 'step_000009'" in r.stderr
    assert "resumed from" in r.stdout and "step_000002 at step 2" in r.stdout


# ---------------------------------------------------------------- 7, 8, 9: bad decks, early


@pytest.mark.mpi
def test_7_a_directory_as_trace_path_is_refused_before_any_work(mpirun, tmp_path):
    (tmp_path / "traces").mkdir()
    r = train(
        mpirun,
        tmp_path / "run",
        *sets("trace.enabled=true", f"trace.path='{tmp_path / 'traces'}'", "run.steps=2"),
    )
    assert r.returncode == 2, r.output
    assert "trace.path" in r.stderr and "is a directory" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists() and list((tmp_path / "traces").iterdir()) == []


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        ("sweep.tolerance=0.0", "sweep.tolerance", "can never be reached"),
        (
            "sweep.sigma_s=[[[0.9, 0.3], [0.0, 0.9]], [[0.1, 0.1], [0.0, 0.5]]]",
            "sweep.sigma_s",
            "scattering ratio c = 1.2 > 1",
        ),
    ],
    ids=["tolerance-0", "scattering-above-total"],
)
def test_8_sweep_decks_that_cannot_converge_are_refused_at_once(change, key, words):
    r = run_cli(["run", SWEEP, "--dry-run", "--set", change])
    assert r.returncode == 2 and key in r.stderr and words in r.stderr, r.output


def test_9_an_empty_run_output_is_refused():
    r = run_cli(["run", TRAIN, "--dry-run", "--world", "2", "--set", 'run.output=""'])
    assert r.returncode == 2 and "run.output" in r.stderr and "working directory" in r.stderr


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_9_any_string_value_survives_the_saved_config(text):
    import dataclasses
    import types

    config = load_config(TRAIN, [])
    run = dataclasses.replace(config.run, output=text)
    changed = Config(
        source=config.source, sections=types.MappingProxyType({**config.sections, "run": run})
    )
    saved = tomllib.loads(dump_toml(changed))
    assert saved["run"]["output"] == text


# ---------------------------------------------------------------- 10: names from files


def test_10_names_from_a_checkpoint_are_escaped_when_printed(tmp_path):
    name = "w\x1b]0;owned\x07\x1b[31m"
    x = np.zeros(3)
    save_checkpoint(
        None,
        tmp_path,
        1,
        {"t": (ShardSpec(name, (3,), x.dtype), x)},
        writer=True,
        fsync=False,
        attrs={"note\x1b[2J": "x\x1b[1mbold"},
    )
    for verb in ("inspect", "verify"):
        r = run_cli(["ckpt", verb, str(tmp_path)])
        assert r.returncode == 0, r.output
        assert "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout + r.stderr
    inspect = run_cli(["ckpt", "inspect", str(tmp_path)]).stdout
    assert "w\\x1b]0;owned\\x07\\x1b[31m" in inspect


# ---------------------------------------------------------------- 12: rerun with the same output


@pytest.mark.mpi
def test_12_a_rerun_never_mixes_with_an_earlier_run(mpirun, tmp_path, finished):
    out = _copy(finished, tmp_path / "run")
    (out / "trace.h5").write_bytes(b"an old trace")  # what an earlier traced run left
    (out / "my_notes.txt").write_text("keep me")
    refused = train(mpirun, out, *sets("run.steps=2"))
    assert refused.returncode == 2, refused.output
    assert "already holds an earlier run" in refused.stderr and "--overwrite" in refused.stderr
    assert (out / "trace.h5").read_bytes() == b"an old trace"
    fresh = train(mpirun, out, "--overwrite", *sets("run.steps=2"))
    assert fresh.returncode == 0, fresh.output
    assert not (out / "trace.h5").exists() and not (out / "checkpoints").exists()
    assert (out / "my_notes.txt").read_text() == "keep me"
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    both = train(mpirun, out, "--overwrite", "--resume", *sets("run.steps=2"))
    assert both.returncode == 2 and "contradict" in both.stderr


def test_the_run_files_policy_lists_what_every_workload_writes():
    """Whatever the code writes into run.output must be a name the policy knows (else a rerun
    would leave it behind): every `output / "name"` in hpcpipe/ is checked."""
    import re

    from hpcpipe.rundir import RUN_FILES

    pattern = re.compile(r'output\)?\s*/\s*"([A-Za-z0-9_.]+)"')
    written = {
        name
        for path in (ROOT / "hpcpipe").rglob("*.py")
        for name in pattern.findall(path.read_text(encoding="utf-8"))
        if not name.endswith(".tmp")  # written, then renamed into place
    }
    assert {"metrics.h5", "status.json", "flux.h5"} <= written  # the scan finds them
    assert written <= {*RUN_FILES, "checkpoints"}, written - {*RUN_FILES, "checkpoints"}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--allow-change", "optim.lr"], "--allow-change is for --resume"),
        (["--resume", "--allow-change", "optim.lrr"], "'optim.lrr' is not compared on resume"),
        (["--resume", "--allow-change", "topology.pp"], "is not compared on resume"),
    ],
    ids=["without-resume", "typo", "not-an-identity-key"],
)
def test_3_allow_change_names_only_compared_keys(args, words):
    r = run_cli(["run", TRAIN, *args])
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.output


def test_rank_reports_reach_stderr_in_one_write(monkeypatch):
    """The launcher merges every rank's stderr: a report written in pieces (print writes the
    text and its newline separately) could be split by another rank's line, so one grep line
    would hold two reports."""
    import os

    from hpcpipe.mpi import guard

    writes: list[tuple[int, bytes]] = []
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, bytes(data))) or len(data))
    guard.report("[rank 3 on host] watchdog: step 2 has run 3.1 s")
    assert writes == [(2, b"[rank 3 on host] watchdog: step 2 has run 3.1 s\n")]
