"""Run the commands the documentation shows, and regenerate the output it shows.

    python docs/samples.py            # rewrite every sample output in README.md and docs/*.md
    python docs/samples.py --check    # run every command and compare (what the test does)
    python docs/samples.py --list     # what would run, what is skipped and why

Conventions in the Markdown (all fenced blocks of README.md and docs/*.md):

- A ```bash block is a script: it runs as shown, in a scratch copy of the repository's inputs/,
  jobscripts/ and benchmarks/ (one copy per page, so a later block may use an earlier one's
  output), with `.venv` pointing at the Python environment running this tool.
- A ```console block is a sample: its first line is `$ COMMAND` (continued with a trailing
  backslash), the rest is what COMMAND prints (stdout and stderr). A line holding only `...`
  stands for any number of lines. `--write` reruns COMMAND and puts its output in place,
  keeping as many head and tail lines around a `...` as the page shows now.
- A ```python block runs as a script.
- Blocks between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` are benchmark tables that
  benchmarks/report.py renders from benchmarks/results/NAME.json (checked by its --check).
- An HTML comment on the line before a fence tunes it, one setting per line:

      <!-- doc
      skip: why it cannot run here (a cluster, a GPU)         not run; reported with the reason
      slow: why (minutes of benchmarks)                        run only with --slow
      exit: 2                                                  expected exit code (default 0)
      vary: tok/s=\\S+                                          a regex for text that varies by
                                                               machine (repeatable)
      unordered                                                lines come from several ranks
      timeout: 300                                             seconds (default 180)
      -->

Comparison: text must be equal (runs of spaces count as one), integers equal, other numbers
within 0.1% (the last printed digit of a loss may differ between BLAS builds); what a `vary`
regex matches is masked on both sides. Fenced blocks of other kinds (```text, ```toml, plain)
are not run; `unrun_commands` flags plain blocks that look like commands, so a command cannot
hide in one.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
COPIED = ("inputs", "jobscripts", "benchmarks")
"""Folders a page's commands may read: copied, so that no command writes into the tree."""
RUN = ("bash", "console", "python")
DEFAULT_TIMEOUT = 180.0
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_FENCE = re.compile(r"^```(\w*)\s*$")
_LOOKS_LIKE_A_COMMAND = re.compile(
    r"^\s*(\$ )?((mpiexec|srun|sbatch|hpcpipe|python3?|pytest|bash|pip)\s|jobscripts/\S+\s)"
)


@dataclass
class Block:
    """One fenced block of a page, with the settings of the comment before it."""

    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    body: list[str]
    skip: str | None = None
    slow: str | None = None
    exit: int = 0
    vary: list[str] = field(default_factory=list)
    unordered: bool = False
    timeout: float = DEFAULT_TIMEOUT
    rendered: bool = False
    """Inside `<!-- bench:NAME -->` markers: a results table benchmarks/report.py renders."""

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def command(self) -> str:
        """A console sample's command (its `$` line and continuation lines)."""
        lines = []
        for i, text in enumerate(self.body):
            text = text[2:] if i == 0 and text.startswith("$ ") else text
            lines.append(text)
            if not text.endswith("\\"):
                break
        return "\n".join(lines)

    @property
    def output(self) -> list[str]:
        """A console sample's shown output."""
        return self.body[len(self.command.splitlines()) :]


def _settings(comment: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for raw in comment:
        text = raw.strip()
        if not text or text in ("<!-- doc", "-->"):
            continue
        key, sep, value = text.partition(":")
        found.setdefault(key.strip(), []).append(value.strip() if sep else "")
    return found


def parse(page: str) -> list[Block]:
    """Every fenced block of `page` (a path relative to the repository root)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks, i, in_bench = [], 0, False
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("<!-- bench:"):
                in_bench = True
            elif lines[i].startswith("<!-- /bench:"):
                in_bench = False
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        comment: list[str] = []
        k = start - 1
        if k >= 0 and lines[k].strip() == "-->":
            while k >= 0 and lines[k].strip() != "<!-- doc":
                k -= 1
            if k >= 0:
                comment = lines[k:start]
        settings = _settings(comment)
        block = Block(page, start + 1, lang, lines[start + 1 : j], rendered=in_bench)
        if lang == "console" and not (block.body and block.body[0].startswith("$ ")):
            raise ValueError(f"{block.name}: a console block starts with `$ COMMAND`")
        block.skip = (settings.get("skip") or [None])[0]
        block.slow = (settings.get("slow") or [None])[0]
        block.exit = int((settings.get("exit") or ["0"])[0])
        block.vary = settings.get("vary", [])
        block.unordered = "unordered" in settings
        block.timeout = float((settings.get("timeout") or [DEFAULT_TIMEOUT])[0])
        unknown = set(settings) - {"skip", "slow", "exit", "vary", "unordered", "timeout"}
        if unknown:
            raise ValueError(f"{block.name}: unknown doc setting(s) {sorted(unknown)}")
        blocks.append(block)
        i = j + 1
    return blocks


def runnable(page: str) -> list[Block]:
    return [b for b in parse(page) if b.lang in RUN]


def unrun_commands(page: str) -> list[str]:
    """Lines of blocks that are not run but look like commands: a command must sit in a
    ```bash or ```console block (run) or carry a `skip:` saying why it cannot run."""
    found = []
    for b in parse(page):
        if b.lang in RUN or b.rendered:
            continue
        for n, text in enumerate(b.body):
            if _LOOKS_LIKE_A_COMMAND.match(text):
                found.append(f"{b.page}:{b.line + 1 + n}: {text.strip()}")
    return found


# ---------------------------------------------------------------------------- running


def workspace(page: str, base: Path) -> Path:
    """A scratch folder for one page's commands: copies of the folders they read, and `.venv`
    pointing at this Python's environment."""
    ws = base / re.sub(r"[^\w.-]", "_", page)
    ws.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if not (ws / name).exists():
            shutil.copytree(ROOT / name, ws / name, ignore=shutil.ignore_patterns("results"))
    (ws / "benchmarks" / "results").mkdir(exist_ok=True)
    if not (ws / ".venv").exists():
        (ws / ".venv").symlink_to(Path(sys.prefix))
    return ws


def environment() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "HPCPIPE_INJECT", "PYTEST_", "VIRTUAL_ENV"))
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Ran:
    returncode: int
    output: str


def run(block: Block, ws: Path) -> Ran:
    """Run a block in `ws`: a bash script, a python script, or a sample's command."""
    if block.lang == "python":
        cmd = [sys.executable, "-c", "\n".join(block.body)]
    elif block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", "\n".join(block.body)]
    else:
        cmd = ["bash", "-o", "pipefail", "-c", block.command]
    try:
        proc = subprocess.run(
            cmd,
            cwd=ws,
            env=environment(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=block.timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        return Ran(-1, f"{out}\n(timed out after {block.timeout:g} s)")
    return Ran(proc.returncode, proc.stdout)


# ---------------------------------------------------------------------------- comparing


def _mask(text: str, vary: list[str]) -> str:
    for pattern in vary:
        text = re.sub(pattern, "<~>", text)
    return " ".join(text.split())


def _same_line(shown: str, got: str, vary: list[str]) -> bool:
    a, b = _mask(shown, vary), _mask(got, vary)
    if _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
        return False
    for x, y in zip(_NUMBER.findall(a), _NUMBER.findall(b), strict=True):
        if re.fullmatch(r"[-+]?\d+", x) and re.fullmatch(r"[-+]?\d+", y):
            if int(x) != int(y):
                return False
        elif abs(float(x) - float(y)) > 1e-3 * max(abs(float(x)), abs(float(y))) + 1e-12:
            return False
    return True


def _segments(lines: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for text in lines:
        if text.strip() == "...":
            out.append([])
        else:
            out[-1].append(text)
    return out


def differences(block: Block, got: str) -> str | None:
    """None when the output matches the sample, else a short explanation."""
    shown, actual = block.output, got.rstrip("\n").splitlines()
    if block.unordered:
        shown, actual = sorted(shown), sorted(actual)
    segments = _segments(shown)
    pos = 0
    for n, seg in enumerate(segments):
        if n == 0:
            where = 0
        elif n == len(segments) - 1:
            where = len(actual) - len(seg)
        else:  # a middle segment: its first occurrence after what matched so far
            where = next(
                (
                    k
                    for k in range(pos, len(actual) - len(seg) + 1)
                    if all(
                        _same_line(s, a, block.vary) for s, a in zip(seg, actual[k:], strict=False)
                    )
                ),
                -1,
            )
        if where < pos or where + len(seg) > len(actual):
            return f"the output has too few lines for the sample ({len(actual)} lines)"
        for k, text in enumerate(seg):
            if not _same_line(text, actual[where + k], block.vary):
                return f"line {where + k + 1}:\n  shown: {text}\n  got:   {actual[where + k]}"
        pos = where + len(seg)
        if len(segments) == 1 and len(actual) != len(seg):
            return f"{len(actual)} lines printed, {len(seg)} shown (use ... to elide)"
    return None


def regenerate(block: Block, got: str) -> list[str]:
    """The sample's new output: all of it, or as many head and tail lines as are shown."""
    actual = got.rstrip("\n").splitlines()
    segments = _segments(block.output)
    if len(segments) == 1:
        return actual
    head, tail = len(segments[0]), len(segments[-1])
    return [*actual[:head], "...", *(actual[-tail:] if tail else [])]


def rewrite(page: str, new: dict[int, list[str]]) -> None:
    """Replace the output lines of the console blocks opening at the given lines."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    for b in sorted(parse(page), key=lambda b: -b.line):
        if b.line not in new:
            continue
        first = b.line + len(b.command.splitlines())  # 0-based index of the first output line
        lines[first : b.line + len(b.body)] = new[b.line]
    (ROOT / page).write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, do not rewrite")
    ap.add_argument("--slow", action="store_true", help="also run the blocks marked slow")
    ap.add_argument("--list", action="store_true", help="list the blocks and exit")
    ap.add_argument("pages", nargs="*", default=list(PAGES), help="pages (default: all)")
    args = ap.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="hpcpipe-docs-") as tmp:
        for page in args.pages:
            ws = None
            new: dict[int, list[str]] = {}
            for line in unrun_commands(page):
                print(f"NOT RUN  {line}  (put it in a bash/console block, or mark it skip)")
                failed += 1
            for b in runnable(page):
                why = b.skip or (b.slow if not args.slow else None)
                if args.list or why:
                    print(
                        f"{'skip' if why else 'run '}     {b.name} {b.lang}"
                        + (f": {why}" if why else "")
                    )
                    continue
                ws = ws or workspace(page, Path(tmp))
                ran = run(b, ws)
                problem = None
                if ran.returncode != b.exit:
                    problem = f"exit {ran.returncode}, expected {b.exit}\n{ran.output[-3000:]}"
                elif b.lang == "console":
                    if args.check:
                        problem = differences(b, ran.output)
                    else:
                        new[b.line] = regenerate(b, ran.output)
                print(f"{'FAIL' if problem else 'ok  '}     {b.name} {b.lang}", flush=True)
                if problem:
                    print("  " + problem.replace("\n", "\n  "))
                    failed += 1
            if new and not args.check:
                rewrite(page, new)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
