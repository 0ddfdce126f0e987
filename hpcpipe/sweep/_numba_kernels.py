"""numba-compiled loops of the sweep (imported by compiled.py only when numba is installed).

Each (direction, group) element of a cell is computed in kernel.py's order of operations, so the
two kernels agree bit for bit on psi and on every face (compiled.py says why).

What makes these loops fast, each found by measurement:
- A cell's directions x groups are one flat loop of A*G elements: the face rows are contiguous
  that way, and the per-direction coefficients and the cell's per-group source and cross
  section are expanded to A*G once (per block, per cell). A loop over the groups alone is too
  short (G = 8) for LLVM's unrolled vector body, which then never runs.
- The arrays are indexed, never sliced per cell: a view costs reference counting that rivals
  the arithmetic of a cell.
- The loop nest `_walk` is written once and inlined with each scheme's cell functions
  (`inline="always"`), so no loop branches on the scheme per element.
- The fix-up: in Kripke's problem a quarter of the cells have a negative outgoing face
  somewhere (and a third of those cells' elements). With the fix-up on, a cell is solved in
  one pass that writes its outgoing faces, keeps the incoming ones in a scratch row and ORs
  the outgoing faces' bits (`_bits`), negative exactly when some face had its sign bit set: a
  clean cell is then done, as fast as without the fix-up but for three stores and three ORs
  per element (one pass instead of a solve pass and a write pass took the fix-up from 1.73x to
  1.58x the kernel without it; an OR of the bits instead of counting the negative faces, which
  compares, widens and adds, from 1.58x to 1.49x). A cell with a negative face runs the first
  fix-up round on all its elements at once, branch-free, from the kept incoming faces, keeping
  the plain values where no face was negative; the rare cells with an element still negative
  after that round run all three rounds (`_fixup_rounds`), which give what kernel._fixup's
  early exit gives. That round, a second division and a dozen selects per element over a
  quarter of the cells, is the rest of the fix-up's cost (the keep pass alone costs 7%; a
  round that only re-solves the cell, one division and no selects, would already cost 25%).
  Nothing in the loops calls a function: a call, even one never made, slows down the loops
  around it.
- What did not pay, measured on Kripke's problem: a cell that needs the fix-up has a third of
  its directions negative (all groups of such a direction, no fixed subset of directions), so
  fixing only chunks holding a negative element would do half the work; but a loop shorter
  than LLVM's unrolled vector body (16 elements here) runs scalar, a chunk bounded with min()
  is not vectorised at all, and per-element flags stored by the solve pass cost it 10-25%.
  Chunked fix-ups (8, 16 or 40 elements) took the fix-up from 1.55x to 1.67-2.08x; a cell
  loop over directions with a constant 8-group inner loop is unrolled into scalar code (LLVM
  cannot prove the face rows apart, so it packs nothing): 2.3x. Predicting the cells to fix
  from the previous iteration (80% right) and solving those in one fused solve-and-fix pass
  slowed every other cell as well, the walk grown by one more inlined pass: 2.0x. A float
  min of the faces, one test instead of three, does not vectorise (1.58x became 2.3x).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["sweep_block_loops"]

_JIT = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}


@intrinsic
def _bits(typingctx, x):  # pragma: no cover (JIT)
    """A float64's bits as an int64, so that OR-ing them keeps any sign bit: the OR is < 0 iff
    some value had its sign set (a -0.0 too, which then costs a fix-up round that changes
    nothing: the rounds fix only faces < 0)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


# Cell functions share one signature: the expanded coefficients (A*G each), the cell's expanded
# source and cross section (A*G), the flat face arrays (rows, A*G) with the cell's rows, and the
# scratch psi (A*G) and inc (3, A*G).


@njit(**_JIT, inline="always")
def _psi(kx, ky, kz, kt, qe, se, e, ix, iy, iz):  # pragma: no cover (JIT)
    """Element e's cell value from its incoming faces, in kernel.py's order of operations:
    (((cx ax + q) + cy ay) + cz az) / (sigma_t + total)."""
    p = kx[e] * ix
    p += qe[e]
    p += ky[e] * iy
    p += kz[e] * iz
    return p / (se[e] + kt[e])


@njit(**_JIT, inline="always")
def _dd(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):  # pragma: no cover (JIT)
    """Diamond difference without the fix-up: solve and write the outgoing faces."""
    for e in range(psi.size):
        ix, iy, iz = fx[rx, e], fy[ry, e], fz[rz, e]
        p = _psi(kx, ky, kz, kt, qe, se, e, ix, iy, iz)
        psi[e] = p
        two = p + p
        fx[rx, e] = two - ix
        fy[ry, e] = two - iy
        fz[rz, e] = two - iz
    return 0


@njit(**_JIT, inline="always")
def _dd_keep(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):  # pragma: no cover
    """Diamond difference writing the outgoing faces, the incoming ones kept in `inc`: psi,
    and whether an outgoing face has its sign bit set (such a cell goes to `_dd_fixup`)."""
    neg = 0
    for e in range(psi.size):
        ix, iy, iz = fx[rx, e], fy[ry, e], fz[rz, e]
        p = _psi(kx, ky, kz, kt, qe, se, e, ix, iy, iz)
        psi[e] = p
        two = p + p
        ox, oy, oz = two - ix, two - iy, two - iz
        inc[0, e] = ix
        inc[1, e] = iy
        inc[2, e] = iz
        fx[rx, e] = ox
        fy[ry, e] = oy
        fz[rz, e] = oz
        neg |= _bits(ox) | _bits(oy) | _bits(oz)
    return neg < 0


@njit(**_JIT, inline="always")
def _dd_fixup(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):  # pragma: no cover
    """A cell `_dd_keep` found a negative face in: the first fix-up round for every element
    (elements with no negative face keep their plain values), from the incoming faces in
    `inc`, which `_fixup_rounds` also uses should an element still be negative after it."""
    still = 0
    for e in range(psi.size):
        ax, ay, az = inc[0, e], inc[1, e], inc[2, e]
        p = psi[e]
        ox, oy, oz = fx[rx, e], fy[ry, e], fz[rz, e]  # 2 psi - in, as _dd_keep wrote them
        nx, ny, nz = ox < 0.0, oy < 0.0, oz < 0.0
        cell, fx1, fy1, fz1 = _rebalance(kx[e], ky[e], kz[e], qe[e], se[e], ax, ay, az, nx, ny, nz)
        bad = nx | ny | nz  # bitwise: no branch
        fx1 = fx1 if bad else ox
        fy1 = fy1 if bad else oy
        fz1 = fz1 if bad else oz
        still |= _bits(fx1) | _bits(fy1) | _bits(fz1)
        psi[e] = cell if bad else p
        fx[rx, e] = fx1
        fy[ry, e] = fy1
        fz[rz, e] = fz1
    if still < 0:  # rare: fixing one face made another one negative
        _fixup_rounds(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc)


@njit(**_JIT, inline="always")
def _rebalance(k1, k2, k3, src, sig, ax, ay, az, nx, ny, nz):  # pragma: no cover (JIT)
    """kernel._rebalance for one element: the cell value and faces with faces n* set to 0."""
    den = sig
    num = src
    den = den + (0.0 if nx else k1)
    num = num + (0.5 * k1 if nx else k1) * ax
    den = den + (0.0 if ny else k2)
    num = num + (0.5 * k2 if ny else k2) * ay
    den = den + (0.0 if nz else k3)
    num = num + (0.5 * k3 if nz else k3) * az
    cell = num / den
    return (
        cell,
        0.0 if nx else 2.0 * cell - ax,
        0.0 if ny else 2.0 * cell - ay,
        0.0 if nz else 2.0 * cell - az,
    )


@njit(**_JIT, inline="always")
def _fixup_rounds(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):  # pragma: no cover
    """All three rounds for every element that had a negative face, from the incoming faces
    in `inc`, branch-free like `_dd_fixup`. A round that fixes no new face repeats the one
    before exactly, so three rounds give what kernel._fixup's early exit gives."""
    for e in range(psi.size):
        ax, ay, az = inc[0, e], inc[1, e], inc[2, e]
        k1, k2, k3 = kx[e], ky[e], kz[e]
        p = _psi(kx, ky, kz, kt, qe, se, e, ax, ay, az)
        two = p + p
        nx, ny, nz = two - ax < 0.0, two - ay < 0.0, two - az < 0.0
        bad = nx | ny | nz
        cell, ox, oy, oz = _rebalance(k1, k2, k3, qe[e], se[e], ax, ay, az, nx, ny, nz)
        for _ in range(2):
            nx, ny, nz = nx | (ox < 0.0), ny | (oy < 0.0), nz | (oz < 0.0)
            cell, ox, oy, oz = _rebalance(k1, k2, k3, qe[e], se[e], ax, ay, az, nx, ny, nz)
        if bad:
            psi[e], fx[rx, e], fy[ry, e], fz[rz, e] = cell, ox, oy, oz


@njit(**_JIT, inline="always")
def _step(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):  # pragma: no cover (JIT)
    """The step scheme: every outgoing face is the cell value."""
    for e in range(psi.size):
        p = _psi(kx, ky, kz, kt, qe, se, e, fx[rx, e], fy[ry, e], fz[rz, e])
        psi[e] = p
        fx[rx, e] = p
        fy[ry, e] = p
        fz[rz, e] = p
    return 0


@njit(**_JIT, inline="always")
def _nothing(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):  # pragma: no cover
    """The faces are already written (schemes that write as they solve, or never fix up)."""


@njit(**_JIT, inline="always")
def _walk(
    solve, finish, fixup, i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy, cz, total, w, q, st,
    phi, fx3, fy3, fz3,
):  # fmt: skip  # pragma: no cover (JIT)
    """The cells of x layers [i0, i1) (counted upwind) of the block in upwind loop order:
    `solve` each; one with a negative face (`solve` returned true) goes to `fixup`, the others
    to `finish`; then phi += w @ psi, each group's terms added in direction order."""
    n_a, n_g = fx3.shape[1], fx3.shape[2]
    n_e = n_a * n_g
    fx = fx3.reshape(fx3.shape[0], n_e)
    fy = fy3.reshape(fy3.shape[0], n_e)
    fz = fz3.reshape(fz3.shape[0], n_e)
    kx, ky, kz, kt = np.empty(n_e), np.empty(n_e), np.empty(n_e), np.empty(n_e)
    for a in range(n_a):
        for g in range(n_g):
            e = a * n_g + g
            kx[e], ky[e], kz[e], kt[e] = cx[a], cy[a], cz[a], total[a]
    psi, qe, se = np.empty(n_e), np.empty(n_e), np.empty(n_e)
    inc = np.empty((3, n_e))
    acc = np.empty(n_g)
    for ii in range(i0, i1):
        i = ii if sx > 0 else bx - 1 - ii
        for jj in range(by):
            j = jj if sy > 0 else by - 1 - jj
            rz = i * by + j
            for kk in range(bz):
                k = kk if sz > 0 else bz - 1 - kk
                c = rz * nz + z0 + k
                rx = j * bz + k
                ry = i * bz + k
                for a in range(n_a):
                    for g in range(n_g):
                        qe[a * n_g + g] = q[c, g]
                        se[a * n_g + g] = st[c, g]
                if solve(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):
                    fixup(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc)
                else:
                    finish(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc)
                for g in range(n_g):
                    acc[g] = 0.0
                for a in range(n_a):
                    wa = w[a]
                    for g in range(n_g):
                        acc[g] += wa * psi[a * n_g + g]
                for g in range(n_g):
                    phi[c, g] += acc[g]


@njit(**_JIT)
def sweep_block_loops(
    i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy, cz, total, w, q, st, phi, fx, fy, fz, dd,
    fix,
):  # fmt: skip  # pragma: no cover (JIT)
    """x layers [i0, i1) of one block: diamond difference (with or without the fix-up) or
    step; see compiled.py."""
    if not dd:
        _walk(
            _step, _nothing, _nothing, i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy, cz,
            total, w, q, st, phi, fx, fy, fz,
        )  # fmt: skip
    elif fix:
        _walk(
            _dd_keep, _nothing, _dd_fixup, i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy,
            cz, total, w, q, st, phi, fx, fy, fz,
        )  # fmt: skip
    else:
        _walk(
            _dd, _nothing, _nothing, i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy, cz,
            total, w, q, st, phi, fx, fy, fz,
        )  # fmt: skip
