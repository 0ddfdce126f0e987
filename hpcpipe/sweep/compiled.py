"""The compiled sweep kernel (numba): one block x one angle block x all groups, cell by cell.

The NumPy kernel (kernel.py) pays Python and temporary-array costs on every hyperplane and
streams (plane x directions x groups) temporaries through memory; compiled code walks the block
in plain upwind loop order with the cell's face rows, source and cross sections in cache and
solves each (direction, group) element in a few flops. Each element is computed in the NumPy
kernel's order of operations (the fix-up as the same rounds), so both kernels give the same psi
and faces bit for bit; phi may differ in the last bit, as NumPy's matmul may pair the terms of
the sum over directions differently.

numba is optional: `available()` says whether it is installed. `prepare()` imports the loops
(_numba_kernels) and compiles them, or loads them from numba's cache, before the first iteration:
a first compile takes seconds, which would otherwise count against the first iteration's
watchdog and grind time.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PROGRESS_UNKNOWNS", "available", "prepare", "sweep_block_compiled"]

PROGRESS_UNKNOWNS = 32_768
"""With a `progress` callback, the block is swept in slabs of x layers of about this many
(cell, direction, group) unknowns (~0.1 ms), and the callback runs between them: MPI moves a
large message only when both ranks call into it, so a rank computing a long block would hold up
the faces its neighbours wait for."""


def available() -> bool:
    """numba can be imported (checked without importing it, which takes a while)."""
    return importlib.util.find_spec("numba") is not None


def prepare() -> tuple[float, bool]:
    """Compile the loops for the argument types `sweep_block_compiled` passes (or load them
    from numba's cache); returns (seconds taken, whether they were compiled rather than loaded).

    The types are those of every caller: ten int64 extents, C-contiguous float64 coefficients
    (1-D), source, cross section and phi (2-D) and faces (3-D), two flags. A caller passing
    other layouts would compile its own specialisation lazily, as numba always does."""
    t0 = time.perf_counter()
    from numba import types

    from hpcpipe.sweep._numba_kernels import sweep_block_loops

    def array(ndim: int) -> Any:
        return types.Array(types.float64, ndim, "C")

    signature = (
        *(types.int64,) * 10,
        *(array(1),) * 5,
        *(array(2),) * 3,
        *(array(3),) * 3,
        types.boolean,
        types.boolean,
    )
    misses = sum(sweep_block_loops.stats.cache_misses.values())
    sweep_block_loops.compile(signature)
    compiled = sum(sweep_block_loops.stats.cache_misses.values()) > misses
    return time.perf_counter() - t0, compiled


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
