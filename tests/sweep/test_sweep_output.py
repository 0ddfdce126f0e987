"""flux.h5, flux.xmf and the PNG slice from a real (one-process) run of the tiny deck."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe.config import dump_toml, load_config
from hpcpipe.sweep.mesh import build_problem
from hpcpipe.sweep.output import FORMAT_VERSION, read_flux
from hpcpipe.sweep.solver import LocalCells, SerialSweeper, solve
from hpcpipe.sweep.workload import run_sweep

TINY = Path(__file__).resolve().parents[2] / "inputs" / "sweep_tiny.toml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    config = load_config(TINY, ["sweep.plot=true"])
    out = tmp_path_factory.mktemp("sweep") / "run"
    lines: list[str] = []
    result = run_sweep(
        config.sweep, MPI.COMM_SELF, out, log=lines.append, config_text=dump_toml(config)
    )
    return out, config, result, lines


def test_flux_file_contents(run_dir):
    out, config, result, _ = run_dir
    sweep = config.sweep
    with h5py.File(out / "flux.h5") as f:
        assert f.attrs["format"] == "hpcpipe-sweep-flux"
        assert f.attrs["format_version"] == FORMAT_VERSION
        assert "[sweep]" in f.attrs["config"] and "sigma_t" in f.attrs["config"]
        assert f.attrs["iterations"] == result.iterations and f.attrs["converged"]
        assert f.attrs["balance_relative_error"] < 1e-9
        assert 0 < f.attrs["efficiency_measured"] <= 1
        assert f.attrs["efficiency_predicted"] == 1.0  # one rank: no pipeline fill
        np.testing.assert_allclose(f["mesh/x"][()], np.linspace(0, 4.0, 9))
        np.testing.assert_allclose(f["mesh/z"][()], np.linspace(0, 2.0, 5))
        assert f["mesh/material"].shape == (sweep.nz, sweep.ny, sweep.nx)
        assert sorted(f["flux"]) == ["group_000", "group_001"]
        assert f["flux/group_001"].shape == (sweep.nz, sweep.ny, sweep.nx)
        hist = f["history/dphi"][()]
        assert hist.size == result.iterations and hist[-1] <= sweep.tolerance
        assert f["history/sweep_seconds"].size == result.iterations


def test_flux_round_trips_and_matches_a_fresh_serial_solve(run_dir):
    out, config, result, _ = run_dir
    phi, attrs = read_flux(out / "flux.h5")
    assert attrs["iterations"] == result.iterations
    problem = build_problem(config.sweep)
    ref = solve(
        problem,
        LocalCells(problem),
        SerialSweeper(problem),
        tolerance=config.sweep.tolerance,
        max_iterations=200,
    )
    np.testing.assert_allclose(phi.reshape(-1, 2), ref.phi, rtol=1e-12)
    # material 1 (the absorbing box) is at x in [2, 4], y in [0, 2], z in [0, 1]
    with h5py.File(out / "flux.h5") as f:
        mat = f["mesh/material"][()].transpose(2, 1, 0)
    assert mat[6, 1, 0] == 1 and mat[1, 6, 3] == 0


def test_reader_refuses_other_versions(run_dir, tmp_path):
    out = run_dir[0]
    copy = tmp_path / "flux.h5"
    copy.write_bytes((out / "flux.h5").read_bytes())
    with h5py.File(copy, "a") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(ValueError, match="format version 2, this hpcpipe reads 1"):
        read_flux(copy)


def test_xdmf_points_at_existing_datasets(run_dir):
    out, config, _, _ = run_dir
    sweep = config.sweep
    root = ET.parse(out / "flux.xmf").getroot()
    topo = root.find("Domain/Grid/Topology")
    assert topo.get("TopologyType") == "3DCoRectMesh"
    assert topo.get("Dimensions") == f"{sweep.nz + 1} {sweep.ny + 1} {sweep.nx + 1}"
    spacing = root.findall("Domain/Grid/Geometry/DataItem")[1].text.split()
    assert [float(v) for v in spacing] == [0.5, 0.5, 0.5]
    attrs = root.findall("Domain/Grid/Attribute")
    assert [a.get("Name") for a in attrs] == ["material", "phi_g0", "phi_g1"]
    with h5py.File(out / "flux.h5") as f:
        for a in attrs:
            item = a.find("DataItem")
            file, _, path = item.text.partition(":")
            assert file == "flux.h5" and path in f
            assert tuple(int(v) for v in item.get("Dimensions").split()) == f[path].shape


def test_png_and_progress_lines(run_dir):
    out, _, result, lines = run_dir
    assert (out / "flux_slice.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    iters = [ln for ln in lines if ln.startswith("iter ")]
    assert len(iters) == result.iterations
    assert all("dphi=" in ln and "grind_ns=" in ln for ln in iters)
    done = [ln for ln in lines if ln.startswith("sweep done")]
    assert len(done) == 1
    for key in ("iterations=", "converged=true", "balance=", "efficiency=", "predicted="):
        assert key in done[0]
