"""The compiled sweep kernel (numba): one block x one angle block x all groups, cell by cell.

The NumPy kernel (kernel.py) pays Python and temporary-array costs on every hyperplane and
streams (plane x directions x groups) temporaries through memory; compiled code walks the block
in plain upwind loop order with the cell's face rows, source and cross sections in cache and
solves each (direction, group) element in a few flops. Each element is computed in the NumPy
kernel's order of operations (the fix-up as the same rounds), so both kernels give the same psi
and faces bit for bit; phi may differ in the last bit, as NumPy's matmul may pair the terms of
the sum over directions differently.

numba is optional: `available()` says whether it is installed, and the loops (_numba_kernels)
are imported, and compiled or loaded from numba's cache, on the first sweep only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

__all__ = ["PROGRESS_UNKNOWNS", "available", "sweep_block_compiled"]

PROGRESS_UNKNOWNS = 32_768
"""With a `progress` callback, the block is swept in slabs of x layers of about this many
(cell, direction, group) unknowns (~0.1 ms), and the callback runs between them: MPI moves a
large message only when both ranks call into it, so a rank computing a long block would hold up
the faces its neighbours wait for."""


def available() -> bool:
    """numba can be imported (checked without importing it, which takes a while)."""
    return importlib.util.find_spec("numba") is not None


def sweep_block_compiled(
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
    progress: Callable[[], None] | None = None,
) -> None:
    """Sweep one (bx, by, bz) block starting at local z `z0`, upwind along `signs`.

    `coefficients` are the angle block's 1-D (cx, cy, cz, total, weights); `faces` the (x, y, z)
    face arrays, left holding the block's outgoing faces, as kernel.sweep_block does.
    `progress` is called between slabs of x layers (PROGRESS_UNKNOWNS).
    """
    from hpcpipe.sweep._numba_kernels import sweep_block_loops

    bx, by, bz = shape
    sx, sy, sz = signs
    cx, cy, cz, total, w = coefficients
    fx, fy, fz = faces
    step = bx
    if progress is not None:
        layer = by * bz * fx.shape[1] * fx.shape[2]
        step = max(1, min(bx, PROGRESS_UNKNOWNS // max(1, layer)))
    for i0 in range(0, bx, step):
        if i0:
            progress()  # type: ignore[misc]
        sweep_block_loops(
            i0, min(bx, i0 + step), bx, by, bz, nz, z0, sx, sy, sz, cx, cy, cz, total, w, q,
            sigma_t, phi, fx, fy, fz, dd, fixup,
        )  # fmt: skip
