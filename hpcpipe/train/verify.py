"""The end-of-run check against a single-process reference: every loss and every parameter
tensor (per-tensor relative norm) within a tolerance, or the run fails."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["compare_with_reference", "tolerance"]


def compare_with_reference(
    log: Any,
    what: str,
    losses: Sequence[float],
    params: dict[int, dict[str, np.ndarray]],
    ref: Any,
    rtol: float,
) -> None:
    """Log the verdict (`log(text)`); raise RuntimeError beyond `rtol`. `what` names the
    reference ("single-process reference", ...), `ref` is a `ReferenceResult`."""
    worst_loss = max(
        abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref.losses, strict=True)
    )
    worst, where = 0.0, "all equal"
    for i, p in ref.params.items():
        for k, expected in p.items():
            rel = float(
                np.linalg.norm(params[i][k].astype(np.float64) - expected)
                / max(np.linalg.norm(expected), 1e-300)
            )
            if rel > worst:
                worst, where = rel, f"unit {i} {k}"
    verdict = "OK" if worst <= rtol and worst_loss <= rtol else "FAILED"
    log(
        f"verify {verdict}: {sum(len(p) for p in params.values())} tensors vs the {what}, "
        f"max_rel_param={worst:.3e} ({where}) max_rel_loss={worst_loss:.3e} rtol={rtol:g}"
    )
    if verdict != "OK":
        raise RuntimeError(
            f"verify failed: parameters differ from the {what} by {worst:.3e} "
            f"(at {where}), losses by {worst_loss:.3e}; tolerance {rtol:g}"
        )


def tolerance(cfg: Any) -> float:
    """`train.verify_rtol`, or the default of the run's dtype (float64 agrees to rounding)."""
    return cfg.train.verify_rtol or (1e-10 if cfg.device.dtype == "float64" else 1e-5)
