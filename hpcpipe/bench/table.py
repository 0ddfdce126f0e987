"""Benchmark results as data: the columns, the rows, and the one text form printed and pasted.

A `Report` prints OSU style (comment lines starting with `#`, a header, one line per row), row
by row as the benchmark measures when `stream` is on, and serialises to JSON
(format `hpcpipe-bench`, version 1) from which `render` reproduces the identical table, so the
performance report is regenerated from the JSON files without rerunning anything. No MPI here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpipe.console import say

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Column",
    "Report",
    "Target",
    "clean",
    "provenance",
    "read_report",
]

FORMAT_NAME = "hpcpipe-bench"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Column:
    """One table column: the row key it shows, its header, a format spec and a width."""

    key: str
    head: str
    fmt: str = ""
    """Format spec without the width, e.g. ".2f"; booleans print as yes / NO."""
    width: int = 10
    align: str = ">"

    def cell(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            text = "-"
        elif isinstance(value, bool):
            text = "yes" if value else "NO"
        else:
            text = format(value, self.fmt)
        return f"{text:{self.align}{max(self.width, len(self.head))}}"

    def title(self) -> str:
        return f"{self.head:{self.align}{max(self.width, len(self.head))}}"


def clean(value: Any) -> Any:
    """JSON-safe copy: NumPy scalars and arrays to Python, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if hasattr(value, "tolist"):  # NumPy scalar or array
        return clean(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass(frozen=True)
class Target:
    """A figure the project aims at, beside what was measured: shown as a column, not a verdict
    line, because one noisy run on a shared machine is evidence, not a judgement."""

    what: str
    want: str
    """e.g. "<= 1.05"."""
    got: str
    met: bool
    detail: str = ""


def provenance(root: str | Path | None = None) -> dict[str, Any]:
    """The git commit (and whether the tree had local changes), the UTC date a result was
    measured on and the source files it ran (hpcpipe._sources), so a report can say when
    a figure is older than the code it describes."""
    import datetime
    import subprocess

    here = Path(root) if root is not None else Path(__file__).resolve().parent
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=here, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    from hpcpipe._sources import collect

    sources = collect()
    commit = git("rev-parse", "HEAD")
    # pathspecs from the top of the work tree (":/"), whatever folder git runs in
    paths = [f":/{path}" for path in sources] or [":/hpcpipe"]
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *paths)
    return {
        "commit": commit,
        "dirty": bool(dirty) if commit else None,
        "date": date,
        "sources": sources,
    }


@dataclass
class Report:
    """A benchmark's table plus what it was run with; `stream` prints lines as they come."""

    benchmark: str
    title: list[str]
    columns: list[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    stream: bool = False

    def header(self) -> str:
        return " ".join(c.title() for c in self.columns).rstrip()

    def line(self, row: dict[str, Any]) -> str:
        return " ".join(c.cell(row.get(c.key)) for c in self.columns).rstrip()

    def start(self) -> None:
        """Print the title and header now (streaming mode)."""
        if self.stream:
            for text in self.title:
                say(f"# {text}")
            say(self.header())

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.stream:
            say(self.line(row))

    def note(self, text: str) -> None:
        """A closing comment line (a summary, a target met or missed)."""
        self.notes.append(text)
        if self.stream:
            say(f"# {text}")

    def target(self, what: str, want: str, got: str, met: bool, detail: str = "") -> None:
        """Record a target beside the figure measured for it (printed by `render_targets`)."""
        self.targets.append(Target(what, want, got, bool(met), detail))

    def render_targets(self) -> list[str]:
        """The targets as a small table of comment lines: what, target, measured."""
        if not self.targets:
            return []
        w = max(len("target"), *(len(t.what) for t in self.targets))
        v = max(len("wanted"), *(len(t.want) for t in self.targets))
        g = max(len("got"), *(len(t.got) for t in self.targets))
        out = [f"# {'target':<{w}}  {'wanted':<{v}}  got"]
        for t in self.targets:
            line = f"# {t.what:<{w}}  {t.want:<{v}}  {t.got:<{g}}"
            out.append((f"{line}  {t.detail}" if t.detail else line).rstrip())
        return out

    def finish(self) -> None:
        """Print the targets table now (streaming mode)."""
        if self.stream:
            for line in self.render_targets():
                say(line)

    def render(self) -> str:
        """The whole table as printed."""
        lines = [f"# {t}" for t in self.title]
        lines.append(self.header())
        lines += [self.line(r) for r in self.rows]
        lines += [f"# {t}" for t in self.notes]
        lines += self.render_targets()
        return "\n".join(lines)

    def to_json(self, **extra: Any) -> dict[str, Any]:
        return clean(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "benchmark": self.benchmark,
                **extra,
                "params": self.params,
                "title": self.title,
                "columns": [c.__dict__ for c in self.columns],
                "rows": self.rows,
                "notes": self.notes,
                "summary": self.summary,
                "targets": [t.__dict__ for t in self.targets],
            }
        )

    def write(self, path: str | Path, **extra: Any) -> Path:
        """The JSON form, stamped with the commit and date it was measured on."""
        extra.setdefault("measured", provenance())
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(**extra), indent=1, allow_nan=False)
        out.write_text(text + "\n", encoding="utf-8")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        if data.get("format") != FORMAT_NAME or data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"not an {FORMAT_NAME} v{FORMAT_VERSION} result (format "
                f"{data.get('format')!r}, version {data.get('version')!r}); rerun the benchmark"
            )
        return cls(
            data["benchmark"],
            list(data["title"]),
            [Column(**c) for c in data["columns"]],
            list(data["rows"]),
            list(data["notes"]),
            dict(data["params"]),
            dict(data["summary"]),
            [Target(**t) for t in data.get("targets", [])],
        )


def read_report(path: str | Path) -> tuple[Report, dict[str, Any]]:
    """A result file's report and its raw JSON (for the machine and other extra fields)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    try:
        return Report.from_json(data), data
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
