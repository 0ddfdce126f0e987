"""[sweep] deck checks: every bad input is an error that names the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcpipe.config import ConfigError, dump_toml, load_config
from hpcpipe.sweep.config import SweepConfig
from hpcpipe.sweep.mesh import build_problem

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "inputs" / "sweep_tiny.toml"
KOBAYASHI = ROOT / "inputs" / "sweep_kobayashi.toml"


def test_decks_load_and_round_trip():
    for deck in (TINY, KOBAYASHI):
        config = load_config(deck)
        assert config.run.workload == "sweep"
        sweep = config.sweep
        assert isinstance(sweep, SweepConfig)
        problem = build_problem(sweep)
        assert problem.mesh.shape == (sweep.nx, sweep.ny, sweep.nz)
        assert problem.groups == sweep.groups


def test_resolved_deck_reloads_identically(tmp_path):
    config = load_config(TINY)
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(config))
    assert load_config(path).sweep == config.sweep


def test_kobayashi_layout():
    problem = build_problem(load_config(KOBAYASHI).sweep)
    ids = problem.material_ids(slice(None), slice(None))
    assert ids[0, 0, 0] == 0 and ids[30, 30, 30] == 2 and ids[20, 30, 30] == 1
    assert (ids == 2).sum() == 6**3  # 20 cm source cube of 3.33 cm cells


@pytest.mark.parametrize(
    "override,key,text",
    [
        ("sweep.px=3", "sweep.nx", "= 8 cells cannot be split evenly over px = 3 ranks"),
        ("sweep.py=3", "sweep.ny", "= 8 cells cannot be split evenly over py = 3 ranks"),
        ("sweep.z_block=3", "sweep.z_block", "= 3 does not divide nz = 4"),
        ("sweep.angle_block=2", "sweep.angle_block", "does not divide the 3 directions"),
        ("sweep.sigma_t=[[1.0, -1.5], [2.0, 4.0]]", "sweep.sigma_t", "negative value -1.5"),
        ("sweep.quadrature='lebedev'", "sweep.quadrature", "is not one of 'level-symmetric'"),
        ("sweep.order=10", "sweep.order", "level-symmetric sets exist for 2, 4, 6, 8"),
        ("sweep.scheme='weighted'", "sweep.scheme", "is not one of 'dd', 'step'"),
        ("sweep.groups=3", "sweep.sigma_t", "material 0 has 2 groups, expected 3"),
        ("sweep.box_materials=[5]", "sweep.box_materials", "uses material 5, only 2"),
        ("sweep.incident_faces=['x-', 'w+']", "sweep.incident_faces", "'w+' is not one of"),
        ("sweep.incident_flux=[1.0]", "sweep.incident_flux", "one value per group (2)"),
        ("sweep.lengths=[1.0, 0.0, 1.0]", "sweep.lengths", "three positive sizes"),
        ("sweep.nx=0", "sweep.nx", "must be >= 1"),
        ("sweep.colour='red'", "sweep.colour", "is not a known key"),
        ("sweep.kernel='fortran'", "sweep.kernel", "is not one of 'auto', 'numba', 'numpy'"),
    ],
)
def test_bad_input_names_the_key(override, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert err.value.key == key
    assert text in str(err.value)
    assert str(TINY) in str(err.value)


def test_bad_scattering_matrix_shape():
    with pytest.raises(ValueError, match="sigma_s: material 0 must be a 1 x 1 matrix"):
        SweepConfig(sigma_s=(((0.1, 0.2),),))


def test_derived_sizes():
    cfg = SweepConfig(quadrature="product", order=6, azimuthal=0, nz=8, z_block=2)
    assert cfg.directions_per_octant == 9
    assert cfg.angle_block_size == 9 and cfg.z_block_size == 2
    assert SweepConfig(order=8).directions_per_octant == 10
