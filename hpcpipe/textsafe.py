"""Text from files is data, not terminal commands: escape what a terminal would interpret.

A tensor name, a host name or a schedule name read from an HDF5 file can hold escape
sequences or control bytes; printed raw they would recolour, retitle or rewrite the user's
terminal. Every command that prints text taken from a file passes it through `printable`.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """`text` with every non-printable character (but newline and tab) as a visible escape."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in "\n\t" or ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)
