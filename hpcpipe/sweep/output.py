"""Sweep outputs: flux.h5 (scalar flux per group, mesh, iteration history, resolved config),
its XDMF sidecar flux.xmf for ParaView / VisIt, and an optional PNG slice.

Layout of flux.h5 (format "hpcpipe-sweep-flux", version 1). Cell arrays are stored (nz, ny, nx),
x fastest, which is the order XDMF and VTK readers expect:

    /mesh/x, /mesh/y, /mesh/z     cell edges (n + 1 each), cm
    /mesh/material                material id per cell, int32 (nz, ny, nx)
    /flux/group_000 ...           scalar flux per group, float64 (nz, ny, nx)
    /history/dphi                 max|dphi| / max|phi| per source iteration
    /history/sweep_seconds        wall time of each sweep
    attributes                    format, format_version, code_version, config (TOML text),
                                  iterations, converged, balance_*, grind_ns, efficiency_*
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcpipe import __version__
from hpcpipe.sweep.mesh import Problem

__all__ = ["FORMAT", "FORMAT_VERSION", "read_flux", "write_flux", "write_slice_png", "write_xdmf"]

FORMAT = "hpcpipe-sweep-flux"
FORMAT_VERSION = 1


def write_flux(
    path: Path,
    problem: Problem,
    phi: np.ndarray,
    *,
    config_text: str,
    history: np.ndarray,
    sweep_seconds: np.ndarray,
    attrs: dict[str, Any],
) -> None:
    """Write the global scalar flux `phi` (nx, ny, nz, G) and run figures; rank 0 only."""
    mesh = problem.mesh
    tmp = path.with_suffix(".h5.partial")
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["code_version"] = __version__
        f.attrs["config"] = config_text
        f.attrs["axes"] = "z,y,x"
        f.attrs["quadrature"] = str(problem.quadrature)
        f.attrs["scheme"] = problem.scheme
        for key, value in attrs.items():
            f.attrs[key] = value
        g = f.create_group("mesh")
        for axis, name in enumerate("xyz"):
            g.create_dataset(name, data=mesh.edges(axis))
        ids = problem.material_ids(slice(None), slice(None))
        g.create_dataset("material", data=ids.transpose(2, 1, 0), compression="gzip")
        fl = f.create_group("flux")
        for grp in range(phi.shape[-1]):
            fl.create_dataset(f"group_{grp:03d}", data=phi[..., grp].transpose(2, 1, 0))
        h = f.create_group("history")
        h.create_dataset("dphi", data=np.asarray(history, dtype=np.float64))
        h.create_dataset("sweep_seconds", data=np.asarray(sweep_seconds, dtype=np.float64))
    tmp.replace(path)


def read_flux(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """Scalar flux (nx, ny, nz, G) and the file attributes; refuses other formats or versions."""
    with h5py.File(path, "r") as f:
        fmt, version = f.attrs.get("format"), f.attrs.get("format_version")
        if fmt != FORMAT:
            raise ValueError(f"{path}: not a sweep flux file (format {fmt!r}, expected {FORMAT!r})")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{path}: flux format version {version}, this hpcpipe reads "
                f"{FORMAT_VERSION}; use the hpcpipe that wrote it"
            )
        names = sorted(f["flux"])
        phi = np.stack([f["flux"][n][()].transpose(2, 1, 0) for n in names], axis=-1)
        attrs = dict(f.attrs)
    return phi, attrs


def write_xdmf(path: Path, h5_name: str, problem: Problem) -> None:
    """XDMF 3 sidecar: a co-rectilinear grid with one cell attribute per group plus materials."""
    mesh = problem.mesh
    nx, ny, nz = mesh.shape
    dx, dy, dz = mesh.spacing
    dims = f"{nz} {ny} {nx}"
    attrs = [_xdmf_attribute("material", f"{h5_name}:/mesh/material", dims, "Int", 4)]
    attrs += [
        _xdmf_attribute(f"phi_g{g}", f"{h5_name}:/flux/group_{g:03d}", dims, "Float", 8)
        for g in range(problem.groups)
    ]
    text = f"""<?xml version="1.0" ?>
<Xdmf Version="3.0">
  <Domain>
    <Grid Name="sweep" GridType="Uniform">
      <Topology TopologyType="3DCoRectMesh" Dimensions="{nz + 1} {ny + 1} {nx + 1}"/>
      <Geometry GeometryType="ORIGIN_DXDYDZ">
        <DataItem Dimensions="3" NumberType="Float" Precision="8" Format="XML">0 0 0</DataItem>
        <DataItem Dimensions="3" NumberType="Float" Precision="8" Format="XML">{dz!r} {dy!r} {dx!r}</DataItem>
      </Geometry>
{"".join(attrs)}    </Grid>
  </Domain>
</Xdmf>
"""  # noqa: E501
    path.write_text(text, encoding="utf-8")


def _xdmf_attribute(name: str, ref: str, dims: str, number: str, precision: int) -> str:
    return (
        f'      <Attribute Name="{name}" AttributeType="Scalar" Center="Cell">\n'
        f'        <DataItem Dimensions="{dims}" NumberType="{number}" '
        f'Precision="{precision}" Format="HDF">{ref}</DataItem>\n'
        "      </Attribute>\n"
    )


def write_slice_png(path: Path, problem: Problem, phi: np.ndarray, group: int = 0) -> None:
    """Mid-height z slice of one group's scalar flux, log colour scale when it spans decades."""
    from hpcpipe.plotting import pyplot

    plt = pyplot("sweep", "sweep.plot")
    from matplotlib.colors import LogNorm

    mesh = problem.mesh
    k = mesh.nz // 2
    data = phi[:, :, k, group].T
    positive = data[data > 0]
    norm = None
    if positive.size and positive.max() / positive.min() > 100:
        norm = LogNorm(vmin=positive.min(), vmax=positive.max())
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    im = ax.pcolormesh(
        mesh.edges(0),
        mesh.edges(1),
        np.where(data > 0, data, np.nan) if norm else data,
        norm=norm,
        shading="flat",
    )
    fig.colorbar(im, ax=ax, label=f"scalar flux, group {group}")
    ax.set_xlabel("x (cm)")
    ax.set_ylabel("y (cm)")
    ax.set_title(f"z = {mesh.centres(2)[k]:.3g} cm")
    ax.set_aspect("equal")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
