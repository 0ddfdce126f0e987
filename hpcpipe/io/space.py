"""Refuse to start an HDF5 write that cannot fit: a full disk must be an error, not a crash.

HDF5 does not fail cleanly when a write hits ENOSPC: h5py 3.16 over HDF5 2.0 prints
"Exception ignored in ObjectID.__dealloc__" and then the process dies with SIGSEGV, which
turns a full file system into an unexplained crash of one rank. Checking free space first
(plus headroom for HDF5's metadata) makes it an OSError that names the path; the checkpoint
writer turns that into the usual all-ranks CheckpointError and the last good checkpoint stays.
A disk that fills up between the check and the write can still crash HDF5: that race is left.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["HEADROOM_BYTES", "PER_OBJECT_BYTES", "ensure_space"]

HEADROOM_BYTES = 64 << 10
"""Room for HDF5's own metadata (superblock, root group, heaps) on top of the data."""
PER_OBJECT_BYTES = 2 << 10
"""Room per dataset (object header, attributes, chunk index)."""


def ensure_space(directory: Path | str, nbytes: int, what: str, objects: int = 0) -> None:
    """Raise OSError(ENOSPC) naming `what` unless `directory` has room for `nbytes` of data
    in `objects` datasets."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return  # not checkable here (the write itself will report what is wrong)
    free = st.f_bavail * st.f_frsize
    need = int(nbytes * 1.02) + HEADROOM_BYTES + PER_OBJECT_BYTES * objects
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: {what} needs about {_size(need)}, "
            f"{_size(free)} free (checked before writing, as HDF5 crashes on a full disk)",
            str(directory),
        )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
