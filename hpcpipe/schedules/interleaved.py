"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v model chunks per rank.

Rank r holds stages r, p+r, ..., (v-1)p+r. Microbatches go through in groups of p: the forward
order on every rank is chunk 0 for microbatches 0..p-1, chunk 1 for the same group, ..., then
the next group; backwards run the chunks in reverse. Rank r warms up with 2(p-1-r) + (v-1)p
forwards, then alternates one forward and one backward. Each stage is 1/v of a rank's share of
the model, so the bubble shrinks by v, (p-1)(T_F+T_B+T_W)/v, at the price of v times more
messages and a peak of p + (p-1)/v full-stage activations on rank 0.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.schedules._build import check_pm
from hpcpipe.schedules.ir import Kind, Schedule

__all__ = ["interleaved_1f1b"]


def _virtual(k: np.ndarray, p: int, v: int, forward: bool) -> tuple[np.ndarray, np.ndarray]:
    """Virtual microbatch index -> (chunk, microbatch) in Megatron's order."""
    group, within = np.divmod(k, p * v)
    chunk = within // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, group * p + within % p


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved schedule; needs m divisible by p (microbatches go in groups of p)."""
    check_pm("interleaved-1f1b", p, m)
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
        raise ValueError(f"interleaved 1F1B needs v >= 1 stages per rank (got v={v!r})")
    if m % p:
        raise ValueError(
            f"interleaved 1F1B needs m divisible by p (got p={p}, m={m}): microbatches "
            "cycle through the chunks in groups of p"
        )
    total = m * v
    per_rank = []
    for r in range(p):
        warm = min((p - 1 - r) * 2 + (v - 1) * p, total)
        steady = total - warm
        fk = np.arange(total)
        bk = np.arange(total)
        f_chunk, f_mb = _virtual(fk, p, v, True)
        b_chunk, b_mb = _virtual(bk, p, v, False)
        order_kind = np.empty(2 * total, dtype=np.int8)
        order_idx = np.empty(2 * total, dtype=np.int64)
        order_kind[:warm] = Kind.F
        order_idx[:warm] = np.arange(warm)
        mid = slice(warm, warm + 2 * steady)
        order_kind[mid][0::2] = Kind.F
        order_idx[mid][0::2] = np.arange(warm, total)
        order_kind[mid][1::2] = Kind.BW
        order_idx[mid][1::2] = np.arange(steady)
        order_kind[warm + 2 * steady :] = Kind.BW
        order_idx[warm + 2 * steady :] = np.arange(steady, total)
        is_f = order_kind == Kind.F
        chunk = np.where(is_f, f_chunk[order_idx], b_chunk[order_idx])
        mb = np.where(is_f, f_mb[order_idx], b_mb[order_idx])
        per_rank.append((order_kind, chunk * p + r, mb))
    placement = [tuple(c * p + r for c in range(v)) for r in range(p)]
    return Schedule.from_arrays(
        "interleaved-1f1b", placement, m, per_rank, params=(("p", p), ("m", m), ("v", v))
    )
