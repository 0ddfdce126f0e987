"""Rewrite the measured blocks of docs/performance.md from benchmarks/results/*.json.

    python benchmarks/report.py              # after the figure scripts (or run_all.py)

A block is the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; NAME is a
results file (its command and table, exactly as printed when it ran), `machine` (where the
numbers come from) or `summary` (every target against what was measured). Text outside the
blocks, the interpretation, is left alone: reread it when the numbers move.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT

from hpcpipe.bench.table import read_report

DOC = ROOT / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- bench:([\w-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def _load(name: str) -> tuple[Any, dict[str, Any]] | None:
    path = RESULTS / f"{name}.json"
    return read_report(path) if path.exists() else None


def table_block(name: str) -> str:
    loaded = _load(name)
    if loaded is None:
        return f"(no results yet: run `python benchmarks/{name}.py`)\n"
    report, data = loaded
    load = data.get("machine", {}).get("load_average")
    end = data.get("machine", {}).get("load_average_end")
    lines = [f"$ {data.get('command', '')}", report.render()]
    if load:
        lines.append(
            f"# load average (1/5/15 min) at start {' '.join(f'{x:.2f}' for x in load)}"
            + (f", at end {' '.join(f'{x:.2f}' for x in end)}" if end else "")
        )
    return "```text\n" + "\n".join(lines) + "\n```\n"


def machine_block() -> str:
    for name in ("p2p_latency", "pipeline_step", "allreduce_buckets"):
        loaded = _load(name)
        if loaded is not None:
            m = loaded[1]["machine"]
            return (
                f"- CPU: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB memory, "
                f"{m['system']}\n"
                f"- Python {m['python']}, NumPy {m['numpy']}, mpi4py {m['mpi4py']}, {m['mpi']}\n"
            )
    return "(no results yet)\n"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _since(s: dict[str, Any]) -> str:
    size = s.get("within_5pct_from_bytes")
    return "" if size is None else f"; within 5% from {_size(size)} up"


def _status(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def summary_block() -> str:
    rows: list[tuple[str, str, str]] = []

    def summary(name: str) -> dict[str, Any]:
        loaded = _load(name)
        return loaded[0].summary if loaded else {}

    s = summary("p2p_latency")
    v = s.get("max_ratio_ge_64KiB")
    rows.append(
        (
            "p2p Mailbox / raw, >= 64 KiB: <= 1.05",
            _fmt(v, ".3f") + " (worst size)" + _since(s),
            _status(None if v is None else v <= 1.05),
        )
    )
    v = s.get("max_extra_us_lt_64KiB")
    rows.append(
        (
            "p2p Mailbox extra latency, < 64 KiB: <= 20 us",
            _fmt(v, ".2f") + " us (worst)",
            _status(None if v is None else v <= 20),
        )
    )
    s = summary("allreduce_buckets")
    v = s.get("max_ratio_ge_64KiB")
    rows.append(
        (
            "bucketed / raw Allreduce, >= 64 KiB: <= 1.05",
            _fmt(v, ".3f") + " (worst)" + _since(s),
            _status(None if v is None else v <= 1.05),
        )
    )
    s = summary("moe_alltoall")
    v = s.get("max_flat_ratio_ge_64KiB")
    rows.append(
        (
            "MoE flat exchange / raw Alltoallv, >= 64 KiB/peer: <= 1.05",
            _fmt(v, ".3f") + " (worst)" + _since(s),
            _status(None if v is None else v <= 1.05),
        )
    )
    s = summary("pipeline_step")
    v = s.get("max_ratio")
    rows.append(
        (
            "pipeline measured / predicted (simulator, measured costs), 2 ranks: <= 1.10",
            f"median {_fmt(s.get('median_ratio'), '.3f')}, worst {_fmt(v, '.3f')}",
            _status(None if v is None else v <= 1.10),
        )
    )
    v = s.get("max_runtime_ratio")
    rows.append(
        (
            "pipeline, the same runs against the lowered message order: <= 1.10",
            f"median {_fmt(s.get('median_runtime_ratio'), '.3f')}, worst {_fmt(v, '.3f')}",
            _status(None if v is None else v <= 1.10),
        )
    )
    for name, label in (
        ("pipeline_synthetic", "synthetic costs, 8 ranks: within 3% of the plan"),
        ("pipeline_synthetic_waits", "synthetic, receives waited for at their consumer: within 3%"),
    ):
        s = summary(name)
        v = s.get("max_plan_ratio")
        rows.append(
            (
                label,
                f"median {_fmt(s.get('median_plan_ratio'), '.3f')}, worst {_fmt(v, '.3f')}",
                _status(None if v is None else v <= 1.03),
            )
        )
    v = summary("trace_overhead").get("max_estimate_pct")
    rows.append(
        (
            "trace recording overhead: <= 2%",
            _fmt(v, ".3f") + "% (worst model)",
            _status(None if v is None else v <= 2),
        )
    )
    s = summary("ckpt_bandwidth")
    rows.append(
        (
            "checkpoint / raw disk bandwidth (no target)",
            f"write {_fmt(s.get('write_vs_raw'), '.2f')}, read {_fmt(s.get('read_vs_raw'), '.2f')}",
            "-",
        )
    )
    loaded = _load("memory_peak")
    if loaded:
        exact = all(
            abs(r["act_mib"] - r["act_model_mib"]) < 1e-9 and r["act_mb"] == r["act_model_mb"]
            for r in loaded[0].rows
            if "act_mib" in r
        )
        rows.append(
            (
                "peak activations per rank = the simulator's memory model",
                "equal on every schedule and rank" if exact else "differ (see table)",
                _status(exact),
            )
        )
    out = ["| target | measured | |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out) + "\n"


def render(text: str) -> str:
    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        if name == "summary":
            body = summary_block()
        elif name == "machine":
            body = machine_block()
        else:
            body = table_block(name)
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(fill, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", default=str(DOC), help="the report to update")
    args = ap.parse_args()
    doc = Path(args.doc)
    text = doc.read_text(encoding="utf-8")
    new = render(text)
    doc.write_text(new, encoding="utf-8")
    blocks = len(BLOCK.findall(text))
    print(
        f"updated {blocks} block(s) of {doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
