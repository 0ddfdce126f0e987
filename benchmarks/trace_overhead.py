"""Trace recorder overhead: per event in a tight loop, and as a share of a real training step.

    python benchmarks/trace_overhead.py                 # prints tables, writes the JSON
    python benchmarks/trace_overhead.py --events 500000 --steps 30 --json out.json

Part 1 times the runtime's hook pattern, `if rec.enabled: rec.record(kind, stage, mb, t0,
rec.now(), nbytes, peer)`, against an empty loop: with tracing off the hook is one attribute
test, with it on one clock read and one row store. Part 2 runs the F/B/W of a one-stage model
(the pipeline's compute, no MPI) in 1F1B order for several model sizes, with the hooks a
pipeline rank executes per microbatch (F, B, W, plus a send and a receive) on and off,
interleaving on/off steps so drift cancels; it reports the measured difference of the fastest
step times and the estimate events x per-event cost / step time (the measured one is noisy on a
shared machine: trust the estimate when the two disagree). BLAS runs one thread.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from _common import machine_facts

from hpcpipe.bench.table import Column, Report
from hpcpipe.io.trace import EventKind, Recorder
from hpcpipe.model.config import ModelConfig
from hpcpipe.model.models import build_model
from hpcpipe.model.stage import Stage

K = EventKind
MODELS = {  # name -> (model config, rows per microbatch, microbatches)
    "tiny (train_tiny deck)": (
        ModelConfig(kind="gpt", layers=6, d_model=16, n_heads=2, d_ff=32, vocab=16, seq_len=8),
        2,
        4,
    ),
    "small (quickstart sizes)": (ModelConfig(), 8, 8),
    "medium": (
        ModelConfig(kind="gpt", layers=4, d_model=128, n_heads=4, d_ff=512, vocab=256, seq_len=64),
        4,
        8,
    ),
}


def per_event(n: int, repeats: int = 5) -> dict[str, float]:
    """ns per iteration of the hook in a tight loop: empty, tracing off, tracing on."""
    off = Recorder(0, enabled=False)
    on = Recorder(0, capacity=n)
    now = time.perf_counter_ns
    kind = K.F

    def empty() -> int:
        t = now()
        for _ in range(n):
            pass
        return now() - t

    def hooked(rec: Recorder) -> int:
        t = now()
        for mb in range(n):
            if rec.enabled:
                rec.record(kind, 1, mb, t, now(), 4096, 2)
        return now() - t

    best: dict[str, float] = {}
    for _ in range(repeats):
        on.clear()
        for name, ns in (("empty", empty()), ("off", hooked(off)), ("on", hooked(on))):
            best[name] = min(best.get(name, float("inf")), ns / n)
    assert len(on) == n
    return {
        "loop_ns": best["empty"],
        "off_ns": best["off"] - best["empty"],
        "on_ns": best["on"] - best["empty"],
    }


def one_f_one_b_order(m: int) -> list[tuple[int, int]]:
    """(kind, microbatch) of a one-rank pipeline step: F, then B and W per microbatch."""
    out = []
    for mb in range(m):
        out += [(K.F, mb), (K.B, mb), (K.W, mb)]
    return out


def step_times(cfg: ModelConfig, rows: int, m: int, steps: int) -> dict[str, float]:
    """Fastest step time with the hooks off and on (the least disturbed by other load), and
    the events recorded per step."""
    units = build_model(cfg)
    stage = Stage(units, range(len(units)))
    params = stage.init(1, np, "float32")
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab, size=(rows, cfg.seq_len))
    y = rng.integers(0, cfg.vocab, size=(rows, cfg.seq_len))
    order = one_f_one_b_order(m)
    now = time.perf_counter_ns

    def step(rec: Recorder, number: int) -> int:
        rec.begin_step(number)
        t_step = now()
        ctx: dict[int, object] = {}
        wctx: dict[int, object] = {}
        for kind, mb in order:
            t0 = now()
            if kind == K.F:
                _, ctx[mb] = stage.forward(params, x, y)
            elif kind == K.B:
                _, wctx[mb] = stage.backward_input(params, ctx.pop(mb), 1.0 / m)
            else:
                stage.backward_weight(params, wctx.pop(mb))
            if rec.enabled:
                rec.record(kind, 0, mb, t0, now())
            if kind != K.W and rec.enabled:  # the send after F / B and the receive before
                t1 = now()
                rec.record(K.SEND_F if kind == K.F else K.SEND_B, 0, mb, t1, now(), 4096, 1)
                rec.record(K.RECV_B if kind == K.F else K.RECV_F, 0, mb, t1, now(), 4096, 1)
        if rec.enabled:
            rec.record(K.STEP, -1, -1, t_step, now())
        return now() - t_step

    off, on = Recorder(0, enabled=False), Recorder(0, capacity=1 << 16)
    step(off, 0)
    step(on, 0)  # warm-up: allocations, caches
    on.clear()
    t_off, t_on = [], []
    for i in range(steps):
        first, second = (off, on) if i % 2 == 0 else (on, off)
        a, b = step(first, i), step(second, i)
        t_off.append(a if first is off else b)
        t_on.append(b if first is off else a)
    return {
        "off_ns": min(t_off),
        "on_ns": min(t_on),
        "events_per_step": len(on) / steps,
    }


COLUMNS = [
    Column("model", "model", "", 26, "<"),
    Column("step_ms", "step_ms", ".3f", 9),
    Column("events_per_step", "events", ".0f", 7),
    Column("estimate_pct", "estimate %", ".3f", 10),
    Column("measured_pct", "measured %", ".2f", 10),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="tight-loop iterations")
    parser.add_argument("--steps", type=int, default=20, help="steps per model, on and off")
    parser.add_argument(
        "--json", default=str(Path(__file__).parent / "results" / "trace_overhead.json")
    )
    args = parser.parse_args(argv)

    ev = per_event(args.events)
    report = Report(
        "trace_overhead",
        [
            f"trace recorder per event (tight loop, best of 5): empty loop {ev['loop_ns']:.1f} "
            f"ns/iter; hook with tracing off {ev['off_ns']:.1f} ns/event, on "
            f"{ev['on_ns']:.1f} ns/event (clock read + row store)",
            "share of a training step (one stage, F/B/W per microbatch, 5 hooks per "
            "microbatch): estimate = events x per-event cost / step; measured = on / off - 1 "
            "(fastest steps, interleaved)",
        ],
        COLUMNS,
        params={"events": args.events, "steps": args.steps},
        stream=True,
    )
    report.start()
    for name, (cfg, rows_mb, m) in MODELS.items():
        st = step_times(cfg, rows_mb, m, args.steps)
        estimate = st["events_per_step"] * ev["on_ns"] / st["off_ns"]
        measured = st["on_ns"] / st["off_ns"] - 1.0
        report.add(
            {
                "model": name,
                "rows_per_microbatch": rows_mb,
                "microbatches": m,
                "step_ms": st["off_ns"] / 1e6,
                **st,
                "estimate_pct": 100 * estimate,
                "measured_pct": 100 * measured,
            }
        )
    worst = max(r["estimate_pct"] for r in report.rows)
    report.summary |= {"per_event": ev, "max_estimate_pct": worst}
    report.target("estimated overhead (worst model)", "<= 2%", f"{worst:.3f}%", worst <= 2)
    report.finish()
    out = report.write(
        args.json,
        machine=machine_facts(),
        command="python benchmarks/trace_overhead.py",
    )
    print(f"# wrote {out.relative_to(Path(__file__).resolve().parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
