"""The sweep kernel: one block of cells x one block of directions x all groups, by hyperplanes.

Cells on a hyperplane I + J + K = h (I, J, K counted from the upwind corner) depend only on
plane h - 1, so each plane is one vectorised update over (cells on the plane) x (directions) x
(groups). Python loops over planes only. `xp` is the array module (NumPy, or CuPy on a GPU).

Face arrays carry the angular flux between cells: `fx[j * bz + k]` holds the x-face flux of row
(j, k) (incoming before a cell is solved, outgoing after), likewise `fy[i * bz + k]` and
`fz[i * by + j]`. Each row has one cell per plane, so one array serves the whole block and ends
holding the block's outgoing faces, which are exactly the messages for the downwind ranks.

On a GPU nothing here copies to the host: the negative-flux fix-up, which on the CPU gathers
the few offending elements (asking the host whether there are any), runs as masked whole-plane
arithmetic instead, giving the same numbers without a device-to-host round trip per plane.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.sweep.compiled import PROGRESS_UNKNOWNS, sweep_block_compiled
from hpcpipe.sweep.compiled import available as compiled_available
from hpcpipe.sweep.config import KERNELS
from hpcpipe.sweep.cuda_kernel import runs_on as cuda_runs_on
from hpcpipe.sweep.cuda_kernel import sweep_block_cuda
from hpcpipe.sweep.mesh import Problem
from hpcpipe.sweep.quadrature import OCTANTS, Quadrature

__all__ = [
    "AngleBlock",
    "BlockOrder",
    "angle_block",
    "block_order",
    "face_current",
    "resolve_kernel",
    "sweep_block",
    "sweep_domain",
]


@dataclass(frozen=True, eq=False)
class BlockOrder:
    """The cells of a (bx, by, bz) block sorted by hyperplane for one octant.

    `cells` indexes the rank's flat (bx, by, nz) arrays for a block starting at z = 0 (add the
    block's first z to shift it); `offsets[h]:offsets[h + 1]` is plane h.
    """

    shape: tuple[int, int, int]
    nz: int
    octant: int
    cells: Any
    fx: Any
    fy: Any
    fz: Any
    offsets: tuple[int, ...]


def block_order(
    xp: Any, shape: tuple[int, int, int], nz: int, octant: int, kernel: str = "numpy"
) -> BlockOrder:
    """Hyperplane order of a block for one octant; `nz` is the z extent of the flat arrays.

    The numba and cuda kernels walk the block in loop order and need no index arrays (building
    them costs about as much as the compiled sweep of the block), so for them they are empty.
    """
    if kernel in ("numba", "cuda"):
        return BlockOrder(shape, nz, octant, None, None, None, None, ())
    bx, by, bz = shape
    sx, sy, sz = OCTANTS[octant]
    big_i, big_j, big_k = (a.ravel() for a in np.indices(shape))
    sort = np.argsort(big_i + big_j + big_k, kind="stable")
    big_i, big_j, big_k = big_i[sort], big_j[sort], big_k[sort]
    i = big_i if sx > 0 else bx - 1 - big_i
    j = big_j if sy > 0 else by - 1 - big_j
    k = big_k if sz > 0 else bz - 1 - big_k
    counts = np.bincount(big_i + big_j + big_k, minlength=bx + by + bz - 2)
    offsets = tuple(int(v) for v in np.concatenate([[0], np.cumsum(counts)]))
    return BlockOrder(
        shape=shape,
        nz=nz,
        octant=octant,
        cells=xp.asarray((i * by + j) * nz + k),
        fx=xp.asarray(j * bz + k),
        fy=xp.asarray(i * bz + k),
        fz=xp.asarray(i * by + j),
        offsets=offsets,
    )


@dataclass(frozen=True, eq=False)
class AngleBlock:
    """Per-direction constants of one block of directions, shaped to broadcast over (P, A, G).

    `cx` is 2|mu|/dx for diamond difference and |mu|/dx for step (likewise cy, cz); `wmu` etc.
    are w|mu| for face currents. `flat` holds (cx, cy, cz, total, weights) as 1-D host arrays
    for the compiled kernel.
    """

    weights: Any
    cx: Any
    cy: Any
    cz: Any
    total: Any
    wmu: Any
    weta: Any
    wxi: Any
    flat: tuple[np.ndarray, ...] = ()

    @property
    def size(self) -> int:
        return int(self.weights.shape[0])


def angle_block(
    xp: Any,
    quad: Quadrature,
    start: int,
    stop: int,
    spacing: tuple[float, float, float],
    scheme: str,
) -> AngleBlock:
    """Constants for directions [start, stop) of an octant (the same in every octant)."""
    dx, dy, dz = spacing
    factor = 2.0 if scheme == "dd" else 1.0
    mu, eta, xi = (a[start:stop] for a in (quad.mu, quad.eta, quad.xi))
    w = quad.weights[start:stop]
    cx, cy, cz = factor * mu / dx, factor * eta / dy, factor * xi / dz
    col = lambda a: xp.asarray(a[:, None])  # noqa: E731
    return AngleBlock(
        xp.asarray(w),
        col(cx),
        col(cy),
        col(cz),
        col(cx + cy + cz),
        xp.asarray(w * mu),
        xp.asarray(w * eta),
        xp.asarray(w * xi),
        tuple(np.ascontiguousarray(a) for a in (cx, cy, cz, cx + cy + cz, w)),
    )


def resolve_kernel(name: str, xp: Any = np) -> str:
    """The kernel a sweep runs for a deck's `kernel` (config.KERNELS) with arrays of `xp`
    (None: a GPU run being planned): auto = numba on the host when it is installed, else
    numpy; cuda on a GPU (numpy for a stand-in array module that is not CuPy). Raises
    ValueError saying what to do when the one asked for cannot run here."""
    if name not in KERNELS:
        raise ValueError(f"unknown sweep kernel {name!r}; known: {', '.join(KERNELS)}")
    on_gpu = xp is None or cuda_runs_on(xp)
    if name == "auto":
        if xp is np:
            return "numba" if compiled_available() else "numpy"
        return "cuda" if on_gpu else "numpy"
    if name == "cuda" and not on_gpu:
        raise ValueError(
            "the cuda kernel runs on CuPy arrays: set device.kind = 'cuda', or use 'auto' "
            "(numba or numpy on the host)"
        )
    if name == "numba" and xp is not np:
        raise ValueError(
            "the numba kernel runs on host arrays; with device.kind = 'cuda' use 'auto' or "
            "'cuda' (compiled for the GPU) or 'numpy' (the hyperplane kernel on CuPy arrays)"
        )
    if name == "numba" and not compiled_available():
        raise ValueError(
            "numba is not installed here: pip install numba, or use 'auto' (which falls "
            "back to the NumPy kernel) or 'numpy'"
        )
    return name


def face_current(face: Any, wcos: Any) -> Any:
    """Per-group particle current through a face array (nf, A, G), per unit face area (the
    cells summed first: half the time of weighting every cell's directions)."""
    return wcos @ face.sum(axis=0)


def sweep_block(
    xp: Any,
    order: BlockOrder,
    z0: int,
    angles: AngleBlock,
    q: Any,
    sigma_t: Any,
    phi: Any,
    fx: Any,
    fy: Any,
    fz: Any,
    scheme: str = "dd",
    fixup: bool = True,
    kernel: str = "numpy",
    progress: Callable[[], None] | None = None,
) -> None:
    """Solve one block for one angle block; updates `phi` and the face arrays in place.

    `q` and `sigma_t` are (cells, G) over the rank's flat (bx, by, nz) arrays; `q` is the
    isotropic source per unit angular weight (scattering + fixed). The arithmetic per cell and
    direction does not depend on the blocking, so every decomposition gives the same psi.
    `kernel` is a resolved name (`resolve_kernel`): "numba" runs compiled.py's loops instead,
    "cuda" cuda_kernel.py's (one launch, asynchronous: nothing to progress meanwhile).
    `progress` (the executor's MPI progress) is called every so often during the block.
    """
    if kernel == "cuda":
        coefficients = (angles.cx, angles.cy, angles.cz, angles.total, angles.weights)
        sweep_block_cuda(
            xp,
            order.shape,
            order.nz,
            z0,
            OCTANTS[order.octant],
            coefficients,
            q,
            sigma_t,
            phi,
            (fx, fy, fz),
            scheme == "dd",
            fixup,
        )
        return
    if kernel == "numba":
        sweep_block_compiled(
            order.shape,
            order.nz,
            z0,
            OCTANTS[order.octant],
            angles.flat,
            q,
            sigma_t,
            phi,
            (fx, fy, fz),
            scheme == "dd",
            fixup,
            progress,
        )
        return
    cells = order.cells + z0 if z0 else order.cells
    off = order.offsets
    cx, cy, cz, total = angles.cx, angles.cy, angles.cz, angles.total
    w = angles.weights
    dd = scheme == "dd"
    take = xp.take
    per_cell = fx.shape[1] * fx.shape[2]
    since = 0
    for h in range(len(off) - 1):
        if progress is not None and since >= PROGRESS_UNKNOWNS:
            progress()
            since = 0
        since += (off[h + 1] - off[h]) * per_cell
        s = slice(off[h], off[h + 1])
        c, ix, iy, iz = cells[s], order.fx[s], order.fy[s], order.fz[s]
        ax, ay, az = take(fx, ix, axis=0), take(fy, iy, axis=0), take(fz, iz, axis=0)
        qc = take(q, c, axis=0)[:, None, :]
        sig = take(sigma_t, c, axis=0)[:, None, :]
        # psi = (q + cx ax + cy ay + cz az) / (sigma_t + cx + cy + cz), without temporaries
        psi = cx * ax
        psi += qc
        tmp = cy * ay
        psi += tmp
        xp.multiply(cz, az, out=tmp)
        psi += tmp
        psi /= sig + total
        if dd:
            two = psi + psi
            ox, oy, oz = two - ax, two - ay, two - az
            if fixup:
                fix = _fixup if xp is np else _fixup_masked
                fix(xp, psi, ox, oy, oz, qc, sig, cx, cy, cz)
            fx[ix], fy[iy], fz[iz] = ox, oy, oz
        else:
            fx[ix], fy[iy], fz[iz] = psi, psi, psi
        phi[c] += w @ psi


def _rebalance(
    xp: Any,
    fix: tuple[Any, Any, Any],
    inc: tuple[Any, Any, Any],
    k: tuple[Any, Any, Any],
    src: Any,
    sig: Any,
    zero: Any,
) -> tuple[Any, Any, Any, Any]:
    """One fix-up round: the cell balance with the faces in `fix` set to 0; returns the cell
    value and the three outgoing faces. Shared by both fix-ups so they agree bit for bit."""
    den = sig
    num = src
    for f, a, c in zip(fix, inc, k, strict=True):
        den = den + xp.where(f, zero, c)
        num = num + xp.where(f, 0.5 * c, c) * a
    cell = num / den
    outs = tuple(xp.where(f, zero, 2.0 * cell - a) for f, a in zip(fix, inc, strict=True))
    return cell, *outs


def _fixup(
    xp: Any,
    psi: Any,
    ox: Any,
    oy: Any,
    oz: Any,
    q: Any,
    st: Any,
    cx: Any,
    cy: Any,
    cz: Any,
) -> None:
    """Negative-flux fix-up: zero each negative outgoing face and re-solve the cell balance.

    With face d set to 0 the balance (|mu_d|/h_d)(out_d - in_d) loses its diamond relation, so
    that face contributes (|mu_d|/h_d) in_d to the right side and nothing to the left. Repeats
    until no face is negative (at most three rounds); works only on the offending elements.

    The incoming faces are taken back from the diamond relation, in_d = 2 psi - out_d (within
    an ulp of 2 psi of the face that came in), so that no kernel has to keep them: the compiled
    kernel's pass over a cell then stores nothing but psi and the outgoing faces, which made
    its fix-up cost 1.20x the kernel without it where keeping them cost 1.27x (Kripke's
    problem). Every kernel takes them back this way, so all give the same faces bit for bit.
    """
    neg = (ox < 0) | (oy < 0) | (oz < 0)
    if not bool(neg.any()):
        return
    p, a, g = xp.nonzero(neg)
    zero = xp.zeros(1, dtype=psi.dtype)
    k = (cx[a, 0], cy[a, 0], cz[a, 0])
    src, sig = q[p, 0, g], st[p, 0, g]
    out = (ox[p, a, g], oy[p, a, g], oz[p, a, g])
    cell = psi[p, a, g]
    two = cell + cell
    inc = tuple(two - o for o in out)
    fix = (xp.zeros(p.shape, dtype=bool),) * 3
    for _ in range(3):
        fix = tuple(f | (o < 0) for f, o in zip(fix, out, strict=True))
        cell, *out = _rebalance(xp, fix, inc, k, src, sig, zero)
        if not bool(((out[0] < 0) | (out[1] < 0) | (out[2] < 0)).any()):
            break
    psi[p, a, g], ox[p, a, g], oy[p, a, g], oz[p, a, g] = cell, *out


def _fixup_masked(
    xp: Any,
    psi: Any,
    ox: Any,
    oy: Any,
    oz: Any,
    q: Any,
    st: Any,
    cx: Any,
    cy: Any,
    cz: Any,
) -> None:
    """`_fixup` for device arrays: the same arithmetic on the whole plane under masks.

    `_fixup` asks the host whether any face is negative and gathers the offenders, both of
    which wait for the device. Here every element runs the three rounds (a round that fixes no
    new face repeats the previous one exactly, so the early exit changes nothing) and only the
    elements with a negative face take the result: equal to `_fixup` element for element.
    """
    bad = (ox < 0) | (oy < 0) | (oz < 0)
    zero = xp.zeros(1, dtype=psi.dtype)
    out = (ox, oy, oz)
    fix = (ox < 0, oy < 0, oz < 0)
    two = psi + psi
    inc = (two - ox, two - oy, two - oz)
    cell = psi
    for _ in range(3):
        fix = tuple(f | (o < 0) for f, o in zip(fix, out, strict=True))
        cell, *out = _rebalance(xp, fix, inc, (cx, cy, cz), q, st, zero)
    psi[...] = xp.where(bad, cell, psi)
    for face, new in zip((ox, oy, oz), out, strict=True):
        face[...] = xp.where(bad, new, face)


def sweep_domain(
    xp: Any, problem: Problem, q: Any, sigma_t: Any, kernel: str = "numpy"
) -> tuple[Any, Any, Any]:
    """The serial reference: every octant over the whole mesh with all its directions at once.

    Returns (phi (cells, G), outflow (G,), inflow (G,)), flows being particles per second
    through the domain surface. The KBA executor must reproduce this to round-off.
    """
    mesh, quad = problem.mesh, problem.quadrature
    nx, ny, nz = mesh.shape
    dx, dy, dz = mesh.spacing
    groups = problem.groups
    angles = angle_block(xp, quad, 0, quad.per_octant, mesh.spacing, problem.scheme)
    n = quad.per_octant
    phi = xp.zeros((mesh.cells, groups))
    outflow = xp.zeros(groups)
    inflow = xp.zeros(groups)
    inc = problem.incident
    for octant in range(8):
        sx, sy, sz = OCTANTS[octant]
        order = block_order(xp, mesh.shape, nz, octant, kernel)
        faces = []
        for axis, (nf, s) in enumerate(((ny * nz, sx), (nx * nz, sy), (nx * ny, sz))):
            value = inc[2 * axis + (0 if s > 0 else 1)]
            faces.append(xp.asarray(np.broadcast_to(value, (nf, n, groups)).copy()))
        fx, fy, fz = faces
        inflow += (
            face_current(fx, angles.wmu) * (dy * dz)
            + face_current(fy, angles.weta) * (dx * dz)
            + face_current(fz, angles.wxi) * (dx * dy)
        )
        sweep_block(
            xp, order, 0, angles, q, sigma_t, phi, fx, fy, fz, problem.scheme, problem.fixup, kernel
        )
        outflow += (
            face_current(fx, angles.wmu) * (dy * dz)
            + face_current(fy, angles.weta) * (dx * dz)
            + face_current(fz, angles.wxi) * (dx * dy)
        )
    return phi, outflow, inflow
