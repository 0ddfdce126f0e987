"""Soak: a long training run keeps memory and file handles flat, and every checkpoint is good.

    python benchmarks/soak.py                  # 2,000 steps of the tiny deck, 4 ranks, every 100
    python benchmarks/soak.py --quick          # 300 steps: a smoke run (writes no results)
    python benchmarks/soak.py --workdir soak   # keep the run directories in ./soak

One `mpiexec -n RANKS hpcpipe run inputs/train_tiny.toml` of STEPS steps, checkpointing every
EVERY steps and keeping them all. While it runs, the VmRSS (/proc/PID/status) and the number of
open file descriptors (/proc/PID/fd) of every rank process (found as descendants of mpiexec) are
sampled from outside every INTERVAL seconds; rank 0's progress lines (`step N/T`, printed every
`run.log_every` steps) tie each sample to a training step. Over the samples taken from step
WARMUP (default: the first checkpoint) to the end of training, each rank's RSS slope (least
squares, MiB per 1000 steps) and its descriptor range are judged against stated limits. The
same run without checkpoints is sampled too (`--no-baseline` skips it), to tell the growth that
checkpointing adds from what the run keeps per step by design (its metrics history).

Then: every checkpoint is verified (each CRC32 recomputed); a fresh run resumed from each
checkpoint k (`--resume DIR/step_k`) to the next one is compared bitwise (every parameter and
optimizer tensor, the optimizer step and the loss history) with the uninterrupted run's
checkpoint there, which by induction shows that resuming from any checkpoint reproduces the
whole run; and one long resume from the middle to the end is compared with the final state.
Prints PASS/FAIL per criterion (exit 1 on any FAIL) and writes benchmarks/results/soak.json
(+ soak.png with matplotlib).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from _common import RESULTS, ROOT, mpiexec, pyplot

from hpcpipe.bench.table import Column, Report

STEP_LINE = re.compile(r"^step (\d+)/(\d+)\b")
LAYOUT_LINE = re.compile(r"^hpcpipe: workload=\w+ world=(\d+) pp=(\d+) dp=(\d+)")
MIB = 2**20


# ------------------------------------------------------------------ running under mpiexec


@dataclass
class Job:
    """A launched `mpiexec ... hpcpipe run`, its output lines timestamped as they arrive."""

    proc: subprocess.Popen
    cmd: list[str]
    t0: float
    stdout: list[tuple[float, str]] = field(default_factory=list)
    stderr: collections.deque = field(default_factory=lambda: collections.deque(maxlen=60))
    threads: list[threading.Thread] = field(default_factory=list)

    def tail(self, n: int = 40) -> str:
        out = [line for _, line in self.stdout[-n:]]
        return (
            "--- stdout (tail) ---\n"
            + "\n".join(out)
            + "\n--- stderr (tail) ---\n"
            + "\n".join(list(self.stderr)[-n:])
        )

    def kill(self) -> None:
        """End the job's process group (mpiexec was started in a new session: its own)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                continue

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=10)


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")  # 4 ranks on few cores: no BLAS threads on top
    return env


def launch(ranks: int, args: list[str]) -> Job:
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "hpcpipe", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=rank_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    job = Job(proc, cmd, time.monotonic())

    def pump(stream: Any, sink: Any, stamped: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            sink.append((time.monotonic() - job.t0, line) if stamped else line)

    for stream, sink, stamped in (
        (proc.stdout, job.stdout, True),
        (proc.stderr, job.stderr, False),
    ):
        t = threading.Thread(target=pump, args=(stream, sink, stamped), daemon=True)
        t.start()
        job.threads.append(t)
    return job


def finish(job: Job, timeout: float, what: str) -> None:
    """Wait for the job; on a timeout or a failure print its output tail and exit 1."""
    try:
        rc = job.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - job.t0)))
    except subprocess.TimeoutExpired:
        job.kill()
        job.join()
        sys.exit(f"FAIL: {what} still running after {timeout:.0f} s, killed\n{job.tail()}")
    job.join()
    if rc != 0:
        sys.exit(f"FAIL: {what} exited {rc}: {shlex.join(job.cmd)}\n{job.tail()}")


def run(ranks: int, args: list[str], timeout: float, what: str) -> Job:
    job = launch(ranks, args)
    finish(job, timeout, what)
    return job


# ------------------------------------------------------------------ sampling from outside


def _ppids() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc/PID/stat; comm may hold spaces)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
            out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def _rank_of(pid: int) -> int | None:
    """The MPI rank a launcher gave the process (MPICH: PMI_RANK), None if not a rank."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    if not argv or "hpcpipe" not in " ".join(argv):
        return None
    if os.path.basename(argv[0]).startswith(("mpiexec", "mpirun", "hydra", "prterun")):
        return None
    for var in (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK"):
        if var in env:
            return int(env[var])
    return -1


def find_ranks(root: int) -> dict[int, int]:
    """rank -> pid of the rank processes below process `root` (ranks unknown: by pid order)."""
    children = collections.defaultdict(list)
    for pid, ppid in _ppids().items():
        children[ppid].append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, ()):
            rank = _rank_of(child)
            if rank is None:
                todo.append(child)
            else:  # not below a rank: a child it forks carries the same command and PMI_RANK
                found[child] = rank
    if any(r < 0 for r in found.values()):
        return {i: pid for i, pid in enumerate(sorted(found))}
    return {rank: pid for pid, rank in found.items()}


def probe(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS KiB, RssAnon KiB, open descriptors) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return int(fields["VmRSS"].split()[0]), int(fields["RssAnon"].split()[0]), fds
    except (OSError, KeyError, ValueError):
        return None


def sample(job: Job, ranks: int, interval: float, timeout: float) -> list[dict[str, Any]]:
    """Probe every rank every `interval` s until the job ends (killed after `timeout` s)."""
    samples: list[dict[str, Any]] = []
    pids: dict[int, int] = {}
    while job.proc.poll() is None:
        tick = time.monotonic()
        if tick - job.t0 > timeout:
            break  # finish() kills it and reports
        if len(pids) < ranks:
            pids = find_ranks(job.proc.pid)
        t = tick - job.t0
        for rank, pid in sorted(pids.items()):
            got = probe(pid)
            if got is None:
                pids = {}  # gone while the job runs: look for the ranks again next time
            else:
                rss, anon, fds = got
                samples.append(
                    {"t": t, "rank": rank, "pid": pid, "rss_kib": rss, "anon_kib": anon, "fds": fds}
                )
        time.sleep(max(0.0, interval - (time.monotonic() - tick)))
    return samples


# ------------------------------------------------------------------ checkpoints


def step_dir(run_dir: Path, step: int) -> Path:
    from hpcpipe.io.ckpt_store import step_name

    return run_dir / "checkpoints" / step_name(step)


def load_state(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A checkpoint's root attributes and every global tensor (CRC32-checked as read)."""
    from hpcpipe.io.checkpoint import ShardSpec, load_checkpoint
    from hpcpipe.io.ckpt_format import read_index

    index = read_index(path)
    wanted = {n: ShardSpec(n, t.shape, t.dtype) for n, t in index.tensors.items()}
    return dict(index.attrs), load_checkpoint(path, wanted)


DETERMINISTIC_HISTORY = {"history/loss", "history/grad_norm", "history/lr"}
"""History tensors a resume must reproduce bitwise (the others are measured times)."""


def compare(a: Path, b: Path) -> tuple[bool, int, str]:
    """Bitwise: same tensor names, dtypes, shapes and bytes, optimizer step, data position,
    and loss history. Returns (equal, tensors compared, first difference)."""
    attrs_a, ta = load_state(a)
    attrs_b, tb = load_state(b)
    if set(ta) != set(tb):
        return False, 0, f"tensor names differ: {sorted(set(ta) ^ set(tb))[:5]}"
    timings = {n for n in ta if n.startswith("history/") and n not in DETERMINISTIC_HISTORY}
    for name in sorted(set(ta) - timings):  # measured times differ from run to run
        x, y = ta[name], tb[name]
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
            return False, len(ta), f"{name} differs (max abs {diff:.3e})"
    for key in ("optimizer_step", "data_position"):
        if int(attrs_a[key]) != int(attrs_b[key]):
            return False, len(ta), f"{key} {attrs_a[key]} != {attrs_b[key]}"
    return True, len(ta) - len(timings), ""


# ------------------------------------------------------------------ figures


def step_clock(job: Job) -> tuple[np.ndarray, np.ndarray]:
    """(time, steps done) from rank 0's progress lines: `step N/T` is printed after step N."""
    points = [(t, int(m.group(1))) for t, line in job.stdout if (m := STEP_LINE.match(line))]
    if len(points) < 2:
        sys.exit(f"FAIL: fewer than 2 progress lines from rank 0\n{job.tail()}")
    t, s = np.array(points, dtype=float).T
    return t, s


def per_rank(samples: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """Each rank's figures over its samples from step `warmup` to the end of training."""
    rows = []
    for rank in sorted({s["rank"] for s in samples}):
        mine = [s for s in samples if s["rank"] == rank]
        window = [s for s in mine if s["phase"] == "train" and s["step"] >= warmup]
        if len(window) < 3:
            phases = collections.Counter(s["phase"] for s in mine)
            sys.exit(
                f"FAIL: rank {rank}: only {len(window)} samples between step {warmup} and the "
                f"end of training (all its samples: {dict(phases)}, last at step "
                f"{mine[-1]['step']:.0f}); lower --interval or raise --steps"
            )
        step = np.array([s["step"] for s in window])
        rss = np.array([s["rss_kib"] for s in window]) / 1024
        fds = np.array([s["fds"] for s in window])
        q = max(1, len(window) // 4)
        rows.append(
            {
                "rank": rank,
                "samples": len(window),
                "warm_step": step[0],
                "rss_warm_mib": rss[0],
                "rss_end_mib": rss[-1],
                "rss_max_mib": rss.max(),
                "rss_peak_run_mib": max(s["rss_kib"] for s in mine) / 1024,
                "slope_mib_per_1k": float(np.polyfit(step, rss, 1)[0] * 1000),
                "anon_slope_mib_per_1k": float(
                    np.polyfit(step, np.array([s["anon_kib"] for s in window]) / 1024, 1)[0] * 1000
                ),
                "fd_min": int(fds.min()),
                "fd_max": int(fds.max()),
                "fd_floor_first": int(fds[:q].min()),
                "fd_floor_last": int(fds[-q:].min()),
            }
        )
    return rows


COLUMNS = [
    Column("rank", "rank", "d", 4),
    Column("samples", "samples", "d", 7),
    Column("warm_step", "from step", ".0f", 9),
    Column("rss_warm_mib", "RSS then MiB", ".2f", 12),
    Column("rss_end_mib", "RSS end MiB", ".2f", 11),
    Column("rss_max_mib", "RSS max MiB", ".2f", 11),
    Column("slope_mib_per_1k", "MiB/1k steps", "+.3f", 12),
    Column("fd_min", "fds min", "d", 7),
    Column("fd_max", "fds max", "d", 7),
]


def plot(
    samples: list[dict[str, Any]],
    baseline: list[dict[str, Any]],
    warmup: int,
    title: str,
    png: Path,
) -> None:
    """RSS and open descriptors of every rank against the training step (grey: the run
    without checkpoints)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for rank in sorted({s["rank"] for s in baseline}):
        mine = [s for s in baseline if s["rank"] == rank and s["phase"] == "train"]
        label = "no checkpoints" if rank == 0 else None
        x = [s["step"] for s in mine]
        ax1.plot(x, [s["rss_kib"] / 1024 for s in mine], color="0.6", lw=0.8, label=label)
    for rank in sorted({s["rank"] for s in samples}):
        mine = [s for s in samples if s["rank"] == rank and s["phase"] == "train"]
        x = [s["step"] for s in mine]
        ax1.plot(x, [s["rss_kib"] / 1024 for s in mine], lw=1.2, label=f"rank {rank}")
        ax2.plot(x, [s["fds"] for s in mine], lw=1.2, drawstyle="steps-post")
    for ax in (ax1, ax2):
        ax.axvline(warmup, color="k", ls=":", lw=1)
    ax1.set(ylabel="VmRSS (MiB)", title=title)
    ax1.legend(ncol=5, fontsize=8, loc="lower right")
    ax2.set(xlabel="training step", ylabel="open file descriptors")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"# wrote {os.path.relpath(png, ROOT)}")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deck", default="inputs/train_tiny.toml")
    ap.add_argument("--ranks", type=int, default=4, help="world size (the tiny deck: pp=2 x dp=2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 2000)")
    ap.add_argument("--every", type=int, default=100, help="checkpoint every N steps")
    ap.add_argument("--quick", action="store_true", help="300 steps, no results written")
    ap.add_argument("--warmup", type=int, default=None, help="judge from this step (= --every)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    ap.add_argument("--rss-slope", type=float, default=2.0, help="limit, MiB per 1000 steps")
    ap.add_argument("--fd-slack", type=int, default=4, help="limit on fds max - min")
    ap.add_argument("--full-resume-from", type=int, default=None, help="default: mid-run")
    ap.add_argument("--no-resume", action="store_true", help="skip the resume checks")
    ap.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also sample the same run without checkpoints (default: on, off with --quick)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the long run")
    ap.add_argument("--resume-timeout", type=float, default=600, help="seconds per resume")
    ap.add_argument("--workdir", default=None, help="keep run directories here (default: temp)")
    ap.add_argument("--json", default=None, help="default results/soak.json (none with --quick)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    steps = args.steps or (300 if args.quick else 2000)
    if args.baseline is None:
        args.baseline = not args.quick
    every = args.every
    warmup = every if args.warmup is None else args.warmup
    if not 0 < every <= steps or warmup >= steps:
        ap.error(f"need 0 < --every <= --steps and --warmup < --steps (got {every}, {steps})")
    json_path = args.json or (None if args.quick else str(RESULTS / "soak.json"))
    ckpt_steps = list(range(every, steps + 1, every)) + ([steps] if steps % every else [])
    full_from = args.full_resume_from
    if full_from is None:
        full_from = ckpt_steps[max(0, len(ckpt_steps) // 2 - 1)]
    if full_from not in ckpt_steps[:-1]:
        ap.error(f"--full-resume-from {full_from}: not a checkpoint before the last")

    import mpi4py

    mpi4py.rc.initialize = False  # this driver only asks MPI for its library version
    mpi4py.rc.finalize = False
    import hpcpipe.bench.harness as harness
    from hpcpipe.config import ConfigError, load_config
    from hpcpipe.io.checkpoint import verify_checkpoint
    from hpcpipe.train.optim import learning_rate

    common = [
        f"checkpoint.every={every}",
        "checkpoint.keep=0",  # keep all
        "train.verify=false",  # the resume comparisons are the check; no 2000-step reference
        f"run.log_every={args.log_every}",
        *args.overrides,
    ]
    try:
        cfg = load_config(ROOT / args.deck, [*common, f"run.steps={steps}"])
    except ConfigError as exc:
        sys.exit(f"ERROR: {exc}")
    # a resume may stop at the next checkpoint (run.steps = k + every) only when the learning
    # rate does not depend on run.steps (constant schedule); otherwise it runs to the end
    short_ok = all(
        learning_rate(cfg.optim, s, min(k + every, steps)) == learning_rate(cfg.optim, s, steps)
        for k in ckpt_steps[:-1]
        for s in range(k, min(k + every, steps))
    )
    machine = harness.machine(SimpleNamespace(size=args.ranks))
    cmd_text = "python benchmarks/soak.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )

    tmp = None
    if args.workdir:
        work = Path(args.workdir).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="hpcpipe-soak-")
        work = Path(tmp.name)

    def sets(output: Path, n: int) -> list[str]:
        items = [*common, f"run.steps={n}", f"run.output={json.dumps(str(output))}"]
        return [x for s in items for x in ("--set", s)]

    def sampled_run(output: Path, extra: list[str], what: str) -> dict[str, Any]:
        """One run of `steps` steps, every rank probed from outside while it trains."""
        extra_sets = [x for s in extra for x in ("--set", s)]
        t_start = time.monotonic()
        job = launch(args.ranks, ["run", args.deck, *sets(output, steps), *extra_sets])
        samples = sample(job, args.ranks, args.interval, args.timeout)
        finish(job, args.timeout, what)
        elapsed = time.monotonic() - t_start
        clock_t, clock_s = step_clock(job)
        for s in samples:
            s["step"] = float(np.interp(s["t"], clock_t, clock_s))
            s["phase"] = (
                "startup" if s["t"] < clock_t[0] else "finish" if s["t"] > clock_t[-1] else "train"
            )
        found = sorted({s["rank"] for s in samples})
        if found != list(range(args.ranks)):
            sys.exit(f"FAIL: {what}: sampled ranks {found}, expected 0..{args.ranks - 1}")
        train_s = clock_t[-1] - clock_t[0]
        return {
            "samples": samples,
            "rows": per_rank(samples, warmup),
            "time_s": elapsed,
            "train_s": train_s,
            "ms_per_step": 1e3 * train_s / max(clock_s[-1] - clock_s[0], 1),
            "layout": next((m for _, line in job.stdout if (m := LAYOUT_LINE.match(line))), None),
        }

    try:
        # ---- the long run, sampled from outside
        main_dir = work / "soak"
        print(
            f"$ mpiexec -n {args.ranks} hpcpipe run {args.deck} --set run.steps={steps} "
            + " ".join(f"--set {s}" for s in common),
            flush=True,
        )
        soak = sampled_run(main_dir, [], "the long run")
        samples, rows, layout = soak["samples"], soak["rows"], soak["layout"]
        t_main, train_s, ms_per_step = soak["time_s"], soak["train_s"], soak["ms_per_step"]
        sizes = {
            k: (
                sum(f.stat().st_size for f in step_dir(main_dir, k).iterdir()),
                (step_dir(main_dir, k) / "index.h5").stat().st_size,
            )
            for k in (ckpt_steps[0], ckpt_steps[-1])
            if step_dir(main_dir, k).is_dir()
        }

        # ---- the same run without checkpoints: how much of the growth is theirs
        baseline = None
        if args.baseline:
            print(f"# baseline: the same {steps} steps with checkpoint.every=0", flush=True)
            baseline = sampled_run(work / "baseline", ["checkpoint.every=0"], "the baseline run")

        # ---- every checkpoint verifies
        t0 = time.monotonic()
        bad = []
        for k in ckpt_steps:
            path = step_dir(main_dir, k)
            problems = verify_checkpoint(path) if path.is_dir() else ["missing"]
            if problems:
                bad.append(f"step {k}: {problems[0]}")
        verified = len(ckpt_steps) - len(bad)
        t_verify = time.monotonic() - t0

        # ---- resumes
        t0 = time.monotonic()
        resumes, mismatches, tensors = 0, [], 0
        full = None
        if not args.no_resume:
            for k in ckpt_steps[:-1]:
                target = ckpt_steps[ckpt_steps.index(k) + 1]
                out = work / f"resume_{k}"
                n = target if short_ok else steps
                run(
                    args.ranks,
                    ["run", args.deck, "--resume", str(step_dir(main_dir, k)), *sets(out, n)],
                    args.resume_timeout,
                    f"resume from step {k}",
                )
                equal, tensors, why = compare(step_dir(out, target), step_dir(main_dir, target))
                resumes += 1
                print(
                    f"# resume {k} -> {target}: {'bitwise equal' if equal else 'DIFFERS: ' + why}",
                    flush=True,
                )
                if not equal:
                    mismatches.append(f"{k} -> {target}: {why}")
            out = work / f"resume_full_{full_from}"
            run(
                args.ranks,
                [
                    "run",
                    args.deck,
                    "--resume",
                    str(step_dir(main_dir, full_from)),
                    *sets(out, steps),
                ],
                args.timeout,
                f"full resume from step {full_from}",
            )
            equal, _, why = compare(step_dir(out, steps), step_dir(main_dir, steps))
            full = {"from": full_from, "to": steps, "equal": equal, "difference": why}
            said = "bitwise equal" if equal else f"DIFFERS: {why}"
            print(f"# resume {full_from} -> {steps}: {said}", flush=True)
        t_resume = time.monotonic() - t0
    finally:
        if tmp is not None:
            tmp.cleanup()

    # ---- verdicts
    worst_slope = max(r["slope_mib_per_1k"] for r in rows)
    rss_ok = worst_slope < args.rss_slope
    fd_ok = all(
        r["fd_max"] - r["fd_min"] <= args.fd_slack and r["fd_floor_last"] <= r["fd_floor_first"]
        for r in rows
    )
    ckpt_ok = verified == len(ckpt_steps)
    resume_ok = None if args.no_resume else (not mismatches and full is not None and full["equal"])
    world = f"pp={layout.group(2)} x dp={layout.group(3)}" if layout else f"{args.ranks} ranks"
    report = Report(
        "soak",
        [
            f"soak: {steps} steps of {args.deck} on {args.ranks} ranks ({world}), checkpoint "
            f"every {every} (all kept); VmRSS and open fds of each rank sampled from outside "
            f"every {args.interval:g} s",
            f"figures over samples from step {warmup} to the end of training: RSS then = first "
            "such sample, MiB/1k steps = least-squares RSS slope per 1000 steps",
        ],
        COLUMNS,
        params={
            "deck": args.deck,
            "ranks": args.ranks,
            "steps": steps,
            "every": every,
            "warmup": warmup,
            "interval_s": args.interval,
            "log_every": args.log_every,
            "overrides": common,
            "rss_slope_limit_mib_per_1k": args.rss_slope,
            "fd_slack": args.fd_slack,
            "short_resumes": short_ok,
        },
        stream=True,
    )
    report.start()
    for r in rows:
        report.add(r)
    fd_lo, fd_hi = min(r["fd_min"] for r in rows), max(r["fd_max"] for r in rows)
    report.note(
        f"RSS flat (slope < {args.rss_slope:g} MiB per 1000 steps on every rank): "
        f"{verdict(rss_ok)} (worst {worst_slope:+.3f}; RssAnon worst "
        f"{max(r['anon_slope_mib_per_1k'] for r in rows):+.3f})"
    )
    if baseline is not None:
        report.note(
            "the same run without checkpoints (checkpoint.every=0): RSS slope per rank "
            + " ".join(f"{r['slope_mib_per_1k']:+.3f}" for r in baseline["rows"])
            + " MiB/1k steps, fds "
            + " ".join(f"{r['fd_min']}..{r['fd_max']}" for r in baseline["rows"])
        )
    report.note(
        f"file handles flat (fds max - min <= {args.fd_slack} and the floor does not rise): "
        f"{verdict(fd_ok)} (fds {fd_lo}..{fd_hi} over all ranks)"
    )
    report.note(
        f"checkpoints verified (every CRC32 recomputed): {verified}/{len(ckpt_steps)} "
        f"{verdict(ckpt_ok)}" + (f" ({'; '.join(bad[:3])})" if bad else "")
    )
    if resume_ok is not None:
        report.note(
            f"resume from checkpoint k reproduces checkpoint k+{every} bitwise ({tensors} "
            f"tensors + optimizer step + loss history): {resumes - len(mismatches)}/{resumes}; "
            f"resume {full_from} -> {steps} equals the final state: "
            f"{'yes' if full['equal'] else 'NO'}; {verdict(resume_ok)}"
            + (f" ({'; '.join(mismatches[:3])})" if mismatches else "")
        )
    if len(sizes) == 2:
        (k0, (all0, idx0)), (k1, (all1, idx1)) = sorted(sizes.items())
        report.note(
            f"checkpoint size: step {k0} {all0 / 1024:.0f} KiB (index.h5 {idx0 / 1024:.0f} KiB), "
            f"step {k1} {all1 / 1024:.0f} KiB (index.h5 {idx1 / 1024:.0f} KiB)"
        )
    report.note(
        f"time: long run {t_main:.1f} s ({ms_per_step:.1f} ms/step), verify {t_verify:.1f} s, "
        f"{resumes + (full is not None)} resume runs {t_resume:.1f} s"
        + (f", baseline run {baseline['time_s']:.1f} s" if baseline else "")
    )
    report.summary |= {
        "rss_flat": rss_ok,
        "fds_flat": fd_ok,
        "checkpoints": len(ckpt_steps),
        "checkpoints_verified": verified,
        "checkpoints_ok": ckpt_ok,
        "resumes": resumes,
        "resumes_matched": resumes - len(mismatches),
        "resume_mismatches": mismatches,
        "full_resume": full,
        "resume_ok": resume_ok,
        "worst_rss_slope_mib_per_1k": worst_slope,
        "tensors_compared": tensors,
        "time_main_s": t_main,
        "time_train_s": train_s,
        "ms_per_step": ms_per_step,
        "time_verify_s": t_verify,
        "time_resumes_s": t_resume,
        "checkpoint_bytes": {str(k): {"total": a, "index": b} for k, (a, b) in sizes.items()},
        "baseline": None
        if baseline is None
        else {
            "overrides": ["checkpoint.every=0"],
            "rows": baseline["rows"],
            "time_s": baseline["time_s"],
            "ms_per_step": baseline["ms_per_step"],
        },
    }
    if json_path:
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        keep = ("t", "step", "phase", "rss_kib", "anon_kib", "fds")

        def by_rank(samples: list[dict[str, Any]]) -> dict[str, list[list[Any]]]:
            ranks = sorted({s["rank"] for s in samples})
            return {
                str(rank): [[s[k] for k in keep] for s in samples if s["rank"] == rank]
                for rank in ranks
            }

        out = report.write(
            json_path,
            command=cmd_text,
            machine=machine,
            sample_fields=list(keep),
            samples=by_rank(samples),
            baseline_samples=by_rank(baseline["samples"]) if baseline else None,
        )
        print(f"# wrote {os.path.relpath(out, ROOT)}")
        title = f"soak: {steps} steps of {Path(args.deck).stem}, {args.ranks} ranks"
        plot(
            samples, baseline["samples"] if baseline else [], warmup, title, out.with_suffix(".png")
        )
    else:
        print("# quick run: no results written (pass --json PATH to keep them)")
    ok = rss_ok and fd_ok and ckpt_ok and resume_ok is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
