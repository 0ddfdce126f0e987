"""[sweep]: the discrete-ordinates problem and how its sweep is cut into pipelined blocks.

Materials are given as arrays indexed by material id: `sigma_t[m][g]`, `sigma_s[m][g][g']`
(scattering from group g into g', isotropic) and `source[m][g]`. The layout starts from
`material` everywhere and paints `boxes` in order (later boxes win); a cell belongs to a box when
its centre lies inside. Or `mesh_file` names an HDF5 file holding the material id of every cell
(format: docs/formats.md, "Sweep mesh files"), checked when the problem is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.config import option
from hpcpipe.sweep.quadrature import LEVEL_SYMMETRIC_ORDERS, QUADRATURES

__all__ = ["FACES", "KERNELS", "SweepConfig"]

FACES: tuple[str, ...] = ("x-", "x+", "y-", "y+", "z-", "z+")
"""Domain faces in the order used for incident-flux arrays: low then high side of x, y, z."""

KERNELS: tuple[str, ...] = ("auto", "numba", "numpy", "cuda")
"""Sweep kernels a deck may ask for (kernel.resolve_kernel says which one runs)."""


@dataclass(frozen=True)
class SweepConfig:
    """[sweep]: mesh, materials, quadrature, scheme, KBA blocking and source-iteration control."""

    px: int = option(1, "ranks along x (KBA grid); px * py must equal the world size", minimum=1)
    py: int = option(1, "ranks along y (KBA grid); each rank owns all of z", minimum=1)
    nx: int = option(8, "cells along x (divisible by px)", minimum=1)
    ny: int = option(8, "cells along y (divisible by py)", minimum=1)
    nz: int = option(8, "cells along z (divisible by z_block)", minimum=1)
    lengths: tuple[float, ...] = option(
        (1.0, 1.0, 1.0), "domain size [lx, ly, lz] in cm", minimum=0.0
    )
    groups: int = option(1, "energy groups", minimum=1)
    sigma_t: tuple[tuple[float, ...], ...] = option(
        ((1.0,),), "total cross section per material and group, 1/cm: [[m0g0, m0g1], ...]"
    )
    sigma_s: tuple[tuple[tuple[float, ...], ...], ...] = option(
        (((0.5,),),), "isotropic scattering per material, from group g (row) into g' (column)"
    )
    source: tuple[tuple[float, ...], ...] = option(
        ((1.0,),), "fixed isotropic source per material and group, particles/cm^3/s"
    )
    material: int = option(0, "material of every cell not inside a box", minimum=0)
    boxes: tuple[tuple[float, ...], ...] = option(
        (), "material boxes [x0, x1, y0, y1, z0, z1] in cm, painted in order"
    )
    box_materials: tuple[int, ...] = option((), "material id of each box", minimum=0)
    mesh_file: str = option(
        "",
        "HDF5 sweep mesh file (dataset material_ids, nx x ny x nz) giving every cell's material; "
        "replaces material and boxes; empty = material and boxes",
    )
    quadrature: str = option("level-symmetric", "angular set", choices=QUADRATURES)
    order: int = option(
        4,
        "S_N order (level-symmetric: 2, 4, 6, 8) or polar Gauss points (product, even)",
        minimum=2,
    )
    azimuthal: int = option(0, "product set: azimuths per quadrant; 0 = order / 2", minimum=0)
    scheme: str = option("dd", "spatial scheme: diamond difference or step", choices=("dd", "step"))
    fixup: bool = option(True, "diamond difference: zero negative outgoing faces and re-solve")
    kernel: str = option(
        "auto",
        "sweep kernel: numba (compiled loops), numpy (vectorised hyperplanes; also on CuPy "
        "arrays), cuda (compiled for the GPU, CuPy); auto = numba on the host when it is "
        "installed, else numpy; cuda on a GPU",
        choices=KERNELS,
    )
    z_block: int = option(
        0,
        "cells per z-block of the KBA pipeline (divides nz); 0 = chosen by the plan's cost "
        "model (hpcpipe plan shows the choice)",
        minimum=0,
    )
    angle_block: int = option(
        0,
        "directions per angle block (divides an octant's); 0 = chosen by the plan's cost model",
        minimum=0,
    )
    octant_order: str = option(
        "auto",
        "octant order: nearest (= auto) starts each rank at its nearest corners, so the "
        "corners' sweeps run at once (8M+2(ceil(Px/2)-1)+2(ceil(Py/2)-1) stages); yx / xy run "
        "one corner at a time on every rank, y or x flipping first (8M+2(Px-1)+3(Py-1) / "
        "8M+3(Px-1)+2(Py-1))",
        choices=("auto", "nearest", "yx", "xy"),
    )
    tolerance: float = option(1e-8, "stop when max|dphi| / max|phi| falls below this", minimum=0.0)
    max_iterations: int = option(200, "source iterations before giving up with an error", minimum=1)
    incident_faces: tuple[str, ...] = option(
        (), "faces with a fixed isotropic incoming flux; the others are vacuum", choices=FACES
    )
    incident_flux: tuple[float, ...] = option(
        (),
        "incoming angular flux per group (in scalar-flux units: an isotropic psi gives phi = psi)",
        minimum=0.0,
    )
    plot: bool = option(False, "also write flux_slice.png (mid-z slice of group 0)")

    def __post_init__(self) -> None:
        _check_mesh(self)
        _check_materials(self)
        if self.quadrature == "level-symmetric" and self.order not in LEVEL_SYMMETRIC_ORDERS:
            allowed = ", ".join(str(n) for n in LEVEL_SYMMETRIC_ORDERS)
            raise ValueError(f"order: = {self.order}: level-symmetric sets exist for {allowed}")
        if self.quadrature == "product" and self.order % 2:
            raise ValueError(
                f"order: = {self.order}: a product set needs an even number of polar points"
            )
        if self.angle_block and self.directions_per_octant % self.angle_block:
            raise ValueError(
                f"angle_block: = {self.angle_block} does not divide the "
                f"{self.directions_per_octant} directions per octant"
            )
        if self.incident_faces and len(self.incident_flux) != self.groups:
            raise ValueError(
                f"incident_flux: needs one value per group ({self.groups}), "
                f"got {len(self.incident_flux)}"
            )
        if len(set(self.incident_faces)) != len(self.incident_faces):
            raise ValueError("incident_faces: lists a face twice")

    @property
    def directions_per_octant(self) -> int:
        if self.quadrature == "level-symmetric":
            return self.order * (self.order + 2) // 8
        return (self.order // 2) * (self.azimuthal or max(1, self.order // 2))

    @property
    def z_block_size(self) -> int:
        """z_block as given, 0 counted as one block (the fewest tasks the deck can mean; the
        plan's own choice for 0 keeps within blocking.MAX_TASKS)."""
        return self.z_block or self.nz

    @property
    def angle_block_size(self) -> int:
        return self.angle_block or self.directions_per_octant


def _check_mesh(c: SweepConfig) -> None:
    if len(c.lengths) != 3 or min(c.lengths) <= 0:
        raise ValueError(f"lengths: = {list(c.lengths)} must be three positive sizes [lx, ly, lz]")
    if c.nx % c.px:
        raise ValueError(f"nx: = {c.nx} cells cannot be split evenly over px = {c.px} ranks")
    if c.ny % c.py:
        raise ValueError(f"ny: = {c.ny} cells cannot be split evenly over py = {c.py} ranks")
    if c.z_block and c.nz % c.z_block:
        raise ValueError(f"z_block: = {c.z_block} does not divide nz = {c.nz}")


def _check_materials(c: SweepConfig) -> None:
    n = len(c.sigma_t)
    g = c.groups
    if n == 0:
        raise ValueError("sigma_t: needs at least one material")
    for key, table in (("sigma_s", c.sigma_s), ("source", c.source)):
        if len(table) != n:
            raise ValueError(f"{key}: has {len(table)} materials, sigma_t has {n}")
    for m in range(n):
        if len(c.sigma_t[m]) != g:
            raise ValueError(f"sigma_t: material {m} has {len(c.sigma_t[m])} groups, expected {g}")
        if len(c.source[m]) != g:
            raise ValueError(f"source: material {m} has {len(c.source[m])} groups, expected {g}")
        if len(c.sigma_s[m]) != g or any(len(row) != g for row in c.sigma_s[m]):
            raise ValueError(f"sigma_s: material {m} must be a {g} x {g} matrix (from g into g')")
        for key, values in (
            ("sigma_t", c.sigma_t[m]),
            ("source", c.source[m]),
            ("sigma_s", [v for row in c.sigma_s[m] for v in row]),
        ):
            bad = [v for v in values if v < 0]
            if bad:
                raise ValueError(
                    f"{key}: material {m} has a negative value {bad[0]} "
                    "(cross sections and sources must be >= 0)"
                )
    if c.material >= n:
        raise ValueError(f"material: = {c.material} but only {n} materials are defined")
    if c.mesh_file and (c.boxes or c.box_materials):
        raise ValueError(
            f"mesh_file: = {c.mesh_file!r} gives every cell's material, so boxes and "
            "box_materials must be empty (set sweep.boxes = [] and sweep.box_materials = [])"
        )
    if len(c.box_materials) != len(c.boxes):
        raise ValueError(f"box_materials: has {len(c.box_materials)} ids for {len(c.boxes)} boxes")
    for b, (box, m) in enumerate(zip(c.boxes, c.box_materials, strict=True)):
        if len(box) != 6 or box[0] > box[1] or box[2] > box[3] or box[4] > box[5]:
            raise ValueError(
                f"boxes: box {b} = {list(box)} must be [x0, x1, y0, y1, z0, z1] "
                "with x0 <= x1, y0 <= y1, z0 <= z1"
            )
        if m >= n:
            raise ValueError(f"box_materials: box {b} uses material {m}, only {n} are defined")
