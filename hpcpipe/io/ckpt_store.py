"""The checkpoint directory protocol: step directory names, durability, `latest`, rotation.

A step directory is complete exactly when it carries its final name (`step_000100/`): it is
written as `step_000100.tmp/`, made durable, then renamed. A checkpoints directory may be
shared with other files: the protocol owns only the names it creates (`step_NNNNNN/`,
`step_NNNNNN.tmp/`, `step_NNNNNN.del.tmp/`, `step_NNNNNN.replaced.tmp/`, `latest` and
`.latest.PID.tmp`), and rotation deletes nothing else. Debris of an interrupted save is never
read.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

from hpcpipe.io.ckpt_format import INDEX_FILE, CheckpointError

__all__ = ["latest_checkpoint", "older_checkpoints", "owned_names", "resolve_checkpoint"]

LATEST = "latest"
CHECKPOINTS_DIR = "checkpoints"
_STEP_RE = re.compile(r"step_(\d{6,})")
_DEBRIS_RE = re.compile(r"step_\d{6,}(\.del|\.replaced)?\.tmp")
"""Directories an interrupted save or rotation leaves: deleted by the next successful save."""
_LATEST_TMP_RE = re.compile(r"\.latest\.\d+\.tmp")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(path: Path) -> int | None:
    """The step of a complete-looking step directory name, else None."""
    m = _STEP_RE.fullmatch(path.name)
    return int(m.group(1)) if m else None


def owned_names(root: Path) -> list[Path]:
    """Everything in a checkpoints directory that the protocol created (nothing else)."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [
        p
        for p in entries
        if (p.is_dir() and (_STEP_RE.fullmatch(p.name) or _DEBRIS_RE.fullmatch(p.name)))
        or (p.name == LATEST or _LATEST_TMP_RE.fullmatch(p.name))
    ]


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to stable storage."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_complete(path: Path) -> bool:
    return step_of(path) is not None and (path / INDEX_FILE).is_file()


def complete_steps(root: Path) -> list[Path]:
    """Complete step directories under a checkpoints directory, oldest first."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    found = [p for p in entries if p.is_dir() and _is_complete(p)]
    return sorted(found, key=lambda p: step_of(p) or 0)


def _checkpoints_dir(root: Path) -> Path:
    """`root` itself when it holds checkpoints, else its `checkpoints/` (a run directory)."""
    if (root / LATEST).is_file() or complete_steps(root):
        return root
    sub = root / CHECKPOINTS_DIR
    return sub if sub.is_dir() else root


def latest_checkpoint(root: Path | str, notes: list[str] | None = None) -> Path | None:
    """The newest complete checkpoint under a checkpoints (or run) directory, or None.

    Follows `latest` when it names a complete step directory of this directory; otherwise
    falls back to the highest complete `step_*` and, when `latest` exists but could not be
    followed (a missing target, a symbolic link, a loop, a name outside the directory, unreadable
    bytes), appends to `notes` what was wrong and what was used instead, for the caller to
    print. `*.tmp` is never returned.
    """
    base = _checkpoints_dir(Path(root))
    pointer = base / LATEST
    problem = None
    if pointer.is_symlink():  # hpcpipe writes a plain file: a link was put there by hand
        problem = "is a symbolic link, not the plain file hpcpipe writes"
    elif pointer.exists():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            problem = f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
        else:
            if _STEP_RE.fullmatch(name) and _is_complete(base / name):
                return base / name
            problem = f"names {name[:80]!r}, which is not a complete checkpoint in {base}"
    steps = complete_steps(base)
    if problem and notes is not None:
        instead = f"using the newest complete one, {steps[-1].name}" if steps else "none found"
        notes.append(f"{pointer} {problem}; {instead}")
    return steps[-1] if steps else None


def older_checkpoints(path: Path, limit: int = 3) -> list[Path]:
    """Complete checkpoints beside `path` with a lower step, newest first."""
    step = step_of(path)
    if step is None:
        return []
    older = [p for p in complete_steps(path.parent) if (step_of(p) or 0) < step]
    return older[::-1][:limit]


def resolve_checkpoint(path: Path | str, notes: list[str] | None = None) -> Path:
    """A step directory from a step, checkpoints or run directory (the CLI's PATH); what
    `latest_checkpoint` notes about a broken `latest` goes to `notes`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError("no such file or directory", path=path)
    if path.is_file() and path.name == INDEX_FILE:
        return path.parent
    if (path / INDEX_FILE).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(
            "not a checkpoint: expected a step, checkpoints or run directory", path=path
        )
    found = latest_checkpoint(path, notes)
    if found is None:
        raise CheckpointError(
            f"no complete checkpoint here (looked for {LATEST}, step_*/{INDEX_FILE}, and "
            f"{CHECKPOINTS_DIR}/); interrupted saves end in .tmp and are ignored",
            path=path,
        )
    return found


def write_latest(root: Path, name: str, *, fsync: bool) -> None:
    """Point `latest` at `name` atomically (temp file, fsync, os.replace)."""
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, root / LATEST)
    if fsync:
        fsync_path(root)


def _remove_tree(path: Path) -> None:
    """Rename to `.tmp` first, so a half-deleted checkpoint never looks complete."""
    doomed = path if path.name.endswith(".tmp") else path.with_name(path.name + ".del.tmp")
    if doomed != path:
        os.rename(path, doomed)
    shutil.rmtree(doomed)


def install(tmp: Path, final: Path, *, fsync: bool) -> None:
    """Rename a finished `step_N.tmp/` to `step_N/`, replacing an older save of the same step."""
    root = final.parent
    old = None
    if final.exists():
        old = final.with_name(final.name + ".replaced.tmp")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    if fsync:
        fsync_path(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def rotate(root: Path, newest: Path, keep: int) -> list[Path]:
    """Delete interrupted saves and all but the newest `keep` checkpoints up to `newest`.

    Runs only after `newest` is complete and `latest` points at it. Checkpoints with a higher
    step than `newest` (a run resumed from an earlier step) are left alone. Failures become
    warnings: the new checkpoint is already safe. Returns what was deleted.
    """
    removed = []
    new_step = step_of(newest)
    doomed = []
    if keep > 0 and new_step is not None:
        older = [p for p in complete_steps(root) if (step_of(p) or 0) < new_step]
        doomed = older[: max(0, len(older) - (keep - 1))]
    try:  # only the protocol's own debris: a user's `results.tmp/` is not ours to delete
        debris = [p for p in root.iterdir() if p.is_dir() and _DEBRIS_RE.fullmatch(p.name)]
    except OSError:
        debris = []
    for path in [*doomed, *debris]:
        try:
            _remove_tree(path)
            removed.append(path)
        except OSError as exc:
            warnings.warn(f"{path}: could not delete old checkpoint: {exc}", stacklevel=2)
    return removed
