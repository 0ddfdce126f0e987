"""Helpers the workloads' own deck checks share (see hpcpipe.workloads): keyed errors, node
memory. Pure: no MPI, no writes."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from hpcpipe.config import Config, ConfigError

__all__ = ["check_paths", "gib", "keyed", "memory_bytes", "os_reason"]


def keyed(exc: ValueError, section: str, source: str) -> ConfigError:
    """A component's ValueError("key: why") as the ConfigError that names section.key."""
    key, sep, why = str(exc).partition(": ")
    if sep and re.fullmatch(r"[a-z_]+", key):
        return ConfigError(source, f"{section}.{key}", why)
    return ConfigError(source, section, f"is not usable: {exc}")


def memory_bytes() -> int:
    """Physical memory of this node (0 when the platform cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_paths(config: Config) -> None:
    """Files the deck names that are read as soon as the deck is used must be regular files: a
    FIFO would block the read forever (and a time-limit signal is held during start-up), a
    directory or device gives a confusing error deep inside a reader."""
    pipeline = config.sections.get("pipeline")
    if pipeline is not None and pipeline.schedule == "csv" and pipeline.schedule_csv:
        path = Path(pipeline.schedule_csv)
        try:
            regular = stat.S_ISREG(path.stat().st_mode)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                config.source,
                "pipeline.schedule_csv",
                f"= {str(path)!r} cannot be read: {os_reason(exc)}",
            ) from None
        if not regular:
            raise ConfigError(
                config.source,
                "pipeline.schedule_csv",
                f"= {str(path)!r} is not a regular file (a directory, FIFO or device)",
            )


def os_reason(exc: OSError | ValueError) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or os.strerror(exc.errno)} [{name}]{where}"
    return str(exc)
