"""The CUDA sweep kernel (CuPy RawModule): one block x one angle block x all groups on a GPU.

The NumPy kernel on CuPy arrays launches a dozen small kernels per hyperplane and waits on
Python between them, so a GPU sweeps slower than one CPU core. Here one launch sweeps the whole
block: every (direction, group) element of the angle block is an independent 3-D sweep (it
depends only on the same element of its upwind cells), so each gets a thread block, whose
threads take the block's (j, k) rows and walk the hyperplanes I + J + K = h in order, with a
barrier between planes. A row has one cell per plane, so the face arrays are updated in place
exactly as kernel.py does. The cell values go to a scratch array and a second launch adds
w . psi to phi, summing the directions in order (no atomics: the same phi on every run); a
block too large for the scratch goes a few directions per launch pair.

Each element is computed in kernel.py's order of operations, compiled without fused
multiply-adds, so psi and every face equal the NumPy kernel's bit for bit (the fix-up too:
`_fixup_masked`'s rounds, stopped once no face is negative, which changes nothing); phi may
differ in the last bit, as cuBLAS may pair the terms of the sum over directions differently.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["runs_on", "sweep_block_cuda"]

_SOURCE = r"""
extern "C" __global__ void sweep_block(
    const int bx, const int by, const int bz, const int nz, const int z0,
    const int sx, const int sy, const int sz, const int ne, const int e0, const int groups,
    const double* __restrict__ cx, const double* __restrict__ cy,
    const double* __restrict__ cz, const double* __restrict__ total,
    const double* __restrict__ q, const double* __restrict__ sigma_t,
    double* fx, double* fy, double* fz, double* __restrict__ psi_out,
    const int dd, const int fixup)
{
    const int e = e0 + blockIdx.x;          // (direction, group) element of the angle block
    const int a = e / groups;
    const int g = e - a * groups;
    const double kx = cx[a], ky = cy[a], kz = cz[a], kt = total[a];
    const int rows = by * bz;
    const int planes = bx + by + bz - 2;
    for (int h = 0; h < planes; ++h) {
        for (int r = threadIdx.x; r < rows; r += blockDim.x) {
            const int J = r / bz;
            const int K = r - J * bz;
            const int I = h - J - K;
            if (I < 0 || I >= bx) continue;
            const int i = sx > 0 ? I : bx - 1 - I;
            const int j = sy > 0 ? J : by - 1 - J;
            const int k = sz > 0 ? K : bz - 1 - K;
            const long cell = ((long)(i * by + j)) * nz + (k + z0);
            const double src = q[cell * groups + g];
            const double sig = sigma_t[cell * groups + g];
            const long rx = (long)(j * bz + k) * ne + e;
            const long ry = (long)(i * bz + k) * ne + e;
            const long rz = (long)(i * by + j) * ne + e;
            const double ax = fx[rx], ay = fy[ry], az = fz[rz];
            double p = kx * ax;
            p += src;
            p += ky * ay;
            p += kz * az;
            p /= sig + kt;
            double ox, oy, oz;
            if (dd) {
                const double two = p + p;
                ox = two - ax; oy = two - ay; oz = two - az;
                if (fixup && (ox < 0.0 || oy < 0.0 || oz < 0.0)) {
                    // the incoming faces taken back from the diamond relation, as kernel.py's
                    // _fixup does
                    const double inx = two - ox, iny = two - oy, inz = two - oz;
                    bool nx = ox < 0.0, ny = oy < 0.0, nw = oz < 0.0;
                    double cell_value = p;
                    for (int round = 0; round < 3; ++round) {
                        nx = nx || ox < 0.0; ny = ny || oy < 0.0; nw = nw || oz < 0.0;
                        double den = sig;
                        den = den + (nx ? 0.0 : kx);
                        den = den + (ny ? 0.0 : ky);
                        den = den + (nw ? 0.0 : kz);
                        double num = src;
                        num = num + (nx ? 0.5 * kx : kx) * inx;
                        num = num + (ny ? 0.5 * ky : ky) * iny;
                        num = num + (nw ? 0.5 * kz : kz) * inz;
                        cell_value = num / den;
                        ox = nx ? 0.0 : 2.0 * cell_value - inx;
                        oy = ny ? 0.0 : 2.0 * cell_value - iny;
                        oz = nw ? 0.0 : 2.0 * cell_value - inz;
                        if (!(ox < 0.0 || oy < 0.0 || oz < 0.0)) break;
                    }
                    p = cell_value;
                }
            } else {
                ox = p; oy = p; oz = p;
            }
            fx[rx] = ox; fy[ry] = oy; fz[rz] = oz;
            psi_out[((long)((i * by + j) * bz + k)) * gridDim.x + blockIdx.x] = p;
        }
        __syncthreads();
    }
}

extern "C" __global__ void add_to_phi(
    const int bx, const int by, const int bz, const int nz, const int z0,
    const int directions, const int groups, const double* __restrict__ w,
    const double* __restrict__ psi, double* phi)
{
    const long n = (long)bx * by * bz * groups;
    const int ne = directions * groups;      // the launch's elements: psi's row length
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < n;
         t += (long)gridDim.x * blockDim.x) {
        const long local = t / groups;
        const int g = (int)(t - local * groups);
        const int k = (int)(local % bz);
        const long ij = local / bz;
        const double* row = psi + local * ne + g;
        double sum = 0.0;
        for (int a = 0; a < directions; ++a) sum += w[a] * row[a * groups];
        const long cell = ij * nz + k + z0;
        phi[cell * groups + g] += sum;
    }
}
"""

_OPTIONS = ("--fmad=false",)  # kernel.py's roundings: no fused multiply-adds

SCRATCH_VALUES = 1 << 25
"""Most cell values (float64) one launch keeps for phi: 256 MiB. A block with more cells x
directions x groups is swept a few directions at a time (Kripke's problem, whole octants:
2.6 M, one launch)."""

_modules: dict[str, Any] = {}  # per array module: CuPy (and the tests' host emulation)


def runs_on(xp: Any) -> bool:
    """Whether `xp` is CuPy (a stand-in array module, such as the tests' fake device, is not)."""
    return getattr(xp, "__name__", "") == "cupy"


def _kernels(xp: Any) -> Any:
    """The compiled module (CuPy caches the binary on disk; this, per process)."""
    name = getattr(xp, "__name__", type(xp).__name__)
    if name not in _modules:
        _modules[name] = xp.RawModule(code=_SOURCE, options=_OPTIONS)
    return _modules[name]


def _contiguous_f64(name: str, array: Any) -> None:
    if array.dtype != np.float64 or not array.flags.c_contiguous:
        raise TypeError(
            f"the cuda sweep kernel needs C-contiguous float64 {name}, got {array.dtype} "
            f"(contiguous: {array.flags.c_contiguous})"
        )


def sweep_block_cuda(
    xp: Any,
    shape: tuple[int, int, int],
    nz: int,
    z0: int,
    signs: tuple[int, int, int],
    coefficients: tuple[Any, ...],
    q: Any,
    sigma_t: Any,
    phi: Any,
    faces: tuple[Any, Any, Any],
    dd: bool,
    fixup: bool,
) -> None:
    """Sweep one (bx, by, bz) block starting at local z `z0`, upwind along `signs`, on the
    current stream; arguments as compiled.sweep_block_compiled takes them, on the device
    (`coefficients`: the angle block's 1-D cx, cy, cz, total, weights)."""
    bx, by, bz = shape
    fx, fy, fz = faces
    cx, cy, cz, total, w = coefficients
    directions, groups = int(fx.shape[1]), int(fx.shape[2])
    for name, array in (("q", q), ("sigma_t", sigma_t), ("phi", phi)):
        _contiguous_f64(name, array)
    for name, array in zip(("x faces", "y faces", "z faces"), faces, strict=True):
        _contiguous_f64(name, array)
    module = _kernels(xp)
    cells = bx * by * bz
    ne = directions * groups
    # directions per launch: the scratch psi (cells x their elements) stays within
    # SCRATCH_VALUES; each launch's are added to phi in order, so the split is deterministic
    per_launch = max(1, min(directions, SCRATCH_VALUES // max(1, cells * groups)))
    psi = xp.empty(cells * per_launch * groups, dtype=np.float64)
    threads = min(1024, max(32, -(-(by * bz) // 32) * 32))
    i32 = np.int32
    sweep, add = module.get_function("sweep_block"), module.get_function("add_to_phi")
    n = cells * groups
    for a0 in range(0, directions, per_launch):
        count = min(per_launch, directions - a0)
        sweep(
            (count * groups,),
            (threads,),
            (
                *(i32(v) for v in (bx, by, bz, nz, z0, *signs, ne, a0 * groups, groups)),
                cx, cy, cz, total, q, sigma_t, fx, fy, fz, psi, i32(dd), i32(fixup),
            ),
        )  # fmt: skip
        add(
            (min(4096, -(-n // 256)),),
            (256,),
            (*(i32(v) for v in (bx, by, bz, nz, z0, count, groups)), w[a0:], psi, phi),
        )
