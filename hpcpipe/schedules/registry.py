"""Schedule names -> generators: the one place that maps a deck's `schedule` key to a plan."""

from __future__ import annotations

from collections.abc import Callable

from hpcpipe.schedules.dualpipe import dualpipe_v
from hpcpipe.schedules.gpipe import gpipe
from hpcpipe.schedules.interleaved import interleaved_1f1b
from hpcpipe.schedules.ir import Schedule
from hpcpipe.schedules.onef1b import one_f_one_b
from hpcpipe.schedules.vshape import v_half, v_min, zb_v
from hpcpipe.schedules.zerobubble import zb_h1, zb_h2

__all__ = ["PUBLISHED", "SCHEDULE_NAMES", "build_schedule", "stages_per_rank"]

_FIXED: dict[str, tuple[Callable[[int, int], Schedule], int]] = {
    "gpipe": (gpipe, 1),
    "1f1b": (one_f_one_b, 1),
    "zb-h1": (zb_h1, 1),
    "zb-h2": (zb_h2, 1),
    "zb-v": (zb_v, 2),
    "v-half": (v_half, 2),
    "v-min": (v_min, 2),
    "dualpipe-v": (dualpipe_v, 2),
}

SCHEDULE_NAMES: tuple[str, ...] = (
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "v-half",
    "v-min",
    "dualpipe-v",
)

PUBLISHED: dict[str, tuple[str, str]] = {
    "gpipe": ("(p-1)(F+B+W)", "m"),
    "1f1b": ("(p-1)(F+B+W)", "p"),
    "interleaved-1f1b": ("(p-1)(F+B+W)/v", "p+(p-1)/v"),
    "zb-h1": ("(p-1)(F+B-W)", "p"),
    "zb-h2": ("(p-1)(F+B-2W)", "2p-1"),
    "zb-v": ("0 if F=B=W", "p"),
    "v-half": ("rate ~p/(2m)", "(p+2)//2"),
    "v-min": ("rate ~2p/(3m)", "(p+4)//3"),
    "dualpipe-v": ("(PP/2-1)(F&B+B-3W)", "PP+1"),
}
"""Published bubble (time per rank; F, B, W are one full stage's times) and peak activations
(full-stage microbatches) as the papers state them. DualPipe's figures are in its own notation
(F&B: an overlapped forward+backward pair, B a full backward)."""


def stages_per_rank(name: str, v: int | None = None) -> int:
    """How many stages each rank holds under schedule `name`."""
    if name == "interleaved-1f1b":
        return 2 if v is None else v
    if name not in _FIXED:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")
    return _FIXED[name][1]


def build_schedule(
    name: str, p: int, m: int, v: int | None = None, *, pairs: bool = False
) -> Schedule:
    """Build schedule `name` for p ranks and m microbatches.

    `v` (stages per rank) applies to interleaved-1f1b (default 2); the others have a fixed
    placement and accept only their own v. Unsupported (p, m, v) raise ValueError saying why.
    `pairs` keeps the overlapped F&B pairs of the schedules that define them (DualPipeV);
    without it every action runs on its own, in the same order.
    """
    if name == "interleaved-1f1b":
        return interleaved_1f1b(p, m, 2 if v is None else v)
    if name not in _FIXED:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}")
    generator, fixed_v = _FIXED[name]
    if v is not None and v != fixed_v:
        raise ValueError(
            f"{name} holds {fixed_v} stage(s) per rank; it cannot use v={v} "
            "(only interleaved-1f1b takes v)"
        )
    built = generator(p, m)
    return built if pairs else built.unpaired()
