"""HDF5 inputs under damage: traces, checkpoints, token datasets and sweep meshes, each truncated,
bit-flipped in its data, with a wrong format version, dtype or shape, or a missing dataset.

Every case must be a clear error of the documented type that names the file and the dataset or
attribute at fault, never a raw h5py/KeyError traceback; under `hpcpipe run` it ends the job with
exit code 2, and a resume from a damaged checkpoint replaces nothing. Corrupt files are made here
from good ones (truncate to half, flip a byte in the middle of the data, rewrite an attribute or
a dataset). Bit flips in raw data are only detectable with a checksum: checkpoints carry CRC32s;
token files, mesh files (and trace tables, once written with it) carry HDF5's Fletcher32 filter,
so the flips below land inside checksummed data. Token files have no format attributes, so they
have no "wrong format version" case. Most cases run in-process; a few go through mpiexec.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import h5py
import numpy as np
import pytest
from conftest import INPUTS, run_cli, run_mpi

from hpcpipe.config import ConfigError, load_config
from hpcpipe.io.checkpoint import (
    CheckpointError,
    ShardSpec,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from hpcpipe.io.ckpt_format import FORMAT_VERSION, read_index
from hpcpipe.io.trace import EVENT_DTYPE, TraceFormatError, read_trace, save_trace
from hpcpipe.model import ModelConfig
from hpcpipe.sweep import mesh
from hpcpipe.sweep.mesh import build_problem, write_mesh_file
from hpcpipe.train import checkpointing as train_ckpt
from hpcpipe.train import data
from hpcpipe.train.data import DataConfig, build_dataset, write_token_file
from hpcpipe.train.optim import OptimState

CORRUPTIONS = ("truncated", "bitflip", "version", "dtype", "shape", "missing")
SWEEP_TINY = INPUTS / "sweep_tiny.toml"
TRAIN_TINY = INPUTS / "train_tiny.toml"

# ---------------------------------------------------------------- damaging files


def truncate_half(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def flip_byte(path: Path, offset: int, bit: int = 4) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


def flip_in_data(path: Path, dataset: str) -> None:
    """Flip one bit in the middle of the dataset's first chunk (or its contiguous data)."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        if ds.chunks is None:
            start, size = ds.id.get_offset(), ds.id.get_storage_size()
        else:
            info = ds.id.get_chunk_info(0)
            start, size = info.byte_offset, info.size
    flip_byte(path, start + size // 2)


def rewrite_attr(path: Path, name: str, value: Any, obj: str = "/") -> None:
    with h5py.File(path, "r+") as f:
        f[obj].attrs[name] = value


def rewrite_dataset(path: Path, name: str, make: Callable[[np.ndarray], np.ndarray]) -> None:
    """Replace a dataset by `make(old data)`, keeping its attributes."""
    with h5py.File(path, "r+") as f:
        old = f[name]
        attrs, values = dict(old.attrs), old[()]
        del f[name]
        new = f.create_dataset(name, data=make(values))
        for k, v in attrs.items():
            new.attrs[k] = v


def rebuild_file(path: Path, name: str, make: Callable[[np.ndarray], np.ndarray]) -> None:
    """Write the file afresh with dataset `name` replaced by `make(old data)`, padded to the old
    size: what a foreign writer could leave, passing any file-size check."""
    size = path.stat().st_size
    fresh = path.with_name(path.name + ".new")
    with h5py.File(path, "r") as src, h5py.File(fresh, "w", libver="v108") as out:
        out.attrs.update(dict(src.attrs))

        def copy(key: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                ds = out.create_dataset(key, data=make(obj[()]) if key == name else obj[()])
                ds.attrs.update(dict(obj.attrs))

        src.visititems(copy)
    assert fresh.stat().st_size <= size
    with open(fresh, "ab") as fh:
        fh.write(b"\0" * (size - fresh.stat().st_size))
    fresh.replace(path)


def drop_dataset(path: Path, name: str) -> None:
    with h5py.File(path, "r+") as f:
        del f[name]


def assert_clean(r: Any, code: int) -> None:
    """A CLI or job failure as the user sees it: the exit code, an ERROR line, no traceback."""
    assert r.returncode == code, r.output
    assert "ERROR" in r.stderr or "FAILED" in r.stdout, r.output
    assert "Traceback" not in r.output, r.output


# ---------------------------------------------------------------- traces


def _events(rank: int, n: int = 40) -> np.ndarray:
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["t_start"] = np.arange(n) * 1000 + rank
    ev["t_end"] = ev["t_start"] + 500
    ev["step"] = np.arange(n) // 10
    ev["stage"], ev["microbatch"], ev["peer"], ev["kind"] = rank, np.arange(n) % 4, -1, 0
    return ev


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    """A 2-rank trace whose event tables carry Fletcher32 checksums."""
    path = save_trace(tmp_path / "trace.h5", [_events(0), _events(1)], {"workload": "test"})
    with h5py.File(path, "r+") as f:  # checksummed tables, as the writer should make them
        for r in range(2):
            g = f[f"ranks/{r}"]
            values = g["events"][()]
            del g["events"]
            g.create_dataset("events", data=values, chunks=True, maxshape=(None,), fletcher32=True)
    assert read_trace(path).num_ranks == 2
    return path


def _damage_trace(path: Path, corruption: str) -> str:
    """Apply one corruption; returns what the error must mention."""
    key = "ranks/0/events"
    if corruption == "truncated":
        truncate_half(path)
        return "truncated"
    if corruption == "bitflip":
        flip_in_data(path, key)
        return f"{key} cannot be read"
    if corruption == "version":
        rewrite_attr(path, "version", 2)
        return "version 2, newer than this hpcpipe reads"
    if corruption == "dtype":
        wrong = np.dtype(
            [(n, "<f8" if n == "t_start" else EVENT_DTYPE[n]) for n in EVENT_DTYPE.names]
        )
        rewrite_dataset(path, key, lambda v: v.astype(wrong))
        return f"{key} field 't_start' is float64, expected int64"
    if corruption == "shape":
        rewrite_dataset(path, key, lambda v: v.reshape(4, -1))
        return f"{key} has shape (4, 10)"
    drop_dataset(path, "ranks/1/events")
    return "ranks/1/events is missing"


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_trace(trace_file: Path, corruption: str) -> None:
    expected = _damage_trace(trace_file, corruption)
    with pytest.raises(TraceFormatError) as info:
        read_trace(trace_file)
    assert info.value.path == str(trace_file)
    assert str(info.value).startswith(f"{trace_file}: ") and expected in str(info.value)


def test_trace_event_ending_before_it_starts(tmp_path: Path) -> None:
    ev = _events(0)
    ev["t_end"][7] = ev["t_start"][7] - 1
    path = save_trace(tmp_path / "trace.h5", [ev])
    with pytest.raises(TraceFormatError, match=r"ranks/0/events row 7 ends before it starts"):
        read_trace(path)


@pytest.mark.parametrize("corruption", ["truncated", "bitflip", "dtype"])
def test_trace_cli_reports_one_line_and_exit_2(trace_file: Path, corruption: str) -> None:
    expected = _damage_trace(trace_file, corruption)
    r = run_cli(["trace", "summary", str(trace_file)])
    assert_clean(r, 2)
    assert str(trace_file) in r.stderr and expected in r.stderr


# ---------------------------------------------------------------- checkpoints

W = np.arange(40, dtype=np.float64).reshape(8, 5)
B = np.linspace(0.0, 1.0, 5)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A one-process checkpoint: 'w' in two slices, 'b' whole, all in shard_000000.h5."""
    tensors = {
        "top": (ShardSpec("w", W.shape, W.dtype, (slice(0, 3),)), W[:3]),
        "bottom": (ShardSpec("w", W.shape, W.dtype, (slice(3, 8),)), W[3:]),
        "b": (ShardSpec("b", B.shape, B.dtype), B),
    }
    return save_checkpoint(None, tmp_path / "checkpoints", 1, tensors, writer=True, fsync=False)


WANTED = {"w": ShardSpec("w", W.shape, W.dtype), "b": ShardSpec("b", B.shape, B.dtype)}


def _slice_dataset(step_dir: Path, tensor: str) -> tuple[Path, str]:
    index = read_index(step_dir)
    entry = index.tensors[tensor].slices[0]
    return index.shard_path(entry.shard), entry.dataset


def _damage_ckpt(step_dir: Path, corruption: str) -> tuple[Path, str]:
    """Apply one corruption; returns the file the error must name and what it must say."""
    shard, dataset = _slice_dataset(step_dir, "w")
    if corruption == "truncated":
        truncate_half(shard)
        return shard, "truncated shard"
    if corruption == "bitflip":
        flip_in_data(shard, dataset)
        return shard, "tensor 'w': CRC32 mismatch"
    if corruption == "version":
        rewrite_attr(step_dir / "index.h5", "format_version", np.int64(FORMAT_VERSION + 1))
        return step_dir / "index.h5", f"format version {FORMAT_VERSION + 1} was written by a newer"
    if corruption == "dtype":
        rebuild_file(shard, dataset, lambda v: v.astype(np.float32))
        return shard, f"dataset {dataset} is float32[3, 5], index says float64[3, 5]"
    if corruption == "shape":
        rebuild_file(shard, dataset, lambda v: v[:2])
        return shard, f"dataset {dataset} is float64[2, 5], index says float64[3, 5]"
    drop_dataset(shard, dataset)
    return shard, f"(dataset {dataset}) is unreadable"


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_checkpoint(ckpt: Path, corruption: str) -> None:
    bad_file, expected = _damage_ckpt(ckpt, corruption)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, WANTED)
    assert info.value.path == bad_file, str(info.value)
    assert str(info.value).startswith(str(bad_file)) and expected in str(info.value)


@pytest.mark.parametrize(("corruption", "code"), [("bitflip", 1), ("shape", 1), ("version", 2)])
def test_checkpoint_cli(ckpt: Path, corruption: str, code: int) -> None:
    """`ckpt verify`: a damaged tensor exits 1 naming it; an index it cannot trust exits 2."""
    bad_file, expected = _damage_ckpt(ckpt, corruption)
    r = run_cli(["ckpt", "verify", str(ckpt)])
    assert_clean(r, code)
    assert str(bad_file) in r.output and expected in r.output


class _OneRank:
    """The communicator calls a one-process restore makes."""

    rank, size = 0, 1

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def gather(self, obj: Any, root: int = 0) -> list[Any]:
        return [obj]

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


def _train_state(seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    params = {0: {0: {"w": rng.random((4, 3))}, 1: {"b": rng.random(3)}}}
    slots = {"m": {0: {"w": rng.random((4, 3))}, 1: {"b": rng.random(3)}}}
    return params, {0: OptimState(5 + seed, slots)}


@pytest.mark.parametrize("corruption", ["bitflip", "attribute"])
def test_damaged_training_checkpoint_replaces_nothing(tmp_path: Path, corruption: str) -> None:
    """Resume reads and checks everything before touching a parameter."""
    from hpcpipe.topology import RankMap

    config = load_config(TRAIN_TINY, [f"run.output='{tmp_path}'", "checkpoint.fsync=false"])
    ctx = SimpleNamespace(
        config=config,
        rankmap=RankMap.build(1, 1, pp=1, dp=1, ep=1, order="dp,ep,pp"),
        comms=SimpleNamespace(world=_OneRank()),
        backend=SimpleNamespace(to_host=np.asarray),
        output=tmp_path,
        rank=0,
        size=1,
        xp=np,
        log=lambda _m: None,
        resume=None,
        allow_changes=(),
    )
    params, opt = _train_state(0)
    path = train_ckpt.save(ctx, 5, params, opt, {"loss": [1.0] * 5})
    if corruption == "bitflip":  # the last tensor read: a partial load would have begun
        index = read_index(path)
        entry = index.tensors["optim/m/unit0001/b"].slices[0]
        flip_in_data(index.shard_path(entry.shard), entry.dataset)
        expected = "tensor 'optim/m/unit0001/b': CRC32 mismatch"
    else:  # the index checksum covers the attributes too (format version 2)
        with h5py.File(path / "index.h5", "r+") as f:
            del f.attrs["optimizer_step"]
        expected = "index checksum mismatch"
    fresh, fresh_opt = _train_state(1)
    before, opt_before = {u: dict(p) for u, p in fresh[0].items()}, fresh_opt[0]
    ctx.resume = str(path)
    with pytest.raises(ConfigError, match="--resume") as info:
        train_ckpt.restore(ctx, fresh, fresh_opt)
    assert str(path) in str(info.value) and expected in str(info.value)
    assert all(fresh[0][u][k] is v for u, p in before.items() for k, v in p.items())
    assert fresh_opt[0] is opt_before and opt_before.step == 6


def test_sweep_restore_refuses_on_every_rank_when_one_rank_failed(tmp_path: Path) -> None:
    """With `comm`, a rank whose own block loaded fine still refuses when another rank's did
    not, so the whole job stops with one error (exit 2) and no rank starts iterating."""
    from hpcpipe.io.ckpt_config import CheckpointConfig
    from hpcpipe.sweep import checkpointing as sweep_ckpt
    from hpcpipe.sweep.solver import Iterate

    class _SecondRankFailed(_OneRank):
        size = 2

        def allgather(self, obj: Any) -> list[Any]:
            return [obj, "shard_000001.h5: tensor 'flux/phi': CRC32 mismatch"]

    cfg = load_config(SWEEP_TINY).sweep
    cells = (slice(None), slice(None))
    phi = np.ones((cfg.nx * cfg.ny * cfg.nz, cfg.groups))
    iterate = Iterate(phi, [0.5, 0.25], [1.0, 1.0], [0.1, 0.1])
    settings = CheckpointConfig(fsync=False)
    path = sweep_ckpt.save(_OneRank(), tmp_path, iterate, cfg, cells, settings, converged=False)
    assert sweep_ckpt.restore(path, cfg, cells)[0].iterations == 2  # fine on its own
    with pytest.raises(ConfigError, match=r"CRC32 mismatch \(found by rank 1; no rank loaded"):
        sweep_ckpt.restore(path, cfg, cells, comm=_SecondRankFailed())


# ---------------------------------------------------------------- token datasets

MODEL = ModelConfig(kind="mlp", layers=1, d_model=8, d_ff=8, vocab=12, seq_len=16)


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    return write_token_file(tmp_path / "tokens.h5", np.arange(600, dtype=np.int32) % 12)


def _build(path: Path, dataset: str = "tokens") -> Any:
    cfg = DataConfig(kind="hdf5", path=str(path), dataset=dataset, global_batch=4)
    return build_dataset(cfg, MODEL, 0, source="deck.toml")


def _damage_tokens(path: Path, corruption: str) -> str:
    if corruption == "truncated":
        truncate_half(path)
        return "is truncated"
    if corruption == "bitflip":
        flip_in_data(path, "tokens")
        return "dataset = 'tokens' in"
    if corruption == "dtype":
        rewrite_dataset(path, "tokens", lambda v: v.astype(np.float64))
        return "'tokens' in {path!r} is float64 with shape (600,); expected a 1-D integer"
    if corruption == "shape":
        rewrite_dataset(path, "tokens", lambda v: v.reshape(20, 30))
        return "is int32 with shape (20, 30); expected a 1-D integer"
    drop_dataset(path, "tokens")
    return "= 'tokens': no such dataset in"


@pytest.mark.parametrize("corruption", [c for c in CORRUPTIONS if c != "version"])
def test_token_dataset(tokens: Path, corruption: str) -> None:
    expected = _damage_tokens(tokens, corruption).format(path=str(tokens))
    with pytest.raises(ConfigError) as info:
        _build(tokens)
    text = str(info.value)
    assert text.startswith("deck.toml: data.") and str(tokens) in text and expected in text
    if corruption == "bitflip":
        assert "tokens 0..599 cannot be read" in text and "the file is damaged" in text


def test_token_bitflip_found_at_read_time_beyond_the_scan(tokens, monkeypatch) -> None:
    """Datasets too large to scan up front fail at the window read, naming file and dataset."""
    monkeypatch.setattr(data, "SCAN_TOKENS", 0)
    ds = _build(tokens)  # only the metadata is read
    flip_in_data(tokens, "tokens")
    with pytest.raises(ConfigError, match=r"data\.dataset = 'tokens' in '.*tokens\.h5': tokens "):
        ds.global_batch(0)


def test_token_out_of_vocab_and_too_short(tmp_path: Path, monkeypatch) -> None:
    ids = np.arange(600) % 12
    ids[433] = 12
    path = write_token_file(tmp_path / "oov.h5", ids)
    with pytest.raises(ConfigError, match=r"model\.vocab = 12 does not cover token 12 .*433"):
        _build(path)  # found up front, the same on every rank
    monkeypatch.setattr(data, "SCAN_TOKENS", 0)
    with pytest.raises(ConfigError, match=r"does not cover token 12 .*oov\.h5.*step \d+"):
        for step in range(50):  # beyond the scan: found in the first window that holds it
            _build(path).global_batch(step)
    short = write_token_file(tmp_path / "short.h5", np.arange(10))
    with pytest.raises(ConfigError, match=r"has 10 tokens; needs at least model\.seq_len \+ 2"):
        _build(short)


# ---------------------------------------------------------------- sweep meshes


@pytest.fixture
def sweep_cfg(tmp_path: Path) -> Any:
    """The tiny sweep deck with its box layout as a mesh file."""
    cfg = load_config(SWEEP_TINY).sweep
    ids = build_problem(cfg).material_ids(slice(None), slice(None))
    path = write_mesh_file(tmp_path / "mesh.h5", ids, cfg.lengths)
    return dataclasses.replace(cfg, mesh_file=str(path), boxes=(), box_materials=())


def _damage_mesh(path: Path, corruption: str) -> str:
    ds = mesh.MESH_DATASET
    if corruption == "truncated":
        truncate_half(path)
        return ": is truncated"
    if corruption == "bitflip":
        flip_in_data(path, ds)
        return f": dataset '{ds}' cannot be read at x cells 0..7"
    if corruption == "version":
        rewrite_attr(path, "format_version", np.int64(2))
        return ": attribute 'format_version' = 2: written by a newer hpcpipe"
    if corruption == "dtype":
        rewrite_dataset(path, ds, lambda v: v.astype(np.float64))
        return f": dataset '{ds}' is float64, expected an integer dtype"
    if corruption == "shape":
        rewrite_dataset(path, ds, lambda v: v[:, :, :3])
        return f": dataset '{ds}' has shape (8, 8, 3), expected (sweep.nx, sweep.ny, sweep.nz)"
    with h5py.File(path, "r+") as f:
        f.move(ds, "ids")
    return f": dataset '{ds}' is missing; datasets there: ids"


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_sweep_mesh(sweep_cfg: Any, corruption: str) -> None:
    path = Path(sweep_cfg.mesh_file)
    expected = _damage_mesh(path, corruption)
    with pytest.raises(ConfigError) as info:
        build_problem(sweep_cfg)
    assert str(info.value).startswith(f"{path}{expected}"), str(info.value)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda p: rewrite_attr(p, "format", "something-else"), "is not an hpcpipe sweep mesh"),
        (lambda p: rewrite_attr(p, "lengths", [1.0, 1.0, 1.0]), "but sweep.lengths = [4.0"),
        (
            lambda p: rewrite_dataset(p, mesh.MESH_DATASET, lambda v: v + 1),
            "holds material id 2 at cell (4, 0, 0), but the deck defines 2 material(s)",
        ),
    ],
)
def test_sweep_mesh_other_mismatches(sweep_cfg: Any, damage: Callable, expected: str) -> None:
    damage(Path(sweep_cfg.mesh_file))
    with pytest.raises(ConfigError) as info:
        build_problem(sweep_cfg)
    assert str(info.value).startswith(sweep_cfg.mesh_file) and expected in str(info.value)


@pytest.mark.parametrize("corruption", ["bitflip", "bad id"])
def test_sweep_mesh_block_checked_by_its_reader(sweep_cfg, monkeypatch, corruption) -> None:
    """Beyond MESH_SCAN_CELLS only the header is checked up front; each rank's block on read."""
    monkeypatch.setattr(mesh, "MESH_SCAN_CELLS", 0)
    path = Path(sweep_cfg.mesh_file)
    if corruption == "bitflip":
        flip_in_data(path, mesh.MESH_DATASET)
        expected = "cannot be read at x cells 0..3, y cells 4..7 (OSError"
    else:

        def bump(v: np.ndarray) -> np.ndarray:
            v[1, 6, 2] = 9
            return v

        rewrite_dataset(path, mesh.MESH_DATASET, bump)
        expected = "holds material id 9 at cell (1, 6, 2) (block x cells 0..3, y cells 4..7)"
    problem = build_problem(sweep_cfg)
    with pytest.raises(ConfigError) as info:
        problem.material_ids(slice(0, 4), slice(4, 8))
    assert str(info.value).startswith(f"{path}: dataset 'material_ids' ")
    assert expected in str(info.value)


# ---------------------------------------------------------------- end to end (mpiexec)


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


@pytest.mark.mpi
@pytest.mark.parametrize("corruption", ["shape", "bitflip"])
def test_sweep_run_with_bad_mesh_exits_2(sweep_cfg: Any, tmp_path: Path, corruption: str):
    path = Path(sweep_cfg.mesh_file)
    expected = _damage_mesh(path, corruption)
    args = _sets(
        "sweep.px=2",
        "sweep.py=2",
        f"sweep.mesh_file='{path}'",
        "sweep.boxes=[]",
        "sweep.box_materials=[]",
        f"run.output='{tmp_path / 'run'}'",
    )
    r = run_mpi(4, ["run", str(SWEEP_TINY), *args], timeout=90)
    assert_clean(r, 2)
    assert r.stderr.count("ERROR") == 1 and expected.lstrip(": ") in r.stderr


@pytest.fixture(scope="module")
def sweep_2x2_ckpt(tmp_path_factory) -> Path:
    """A checkpoint written by a 2 x 2 sweep (each rank's flux block in its own shard)."""
    out = tmp_path_factory.mktemp("sweep-ckpt")
    args = _sets("sweep.px=2", "sweep.py=2", f"run.output='{out}'", "checkpoint.every=10")
    r = run_mpi(4, ["run", str(SWEEP_TINY), *args, "--set", "checkpoint.fsync=false"])
    assert r.returncode == 0, r.output
    return out / "checkpoints" / "step_000010"


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("corruption", "expected"),
    [
        ("version", f"index.h5: format version {FORMAT_VERSION + 1} was written by a newer"),
        # only rank 3 reads its block: the job still ends with exit 2, naming shard and tensor
        ("bitflip", "shard_000003.h5: tensor 'flux/phi': CRC32 mismatch"),
    ],
)
def test_sweep_resume_from_damaged_checkpoint_exits_2(
    sweep_2x2_ckpt, tmp_path, corruption, expected
):
    step = shutil.copytree(sweep_2x2_ckpt, tmp_path / "step_000010")
    if corruption == "version":
        rewrite_attr(step / "index.h5", "format_version", np.int64(FORMAT_VERSION + 1))
    else:
        flip_in_data(step / "shard_000003.h5", "r000003/s000000")
    args = _sets("sweep.px=2", "sweep.py=2", f"run.output='{tmp_path / 'run'}'")
    r = run_mpi(4, ["run", str(SWEEP_TINY), *args, "--resume", str(step)], timeout=90)
    assert_clean(r, 2)
    assert expected in r.stderr and not (tmp_path / "run" / "flux.h5").exists()


@pytest.mark.mpi
def test_train_run_with_damaged_token_file_exits_2(tokens: Path, tmp_path: Path) -> None:
    flip_in_data(tokens, "tokens")
    args = _sets(
        "data.kind='hdf5'", f"data.path='{tokens}'", "model.vocab=16", f"run.output='{tmp_path}'"
    )
    r = run_mpi(2, ["run", str(TRAIN_TINY), *args], timeout=90)
    assert_clean(r, 2)
    assert r.stderr.count("ERROR") == 1
    assert f"data.dataset = 'tokens' in '{tokens}': tokens 0..599 cannot be read" in r.stderr


@pytest.mark.mpi
def test_train_resume_from_damaged_checkpoint_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "run"
    base = _sets(f"run.output='{out}'", "run.steps=2", "checkpoint.fsync=false")
    r = run_mpi(2, ["run", str(TRAIN_TINY), *base, "--set", "checkpoint.every=2"], timeout=90)
    assert r.returncode == 0, r.output
    step = out / "checkpoints" / "step_000002"
    index = read_index(step)
    name = sorted(index.tensors)[-1]
    entry = index.tensors[name].slices[0]
    flip_in_data(index.shard_path(entry.shard), entry.dataset)
    assert len(verify_checkpoint(step)) == 1
    r = run_mpi(2, ["run", str(TRAIN_TINY), *base, "--resume", str(step)], timeout=90)
    assert_clean(r, 2)
    assert r.stderr.count("ERROR") == 1 and f"tensor {name!r}: CRC32 mismatch" in r.stderr
    assert os.path.basename(index.shard_path(entry.shard)) in r.stderr
