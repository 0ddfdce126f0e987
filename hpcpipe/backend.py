"""Array backend: NumPy on CPU, CuPy on one GPU per local rank, and how device buffers reach MPI.

CUDA-aware MPI takes device pointers directly, after the producing stream is synchronised (CuPy
does not do it for MPI: a kernel still running when MPI reads the buffer sends stale data).
Otherwise buffers are staged through pinned host buffers that are reused across steps (one per
named slot, grown when a message outgrows it), with the copies on a separate non-blocking copy
stream ordered by events: a device-to-host copy waits only for the kernels queued before it, and
a host-to-device copy makes the compute stream wait for it without blocking the host, so both
overlap with compute the schedule has already queued. CPU-only runs never import cupy.

Every deliberate host transfer goes through `Backend` and is counted in `Backend.transfers`, so
tests and traces can check that a step makes only the copies it should (see docs/gpu.md).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "TEST_ARRAY_MODULE_ENV",
    "Backend",
    "StagedCopy",
    "TransferCounter",
    "active_backend",
    "detect_cuda_aware",
    "make_backend",
]

TEST_ARRAY_MODULE_ENV = "HPCPIPE_TEST_ARRAY_MODULE"
"""Tests only: the module that stands in for cupy when device.kind = "cuda" (a host-side double
that counts device-to-host conversions, so the GPU code paths run and are checked on any CI)."""

_ACTIVE: Backend | None = None


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library this process loaded (found in its memory map)."""
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
    """(is CUDA-aware, why we think so). `setting` is the deck's device.cuda_aware.

    The MPI library's own run-time answer wins: MPICH's `MPIX_GPU_query_support` (which also
    reflects MPIR_CVAR_ENABLE_GPU), then Open MPI's `MPIX_Query_cuda_support`. Libraries with
    neither are judged by the variables that switch their GPU support on (Cray MPICH,
    MVAPICH2-GDR); anything else is taken as not CUDA-aware, which is always safe (staging).
    """
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
    for var in ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True, f"{var}={os.environ[var]} (the MPI library offers no CUDA query)"
    return False, "the MPI library offers no CUDA query; set device.cuda_aware = on to force"


@dataclass
class TransferCounter:
    """Host <-> device copies made through the backend, by direction (counts and bytes).

    A hot path should make a small, fixed number per step (the loss and gradient-norm scalars,
    and staged messages when MPI is not CUDA-aware); tests reset it and read it per step.
    """

    d2h: int = 0
    h2d: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0

    def reset(self) -> None:
        self.d2h = self.h2d = self.d2h_bytes = self.h2d_bytes = 0

    def snapshot(self) -> dict[str, int]:
        return {
            "d2h": self.d2h,
            "h2d": self.h2d,
            "d2h_bytes": self.d2h_bytes,
            "h2d_bytes": self.h2d_bytes,
        }


@dataclass
class StagedCopy:
    """A device-to-host copy in flight on the copy stream into a pinned staging buffer.

    `host` may be handed to MPI only once `ready()` (or after `wait()`); `source` keeps the
    device array alive until then, so the memory pool cannot give it to a new kernel while the
    copy engine still reads it.
    """

    host: np.ndarray
    event: Any = None
    source: Any = None

    def ready(self) -> bool:
        """True once the copy has landed (never blocks)."""
        if self.event is None or self.event.done:
            self.source = None
            return True
        return False

    def wait(self) -> np.ndarray:
        """Block until the copy has landed; returns the host buffer."""
        if self.event is not None:
            self.event.synchronize()
        self.source = None
        return self.host


@dataclass
class Backend:
    """The array module `xp` plus the rules for handing its buffers to MPI."""

    kind: str
    xp: Any
    dtype: Any
    device_id: int | None = None
    cuda_aware: bool = False
    cuda_aware_reason: str = "cpu run: host buffers go to MPI directly"
    transfers: TransferCounter = field(default_factory=TransferCounter)
    _pinned: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    _slot_events: dict[str, Any] = field(default_factory=dict, repr=False)
    _copy_stream: Any = field(default=None, repr=False)
    pinned_allocations: int = 0
    """How many pinned buffers were allocated (flat after the first step: buffers are reused)."""
    pinned_bytes: int = 0
    """Bytes of pinned staging memory held (bounded by the plans, not by microbatches)."""

    @property
    def on_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def staged(self) -> bool:
        """Device buffers reach MPI through host copies (a GPU run without CUDA-aware MPI)."""
        return self.on_gpu and not self.cuda_aware

    def describe(self) -> str:
        """One line for the log and the trace: device, and how buffers reach MPI and why."""
        if not self.on_gpu:
            return "device=cpu mpi_buffers=host"
        how = "direct" if self.cuda_aware else "staged"
        return (
            f"device=cuda:{self.device_id} mpi_buffers={how} cuda_aware={int(self.cuda_aware)} "
            f"({self.cuda_aware_reason})"
        )

    # ------------------------------------------------------------------ synchronisation

    def synchronize(self) -> None:
        """Make every kernel that produced a buffer finish before MPI reads it."""
        if self.on_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    @property
    def copy_stream(self) -> Any:
        """The non-blocking stream that staging copies run on (created on first use)."""
        if self._copy_stream is None:
            self._copy_stream = self.xp.cuda.Stream(non_blocking=True)
        return self._copy_stream

    def _event(self, stream: Any) -> Any:
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def record_event(self) -> Any:
        """An event after the work queued so far on the compute stream: MPI may read what those
        kernels wrote (or overwrite what they read) once it is done. Waiting on it is a targeted
        host wait, not a stream or device synchronisation."""
        return self._event(self.xp.cuda.get_current_stream())

    def pending_copy(self, slot: str) -> Any:
        """The event of the last asynchronous copy through staging `slot` (None if none is
        pending): MPI must not touch the slot's buffer before it is done."""
        return self._slot_events.pop(slot, None)

    # ------------------------------------------------------------------ counted host transfers

    def to_host(self, array: Any) -> np.ndarray:
        """A host copy of `array` (counted when it crosses from the device)."""
        if not self.on_gpu:
            return np.asarray(array)
        self.transfers.d2h += 1
        self.transfers.d2h_bytes += int(array.nbytes)
        return self.xp.asnumpy(array)

    def scalars(self, values: Sequence[Any]) -> list[float]:
        """Device scalars (0-d arrays or numbers) as floats in one transfer, not one each."""
        if not values:
            return []
        if not self.on_gpu:
            return [float(v) for v in values]
        xp = self.xp
        stacked = xp.stack([xp.asarray(v, dtype=np.float64).reshape(()) for v in values])
        return [float(v) for v in self.to_host(stacked).tolist()]

    # ------------------------------------------------------------------ staging

    def staging(self, nbytes: int, slot: str = "default") -> np.ndarray:
        """A pinned host buffer of `nbytes` for `slot`, reused across steps.

        Waits for the last asynchronous copy through this slot first, so MPI never writes a
        buffer the copy engine still reads (or the reverse). A slot outgrown by a message is
        replaced by one of the next power of two, so varying sizes (MoE dispatch) settle fast.
        """
        event = self._slot_events.pop(slot, None)
        if event is not None:
            event.synchronize()
        buf = self._pinned.get(slot)
        if buf is None or buf.nbytes < nbytes:
            capacity = 1 << (nbytes - 1).bit_length() if nbytes > 1 else 1
            if self.on_gpu:
                mem = self.xp.cuda.alloc_pinned_memory(capacity)
                buf = np.frombuffer(mem, dtype=np.uint8, count=capacity)
            else:
                buf = np.empty(capacity, dtype=np.uint8)
            old = self._pinned.get(slot)
            self.pinned_bytes += capacity - (old.nbytes if old is not None else 0)
            self._pinned[slot] = buf
            self.pinned_allocations += 1
        return buf[:nbytes]

    def slot_capacity(self, slot: str) -> int:
        """Bytes the pinned buffer of `slot` holds now (0 before its first use)."""
        buf = self._pinned.get(slot)
        return 0 if buf is None else int(buf.nbytes)

    def _host_view(self, array: Any, slot: str) -> np.ndarray:
        return self.staging(array.nbytes, slot).view(array.dtype).reshape(array.shape)

    def stage_out(self, array: Any, slot: str) -> StagedCopy:
        """Start copying `array` into the pinned buffer of `slot` on the copy stream.

        The copy stream waits (on the device) for an event recorded after the kernels that
        produced `array`; the host does not wait at all. Hand `host` to MPI once `ready()`.
        """
        if not self.on_gpu:
            return StagedCopy(np.asarray(array))
        xp = self.xp
        src = array if array.flags.c_contiguous else xp.ascontiguousarray(array)
        host = self._host_view(src, slot)
        if not src.nbytes:
            return StagedCopy(host)
        stream = self.copy_stream
        stream.wait_event(self._event(xp.cuda.get_current_stream()))
        _get_async(src, host, stream)
        done = self._event(stream)
        self._slot_events[slot] = done
        self.transfers.d2h += 1
        self.transfers.d2h_bytes += int(src.nbytes)
        return StagedCopy(host, done, src)

    def stage_in(self, array: Any, host: np.ndarray, slot: str | None = None) -> None:
        """Copy a received host buffer into the device array `array` on the copy stream.

        The compute stream waits for the copy on the device (kernels queued later read the new
        data), the host does not; the slot stays busy until the copy is done. Without a slot
        the host waits, because nothing else would keep `host` from being reused too early.
        """
        if not array.nbytes:
            return
        xp = self.xp
        stream = self.copy_stream
        # `array` may reuse pool memory a queued kernel still reads: copy after those kernels
        stream.wait_event(self._event(xp.cuda.get_current_stream()))
        _set_async(array, host, stream)
        done = self._event(stream)
        xp.cuda.get_current_stream().wait_event(done)
        if slot is None:
            done.synchronize()
        else:
            self._slot_events[slot] = done
        self.transfers.h2d += 1
        self.transfers.h2d_bytes += int(array.nbytes)

    def wait_copies(self) -> None:
        """Block until every staging copy issued so far has landed."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        self._slot_events.clear()

    # ------------------------------------------------------------------ MPI buffers

    def finish_recv(self, array: Any, buffer: Any, slot: str | None = None) -> None:
        """Copy a staged receive into its device array (no-op when MPI wrote it directly)."""
        if buffer is not array:
            self.stage_in(array, buffer, slot)


def _get_async(array: Any, host: np.ndarray, stream: Any) -> None:
    """Device -> pinned host copy queued on `stream` without blocking the host."""
    try:
        array.get(stream=stream, out=host, blocking=False)
    except TypeError:  # CuPy < 13 has no `blocking`: a given stream makes the copy async
        array.get(stream=stream, out=host)


def _set_async(array: Any, host: np.ndarray, stream: Any) -> None:
    """Pinned host -> device copy queued on `stream` (asynchronous for pinned memory)."""
    array.set(host, stream=stream)


def active_backend() -> Backend | None:
    """The GPU backend `make_backend` built in this process (one device and one MPI per rank;
    None for CPU runs): lets code without a backend handle (the MoE exchange, deliberate host
    copies in MoE routing) use its staging buffers and transfer counter."""
    return _ACTIVE


def _device_module() -> Any:
    name = os.environ.get(TEST_ARRAY_MODULE_ENV)
    if name:
        return importlib.import_module(name)
    import cupy

    return cupy


def make_backend(kind: str, dtype: str, local_rank: int, cuda_aware: str = "auto") -> Backend:
    """NumPy for `cpu`; for `cuda`, CuPy on GPU `local_rank % device_count`."""
    global _ACTIVE
    if kind == "cpu":
        return Backend("cpu", np, np.dtype(dtype))
    try:
        cupy = _device_module()
    except ImportError as exc:
        raise RuntimeError(
            f"device.kind = 'cuda' needs CuPy: pip install 'hpcpipe[gpu]' ({exc})"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        raise RuntimeError(
            f"device.kind = 'cuda' but CUDA reports no usable device: {exc}"
        ) from None
    if count < 1:
        raise RuntimeError("device.kind = 'cuda' but no CUDA device is visible on this node")
    device_id = local_rank % count
    cupy.cuda.Device(device_id).use()
    aware, reason = detect_cuda_aware(cuda_aware)
    _ACTIVE = Backend("cuda", cupy, np.dtype(dtype), device_id, aware, reason)
    return _ACTIVE
