"""Sleeping precisely without spinning: the stand-in for compute of synthetic devices and
sleeping benchmark stages.

A rank that spins while it waits takes the core of one that has work wherever ranks share
cores, so every modelled wait here is a real sleep; Linux's default 50 us timer slack is cut to
1 us so that a sleep ends close to when it was asked to.
"""

from __future__ import annotations

import ctypes
import sys
import time

__all__ = ["fine_timer_slack", "sleep_until", "sleep_until_ns"]


def fine_timer_slack() -> None:
    """Ask Linux for 1 us timer slack (default 50 us), so sleeps end close to when asked."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
        except (OSError, AttributeError):
            return


def sleep_until(deadline: float) -> None:
    """Sleep until `deadline` on the `time.perf_counter` clock (seconds)."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def sleep_until_ns(deadline: int) -> None:
    """Sleep until `deadline` on the `time.perf_counter_ns` clock."""
    left = deadline - time.perf_counter_ns()
    if left > 0:
        time.sleep(left * 1e-9)
