"""Lines that reach the terminal whole when every rank writes at once.

`print(text)` writes the text and its newline in two calls when output is unbuffered
(PYTHONUNBUFFERED=1, common in job scripts); the launcher merges every rank's output as it
arrives, so another rank's line can land between the two halves. `say` hands the stream the line
and its newline as one string, which an unbuffered stream passes on as one write (atomic on a
pipe up to 4 KiB), and a buffered one flushes at once.
"""

from __future__ import annotations

import sys


def say(text: str, *, err: bool = False) -> None:
    """Write `text` and a newline to stdout (stderr with `err`) as one write, flushed."""
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{text}\n")
    stream.flush()
