"""Real mpiexec jobs: save on 4 ranks (ZeRO-style and writer-per-replica), load on other
decompositions and world sizes bitwise, and saves that fail alike on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from ckpt_driver import EXPERTS, global_tensors
from conftest import clean_environ, mpiexec_command

from hpcpipe.io.checkpoint import (
    ShardSpec,
    block_index,
    latest_checkpoint,
    load_checkpoint,
    read_attrs,
    verify_checkpoint,
)

pytestmark = pytest.mark.mpi

DRIVER = Path(__file__).resolve().parent / "ckpt_driver.py"


def driver(n: int, *args: str, env: dict | None = None, timeout: float = 120):
    """`mpiexec -n N python ckpt_driver.py ARGS`: (return code, JSON records, all output)."""

    cmd = [*mpiexec_command(), "-n", str(n), sys.executable, str(DRIVER), *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**clean_environ(), **(env or {})}
    )
    records = []
    for line in proc.stdout.splitlines():
        records += [json.loads("{" + part) for part in line.strip().split("{")[1:]]
    return proc.returncode, records, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written by 4 ranks (pp 2 x dp 2): step 10 ZeRO-style, step 20 replica."""
    root = tmp_path_factory.mktemp("mpi") / "checkpoints"
    for step, scheme in ((10, "zero"), (20, "replica")):
        rc, records, out = driver(4, "save", str(root), str(step), "--scheme", scheme)
        assert rc == 0, out
        assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], out
        assert {r["path"] for r in records} == {str(root / f"step_{step:06d}")}
    return root


def test_writers_and_files(saved):
    zero, replica = saved / "step_000010", saved / "step_000020"
    assert sorted(p.name for p in zero.iterdir()) == [
        "index.h5",
        *(f"shard_{r:06d}.h5" for r in range(4)),
    ]
    # writer = dp rank 0 only: the replicas' copies were not written
    assert sorted(p.name for p in replica.iterdir()) == [
        "index.h5",
        "shard_000000.h5",
        "shard_000002.h5",
    ]
    assert latest_checkpoint(saved) == replica
    attrs = read_attrs(zero)
    assert attrs["world_size"] == 4 and attrs["scheme"] == "zero" and attrs["step"] == 10
    assert attrs["rng"] == bytes([0, 0, 255])  # rank 0's attrs
    for path in (zero, replica):
        assert verify_checkpoint(path) == []
        with h5py.File(path / "index.h5", "r") as f:
            assert f.attrs["format"] == b"hpcpipe-checkpoint" and f.attrs["world_size"] == 4


@pytest.mark.parametrize("step", [10, 20])
@pytest.mark.parametrize(
    "decomposition", ["whole", "rows3", "cols4", "cols1", "strided", "experts-per-rank"]
)
def test_load_into_another_layout_is_bitwise_equal(saved, step, decomposition):
    full = global_tensors(4)
    parts = {"whole": 1, "rows3": 3, "cols4": 4, "cols1": 1, "strided": 2}.get(decomposition, 1)
    wanted = {}
    for name, arr in full.items():
        for p in range(parts):
            if decomposition == "rows3" and arr.ndim:
                index = block_index(arr.shape, 0, parts, p)
            elif decomposition.startswith("cols") and arr.ndim:
                index = block_index(arr.shape, arr.ndim - 1, parts, p)
            elif decomposition == "strided" and arr.ndim:
                index = tuple(slice(min(p, n), None, 2) for n in arr.shape)
            else:
                index = ()
            wanted[f"{name}#{p}"] = ShardSpec(name, arr.shape, arr.dtype, index)
    if decomposition == "experts-per-rank":  # ep 4 -> ep 1 and 3 experts on one rank
        wanted = {
            f"e{e}": ShardSpec(
                "experts/w1", full["experts/w1"].shape, np.float32, (slice(e, e + 1),)
            )
            for e in range(EXPERTS)
        }
    got = load_checkpoint(saved / f"step_{step:06d}", wanted)
    assert got.keys() == wanted.keys()
    for key, spec in wanted.items():
        expect = full[spec.name][spec.index]
        assert got[key].dtype == expect.dtype and got[key].tobytes() == expect.tobytes(), key


def test_each_rank_of_a_smaller_job_loads_what_it_owns(saved):
    rc, records, out = driver(3, "load", str(saved), "--saved-world", "4")
    assert rc == 0, out
    assert sorted(r["rank"] for r in records) == [0, 1, 2], out
    for r in records:
        assert r["mismatched"] == [] and len(r["loaded"]) == len(global_tensors(4)), r


def test_bad_saves_fail_on_every_rank_and_leave_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    rc, records, out = driver(4, "save", str(root), "1")
    assert rc == 0, out
    rc, records, out = driver(4, "errors", str(root), "2")
    assert rc == 0, out  # every rank got the same CheckpointError: no hang, no abort
    expected = {
        "overlap": "tensor 'stage0/adam_m': written twice: rank 0 [0:9, 0:6] overlaps rank 1",
        "dtype": "tensor 'cplx': array (key 'cplx') is complex128 but the spec says complex64",
        "hole": "tensor 'experts/w1': the writers hold 45 of its 60 elements",
    }
    for case, needle in expected.items():
        errors = [r["error"] for r in records if r["case"] == case]
        assert len(errors) == 4 and len(set(errors)) == 1, (case, errors)
        assert needle in errors[0], errors[0]
    assert "rank 3 on " in next(r["error"] for r in records if r["case"] == "dtype")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert verify_checkpoint(root) == []


def test_shared_layout_loads_like_shards(tmp_path, parallel_h5py):
    root = tmp_path / "checkpoints"
    rc, _, out = driver(4, "save", str(root), "5", "--layout", "shared")
    assert rc == 0, out
    step = root / "step_000005"
    assert sorted(p.name for p in step.iterdir()) == ["data.h5", "index.h5"]
    assert read_attrs(step)["layout"] == "shared" and verify_checkpoint(step) == []
    full = global_tensors(4)
    wanted = {
        n: ShardSpec(n, a.shape, a.dtype, block_index(a.shape, a.ndim - 1, 2, 1) if a.ndim else ())
        for n, a in full.items()
    }
    got = load_checkpoint(step, wanted)
    for name, spec in wanted.items():
        assert got[name].tobytes() == full[name][spec.index].tobytes(), name
