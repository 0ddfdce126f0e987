"""Rewrite the measured blocks of docs/performance.md from benchmarks/results/*.json.

    python benchmarks/report.py              # after the figure scripts (or run_all.py)
    python benchmarks/report.py --check      # exit 1 if a page's tables differ from the results
    python benchmarks/report.py --strict     # ... or if a result is older than its code

A block is the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; NAME is a
results file (its command and table, exactly as printed when it ran), `machine` (where the
numbers come from) or `summary` (every target against what was measured). Text outside the
blocks, the interpretation, is left alone: reread it when the numbers move.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT

from hpcpipe.bench.table import read_report

BLOCK = re.compile(r"(<!-- bench:([\w-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def _load(name: str) -> tuple[Any, dict[str, Any]] | None:
    path = RESULTS / f"{name}.json"
    return read_report(path) if path.exists() else None


def _stamp(data: dict[str, Any]) -> str:
    """Which commit and day a result was measured on (what a page may say without going stale
    itself; whether the code has moved on since is for `stale`, asked when the page is read)."""
    measured = data.get("measured") or {}
    commit, date = measured.get("commit"), measured.get("date", "")
    if not commit:
        return "# measured on: an unrecorded commit (rerun the benchmark)"
    local = " + local changes" if measured.get("dirty") else ""
    return f"# measured on commit {commit[:10]}{local}, {date[:10]}"


def stale() -> list[str]:
    """Results measured before the code they describe last changed, one line each."""
    found = []
    for path in sorted(RESULTS.glob("*.json")):
        try:
            data = _load(path.stem)
        except ValueError:
            continue
        if data is None:
            continue
        measured = data[1].get("measured") or {}
        commit = measured.get("commit")
        later = changes_since(commit, measured.get("sources"), path.stem) if commit else None
        if commit is None or later:
            why = "no commit recorded" if commit is None else f"{later} later code commit(s)"
            again = data[1].get("command") or f"python benchmarks/run_all.py --only {path.stem}"
            found.append(f"{path.relative_to(ROOT)}: older than the code ({why}): rerun {again}")
    return found


def changes_since(
    commit: str, sources: list[str] | None = None, figure: str | None = None
) -> int | None:
    """Commits after `commit` that touch the code a figure describes (None: unknown commit):
    the source files its processes ran, as the result records them (hpcpipe._sources),
    or, for a result that does not, all of hpcpipe/ and the benchmark scripts, not the
    results or this writer. A commit whose message has the trailer line `Figures: unchanged
    (why)` is not counted: its author states that it cannot move a figure (an import
    rewritten, a comment), and says why, in the history where anyone can check it. One with
    `Figures: only NAME, NAME (why)` counts for the figures it names only: a change to a
    module many figures load (the schedule search, which every CLI process imports) that can
    move only the figures which run it."""
    paths = (
        list(sources)
        if sources
        else [
            "hpcpipe",
            "benchmarks",
            ":(exclude)benchmarks/results",  # the figures themselves
            ":(exclude)benchmarks/report.py",  # the page writer measures nothing
        ]
    )
    try:
        out = subprocess.run(
            ["git", "log", "--format=%H%x00%B%x01", f"{commit}..HEAD", "--", *paths],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    entries = [e.partition("\x00")[2] for e in out.stdout.split("\x01") if e.strip()]
    return sum(_counts(message, figure) for message in entries)


def _counts(message: str, figure: str | None) -> bool:
    """Whether a commit with this message can move `figure` (None: any figure)."""
    if UNCHANGED.search(message):
        return False
    only = ONLY.search(message)
    if only is None or figure is None:
        return True
    return figure in {name.strip() for name in only.group(1).split(",")}


UNCHANGED = re.compile(r"^Figures: unchanged \(.+\)\s*$", re.MULTILINE)
"""The commit-message trailer of a change that cannot move any figure (see `changes_since`)."""

ONLY = re.compile(r"^Figures: only ([\w, -]+?) \(.+\)\s*$", re.MULTILINE)
"""The trailer of a change that can move only the figures it names (see `changes_since`)."""


def table_block(name: str) -> str:
    loaded = _load(name)
    if loaded is None:
        return f"(no results yet: run `python benchmarks/run_all.py --only {name}`)\n"
    report, data = loaded
    load = data.get("machine", {}).get("load_average")
    end = data.get("machine", {}).get("load_average_end")
    lines = [f"$ {data.get('command', '')}", report.render()]
    if load:
        lines.append(
            f"# load average (1/5/15 min) at start {' '.join(f'{x:.2f}' for x in load)}"
            + (f", at end {' '.join(f'{x:.2f}' for x in end)}" if end else "")
        )
    lines.append(_stamp(data))
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


SUMMARY = (
    "p2p_latency",
    "allreduce_buckets",
    "moe_alltoall",
    "pipeline_step",
    "pipeline_synthetic",
    "replan",
    "replan_synthetic",
    "flushfree",
    "flushfree_synthetic",
    "async_dp",
    "sweep_grind",
    "plan_scale",
    "layout_search",
    "layout_ranking",
    "trace_overhead",
)
"""Results whose targets the summary lists, in the page's order."""


def summary_block() -> str:
    """Every target beside what was measured for it, and the commit it was measured on."""
    out = ["| figure | target | wanted | got | measured on |", "|---|---|---|---|---|"]
    for name in SUMMARY:
        loaded = _load(name)
        if loaded is None:
            out.append(f"| {name} | (no results yet) | | | |")
            continue
        report, data = loaded
        commit = (data.get("measured") or {}).get("commit")
        when = commit[:10] if commit else "unrecorded"
        for t in report.targets:
            got = f"{t.got} ({t.detail})" if t.detail else t.got
            out.append(f"| {name} | {t.what} | {t.want} | {got} | {when} |")
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
    ap.add_argument(
        "pages", nargs="*", help="pages to update (default: every docs/*.md with bench blocks)"
    )
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if a page differs from the results"
    )
    ap.add_argument(
        "--strict",
        action="store_true",
        help="also exit 1 when a result is older than the code it describes",
    )
    args = ap.parse_args()
    pages = [Path(p) for p in args.pages] or sorted((ROOT / "docs").glob("*.md"))
    differ = []
    for doc in pages:
        text = doc.read_text(encoding="utf-8")
        blocks = len(BLOCK.findall(text))
        if not blocks:
            continue
        new = render(text)
        shown = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
        if args.check:
            if new != text:
                differ.append(str(shown))
            continue
        doc.write_text(new, encoding="utf-8")
        print(f"updated {blocks} block(s) of {shown}")
    old = stale()
    for line in old:
        print(f"STALE: {line}")
    if differ:
        print(
            f"not rendered from benchmarks/results: {', '.join(differ)} "
            "(run python benchmarks/report.py)"
        )
        return 1
    return 1 if args.strict and old else 0


if __name__ == "__main__":
    sys.exit(main())
