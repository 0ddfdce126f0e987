"""Problem generation, kept apart from the solve: mesh geometry, materials and their layout.

A `Problem` is small (it never holds a global cell array), so every rank builds the same one and
then asks only for the cells it owns: `material_ids(x_cells, y_cells)` paints a block from the
deck's boxes, or reads it from the `[sweep] mesh_file` (format: docs/formats.md, "Sweep mesh
files"). The file is checked when the problem is built, identically on every rank, so a bad one
exits with code 2 before any MPI work; each rank later reads only its own block.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.config import ConfigError
from hpcpipe.io.ckpt_format import LIBVER, set_attr
from hpcpipe.sweep.config import FACES, SweepConfig
from hpcpipe.sweep.quadrature import Quadrature, make_quadrature

__all__ = [
    "MESH_DATASET",
    "MESH_FORMAT",
    "MESH_FORMAT_VERSION",
    "MESH_SCAN_CELLS",
    "Materials",
    "Mesh",
    "Problem",
    "build_problem",
    "check_mesh_file",
    "read_mesh_block",
    "write_mesh_file",
]

MESH_FORMAT = "hpcpipe-sweep-mesh"
MESH_FORMAT_VERSION = 1
MESH_DATASET = "material_ids"
MESH_SCAN_CELLS = 1 << 24
"""Mesh files up to this many cells have every material id checked when the problem is built
(every rank reads the whole file once, at most 64 MiB of int32); larger ones are checked block by
block as each rank reads its own cells, so a bad id there stops the job from that rank."""
_SLAB_CELLS = 1 << 22
"""Cells read at a time while scanning a mesh file: bounded memory for any mesh size."""
_H5_ERRORS = (OSError, KeyError, ValueError, TypeError, RuntimeError)
"""What h5py raises for damaged files: turned into errors that name the file and the dataset."""


@dataclass(frozen=True)
class Mesh:
    """A uniform Cartesian mesh of nx x ny x nz cells over [0, lx] x [0, ly] x [0, lz]."""

    nx: int
    ny: int
    nz: int
    lx: float
    ly: float
    lz: float

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.nx, self.ny, self.nz)

    @property
    def cells(self) -> int:
        return self.nx * self.ny * self.nz

    @property
    def spacing(self) -> tuple[float, float, float]:
        return (self.lx / self.nx, self.ly / self.ny, self.lz / self.nz)

    @property
    def cell_volume(self) -> float:
        dx, dy, dz = self.spacing
        return dx * dy * dz

    def edges(self, axis: int) -> np.ndarray:
        """Cell boundaries along axis 0, 1 or 2 (n + 1 points)."""
        cells, size = ((self.nx, self.lx), (self.ny, self.ly), (self.nz, self.lz))[axis]
        return np.linspace(0.0, size, cells + 1)

    def centres(self, axis: int) -> np.ndarray:
        e = self.edges(axis)
        return 0.5 * (e[1:] + e[:-1])


@dataclass(frozen=True, eq=False)
class Materials:
    """Multigroup data by material id: sigma_t (M, G), sigma_s (M, G, G) g -> g', source (M, G)."""

    sigma_t: np.ndarray
    sigma_s: np.ndarray
    source: np.ndarray

    @property
    def groups(self) -> int:
        return int(self.sigma_t.shape[1])

    @property
    def sigma_a(self) -> np.ndarray:
        """Absorption: what leaves a group and is not scattered into any group."""
        return self.sigma_t - self.sigma_s.sum(axis=2)

    @property
    def scattering_ratio(self) -> np.ndarray:
        """c = sum_g' sigma_s[g -> g'] / sigma_t per material and group (source iteration rate)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.sigma_t > 0, self.sigma_s.sum(axis=2) / self.sigma_t, 0.0)


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything the solve needs except the decomposition: geometry, data, angles, boundaries."""

    mesh: Mesh
    materials: Materials
    quadrature: Quadrature
    scheme: str
    fixup: bool
    background: int
    boxes: tuple[tuple[float, ...], ...]
    box_materials: tuple[int, ...]
    incident: np.ndarray
    """(6, G) incoming angular flux on the faces x-, x+, y-, y+, z-, z+ (0 = vacuum)."""
    mesh_file: str = ""
    """Sweep mesh file giving every cell's material (checked by build_problem); "" = boxes."""
    kernel: str = "auto"
    """The deck's sweep kernel (config.KERNELS); the sweepers resolve it for their arrays."""

    @property
    def groups(self) -> int:
        return self.materials.groups

    def material_ids(self, x_cells: slice, y_cells: slice) -> np.ndarray:
        """Material id of the block of cells [x_cells, y_cells, all z], shape (bx, by, nz)."""
        if self.mesh_file:
            count = int(self.materials.sigma_t.shape[0])
            return read_mesh_block(self.mesh_file, x_cells, y_cells, count)
        xc = self.mesh.centres(0)[x_cells]
        yc = self.mesh.centres(1)[y_cells]
        zc = self.mesh.centres(2)
        ids = np.full((xc.size, yc.size, zc.size), self.background, dtype=np.int32)
        for (x0, x1, y0, y1, z0, z1), m in zip(self.boxes, self.box_materials, strict=True):
            inside = (
                ((xc >= x0) & (xc <= x1))[:, None, None]
                & ((yc >= y0) & (yc <= y1))[None, :, None]
                & ((zc >= z0) & (zc <= z1))[None, None, :]
            )
            ids[inside] = m
        return ids


def build_problem(cfg: SweepConfig) -> Problem:
    """Turn a validated [sweep] section into arrays (the same on every rank).

    With a `mesh_file`, the file is checked here (format, version, dataset shape and dtype,
    lengths, and every id of meshes up to MESH_SCAN_CELLS cells): a ConfigError naming the file.
    """
    if cfg.mesh_file:
        check_mesh_file(cfg.mesh_file, (cfg.nx, cfg.ny, cfg.nz), len(cfg.sigma_t), cfg.lengths)
    mesh = Mesh(cfg.nx, cfg.ny, cfg.nz, *cfg.lengths)
    materials = Materials(
        sigma_t=np.array(cfg.sigma_t, dtype=np.float64),
        sigma_s=np.array(cfg.sigma_s, dtype=np.float64),
        source=np.array(cfg.source, dtype=np.float64),
    )
    incident = np.zeros((6, cfg.groups))
    for face in cfg.incident_faces:
        incident[FACES.index(face)] = cfg.incident_flux
    return Problem(
        mesh=mesh,
        materials=materials,
        quadrature=make_quadrature(cfg.quadrature, cfg.order, cfg.azimuthal),
        scheme=cfg.scheme,
        fixup=cfg.fixup,
        background=cfg.material,
        boxes=cfg.boxes,
        box_materials=cfg.box_materials,
        incident=incident,
        mesh_file=cfg.mesh_file,
        kernel=cfg.kernel,
    )


# ---------------------------------------------------------------- sweep mesh files


def write_mesh_file(
    path: str | Path,
    material_ids: Any,
    lengths: Sequence[float] | None = None,
) -> Path:
    """Write a sweep mesh file (the `[sweep] mesh_file` input) atomically; returns its path.

    `material_ids` is an integer array (nx, ny, nz) of ids >= 0; `lengths` ([lx, ly, lz] cm),
    when given, is stored so that a deck with other sizes is refused. The dataset is chunked
    with HDF5's Fletcher32 checksum, so a flipped byte is an error on read, never a wrong id.
    """
    import h5py

    ids = np.asarray(material_ids)
    if ids.ndim != 3 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"material_ids must be a 3-D integer array (nx, ny, nz), got {ids.dtype}{ids.shape}"
        )
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"material_ids must be >= 0, found {int(ids.min())}")
    if min(ids.shape) < 1:
        raise ValueError(f"material_ids must have at least one cell per axis, got {ids.shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with h5py.File(tmp, "w", libver=LIBVER) as f:  # metadata blocks carry checksums
            set_attr(f.attrs, "format", MESH_FORMAT)  # fixed-length: no unchecked global heap
            f.attrs["format_version"] = np.int64(MESH_FORMAT_VERSION)
            if lengths is not None:
                sizes = np.asarray(lengths, dtype=np.float64)
                if sizes.shape != (3,) or not (np.isfinite(sizes).all() and (sizes > 0).all()):
                    raise ValueError(f"lengths must be three positive sizes, got {list(lengths)}")
                f.attrs["lengths"] = sizes
            f.create_dataset(MESH_DATASET, data=ids, chunks=True, fletcher32=True)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _mesh_error(path: str | Path, what: str, why: str) -> ConfigError:
    """Bad input (exit 2): `path: what why`, what = the dataset or attribute ("" = the file)."""
    return ConfigError(str(path), what, why)


def _open_mesh(path: str | Path) -> Any:
    import h5py

    p = Path(path)
    if not p.exists():
        raise _mesh_error(path, "", "no such file (sweep.mesh_file): give an existing mesh file")
    if not p.is_file():
        raise _mesh_error(path, "", "is not a file (sweep.mesh_file names an HDF5 mesh file)")
    try:
        return h5py.File(p, "r")
    except OSError as exc:
        kind = "is truncated" if "truncated" in str(exc) else "is not an HDF5 file or is damaged"
        raise _mesh_error(
            path,
            "",
            f"{kind} ({exc}); copy it again or re-create it with "
            "hpcpipe.sweep.mesh.write_mesh_file (sweep.mesh_file)",
        ) from None


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _check_header(path: str | Path, f: Any) -> None:
    """Format name and version: refuse foreign files and versions from the future."""
    fmt = _text(f.attrs.get("format"))
    if fmt != MESH_FORMAT:
        found = "no 'format' attribute" if fmt is None else f"'format' = {fmt!r}"
        raise _mesh_error(
            path,
            "",
            f"is not an hpcpipe sweep mesh file ({found}, expected {MESH_FORMAT!r}); write "
            "it with hpcpipe.sweep.mesh.write_mesh_file (docs/formats.md)",
        )
    version = f.attrs.get("format_version")
    if isinstance(version, np.ndarray) and version.shape == ():
        version = version[()]
    if isinstance(version, bool | np.bool_) or not isinstance(version, int | np.integer):
        raise _mesh_error(
            path, "attribute 'format_version'", f"= {version!r} is not an integer (expected 1)"
        )
    if version > MESH_FORMAT_VERSION:
        raise _mesh_error(
            path,
            "attribute 'format_version'",
            f"= {int(version)}: written by a newer hpcpipe; this one reads version "
            f"{MESH_FORMAT_VERSION}: upgrade hpcpipe to use it",
        )
    if version < 1:
        raise _mesh_error(
            path, "attribute 'format_version'", f"= {int(version)} is not a valid version"
        )


def _mesh_dataset(path: str | Path, f: Any, shape: tuple[int, int, int]) -> Any:
    """The material_ids dataset, checked for kind, shape and dtype."""
    import h5py

    if MESH_DATASET not in f:
        found: list[str] = []
        f.visititems(lambda k, v: found.append(k) if isinstance(v, h5py.Dataset) else None)
        raise _mesh_error(
            path,
            f"dataset {MESH_DATASET!r}",
            "is missing; datasets there: " + (", ".join(found) or "none"),
        )
    ds = f[MESH_DATASET]
    if not isinstance(ds, h5py.Dataset):
        raise _mesh_error(path, f"dataset {MESH_DATASET!r}", "is a group, not a dataset")
    if ds.shape != shape:
        raise _mesh_error(
            path,
            f"dataset {MESH_DATASET!r}",
            f"has shape {ds.shape}, expected (sweep.nx, sweep.ny, sweep.nz) = {shape}: "
            "write the mesh for this deck or change the deck's cell counts",
        )
    if ds.dtype.kind not in "iu":
        raise _mesh_error(
            path,
            f"dataset {MESH_DATASET!r}",
            f"is {ds.dtype}, expected an integer dtype (material ids index sweep.sigma_t rows)",
        )
    return ds


def _check_lengths(path: str | Path, f: Any, lengths: Sequence[float]) -> None:
    """The file's optional `lengths` must equal sweep.lengths: the deck stays the one source."""
    if "lengths" not in f.attrs:
        return
    raw = np.asarray(f.attrs["lengths"])
    if raw.shape != (3,) or raw.dtype.kind not in "iuf" or not np.isfinite(raw).all():
        raise _mesh_error(
            path, "attribute 'lengths'", f"= {raw.tolist()!r} is not three sizes [lx, ly, lz]"
        )
    stored = [float(v) for v in raw]
    if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(stored, lengths, strict=True)):
        raise _mesh_error(
            path,
            "attribute 'lengths'",
            f"= {stored} cm but sweep.lengths = {list(lengths)}: set sweep.lengths = {stored} "
            "(the file was made for that domain) or use a mesh file made for this one",
        )


def _check_ids(
    path: str | Path, block: np.ndarray, materials: int, origin: tuple[int, int], where: str
) -> None:
    """Every id in 0..materials-1; else name the first bad cell by its global index."""
    if not block.size:
        return
    bad = (block < 0) | (block >= materials)
    if not bad.any():
        return
    i, j, k = (int(v) for v in np.argwhere(bad)[0])
    value = int(block[i, j, k])
    cell = (origin[0] + i, origin[1] + j, k)
    raise _mesh_error(
        path,
        f"dataset {MESH_DATASET!r}",
        f"holds material id {value} at cell {cell}{where}, but the deck defines {materials} "
        f"material(s) (rows of sweep.sigma_t): ids must be 0..{materials - 1}",
    )


def _read(path: str | Path, ds: Any, index: tuple[slice, ...], what: str) -> np.ndarray:
    try:
        return np.asarray(ds[index])
    except _H5_ERRORS as exc:
        raise _mesh_error(
            path,
            f"dataset {MESH_DATASET!r}",
            f"cannot be read at {what} ({type(exc).__name__}: {exc}): the file is damaged "
            "(a flipped byte or a partial copy); copy it again or re-create it",
        ) from None


def check_mesh_file(
    path: str | Path,
    shape: tuple[int, int, int],
    materials: int,
    lengths: Sequence[float],
) -> None:
    """Check a sweep mesh file against the deck; raise ConfigError naming the file and what.

    Checks format and version, the dataset's presence, shape (nx, ny, nz) and integer dtype, the
    optional `lengths` attribute, and for meshes up to MESH_SCAN_CELLS cells every id (which
    also verifies the Fletcher32 checksums written by write_mesh_file). Pure and deterministic:
    every rank calls it and gets the same answer, so bad input exits 2 once.
    """
    with _open_mesh(path) as f:
        try:
            _check_header(path, f)
            ds = _mesh_dataset(path, f, tuple(shape))
            _check_lengths(path, f, lengths)
            cells = math.prod(shape)
            if cells > MESH_SCAN_CELLS:
                return
            per_x = max(1, _SLAB_CELLS // max(1, shape[1] * shape[2]))
            for x0 in range(0, shape[0], per_x):
                x1 = min(shape[0], x0 + per_x)
                slab = _read(path, ds, (slice(x0, x1),), f"x cells {x0}..{x1 - 1}")
                _check_ids(path, slab, materials, (x0, 0), "")
        except ConfigError:
            raise
        except _H5_ERRORS as exc:
            raise _mesh_error(
                path, "", f"is damaged ({type(exc).__name__}: {exc}); copy it again or re-create it"
            ) from None


def read_mesh_block(path: str | Path, x_cells: slice, y_cells: slice, materials: int) -> np.ndarray:
    """This rank's block [x_cells, y_cells, all z] of a checked mesh file, as int32 ids.

    Reads only the block (h5py hyperslab) and checks its ids; a damaged or out-of-range block is
    a ConfigError naming the file, the dataset and the cell range.
    """
    with _open_mesh(path) as f:
        try:
            ds = f[MESH_DATASET]
            nx, ny, _ = ds.shape
        except _H5_ERRORS as exc:
            raise _mesh_error(
                path, "", f"is damaged ({type(exc).__name__}: {exc}); copy it again or re-create it"
            ) from None
        xs, ys = range(nx)[x_cells], range(ny)[y_cells]
        where = f"x cells {xs.start}..{xs.stop - 1}, y cells {ys.start}..{ys.stop - 1}"
        block = _read(path, ds, (x_cells, y_cells, slice(None)), where)
    _check_ids(path, block, materials, (xs.start, ys.start), f" (block {where})")
    return block.astype(np.int32, copy=False)
