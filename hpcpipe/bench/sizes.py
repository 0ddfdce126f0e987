"""Message sizes on the command line: `4096`, `64K`, `64Ki`, `1M`, `64MiB` (powers of 1024)."""

from __future__ import annotations

import argparse
import re

from hpcpipe.config import ConfigError

__all__ = ["met_from", "parse_bytes", "size_range"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """`'64Ki'` -> 65536; an argparse type, so bad sizes are usage errors (exit 2)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: use bytes or a K/M/G suffix, e.g. 4096, 64Ki, 64MiB"
        )
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return value


def size_range(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo*factor, ... up to hi (hi itself included when the steps skip it)."""
    if factor < 2:
        raise ConfigError("--factor", "", f"must be >= 2, got {factor}")
    if hi < lo:
        raise ConfigError("--max-bytes", "", f"= {hi} is below --min-bytes = {lo}")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != hi:
        sizes.append(hi)
    return sizes


def met_from(rows: list[dict], key: str, limit: float, size_key: str = "bytes") -> int | None:
    """The smallest size from which every row's `key` is within `limit` (None: not even the
    largest)."""
    best = None
    for row in sorted(rows, key=lambda r: r[size_key], reverse=True):
        if row[key] > limit:
            break
        best = row[size_key]
    return best
