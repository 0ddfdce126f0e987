"""A communicator that checks every buffer handed to MPI against the fake device's streams.

`RecordingComm(comm)` is the same MPI communicator (no duplicate is made) whose point-to-point
and collective calls first ask `fake_device.check_mpi_buffer` whether the buffer is safe to give
to MPI now: a device buffer needs its producing stream synchronised, a staged host buffer needs
its copy to have landed. Each call appends ("mpi", name, where) to the fake's event log and any
violation to `VIOLATIONS`, so a test can assert both the order of events and that there were
none. `Dup` and `Split` return recording communicators too; persistent requests are checked
at each `Start`.
"""

from __future__ import annotations

from typing import Any

import fake_device
import numpy as np
from mpi4py import MPI

VIOLATIONS: list[str] = []


def _buffers(arg: Any) -> list[Any]:
    """The arrays inside an mpi4py buffer argument (array, [array, type], [array, counts...])."""
    if isinstance(arg, np.ndarray):
        return [arg]
    if isinstance(arg, list | tuple) and arg and isinstance(arg[0], np.ndarray):
        return [arg[0]]
    return []


def _where(buf: Any) -> str:
    return "device" if isinstance(buf, fake_device.ndarray) else "host"


class RecordingComm(MPI.Intracomm):
    """`comm` with each buffer-taking call checked and logged (see the module docstring)."""

    def _check(self, name: str, *args: Any) -> None:
        bufs = [b for a in args for b in _buffers(a)]
        for b in bufs:
            why = fake_device.check_mpi_buffer(b)
            if why is not None:
                VIOLATIONS.append(f"{name}: {why}")
        where = ",".join(sorted({_where(b) for b in bufs})) or "none"
        fake_device.STATS.log.append(("mpi", name, where))

    def Isend(self, buf: Any, *args: Any, **kwargs: Any) -> MPI.Request:
        self._check("Isend", buf)
        return super().Isend(buf, *args, **kwargs)

    def Send(self, buf: Any, *args: Any, **kwargs: Any) -> None:
        self._check("Send", buf)
        return super().Send(buf, *args, **kwargs)

    def Ssend(self, buf: Any, *args: Any, **kwargs: Any) -> None:
        self._check("Ssend", buf)
        return super().Ssend(buf, *args, **kwargs)

    def Irecv(self, buf: Any, *args: Any, **kwargs: Any) -> MPI.Request:
        self._check("Irecv", buf)
        return super().Irecv(buf, *args, **kwargs)

    def Recv(self, buf: Any, *args: Any, **kwargs: Any) -> None:
        self._check("Recv", buf)
        return super().Recv(buf, *args, **kwargs)

    def Recv_init(self, buf: Any, *args: Any, **kwargs: Any) -> RecordingPrequest:
        return RecordingPrequest(self, "Recv_init", buf, super().Recv_init(buf, *args, **kwargs))

    def Send_init(self, buf: Any, *args: Any, **kwargs: Any) -> RecordingPrequest:
        return RecordingPrequest(self, "Send_init", buf, super().Send_init(buf, *args, **kwargs))

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, *args: Any, **kwargs: Any) -> MPI.Request:
        self._check("Iallreduce", sendbuf, recvbuf)
        return super().Iallreduce(sendbuf, recvbuf, *args, **kwargs)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, *args: Any, **kwargs: Any) -> None:
        self._check("Allreduce", sendbuf, recvbuf)
        return super().Allreduce(sendbuf, recvbuf, *args, **kwargs)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        self._check("Alltoallv", sendbuf, recvbuf)
        return super().Alltoallv(sendbuf, recvbuf)

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        self._check("Alltoall", sendbuf, recvbuf)
        return super().Alltoall(sendbuf, recvbuf)

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> MPI.Request:
        self._check("Ialltoallv", sendbuf, recvbuf)
        return super().Ialltoallv(sendbuf, recvbuf)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> MPI.Request:
        self._check("Alltoall", sendbuf, recvbuf)  # the per-expert counts, host integers
        return super().Ialltoall(sendbuf, recvbuf)

    def Dup(self, *args: Any, **kwargs: Any) -> RecordingComm:
        return RecordingComm(super().Dup(*args, **kwargs))

    def Split(self, *args: Any, **kwargs: Any) -> RecordingComm:
        return RecordingComm(super().Split(*args, **kwargs))


class RecordingPrequest:
    """A persistent request whose every `Start` is checked and logged like a nonblocking call
    (MPI touches the buffer from `Start` on, not from `Send_init`/`Recv_init`)."""

    def __init__(self, comm: RecordingComm, name: str, buf: Any, request: MPI.Prequest):
        self.comm, self.name, self.buf, self.request = comm, name, buf, request

    def Start(self) -> None:
        self.comm._check(self.name, self.buf)
        self.request.Start()

    def Wait(self, status: Any = None) -> bool:
        return self.request.Wait(status)

    def Test(self, status: Any = None) -> bool:
        return self.request.Test(status)

    def Free(self) -> None:
        self.request.Free()
