"""Problem generation, kept apart from the solve: mesh geometry, materials and their layout.

A `Problem` is small (it never holds a global cell array), so every rank builds the same one and
then asks only for the cells it owns: `material_ids(x_cells, y_cells)` paints a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcpipe.sweep.config import FACES, SweepConfig
from hpcpipe.sweep.quadrature import Quadrature, make_quadrature

__all__ = ["Materials", "Mesh", "Problem", "build_problem"]


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

    @property
    def groups(self) -> int:
        return self.materials.groups

    def material_ids(self, x_cells: slice, y_cells: slice) -> np.ndarray:
        """Material id of the block of cells [x_cells, y_cells, all z], shape (bx, by, nz)."""
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
    """Turn a validated [sweep] section into arrays (the same on every rank)."""
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
    )
