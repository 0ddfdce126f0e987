"""A CuPy stand-in that runs on the host, so the GPU code paths run and are checked on any CI.

Select it with `HPCPIPE_TEST_ARRAY_MODULE=fake_device` (this folder on `sys.path`) and
`device.kind = "cuda"`: `hpcpipe.backend.make_backend` then imports this module instead of cupy.
Arrays are `fake_device.ndarray`, a NumPy subclass playing device memory, and it behaves like
CuPy where the difference matters to the code under test:

- every conversion to the host is counted (`STATS.d2h`): `.get()`, `asnumpy`, `float()`,
  `int()`, `bool()`, `.item()`, `.tolist()`, `repr`/`format`; scalars stay 0-d device arrays
  (reductions and `a[i]`), so a later `float()` is counted where CuPy would copy;
- host arrays mixed into device operations raise TypeError, as CuPy does (a hidden transfer);
- copies queued on a stream (`get(stream=, blocking=False)`, `set(..., stream=)`) run only when
  that stream or a later event on it is synchronised, waited for or polled (`Event.done`), so
  a missing event or synchronisation shows up as wrong numbers; `Event.delay_queries` makes
  `done` answer False a few times first, to exercise code that polls;
- kernels (ufuncs, array functions, fancy indexing, astype/copy) record the memory they use;
  `check_mpi_buffer` (used by `fake_mpi.RecordingComm`) says whether handing a buffer to MPI
  now would be a race: a device buffer is safe once the host knows every kernel that used it
  has completed (its stream synchronised, or a later event on it waited for or polled done).

Not caught: `np.asarray(device_array)` (NumPy gives subclasses a base view without asking; CuPy
raises TypeError there, so the real-GPU tests catch it), and memory-pool reuse while a copy is
in flight (the fake's memory is never reused).
"""

from __future__ import annotations

import functools
import itertools
import os
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# --------------------------------------------------------------------------- bookkeeping

_seq = itertools.count(1)


@dataclass
class Stats:
    """Everything the fake saw since the last `reset()`."""

    d2h: int = 0
    h2d: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    pinned: int = 0
    log: list[tuple] = field(default_factory=list)
    d2h_sites: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.d2h = self.h2d = self.d2h_bytes = self.h2d_bytes = 0
        self.log.clear()
        self.d2h_sites.clear()


STATS = Stats()
_pending: list[_Op] = []  # queued copies not yet run, on any stream


def reset() -> None:
    """Clear the counters and the event log (streams and pending copies are left alone)."""
    STATS.reset()


def _d2h(nbytes: int, how: str) -> None:
    STATS.d2h += 1
    STATS.d2h_bytes += int(nbytes)
    STATS.d2h_sites.append(how)
    STATS.log.append(("d2h", how, int(nbytes)))


def _h2d(nbytes: int, how: str) -> None:
    STATS.h2d += 1
    STATS.h2d_bytes += int(nbytes)
    STATS.log.append(("h2d", how, int(nbytes)))


_touched: dict[int, tuple[Stream, int]] = {}  # memory owner -> (stream, seq) of its last kernel


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _touch(obj: Any, stream: Stream, seq: int) -> None:
    if isinstance(obj, np.ndarray):
        root = _root(obj)
        key = id(root)
        if key not in _touched:
            weakref.finalize(root, _touched.pop, key, None)
        _touched[key] = (stream, seq)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _touch(x, stream, seq)
    elif isinstance(obj, dict):
        for x in obj.values():
            _touch(x, stream, seq)


def _kernel(*used: Any) -> None:
    """Work was queued on the current stream (the fake runs it at once, but the host has not
    waited for it until that stream is synchronised, or an event recorded after it has been
    waited for or polled done). `used`: the arrays it reads or writes."""
    stream = _current
    seq = stream.last_work = next(_seq)
    for obj in used:
        _touch(obj, stream, seq)


# --------------------------------------------------------------------------- streams, events


@dataclass(eq=False)
class _Op:
    seq: int
    stream: Stream
    run: Any
    host: np.ndarray  # the host side of the copy (MPI must not touch it until the copy ran)


class Stream:
    """A CUDA stream: kernels run eagerly; queued copies run when someone waits for them."""

    _ids = itertools.count()

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.name = "null" if null else f"stream{next(Stream._ids)}"
        self.non_blocking = non_blocking
        self.last_work = 0  # seq of the last kernel queued here
        self.synced = 0  # seq up to which the host has waited for this stream
        self.queue: list[_Op] = []

    @property
    def ptr(self) -> int:
        return id(self)

    @property
    def dirty(self) -> bool:
        """Kernels were queued since the host last waited for this stream."""
        return self.last_work > self.synced

    def enqueue(self, run: Any, host: np.ndarray) -> int:
        op = _Op(next(_seq), self, run, host)
        self.queue.append(op)
        _pending.append(op)
        return op.seq

    def _run_until(self, seq: int) -> None:
        while self.queue and self.queue[0].seq <= seq:
            op = self.queue.pop(0)
            _pending.remove(op)
            op.run()

    def synchronize(self) -> None:
        now = next(_seq)
        self._run_until(now)
        self.synced = now
        STATS.log.append(("sync", self.name))

    def wait_event(self, event: Event) -> None:
        """Later work on this stream comes after the event: run what it stands for now."""
        if event.stream is not None:
            event.stream._run_until(event.seq)
        STATS.log.append(("wait_event", self.name, event.stream.name if event.stream else None))

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    @property
    def done(self) -> bool:
        return not self.queue

    def use(self) -> Stream:
        global _current
        _current = self
        return self

    def __enter__(self) -> Stream:
        self._prev = _current
        return self.use()

    def __exit__(self, *exc: Any) -> None:
        self._prev.use()


class Event:
    """A CUDA event: marks a point in a stream's work."""

    delay_queries = 0
    """`done` answers False this many times per event before running the copies it covers."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ):
        self.stream: Stream | None = None
        self.seq = 0
        self._misses = Event.delay_queries

    def record(self, stream: Stream | None = None) -> None:
        self.stream = stream or _current
        self.seq = next(_seq)
        STATS.log.append(("record", self.stream.name))

    def _pending(self) -> bool:
        s = self.stream
        return s is not None and bool(s.queue) and s.queue[0].seq <= self.seq

    @property
    def done(self) -> bool:
        if self._pending():
            if self._misses > 0:
                self._misses -= 1
                return False
            self.stream._run_until(self.seq)  # type: ignore[union-attr]
        if self.stream is not None:
            self.stream.synced = max(self.stream.synced, self.seq)
        return True

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream._run_until(self.seq)
            self.stream.synced = max(self.stream.synced, self.seq)
            STATS.log.append(("event_sync", self.stream.name))


_null = Stream(null=True)
_current = _null


def get_current_stream() -> Stream:
    return _current


# --------------------------------------------------------------------------- arrays


def _is_host_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) and not isinstance(x, ndarray) and x.ndim > 0


def _reject_host(what: str, items: Any) -> None:
    """CuPy raises TypeError when a NumPy array meets a device operation: so does the fake."""
    for x in items:
        if isinstance(x, list | tuple):
            _reject_host(what, x)
        elif _is_host_array(x):
            raise TypeError(
                f"fake_device: a host numpy array {x.dtype}{x.shape} was passed to device "
                f"operation {what} (CuPy raises here; copy it with xp.asarray first)"
            )


def _unwrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x.view(np.ndarray)
    if isinstance(x, list):
        return [_unwrap(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _wrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x
    if isinstance(x, np.ndarray):
        return x.view(ndarray)
    if isinstance(x, np.generic):
        return np.asarray(x).view(ndarray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


class ndarray(np.ndarray):
    """Device memory, played by host memory (see the module docstring)."""

    __array_priority__ = 100.0

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _reject_host(f"{ufunc.__name__}.{method}", inputs)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o) for o in out)
        result = getattr(ufunc, method)(*(_unwrap(x) for x in inputs), **kwargs)
        _kernel(self, inputs, out, result)
        if method == "at":
            return None
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        _reject_host(func.__name__, args)
        result = func(*_unwrap(args), **_unwrap(kwargs))
        _kernel(args, kwargs, result)
        return _wrap(result)

    def __getitem__(self, key: Any) -> Any:
        result = super().__getitem__(key)
        if not isinstance(result, np.ndarray) or not np.shares_memory(result, self):
            _kernel(self, result)  # a gather: a kernel on the device
        return _wrap(result)

    def __setitem__(self, key: Any, value: Any) -> None:
        if _is_host_array(value):
            _h2d(value.nbytes, "setitem")
        super().__setitem__(key, value)
        _kernel(self, value)

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    def astype(self, *args: Any, **kwargs: Any) -> Any:
        result = super().astype(*args, **kwargs)
        _kernel(self, result)
        return _wrap(result)

    def copy(self, *args: Any, **kwargs: Any) -> Any:
        result = super().copy(*args, **kwargs)
        _kernel(self, result)
        return _wrap(result)

    # conversions to the host: each one a device-to-host copy (and a wait for the stream)
    def _host(self, how: str) -> np.ndarray:
        _d2h(self.nbytes, how)
        _current.synced = max(_current.synced, _current.last_work)
        return self.view(np.ndarray)

    def __float__(self) -> float:
        return float(self._host("float"))

    def __int__(self) -> int:
        return int(self._host("int"))

    def __index__(self) -> int:
        return self._host("index").__index__()

    def __bool__(self) -> bool:
        return bool(self._host("bool"))

    def __complex__(self) -> complex:
        return complex(self._host("complex"))

    def item(self, *args: Any) -> Any:
        return self._host("item").item(*args)

    def tolist(self) -> Any:
        return self._host("tolist").tolist()

    def __repr__(self) -> str:
        return f"fake_device.{np.array_repr(self._host('repr'))}"

    def __str__(self) -> str:
        return str(self._host("str"))

    def __format__(self, spec: str) -> str:
        host = self._host("format")
        return format(host.item() if host.ndim == 0 else host, spec)

    def get(
        self, stream: Stream | None = None, order: str = "C", out: Any = None, blocking: bool = True
    ) -> np.ndarray:
        """A host copy; with a stream and blocking=False it is queued on that stream."""
        _d2h(self.nbytes, "get-async" if stream is not None and not blocking else "get")
        src = self.view(np.ndarray)
        if out is None:
            out = np.empty(self.shape, dtype=self.dtype, order=order)
        elif out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"out is {out.dtype}{out.shape}, array is {self.dtype}{self.shape}")
        if stream is not None and not blocking:
            stream.enqueue(lambda: np.copyto(out, src), out)
            return out
        (stream or _current).synchronize()
        np.copyto(out, src)
        return out

    def set(self, arr: np.ndarray, stream: Stream | None = None) -> None:
        """Copy host data in; with a stream the copy is queued there."""
        _h2d(self.nbytes, "set-async" if stream is not None else "set")
        dst = self.view(np.ndarray)
        src = np.asarray(arr)
        if src.shape != dst.shape:
            src = src.reshape(dst.shape)
        if stream is not None:
            stream.enqueue(lambda: np.copyto(dst, src), src)
            return
        np.copyto(dst, src)


ndarray.__module__ = __name__  # what array_module() reads to find this module


class _UFunc:
    """`xp.exp` etc.: NumPy's ufunc, refusing host arrays and returning device arrays."""

    def __init__(self, ufunc: np.ufunc):
        self._u = ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _reject_host(self.__name__, args)
        if any(isinstance(a, ndarray) for a in args) or "out" in kwargs:
            return self._u(*args, **kwargs)  # dispatches to ndarray.__array_ufunc__
        result = self._u(*args, **kwargs)
        _kernel(result)
        return _wrap(result)  # scalars in: a 0-d device array out

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._u, name)
        if not callable(attr):
            return attr

        def method(*args: Any, **kwargs: Any) -> Any:
            _reject_host(f"{self.__name__}.{name}", args)
            return _wrap(attr(*args, **kwargs))

        return method


# --------------------------------------------------------------------------- the module API

_SHAPE_ONLY = {"zeros_like", "empty_like", "ones_like", "full_like", "shape", "ndim", "size"}


def asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    """Host data to the device (counted), device arrays unchanged (or cast)."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    host = np.array(a, dtype=dtype, order=order or "K", copy=True)
    if isinstance(a, np.ndarray) and a.ndim > 0:
        _h2d(host.nbytes, "asarray")
    _kernel(host)
    return host.view(ndarray)


def array(a: Any, dtype: Any = None, copy: bool = True, order: str = "K", ndmin: int = 0) -> Any:
    if isinstance(a, ndarray):
        out = np.array(a.view(np.ndarray), dtype=dtype, copy=copy, order=order, ndmin=ndmin)
        _kernel(a, out)
        return out.view(ndarray)
    return asarray(np.array(a, dtype=dtype, order=order, ndmin=ndmin))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if not isinstance(a, ndarray):
        return asarray(np.ascontiguousarray(a, dtype=dtype))
    if a.flags.c_contiguous and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    result = np.ascontiguousarray(a.view(np.ndarray), dtype=dtype)
    _kernel(a, result)
    return result.view(ndarray)


def asnumpy(
    a: Any, stream: Stream | None = None, order: str = "C", out: Any = None, *, blocking=True
) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order)


def get_array_module(*args: Any) -> Any:
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


def __getattr__(name: str) -> Any:
    obj = getattr(np, name)  # AttributeError for names NumPy lacks too
    if isinstance(obj, np.ufunc):
        wrapped: Any = _UFunc(obj)
    elif isinstance(obj, type | types.ModuleType) or not callable(obj):
        return obj
    else:

        @functools.wraps(obj)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name not in _SHAPE_ONLY:
                _reject_host(name, args)
            result = obj(*_unwrap(args), **_unwrap(kwargs))
            _kernel(args, kwargs, result)
            return _wrap(result)

    globals()[name] = wrapped
    return wrapped


# --------------------------------------------------------------------------- cupy.cuda


class _PinnedMemory(bytearray):
    """Page-locked host memory, played by a bytearray (NumPy can view it)."""


def _alloc_pinned_memory(nbytes: int) -> _PinnedMemory:
    STATS.pinned += 1
    return _PinnedMemory(nbytes)


class _Device:
    def __init__(self, device: int = 0):
        self.id = device

    def use(self) -> None:
        return None

    def synchronize(self) -> None:
        _current.synchronize()


def _device_count() -> int:
    return int(os.environ.get("FAKE_DEVICE_COUNT", "1"))


cuda = types.SimpleNamespace(
    Stream=Stream,
    Event=Event,
    Device=_Device,
    get_current_stream=get_current_stream,
    alloc_pinned_memory=_alloc_pinned_memory,
    runtime=types.SimpleNamespace(getDeviceCount=_device_count),
)


# --------------------------------------------------------------------------- checks for MPI


def check_mpi_buffer(buf: Any) -> str | None:
    """Why handing `buf` to MPI now would be a race (None when it is safe)."""
    if isinstance(buf, ndarray):
        last = _touched.get(id(_root(buf)))
        if last is not None and last[1] > last[0].synced:
            return (
                "device buffer handed to MPI while a kernel that used it may still run (no "
                "synchronisation or completed event since)"
            )
        return None
    if isinstance(buf, np.ndarray):
        for op in _pending:
            if np.may_share_memory(op.host, buf):
                return f"host buffer handed to MPI while a copy on {op.stream.name} still uses it"
    return None
