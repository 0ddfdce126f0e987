"""`hpcpipe ckpt inspect | verify | convert` on a run directory, a checkpoints directory and a
step directory; exit codes 0 (ok), 1 (damaged: the bad tensor is named), 2 (bad input)."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import clean_environ

from hpcpipe.io.checkpoint import ShardSpec, block_index, read_attrs, save_checkpoint

RNG = np.random.default_rng(11)
STATE = {
    "stage0/w": RNG.standard_normal((6, 4)).astype(np.float32),
    "stage1/w": RNG.standard_normal((4, 3)),
    "step": np.array(42, dtype=np.int64),
}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory whose checkpoints/ holds steps 1 and 2 (rows of stage0/w in 2 slices)."""
    tensors = {}
    for name, a in STATE.items():
        parts = 2 if a.ndim == 2 and name == "stage0/w" else 1
        for p in range(parts):
            index = block_index(a.shape, 0, parts, p) if parts > 1 else ()
            spec = ShardSpec(name, a.shape, a.dtype, index)
            tensors[f"{name}#{p}"] = (spec, a[spec.index])
    for step in (1, 2):
        save_checkpoint(
            None, tmp_path / "checkpoints", step, tensors, writer=True, attrs={"seed": 5}
        )
    return tmp_path


def test_inspect_shows_step_tensors_and_attributes(cli, run_dir):
    r = cli(["ckpt", "inspect", str(run_dir)])
    assert r.returncode == 0, r.output
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_000002'}" in r.stdout
    assert "step        2" in r.stdout and "seed  5" in r.stdout
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[-3:]}
    assert rows == {
        "stage0/w": ["6x4", "float32", "2", "96", "B"],
        "stage1/w": ["4x3", "float64", "1", "96", "B"],
        "step": ["scalar", "int64", "1", "8", "B"],
    }
    r = cli(["ckpt", "inspect", str(run_dir / "checkpoints" / "step_000001"), "--slices"])
    assert r.returncode == 0 and "step        1" in r.stdout
    assert "[3:6, 0:4] in shard_000000.h5:r000000/s000001 crc32=0x" in r.stdout


def test_verify_ok_then_names_the_damaged_tensor(cli, run_dir):
    step = run_dir / "checkpoints" / "step_000002"
    r = cli(["ckpt", "verify", str(run_dir / "checkpoints")])
    assert r.returncode == 0, r.output
    assert r.stdout.startswith(f"OK: {step} (step 2): 3 tensors, 4 slices, 200 bytes")
    with h5py.File(step / "shard_000000.h5", "r") as f:
        offset = f["r000000/s000002"].id.get_offset()  # stage1/w
    data = bytearray((step / "shard_000000.h5").read_bytes())
    data[offset + 5] ^= 0x40
    (step / "shard_000000.h5").write_bytes(bytes(data))
    r = cli(["ckpt", "verify", str(step)])
    assert r.returncode == 1, r.output
    assert "FAILED" in r.stdout and "1 problem(s)" in r.stdout
    assert "tensor 'stage1/w': CRC32 mismatch" in r.stdout and "stage0/w" not in r.stdout


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_bad_paths_exit_2(cli, tmp_path, verb):
    r = cli(["ckpt", verb, str(tmp_path / "nowhere")])
    assert r.returncode == 2 and "no such file or directory" in r.stderr
    r = cli(["ckpt", verb, str(tmp_path)])
    assert r.returncode == 2 and "no complete checkpoint here" in r.stderr


def test_convert_exports_one_dataset_per_tensor(cli, run_dir, tmp_path):
    out = tmp_path / "export.h5"
    r = cli(["ckpt", "convert", str(run_dir), str(out)])
    assert r.returncode == 0, r.output
    assert "wrote" in r.stdout and "3 tensors" in r.stdout
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == b"hpcpipe-checkpoint-export"
        assert f.attrs["step"] == 2 and f.attrs["seed"] == 5
        for name, a in STATE.items():
            assert f[name].dtype == a.dtype and f[name][()].tobytes() == a.tobytes(), name
    source = read_attrs(run_dir)
    with h5py.File(out, "r") as f:
        assert f.attrs["checkpoint_id"].decode() == source["checkpoint_id"]
    r = cli(["ckpt", "convert", str(run_dir), str(out)])
    assert r.returncode == 2 and "already exists (pass --force" in r.stderr
    assert cli(["ckpt", "convert", str(run_dir), str(out), "--force"]).returncode == 0


def test_registering_the_verbs_imports_neither_mpi_nor_h5py():
    code = (
        "import sys, hpcpipe.io.ckpt_cli; "
        "assert 'mpi4py' not in sys.modules and 'h5py' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=clean_environ())
