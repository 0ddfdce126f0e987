"""Checkpoint library in one process (comm=None): specs, slicing, attributes, save/load,
resharded reads, the directory protocol (latest, rotation, replacement) and the deck section."""

from __future__ import annotations

import itertools
import json
import os

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpipe.config import load_config
from hpcpipe.io import ckpt_format
from hpcpipe.io.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    ShardSpec,
    block_index,
    latest_checkpoint,
    load_checkpoint,
    read_attrs,
    resolve_checkpoint,
    resolve_layout,
    save_checkpoint,
    verify_checkpoint,
)
from hpcpipe.io.ckpt_config import CheckpointConfig
from hpcpipe.io.ckpt_format import first_overlap

RNG = np.random.default_rng(3)
GRID = RNG.standard_normal((11, 7)).astype(np.float32)
CUBE = RNG.integers(-1000, 1000, size=(4, 5, 6), dtype=np.int32)


def _grid_pieces() -> dict[str, tuple[ShardSpec, np.ndarray]]:
    """GRID as 3 x 2 uneven blocks and CUBE as 2 blocks: many slices of one tensor held by
    one writer, so resharded reads cross slice boundaries in every dimension."""
    pieces = {}
    rows = [block_index(GRID.shape, 0, 3, i)[0] for i in range(3)]
    cols = [block_index(GRID.shape, 1, 2, j)[1] for j in range(2)]
    for i, (r, c) in enumerate(itertools.product(rows, cols)):
        spec = ShardSpec("grid", GRID.shape, GRID.dtype, (r, c))
        pieces[f"grid{i}"] = (spec, GRID[spec.index])
    for j in range(2):
        spec = ShardSpec("cube", CUBE.shape, CUBE.dtype, block_index(CUBE.shape, 2, 2, j))
        pieces[f"cube{j}"] = (spec, CUBE[spec.index])
    return pieces


@pytest.fixture(scope="module")
def grid_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    return save_checkpoint(None, root, 3, _grid_pieces(), writer=True)


# ---------------------------------------------------------------- specs and slices


def test_shard_spec_normalizes_and_checks():
    spec = ShardSpec("w", [4, 6], "float32", (slice(1, 3),))
    assert spec.index == (slice(1, 3, 1), slice(0, 6, 1))
    assert spec.shape == (2, 6) and spec.dtype == np.float32 and spec.is_box
    assert ShardSpec("w", (4, 6), np.float32, (slice(1, 3), slice(None))) == spec
    assert ShardSpec("w", (10,), "i8", (slice(1, None, 3),)).shape == (3,)
    assert ShardSpec.whole("s", (), "i8").shape == ()
    bad = [
        (("", (3,), "f4"), "non-empty"),
        (("w", (3,), "O"), "plain numeric"),
        (("w", (3,), "f4", (slice(0, 4),)), "outside 0..3"),
        (("w", (3,), "f4", (slice(-1, None),)), "outside"),
        (("w", (3,), "f4", (1,)), "must be a slice"),
        (("w", (3,), "f4", (slice(0, 3, 0),)), "step must be >= 1"),
        (("w", (3,), "f4", (slice(None), slice(None))), "more entries"),
        (("w", (-1,), "f4"), "negative"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            ShardSpec(*args)


@given(st.integers(0, 40), st.integers(1, 9))
def test_block_index_tiles_exactly(n, parts):
    blocks = [block_index((n, 2), 0, parts, p)[0] for p in range(parts)]
    assert blocks[0].start == 0 and blocks[-1].stop == n
    assert all(a.stop == b.start for a, b in itertools.pairwise(blocks))
    sizes = [b.stop - b.start for b in blocks]
    assert max(sizes) - min(sizes) <= 1


def test_first_overlap_finds_clashes_in_any_axis():
    cols = [((0, 0), (9, 3)), ((0, 3), (9, 6)), ((0, 6), (9, 9))]
    assert first_overlap(cols) is None
    assert first_overlap([*cols, ((4, 5), (5, 7))]) == (1, 3)
    assert first_overlap([((), ()), ((), ())]) == (0, 1)
    assert first_overlap([((0,), (0,)), ((0,), (0,))]) is None  # empty boxes hold nothing


# ---------------------------------------------------------------- save and load


def test_round_trip_every_dtype_and_attrs(tmp_path):
    arrays = {
        "f16": np.arange(6, dtype=np.float16).reshape(2, 3),
        "f64": RNG.standard_normal(5),
        "u8": np.arange(7, dtype=np.uint8),
        "i64": np.array(-3, dtype=np.int64),
        "bool": np.array([True, False, True]),
        "c128": np.array([1 + 2j, -3j]),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "big-endian": np.arange(4, dtype=">i4"),
    }
    tensors = {k: (ShardSpec.whole(k, a.shape, a.dtype), a) for k, a in arrays.items()}
    attrs = {
        "config": "[run]\nseed = 1\n" + "#" * 200_000,  # larger than a compact HDF5 attribute
        "rng": b"\x00\x01\xff\x00",
        "no_bytes": b"",
        "topology": {"pp": 2, "dp": 2, "order": "ep,dp,pp"},
        "data_position": [3, 17],
        "lr": 0.25,
        "epoch": 4,
        "flag": True,
        "mt_state": np.arange(624, dtype=np.uint32),
    }
    path = save_checkpoint(None, tmp_path, 7, tensors, writer=True, attrs=attrs)
    assert path == tmp_path / "step_000007"
    got = load_checkpoint(tmp_path, {k: spec for k, (spec, _) in tensors.items()})
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and got[k].shape == a.shape
        assert got[k].tobytes() == a.tobytes(), k
    back = read_attrs(path)
    for key, value in attrs.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(back[key], value) and back[key].dtype == value.dtype
        else:
            assert back[key] == value and type(back[key]) is type(value), key
    assert back["step"] == 7 and back["format"] == "hpcpipe-checkpoint"
    assert back["format_version"] == FORMAT_VERSION and back["world_size"] == 1
    assert verify_checkpoint(path) == []


def test_cupy_like_arrays_are_copied_to_host(tmp_path):
    class DeviceArray:  # what CuPy offers: .get() returns a NumPy copy
        def __init__(self, a):
            self.a = a

        def get(self):
            return self.a

    a = np.arange(12.0).reshape(3, 4)
    spec = ShardSpec.whole("w", a.shape, a.dtype)
    save_checkpoint(None, tmp_path, 1, {"w": (spec, DeviceArray(a))}, writer=True)
    assert np.array_equal(load_checkpoint(tmp_path, {"w": spec})["w"], a)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("axis", [0, 1])
def test_load_blocks_of_another_decomposition(grid_ckpt, parts, axis):
    wanted = {
        f"p{p}": ShardSpec("grid", GRID.shape, GRID.dtype, block_index(GRID.shape, axis, parts, p))
        for p in range(parts)
    }
    got = load_checkpoint(grid_ckpt, wanted)
    glued = np.concatenate([got[f"p{p}"] for p in range(parts)], axis=axis)
    assert glued.tobytes() == GRID.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_slicing_reads_exactly_that(grid_ckpt, data):
    name, full = data.draw(st.sampled_from([("grid", GRID), ("cube", CUBE)]))
    index = []
    for n in full.shape:
        start = data.draw(st.integers(0, n))
        stop = data.draw(st.integers(start, n))
        index.append(slice(start, stop, data.draw(st.integers(1, 4))))
    spec = ShardSpec(name, full.shape, full.dtype, tuple(index))
    got = load_checkpoint(grid_ckpt, {"x": spec, "again": spec})
    assert got["x"].tobytes() == full[tuple(index)].tobytes()
    assert got["again"].shape == spec.shape


def test_reads_stream_in_bounded_blocks(grid_ckpt, monkeypatch):
    monkeypatch.setattr(ckpt_format, "BLOCK_BYTES", 3 * GRID.itemsize)  # one row at a time
    spec = ShardSpec("grid", GRID.shape, GRID.dtype, (slice(1, 11, 4), slice(2, 7, 2)))
    assert np.array_equal(load_checkpoint(grid_ckpt, {"g": spec})["g"], GRID[1:11:4, 2:7:2])
    assert verify_checkpoint(grid_ckpt) == []


def test_wrong_requests_name_the_tensor(grid_ckpt):
    cases = [
        (ShardSpec("grid", GRID.shape, np.float64), "stored as float32, asked for float64"),
        (ShardSpec("grid", (11, 8), GRID.dtype), r"global shape \(11, 7\), asked for \(11, 8\)"),
        (ShardSpec("nope", (1,), GRID.dtype), "not in this checkpoint .*cube, grid"),
    ]
    for spec, message in cases:
        with pytest.raises(CheckpointError, match=message) as info:
            load_checkpoint(grid_ckpt, {"k": spec})
        assert info.value.tensor == spec.name and "index.h5" in str(info.value)
    with pytest.raises(CheckpointError, match="not a ShardSpec"):
        load_checkpoint(grid_ckpt, {"k": (slice(None),)})


# ---------------------------------------------------------------- what save refuses


def _one(name="w", array=None, index=()):
    a = np.arange(12, dtype=np.float32).reshape(3, 4) if array is None else array
    return {name: (ShardSpec(name, (3, 4), np.float32, index), a)}


@pytest.mark.parametrize(
    "tensors, attrs, message",
    [
        (_one(array=np.zeros((3, 4))), {}, "float64 but the spec says float32; convert"),
        (_one(array=np.zeros((2, 4), np.float32)), {}, r"shape \(2, 4\) but the slice"),
        (_one(index=(slice(0, 3, 2),)), {}, "step 1"),
        (_one(index=(slice(0, 2),), array=np.zeros((2, 4), np.float32)), {}, "hold 8 of its 12"),
        ({"w": np.zeros(3)}, {}, "must be a .ShardSpec, array. pair"),
        (_one(), {"step": 3}, "reserved"),
        (_one(), {"obj": object()}, "neither an HDF5 value nor JSON"),
    ],
)
def test_save_refuses_and_leaves_nothing(tmp_path, tensors, attrs, message):
    good = save_checkpoint(None, tmp_path, 1, _one(), writer=True)
    with pytest.raises(CheckpointError, match=message):
        save_checkpoint(None, tmp_path, 2, tensors, writer=True, attrs=attrs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert latest_checkpoint(tmp_path) == good


def test_shared_layout_needs_parallel_h5py(tmp_path):
    if h5py.get_config().mpi:
        with pytest.raises(CheckpointError, match="needs an MPI communicator"):
            save_checkpoint(None, tmp_path, 1, _one(), writer=True, layout="shared")
        return
    with pytest.raises(CheckpointError, match="parallel HDF5"):
        save_checkpoint(None, tmp_path, 1, _one(), writer=True, layout="shared")
    assert resolve_layout("auto", 10_000) == "shards"
    with pytest.raises(CheckpointError, match="not one of"):
        resolve_layout("striped", 1)
    assert not tmp_path.joinpath("step_000001.tmp").exists()


def test_a_non_writer_writes_nothing(tmp_path):
    path = save_checkpoint(None, tmp_path, 1, _one(), writer=False, attrs={"note": "empty"})
    assert [p.name for p in path.iterdir()] == ["index.h5"]
    assert read_attrs(path)["note"] == "empty" and verify_checkpoint(path) == []


# ---------------------------------------------------------------- directory protocol


def _steps(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def test_keep_rotates_only_after_the_new_one_is_complete(tmp_path):
    for step in range(1, 6):
        save_checkpoint(None, tmp_path, step, _one(), writer=True, keep=2)
        assert (tmp_path / "latest").read_text() == f"step_{step:06d}\n"
    assert _steps(tmp_path) == ["step_000004", "step_000005"]
    (tmp_path / "step_000002.tmp").mkdir()  # debris of an interrupted save
    save_checkpoint(None, tmp_path, 9, _one(), writer=True, keep=0)  # 0 keeps every one
    assert _steps(tmp_path) == ["step_000004", "step_000005", "step_000009"]  # debris gone
    # resumed from step 4: the newer step 9 belongs to an abandoned timeline and is kept
    save_checkpoint(None, tmp_path, 6, _one(), writer=True, keep=1)
    assert _steps(tmp_path) == ["step_000006", "step_000009"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000006"


def test_saving_a_step_again_replaces_it(tmp_path):
    first = save_checkpoint(None, tmp_path, 3, _one(), writer=True)
    old_id = read_attrs(first)["checkpoint_id"]
    twice = _one(array=2 * np.arange(12, dtype=np.float32).reshape(3, 4))
    second = save_checkpoint(None, tmp_path, 3, twice, writer=True)
    assert second == first and read_attrs(second)["checkpoint_id"] != old_id
    assert load_checkpoint(second, {"w": twice["w"][0]})["w"][2, 3] == 22
    assert _steps(tmp_path) == ["step_000003"]


def test_latest_follows_the_pointer_and_falls_back(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    for step in (1, 2):
        save_checkpoint(None, tmp_path, step, _one(), writer=True)
    (tmp_path / "latest").write_text("step_000001\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    for garbage in ("step_000777\n", "../../etc\n", "\xff\n"):
        (tmp_path / "latest").write_text(garbage, encoding="latin-1")
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    # a complete-looking .tmp (killed just before the rename) is never chosen
    tmp = tmp_path / "step_000003.tmp"
    tmp.mkdir()
    os.link(tmp_path / "step_000002" / "index.h5", tmp / "index.h5")
    (tmp_path / "latest").write_text("step_000003.tmp\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"


def test_resolve_accepts_run_checkpoints_and_step_dirs(tmp_path):
    ckpts = tmp_path / "checkpoints"
    path = save_checkpoint(None, ckpts, 5, _one(), writer=True)
    for where in (tmp_path, ckpts, path, path / "index.h5"):
        assert resolve_checkpoint(where) == path
    assert latest_checkpoint(tmp_path) == path
    with pytest.raises(CheckpointError, match="no such file"):
        resolve_checkpoint(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint here"):
        resolve_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        resolve_checkpoint(path / "shard_000000.h5")


def test_index_lists_every_slice_with_its_checksum(grid_ckpt):
    with h5py.File(grid_ckpt / "index.h5", "r") as f:
        assert list(f["tensors/name"].asstr()[()]) == ["cube", "grid"]
        assert f["slices/start"].shape == (8, 3) and len(f["slices/crc32"]) == 8
        assert json.loads(f.attrs["attr_codecs"]) == {}
        assert f.attrs["layout"] == b"shards"  # fixed-length UTF-8: h5py gives bytes


# ---------------------------------------------------------------- deck section


def test_checkpoint_section_in_a_deck(tmp_path):
    deck = tmp_path / "deck.toml"
    deck.write_text("[run]\noutput = 'runs/x'\n[checkpoint]\nevery = 50\nkeep = 2\n")
    cfg = load_config(deck, ["checkpoint.layout=shards", "checkpoint.fsync=false"]).checkpoint
    assert cfg == CheckpointConfig(every=50, keep=2, layout="shards", dir="", fsync=False)
    assert cfg.directory("runs/x").as_posix() == "runs/x/checkpoints"
    assert CheckpointConfig(dir="/scratch/ck").directory("runs/x").as_posix() == "/scratch/ck"
    for bad, message in [
        ("checkpoint.layout=striped", "is not one of"),
        ("checkpoint.keep=-1", "must be >= 0"),
        ("checkpoint.every=1.5", "must be an integer"),
        ("checkpoint.often=1", "is not a known key"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config(deck, [bad])
