"""The CUDA sweep kernel's source run on the host: compiled as C++ by the machine's compiler,
each thread block run in turn by one thread (the kernels loop over their work by blockDim, so
any thread count gives the same result; barriers are then no-ops). A stand-in for CuPy's
`RawModule` and `empty`, so that cuda_kernel.py's own wrapper runs unchanged, on NumPy arrays.

What this checks without a GPU: the indexing, the upwind order, the arithmetic and its
rounding (compiled without contraction, as NVRTC is told). What only a GPU checks: the real
launch, many threads per block, and CuPy's handling of the arguments (tests/gpu)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

_PRELUDE = r"""
struct Dim3 { unsigned int x; };
static Dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __syncthreads()
extern "C" void launch_as(unsigned int block, unsigned int blocks) {
    blockIdx.x = block; gridDim.x = blocks; threadIdx.x = 0; blockDim.x = 1;
}
"""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, name: str):
        self.lib, self.fn = lib, getattr(lib, name)

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]):
        converted = []
        for a in args:
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous and a.dtype == np.float64
                converted.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int32):
                converted.append(ctypes.c_int(int(a)))
            else:
                raise TypeError(f"argument of type {type(a).__name__}: CuPy would need a cast")
        for b in range(grid[0]):
            self.lib.launch_as(b, grid[0])
            self.fn(*converted)


class _Module:
    def __init__(self, code: str, options: tuple[str, ...]):
        assert "--fmad=false" in options  # the host build matches it with -ffp-contract=off
        source = _PRELUDE + code
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        out = Path(tempfile.gettempdir()) / f"hpcpipe-cuda-emulation-{digest}.so"
        if not out.exists():
            src = out.with_suffix(".cpp")
            src.write_text(source, encoding="utf-8")
            tmp = out.with_suffix(f".{os.getpid()}.so")
            cmd = [compiler() or "c++", "-O1", "-ffp-contract=off", "-shared", "-fPIC"]
            subprocess.run([*cmd, "-o", str(tmp), str(src)], check=True, timeout=120)
            tmp.replace(out)
        self.lib = ctypes.CDLL(str(out))

    def get_function(self, name: str) -> _Kernel:
        return _Kernel(self.lib, name)


class HostEmulation:
    """The part of CuPy's API cuda_kernel.py uses."""

    __name__ = "cuda-emulation"

    RawModule = _Module

    @staticmethod
    def empty(n: int, dtype: Any) -> np.ndarray:
        return np.full(n, np.nan, dtype=dtype)  # NaN: a cell the kernel forgets shows
