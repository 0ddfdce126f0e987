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
  somewhere, and in those a third of the elements (all groups of a third of the directions).
  Where a cell's A*G elements are a multiple of 4, the fix-up path works on vectors of 4
  (`_V4`), written as LLVM IR through numba intrinsics: the check pass (`_check4`) solves a
  vector, writes psi and its outgoing faces, as the plain kernel does, and sets the vector's
  bit in `marks` when one of its outgoing faces is < 0. A clean cell is then done; a cell
  with bits set runs the first fix-up round on those vectors only (`_fix4`, the loop taking
  the set bits lowest first: it branches once per cell, not once per vector), from incoming
  faces taken back from the diamond relation (kernel._fixup), and a vector still negative
  after it takes the other two rounds on its 4 elements in an unlikely branch, which give
  what kernel._fixup's early exit gives. Other element counts run the first round on all the
  cell's elements (`_dd_check` and `_dd_fixup`; the check ORs the faces' sign bits, `_bits`).
  Measured on Kripke's problem (one process sweeping all octants, 15 interleaved pairs): the
  fix-up costs 1.20x the kernel without it; 1.27x when the check pass also kept the incoming
  faces in a scratch row (three more stores per vector: the pass is store-bound), 1.24x when
  it left a marked vector's incoming faces in the face rows instead (a select per face, whose
  mask the stores then wait for), 1.39-1.47x for a first round on all the cell's elements.
  Nothing in the loops calls a function: a call, even one never made, slows down the loops
  around it.
- Why vectors written by hand, and why 4: a loop shorter than LLVM's unrolled vector body (16
  elements here) runs scalar, a chunk bounded with min() is not vectorised at all, and a cell
  loop over directions with a constant 8-group inner loop is unrolled into scalar code (LLVM
  cannot prove the face rows apart); those chunked fix-ups measured 1.67-2.3x. Vectors of 8
  read what the check pass (LLVM's loop, 4-wide stores even on AVX-512) had just written two
  stores per load, which waits for both to retire: the mask alone then cost as much as the
  round, 1.45x in all. Per-element flags stored by the solve pass cost it 10-25%; so did
  per-vector flag bytes (1.28x), and two vectors per mark (1.27x).
- What else did not pay: predicting the cells to fix from the previous iteration (80% right)
  and solving those in one fused solve-and-fix pass slowed every other cell as well, the walk
  grown by one more inlined pass: 2.0x. So did the fix-up inside the check pass, one branch
  per vector (1.29x, against 1.29x for the marks then). A float min of the faces, one test
  instead of three, does not vectorise (1.58x became 2.3x).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
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
# source and cross section (A*G), the flat face arrays (rows, A*G) with the cell's rows, the
# scratch psi (A*G) and inc (6, A*G: `_dd_fixup`'s), and `marks` (the vector path's bits,
# int64 words).


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
def _dd(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks):  # pragma: no cover (JIT)
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
def _dd_check(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks):  # pragma: no cover
    """Diamond difference writing psi and the outgoing faces, and whether an outgoing face
    has its sign bit set (such a cell goes to `_dd_fixup`)."""
    neg = 0
    for e in range(psi.size):
        ix, iy, iz = fx[rx, e], fy[ry, e], fz[rz, e]
        p = _psi(kx, ky, kz, kt, qe, se, e, ix, iy, iz)
        psi[e] = p
        two = p + p
        ox, oy, oz = two - ix, two - iy, two - iz
        fx[rx, e] = ox
        fy[ry, e] = oy
        fz[rz, e] = oz
        neg |= _bits(ox) | _bits(oy) | _bits(oz)
    return neg < 0


@njit(**_JIT, inline="always")
def _dd_fixup(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks):  # pragma: no cover
    """A cell `_dd_check` found a negative face in: the first fix-up round for every element
    (elements with no negative face keep their plain values), from the incoming faces taken
    back from the diamond relation (kernel._fixup says why); they are kept in `inc` for
    `_fixup_rounds`, should an element still be negative after it."""
    still = 0
    for e in range(psi.size):
        p = psi[e]
        ox, oy, oz = fx[rx, e], fy[ry, e], fz[rz, e]  # 2 psi - in, as _dd_check wrote them
        two = p + p
        ax, ay, az = two - ox, two - oy, two - oz
        inc[0, e] = ax
        inc[1, e] = ay
        inc[2, e] = az
        inc[3, e] = ox
        inc[4, e] = oy
        inc[5, e] = oz
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
        _fixup_rounds(kx, ky, kz, qe, se, fx, rx, fy, ry, fz, rz, psi, inc)


_V4 = ir.VectorType(ir.DoubleType(), 4)
"""The vectors of the fix-up path: 4 elements, the width LLVM's vectorised loops store with on
AVX-512 machines too (a load of 8 over two stores of 4 would wait for both to retire)."""


def _lanes(context, builder, aryty, ary, indices):
    """A <4 x double>* at ary[indices] (the 4 consecutive elements from there)."""
    arr = context.make_array(aryty)(context, builder, ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, arr, indices, wraparound=False)
    return builder.bitcast(ptr, _V4.as_pointer())


def _ir_rebalance(builder, negative, coeffs, incoming, sig, src):
    """`_rebalance` on vectors (the IR of one round): the cell value and outgoing faces."""
    zero, half, two = (ir.Constant(_V4, [x] * 4) for x in (0.0, 0.5, 2.0))
    den, num = sig, src
    for n, k, a in zip(negative, coeffs, incoming, strict=True):
        den = builder.fadd(den, builder.select(n, zero, k))
        num = builder.fadd(num, builder.fmul(builder.select(n, builder.fmul(half, k), k), a))
    cell = builder.fdiv(num, den)
    twice = builder.fmul(two, cell)
    outs = [
        builder.select(n, zero, builder.fsub(twice, a))
        for n, a in zip(negative, incoming, strict=True)
    ]
    return cell, outs


@intrinsic
def _fix4(typingctx, kx, ky, kz, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, e):  # pragma: no cover
    """`_dd_fixup` and, where a face is still negative after the first round, `_fixup_rounds`
    for the 4 elements from e, as vectors: the same operations in the same order, so the same
    values lane for lane."""

    def codegen(context, builder, signature, args):
        kinds, e = signature.args, args[13]

        def at(i, *index):  # the 4 elements of argument i from index
            return _lanes(context, builder, kinds[i], args[i], list(index))

        def load(ptr):
            return builder.load(ptr, align=8)

        zero = ir.Constant(_V4, [0.0] * 4)
        coeffs = [load(at(i, e)) for i in (0, 1, 2)]
        src, sig = load(at(3, e)), load(at(4, e))
        face_ptrs = [at(i, args[i + 1], e) for i in (5, 7, 9)]
        outgoing = [load(ptr) for ptr in face_ptrs]
        psi_ptr = at(11, e)
        cell = load(psi_ptr)
        two = builder.fadd(cell, cell)
        incoming = [builder.fsub(two, o) for o in outgoing]  # as kernel._fixup takes them back
        negative = [builder.fcmp_ordered("<", o, zero) for o in outgoing]
        bad = builder.or_(builder.or_(negative[0], negative[1]), negative[2])
        cell, outs = _ir_rebalance(builder, negative, coeffs, incoming, sig, src)

        def store(cell, outs):  # the elements with a negative face take the round's values
            for new, o, ptr in zip(outs, outgoing, face_ptrs, strict=True):
                builder.store(builder.select(bad, new, o), ptr, align=8)
            builder.store(builder.select(bad, cell, load(psi_ptr)), psi_ptr, align=8)

        store(cell, outs)
        still = [builder.fcmp_ordered("<", o, zero) for o in outs]
        any_still = builder.and_(builder.or_(builder.or_(still[0], still[1]), still[2]), bad)
        packed = builder.bitcast(any_still, ir.IntType(4))
        with cgutils.if_unlikely(builder, builder.icmp_unsigned("!=", packed, packed.type(0))):
            for _ in range(2):  # rare: fixing one face made another one negative
                negative = [
                    builder.or_(n, builder.fcmp_ordered("<", o, zero))
                    for n, o in zip(negative, outs, strict=True)
                ]
                cell, outs = _ir_rebalance(builder, negative, coeffs, incoming, sig, src)
            store(cell, outs)
        return context.get_dummy_value()

    return types.none(kx, ky, kz, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, e), codegen


@intrinsic
def _check4(
    typingctx, kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, e
):  # pragma: no cover
    """`_dd_check`'s loop body for the 4 elements from e, as vectors; returns whether one of
    their outgoing faces is < 0."""

    def codegen(context, builder, signature, args):
        kinds, e = signature.args, args[14]

        def at(i, *index):
            return _lanes(context, builder, kinds[i], args[i], list(index))

        def load(ptr):
            return builder.load(ptr, align=8)

        zero = ir.Constant(_V4, [0.0] * 4)
        k1, k2, k3, kt_, src, sig = (load(at(i, e)) for i in range(6))
        face_ptrs = [at(i, args[i + 1], e) for i in (6, 8, 10)]
        ix, iy, iz = (load(ptr) for ptr in face_ptrs)
        p = builder.fmul(k1, ix)
        p = builder.fadd(p, src)
        p = builder.fadd(p, builder.fmul(k2, iy))
        p = builder.fadd(p, builder.fmul(k3, iz))
        p = builder.fdiv(p, builder.fadd(sig, kt_))
        builder.store(p, at(12, e), align=8)
        two = builder.fadd(p, p)
        neg = None
        for a, ptr in zip((ix, iy, iz), face_ptrs, strict=True):
            o = builder.fsub(two, a)
            builder.store(o, ptr, align=8)
            lt = builder.fcmp_ordered("<", o, zero)
            neg = lt if neg is None else builder.or_(neg, lt)
        packed = builder.bitcast(neg, ir.IntType(4))
        return builder.zext(
            builder.icmp_unsigned("!=", packed, ir.Constant(ir.IntType(4), 0)), ir.IntType(64)
        )

    return types.int64(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, e), codegen


@intrinsic
def _low_bit(typingctx, m):  # pragma: no cover (JIT)
    """Index of the lowest set bit of m > 0 (llvm.cttz)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
        fn = builder.module.declare_intrinsic("llvm.cttz", [i64], fnty)
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 1)])

    return types.int64(m), codegen


@njit(**_JIT, inline="always")
def _dd_check4(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks):  # pragma: no cover
    """`_dd_check` by vectors of 4 elements: each vector's bit in `marks` (63 to a word) says
    whether one of its outgoing faces is < 0; returns whether any is."""
    any_bad = 0
    vectors = psi.size // 4
    for word in range(marks.size):
        m = 0
        first = word * 63
        for c in range(first, min(vectors, first + 63)):
            bad = _check4(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, c * 4)
            m |= bad << (c - first)
        marks[word] = m
        any_bad |= m
    return any_bad != 0


@njit(**_JIT, inline="always")
def _dd_fixup4(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks):  # pragma: no cover
    """The fix-up for the vectors `_dd_check4` marked (`_fix4`), lowest bit first."""
    for word in range(marks.size):
        m = marks[word]
        while m:
            c = _low_bit(m)
            m &= m - 1
            _fix4(kx, ky, kz, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, (word * 63 + c) * 4)


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
def _fixup_rounds(kx, ky, kz, qe, se, fx, rx, fy, ry, fz, rz, psi, inc):  # pragma: no cover
    """All three rounds for every element that had a negative face, from what `_dd_fixup`
    kept in `inc` (the incoming faces, then the first outgoing ones), branch-free like
    `_dd_fixup`. A round that fixes no new face repeats the one before exactly, so three
    rounds give what kernel._fixup's early exit gives."""
    for e in range(psi.size):
        ax, ay, az = inc[0, e], inc[1, e], inc[2, e]
        k1, k2, k3 = kx[e], ky[e], kz[e]
        nx, ny, nz = inc[3, e] < 0.0, inc[4, e] < 0.0, inc[5, e] < 0.0
        bad = nx | ny | nz
        cell, ox, oy, oz = _rebalance(k1, k2, k3, qe[e], se[e], ax, ay, az, nx, ny, nz)
        for _ in range(2):
            nx, ny, nz = nx | (ox < 0.0), ny | (oy < 0.0), nz | (oz < 0.0)
            cell, ox, oy, oz = _rebalance(k1, k2, k3, qe[e], se[e], ax, ay, az, nx, ny, nz)
        if bad:
            psi[e], fx[rx, e], fy[ry, e], fz[rz, e] = cell, ox, oy, oz


@njit(**_JIT, inline="always")
def _step(
    kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks
):  # pragma: no cover (JIT)
    """The step scheme: every outgoing face is the cell value."""
    for e in range(psi.size):
        p = _psi(kx, ky, kz, kt, qe, se, e, fx[rx, e], fy[ry, e], fz[rz, e])
        psi[e] = p
        fx[rx, e] = p
        fy[ry, e] = p
        fz[rz, e] = p
    return 0


@njit(**_JIT, inline="always")
def _nothing(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks):  # pragma: no cover
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
    inc = np.empty((6, n_e))  # _dd_fixup's, for _fixup_rounds
    marks = np.zeros(max(1, -(-(n_e // 4) // 63)), dtype=np.int64)  # _dd_check4's, 63 a word
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
                if solve(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks):
                    fixup(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks)
                else:
                    finish(kx, ky, kz, kt, qe, se, fx, rx, fy, ry, fz, rz, psi, inc, marks)
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
    elif fix and (fx.shape[1] * fx.shape[2]) % 4 == 0:
        _walk(
            _dd_check4, _nothing, _dd_fixup4, i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy,
            cz, total, w, q, st, phi, fx, fy, fz,
        )  # fmt: skip
    elif fix:
        _walk(
            _dd_check, _nothing, _dd_fixup, i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy,
            cz, total, w, q, st, phi, fx, fy, fz,
        )  # fmt: skip
    else:
        _walk(
            _dd, _nothing, _nothing, i0, i1, bx, by, bz, nz, z0, sx, sy, sz, cx, cy, cz,
            total, w, q, st, phi, fx, fy, fz,
        )  # fmt: skip
