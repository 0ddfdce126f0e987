"""Documentation that cannot drift: every command README.md and docs/*.md show runs as shown,
and every sample output they show is what the command prints now (docs/samples.py; numbers
that vary by machine are masked, structure is not). Blocks that cannot run here carry a
`skip:` or `slow:` comment in the page, and are reported as skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import ROOT, clean_environ, mpiexec_command

from hpcpipe import _sources as sources

_spec = importlib.util.spec_from_file_location("doc_samples", ROOT / "docs" / "samples.py")
samples = importlib.util.module_from_spec(_spec)
sys.modules["doc_samples"] = samples
_spec.loader.exec_module(samples)

pytestmark = pytest.mark.docs

BLOCKS = [b for page in samples.PAGES for b in samples.runnable(page)]


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    base = tmp_path_factory.mktemp("docs")
    made: dict[str, object] = {}

    def get(page: str):
        if page not in made:
            made[page] = samples.workspace(page, base)
        return made[page]

    return get


@pytest.mark.slow  # about two minutes of runs; CI runs it on every change
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_documented_block_runs_as_shown(block, workspaces):
    if block.skip:
        pytest.skip(f"{block.name}: {block.skip}")
    if block.slow and not os.environ.get("HPCPIPE_DOCS_SLOW"):
        pytest.skip(f"{block.name}: slow ({block.slow}); HPCPIPE_DOCS_SLOW=1 runs it")
    ran = samples.run(block, workspaces(block.page))
    assert ran.returncode == block.exit, (
        f"{block.name}: exit {ran.returncode}, the page expects {block.exit}\n{ran.output[-4000:]}"
    )
    if block.lang == "console":
        problem = samples.differences(block, ran.output)
        assert problem is None, (
            f"{block.name}: the output differs from the page ({problem}); if the change is "
            f"intended, regenerate it with `python docs/samples.py {block.page}`"
        )


def test_no_command_hides_in_a_block_that_is_not_run():
    hidden = [line for page in samples.PAGES for line in samples.unrun_commands(page)]
    assert hidden == [], "put these in a ```bash or ```console block:\n" + "\n".join(hidden)


def test_every_page_is_checked():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {p.split("/")[-1] for p in samples.PAGES} >= pages | {"README.md"}


def test_benchmark_tables_are_rendered_from_their_results():
    """A table in docs/performance.md (or any page) is the output its results file renders,
    ending with the commit it was measured on: never typed, never edited by hand."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_environ(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():  # said, not failed: rerunning takes 15 minutes
        if line.startswith("STALE:"):
            import warnings

            warnings.warn(line, stacklevel=1)
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    blocks = (
        text.count("<!-- bench:")
        - text.count("<!-- bench:summary")
        - text.count("<!-- bench:machine")
    )
    assert text.count("# measured on") == blocks, "every measured table names its commit"


def test_the_sample_checker_catches_a_stale_sample():
    """The comparison itself: equal text, integers exact, other numbers to 0.1%, masks."""
    block = samples.Block("x.md", 1, "console", ["$ true", "step 1/30 loss=3.9115 tok/s=12946"])
    block.vary = [r"tok/s=\S+"]
    assert samples.differences(block, "step 1/30 loss=3.9116 tok/s=99\n") is None
    assert samples.differences(block, "step 2/30 loss=3.9115 tok/s=99\n") is not None
    assert samples.differences(block, "step 1/30 loss=3.9515 tok/s=99\n") is not None
    assert samples.differences(block, "step 1/30 lost=3.9115 tok/s=99\n") is not None
    stale = samples.Block("x.md", 1, "console", ["$ true", "units=[2, 2, 2, 2]", "..."])
    assert samples.differences(stale, "units=[3, 1, 2, 2]\nmore\n") is not None
    assert samples.differences(stale, "units=[2, 2, 2, 2]\nmore\n") is None


def _deck_header_commands() -> list[tuple[str, list[str], int]]:
    """(deck, hpcpipe arguments, ranks) of every command a deck's header comment shows."""
    import re
    import shlex

    found = []
    for deck in sorted((ROOT / "inputs").glob("*.toml")):
        for line in deck.read_text(encoding="utf-8").splitlines():
            m = re.search(r"((mpiexec -n \d+ )?hpcpipe (run|plan) .*)", line)
            if not line.startswith("#") or m is None:
                continue
            words = shlex.split(m.group(1), comments=True)
            ranks = int(words[2]) if words[0] == "mpiexec" else 1
            found.append((deck.name, words[words.index("hpcpipe") + 1 :], ranks))
    return found


HEADER_COMMANDS = _deck_header_commands()


@pytest.mark.parametrize(
    ("deck", "args", "ranks"),
    HEADER_COMMANDS,
    ids=[f"{d}:{' '.join(a)}" for d, a, _ in HEADER_COMMANDS],
)
def test_commands_in_deck_headers_are_accepted(deck, args, ranks, tmp_path):
    """What a deck's header suggests must run: `run` commands are checked as the job would
    be (`--dry-run` on the same world, no MPI), `plan` commands run as shown, in a scratch
    folder that sees the repository's inputs/ (what they write, e.g. `--pareto-png
    front.png`, stays out of the repository)."""
    if args[0] == "run":
        args = [*args, "--dry-run", "--world", str(ranks)]
    (tmp_path / "inputs").symlink_to(ROOT / "inputs")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcpipe", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_environ(),
    )
    assert proc.returncode == 0, f"{deck}: hpcpipe {' '.join(args)}\n{proc.stderr}"


def _report_module(monkeypatch, tmp_path):
    """benchmarks/report.py, imported with its own sources log (its _common names one for the
    process at import; this one goes away with the test)."""
    monkeypatch.setenv(sources.ENV, str(tmp_path / "sources.txt"))
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(report)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return report


def test_only_an_explained_trailer_keeps_figures_current(monkeypatch, tmp_path):
    """`Figures: unchanged (why)` on its own line exempts a commit from staleness; nothing
    else does (no reason, or the words inside a sentence)."""
    report = _report_module(monkeypatch, tmp_path)
    assert report.UNCHANGED.search("Fix imports\n\nFigures: unchanged (same module bound)\n")
    assert not report.UNCHANGED.search("Fix imports\n\nFigures: unchanged\n")
    assert not report.UNCHANGED.search("we hope Figures: unchanged (really) holds\n")


def test_a_result_records_the_sources_every_rank_ran(monkeypatch, tmp_path):
    """Ranks started under mpiexec log the hpcpipe files they loaded when they exit; the
    writer's record (collect) joins them with its own."""
    log = tmp_path / "sources.txt"
    monkeypatch.setenv(sources.ENV, str(log))
    code = "import hpcpipe.sweep.kernel"
    proc = subprocess.run(
        [*mpiexec_command(), "-n", "2", sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_environ(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().split()
    assert lines.count("hpcpipe/sweep/kernel.py") == 2  # one line per rank
    recorded = sources.collect()
    assert "hpcpipe/sweep/kernel.py" in recorded
    assert "hpcpipe/_sources.py" in recorded  # this process's own
    assert not any(r.startswith(("tests/", "/")) for r in recorded)


def test_a_figure_goes_stale_only_when_code_it_ran_changes(monkeypatch, tmp_path):
    """With the sources a result records, a commit touching other files leaves it current;
    without them (an older result), any code commit makes it stale; a commit trailer
    `Figures: only NAME, ...` counts for the figures it names only."""
    report = _report_module(monkeypatch, tmp_path)
    repo = tmp_path / "repo"
    (repo / "hpcpipe").mkdir(parents=True)

    def git(*args: str) -> str:
        ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
        out = subprocess.run(
            ["git", *ident, *args], cwd=repo, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def commit(path: str, text: str, message: str) -> str:
        (repo / path).write_text(text)
        git("add", path)
        git("commit", "-q", "-m", message)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    commit("hpcpipe/a.py", "a = 1\n", "a")
    measured = commit("hpcpipe/b.py", "b = 1\n", "b")
    commit("hpcpipe/b.py", "b = 2\n", "b changes")
    commit("hpcpipe/a.py", "a = 1  # one\n", "a comment\n\nFigures: unchanged (a comment)")
    monkeypatch.setattr(report, "ROOT", repo)
    assert report.changes_since(measured, ["hpcpipe/a.py"]) == 0
    assert report.changes_since(measured, ["hpcpipe/a.py", "hpcpipe/b.py"]) == 1
    assert report.changes_since(measured, None) == 1  # every code commit but the exempt one
    assert report.changes_since("0" * 40, ["hpcpipe/a.py"]) is None  # unknown commit
    scoped = "search\n\nFigures: only schedule_search, replan (the search's result changes)"
    commit("hpcpipe/a.py", "a = 2\n", scoped)
    assert report.changes_since(measured, ["hpcpipe/a.py"], "schedule_search") == 1
    assert report.changes_since(measured, ["hpcpipe/a.py"], "replan") == 1
    assert report.changes_since(measured, ["hpcpipe/a.py"], "sweep_grind") == 0
    assert report.changes_since(measured, ["hpcpipe/a.py"]) == 1  # no figure named: counted


def test_the_sources_hook_imports_no_numpy(tmp_path):
    """With the log set, `import hpcpipe` arms the hook without importing numpy: a rank that
    imports numpy before the CLI limits BLAS threads runs one BLAS thread per core, and two
    such ranks on two cores ran the sweep figure's '2 x 1 rank' row at half speed."""
    env = clean_environ() | {sources.ENV: str(tmp_path / "sources.txt")}
    code = "import sys, hpcpipe; print('numpy' in sys.modules, 'hpcpipe._sources' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]
    assert "hpcpipe/_sources.py" in (tmp_path / "sources.txt").read_text().split()
