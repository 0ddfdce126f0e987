"""Array backend: NumPy on CPU, CuPy on one GPU per local rank, and how device buffers reach MPI.

CUDA-aware MPI takes device pointers directly (after the producing stream is synchronised,
which CuPy does not do for MPI); otherwise buffers are staged through reusable pinned host
buffers. CPU-only runs never import cupy.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Backend", "detect_cuda_aware", "make_backend"]


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py loaded (found in this process's memory map)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            maps = fh.read()
    except OSError:
        return None
    libs = sorted(set(re.findall(r"(/\S*lib(?:mpi|mpich)\S*\.so[.\d]*)", maps)))
    for path in libs:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def detect_cuda_aware(setting: str = "auto") -> tuple[bool, str]:
    """(is CUDA-aware, why we think so). `setting` is the deck's device.cuda_aware."""
    if setting == "on":
        return True, "device.cuda_aware = on (deck)"
    if setting == "off":
        return False, "device.cuda_aware = off (deck)"
    lib = _libmpi()
    if lib is not None:
        # MPICH >= 4: MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA = 0, &flag)
        if hasattr(lib, "MPIX_GPU_query_support"):
            flag = ctypes.c_int(0)
            if lib.MPIX_GPU_query_support(0, ctypes.byref(flag)) == 0:
                if flag.value:
                    return True, "MPIX_GPU_query_support(CUDA) = 1"
                env = os.environ.get("MPIR_CVAR_ENABLE_GPU")
                return False, (
                    "MPIX_GPU_query_support(CUDA) = 0"
                    + (f", MPIR_CVAR_ENABLE_GPU={env}" if env else "")
                )
        # Open MPI: MPIX_Query_cuda_support() (run-time answer, needs mpi-ext built in)
        if hasattr(lib, "MPIX_Query_cuda_support"):
            lib.MPIX_Query_cuda_support.restype = ctypes.c_int
            if lib.MPIX_Query_cuda_support():
                return True, "MPIX_Query_cuda_support() = 1"
            return False, "MPIX_Query_cuda_support() = 0"
    return False, "the MPI library offers no CUDA query; set device.cuda_aware = on to force"


@dataclass
class Backend:
    """The array module `xp` plus the rules for handing its buffers to MPI."""

    kind: str
    xp: Any
    dtype: Any
    device_id: int | None = None
    cuda_aware: bool = False
    cuda_aware_reason: str = "cpu run: host buffers go to MPI directly"
    _pinned: dict[tuple[int, str], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def on_gpu(self) -> bool:
        return self.kind == "cuda"

    def synchronize(self) -> None:
        """Make every kernel that produced a buffer finish before MPI reads it."""
        if self.on_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def to_host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array) if self.on_gpu else np.asarray(array)

    def staging(self, nbytes: int, slot: str = "default") -> np.ndarray:
        """A pinned host buffer of at least `nbytes`, reused across steps (keyed by slot)."""
        key = (nbytes, slot)
        buf = self._pinned.get(key)
        if buf is None:
            if self.on_gpu:
                mem = self.xp.cuda.alloc_pinned_memory(nbytes)
                buf = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
            else:
                buf = np.empty(nbytes, dtype=np.uint8)
            self._pinned[key] = buf
        return buf

    def mpi_send_buffer(self, array: Any, slot: str = "send") -> Any:
        """What to pass to MPI for sending `array`: itself, or a host copy in a pinned buffer."""
        if not self.on_gpu:
            return array
        self.synchronize()
        if self.cuda_aware:
            return array
        host = self.staging(array.nbytes, slot)[: array.nbytes].view(array.dtype)
        host = host.reshape(array.shape)
        array.get(out=host)
        return host

    def mpi_recv_buffer(self, array: Any, slot: str = "recv") -> Any:
        """A buffer MPI can receive into for `array` (call `finish_recv` after completion)."""
        if not self.on_gpu or self.cuda_aware:
            if self.on_gpu:
                self.synchronize()
            return array
        return (
            self.staging(array.nbytes, slot)[: array.nbytes].view(array.dtype).reshape(array.shape)
        )

    def finish_recv(self, array: Any, buffer: Any) -> None:
        """Copy a staged receive into its device array (no-op when MPI wrote it directly)."""
        if buffer is not array:
            array.set(buffer)


def make_backend(kind: str, dtype: str, local_rank: int, cuda_aware: str = "auto") -> Backend:
    """NumPy for `cpu`; for `cuda`, CuPy on GPU `local_rank % device_count`."""
    if kind == "cpu":
        return Backend("cpu", np, np.dtype(dtype))
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            f"device.kind = 'cuda' needs CuPy: pip install 'hpcpipe[gpu]' ({exc})"
        ) from None
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise RuntimeError("device.kind = 'cuda' but no CUDA device is visible on this node")
    device_id = local_rank % count
    cupy.cuda.Device(device_id).use()
    aware, reason = detect_cuda_aware(cuda_aware)
    return Backend("cuda", cupy, np.dtype(dtype), device_id, aware, reason)
