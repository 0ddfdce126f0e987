"""Sweep mesh files ([sweep] mesh_file): the file equal to the box layout gives bitwise the same
flux as the boxes, in one process and on a 2 x 2 grid under mpiexec; each rank reads its block."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import INPUTS, run_mpi
from mpi4py import MPI

from hpcpipe.config import ConfigError, load_config
from hpcpipe.sweep import checkpointing, mesh
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.mesh import build_problem, write_mesh_file
from hpcpipe.sweep.output import read_flux
from hpcpipe.sweep.workload import run_sweep

TINY = INPUTS / "sweep_tiny.toml"
NO_BOXES = {"boxes": (), "box_materials": ()}


def _box_ids(cfg: SweepConfig) -> np.ndarray:
    return build_problem(cfg).material_ids(slice(None), slice(None))


@pytest.fixture
def tiny_mesh(tmp_path: Path) -> tuple[SweepConfig, SweepConfig, Path]:
    """The tiny deck (boxes), the same deck with a mesh file of its layout, and the file."""
    cfg = load_config(TINY).sweep
    path = write_mesh_file(tmp_path / "tiny_mesh.h5", _box_ids(cfg), cfg.lengths)
    return cfg, dataclasses.replace(cfg, mesh_file=str(path), **NO_BOXES), path


def test_writer_stores_format_checksummed_ids_and_lengths(tiny_mesh):
    cfg, _, path = tiny_mesh
    with h5py.File(path, "r") as f:
        assert f.attrs["format"].decode() == mesh.MESH_FORMAT
        assert int(f.attrs["format_version"]) == mesh.MESH_FORMAT_VERSION
        assert list(f.attrs["lengths"]) == list(cfg.lengths)
        ds = f[mesh.MESH_DATASET]
        assert ds.fletcher32 and ds.chunks is not None
        assert np.array_equal(ds[()], _box_ids(cfg))
    assert not list(path.parent.glob(".*.tmp"))  # written under a temporary name, renamed


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        (np.zeros((4, 4), dtype=np.int32), "3-D integer array"),
        (np.zeros((4, 4, 4)), "3-D integer array"),
        (np.full((2, 2, 2), -1), "must be >= 0"),
    ],
)
def test_writer_refuses_what_no_deck_could_use(tmp_path, ids, why):
    with pytest.raises(ValueError, match=why):
        write_mesh_file(tmp_path / "m.h5", ids)
    assert not (tmp_path / "m.h5").exists()


def test_every_block_equals_the_boxes(tiny_mesh):
    cfg, with_file, _ = tiny_mesh
    boxes, from_file = build_problem(cfg), build_problem(with_file)
    for xs in (slice(0, 4), slice(4, 8), slice(None)):
        for ys in (slice(0, 2), slice(2, 8), slice(None)):
            got = from_file.material_ids(xs, ys)
            assert got.dtype == np.int32
            assert np.array_equal(got, boxes.material_ids(xs, ys))


def test_mesh_file_and_boxes_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"sweep\.mesh_file = 'm\.h5' gives every cell's mat"):
        load_config(TINY, ["sweep.mesh_file='m.h5'"])


def test_checkpoints_from_before_mesh_file_still_resume(tiny_mesh):
    cfg, with_file, _ = tiny_mesh
    saved = checkpointing._plain(cfg)
    del saved["mesh_file"]  # written before the key existed: it had the default, ""
    checkpointing._check_same_problem(Path("ckpt"), saved, cfg)
    with pytest.raises(ConfigError, match=r"sweep\.mesh_file = '' there"):
        checkpointing._check_same_problem(Path("ckpt"), saved, with_file)


def test_one_process_run_is_bitwise_equal_to_the_boxes(tiny_mesh):
    cfg, with_file, _ = tiny_mesh
    quiet = {"log": lambda _m: None}
    a = run_sweep(cfg, MPI.COMM_SELF, None, **quiet)
    b = run_sweep(with_file, MPI.COMM_SELF, None, **quiet)
    assert a.converged and b.iterations == a.iterations
    assert np.array_equal(np.asarray(a.phi), np.asarray(b.phi))
    assert np.array_equal(a.history, b.history)


@pytest.mark.mpi
def test_mpiexec_2x2_run_is_bitwise_equal_to_the_boxes(tiny_mesh, tmp_path):
    _, _, path = tiny_mesh
    grid = ["--set", "sweep.px=2", "--set", "sweep.py=2"]
    runs = {}
    for name, extra in (
        ("boxes", []),
        (
            "file",
            [
                *("--set", f"sweep.mesh_file='{path}'"),
                *("--set", "sweep.boxes=[]", "--set", "sweep.box_materials=[]"),
            ],
        ),
    ):
        out = tmp_path / name
        r = run_mpi(4, ["run", str(TINY), *grid, *extra, "--set", f"run.output='{out}'"])
        assert r.returncode == 0, r.output
        runs[name] = read_flux(out / "flux.h5")
    (phi_a, attrs_a), (phi_b, attrs_b) = runs["boxes"], runs["file"]
    assert attrs_a["iterations"] == attrs_b["iterations"] and attrs_b["converged"]
    assert np.array_equal(phi_a, phi_b)
    with h5py.File(tmp_path / "file" / "flux.h5") as f:  # flux.h5 records the file's layout
        assert np.array_equal(
            f["mesh/material"][()],
            mesh.read_mesh_block(path, *[slice(None)] * 2, 2).transpose(2, 1, 0),
        )
