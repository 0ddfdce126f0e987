#!/usr/bin/env bash
# shellcheck disable=SC2317  # the functions below run through run_step (in bash -c)
# The GPU device check of hpcpipe, in one run, from the repository root, on a fresh machine with
# a CUDA GPU and no network (one H200, 16 cores: about 5 minutes, never more than $BUDGET_S):
#
#   tests/gpu/fetch_wheels.sh                 # here, once: ./wheelhouse (mpich, mpi4py; ~14 MiB)
#   bash tests/gpu/run_device_checks.sh       # there, with ./wheelhouse carried along
#
# Results go to $OUT (default ./gpu-results): log.txt (everything), pytest.txt, results.json
# (machine, CUDA-aware decision, step statuses and every benchmark's JSON), summary.txt.
#
# Steps, each under `timeout`, each run even when an earlier one failed (the summary says which):
#   1. info      nvidia-smi, python3, CuPy and its device, mpi4py and the MPI library
#   2. mpi       an MPI for mpi4py: the machine's if it works, else the mpich wheel from
#                ./wheelhouse (pip --no-index); then the CUDA-aware decision as hpcpipe makes it
#   3. tests     pytest tests/gpu -m gpu: 2-rank gpt training on device=cuda vs the CPU
#                reference, Mailbox / BucketedAllreduce / MoE all-to-all / sweep on device
#                buffers (direct where MPI is CUDA-aware, staged always), host copies per step
#   4. p2p       device -> device ping-pong, 1 MiB .. 256 MiB: direct vs staged vs host buffers
#   5. pipeline  gpt step time on the GPU vs the CPU (hpcpipe bench pipeline), small and medium
#   6. sweep     sweep grind time on the GPU (and the CPU) for the bench problem, 1 and 2 ranks
#
# Assumed there: python3 with CuPy (the image's cupy-cuda13x; a 130+ MiB CuPy wheel cannot be
# carried within the runner's 64 MiB), numpy, h5py, pytest (+ pytest-timeout). Nothing else:
# an MPI comes from ./wheelhouse when the machine has none that mpi4py can load. Environment:
# PYTHON (default python3), OUT, BUDGET_S (default 450), HPCPIPE_GPU_CUDA_AWARE=on to force
# the direct paths (only with an MPI known to be CUDA-aware).
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
LOG=$OUT/log.txt
BUDGET_S=${BUDGET_S:-450}
# an absolute path: Open MPI's launcher may not find a venv's python3 on PATH for its ranks
PY=$(command -v "${PYTHON:-python3}" || echo "${PYTHON:-python3}")
START=$SECONDS
: >"$LOG"
: >"$WORK/status.tsv"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# BLAS threads per rank for the 2-rank CPU runs: half the cores less one (MPI ranks spin while
# they wait; more threads than cores makes OpenBLAS crawl)
THREADS=$(($(nproc) / 2 - 1))
((THREADS < 1)) && THREADS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$THREADS}
export ROOT OUT WORK LOG PY

say() { echo "$*" | tee -a "$LOG"; }

# run_step NAME LIMIT_S COMMAND...: run with a time limit, output to the log, status recorded.
# A COMMAND that is a function of this script runs in `bash -c` (functions are exported).
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 15)); then
        say "=== $name: SKIPPED (time budget of ${BUDGET_S}s used up)"
        printf '%s\tskipped\t0\n' "$name" >>"$WORK/status.tsv"
        return 0
    fi
    ((limit > left)) && limit=$left
    say "=== $name (limit ${limit}s, $((SECONDS - START))s elapsed)"
    if [[ $(type -t "$1") == function ]]; then
        set -- bash -c '"$@"' "$name" "$@"
    fi
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    local took=$((SECONDS - t0)) verdict=ok
    ((rc == 124 || rc == 137)) && verdict=timeout
    ((rc != 0 && rc != 124 && rc != 137)) && verdict="failed(rc=$rc)"
    say "=== $name: $verdict in ${took}s"
    printf '%s\t%s\t%s\n' "$name" "$verdict" "$took" >>"$WORK/status.tsv"
    return 0
}

# ----------------------------------------------------------------------------------- 1. info
info() {
    nvidia-smi || echo "nvidia-smi: not available"
    "$PY" - <<'PYEOF'
import json, platform, sys
info = {"python": sys.version.split()[0], "executable": sys.executable,
        "machine": platform.platform()}
for name in ("numpy", "cupy", "mpi4py", "h5py", "pytest"):
    try:
        mod = __import__(name)
        info[name] = getattr(mod, "__version__", "?")
    except Exception as exc:
        info[name] = f"missing: {exc}"
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    info["gpus"] = n
    info["gpu0"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
except Exception as exc:
    info["cupy_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(info, indent=1))
PYEOF
}
export -f info
run_step info 60 info
"$PY" - >"$WORK/info.json" 2>/dev/null <<'PYEOF'
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import cupy
    out["cupy"] = cupy.__version__
    out["gpus"] = cupy.cuda.runtime.getDeviceCount()
    p = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    out["gpu0"] = p.decode() if isinstance(p, bytes) else p
except Exception as exc:
    out["cupy_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
PYEOF

# ----------------------------------------------------------------------------------- 2. mpi
mpi_works() {
    "$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])" \
        >>"$LOG" 2>&1
}
find_mpiexec() {
    local beside
    beside=$("$PY" -c 'import os, sys; print(os.path.join(sys.prefix, "bin", "mpiexec"))')
    if [[ -x "$beside" ]]; then
        echo "$beside"
    elif [[ -n "${PREFIX_BIN:-}" && -x "$PREFIX_BIN/mpiexec" ]]; then
        echo "$PREFIX_BIN/mpiexec"
    else
        command -v mpiexec || true
    fi
}
setup_mpi() {
    if mpi_works && [[ -n "$(find_mpiexec)" ]]; then
        echo "using the machine's MPI: $(find_mpiexec)"
        return 0
    fi
    if ! compgen -G "wheelhouse/*.whl" >/dev/null; then
        echo "no working MPI and no ./wheelhouse: run tests/gpu/fetch_wheels.sh and carry it"
        return 1
    fi
    local pkgs=(mpich)
    "$PY" -c "import mpi4py" 2>/dev/null || pkgs+=(mpi4py)
    echo "installing ${pkgs[*]} from ./wheelhouse"
    if ! "$PY" -m pip install -q --no-index --no-deps --find-links wheelhouse "${pkgs[@]}"; then
        echo "pip into the interpreter's environment failed: installing under $WORK/prefix"
        "$PY" -m pip install -q --no-index --no-deps --find-links wheelhouse \
            --prefix "$WORK/prefix" "${pkgs[@]}" || return 1
    fi
    mpi_works
}
export -f mpi_works find_mpiexec setup_mpi
run_step mpi 120 setup_mpi
if [[ -d "$WORK/prefix" ]]; then
    export PREFIX_BIN="$WORK/prefix/bin"
    export PATH="$PREFIX_BIN:$PATH"
    export LD_LIBRARY_PATH="$WORK/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    PYTHONPATH="$PYTHONPATH:$(echo "$WORK"/prefix/lib/python3*/site-packages)"
    export PYTHONPATH
fi
MPIEXEC=$(find_mpiexec)
export HPCPIPE_MPIEXEC="${MPIEXEC:-mpiexec}"
# Open MPI's mpiexec refuses root unless told twice (a GPU image often runs as root)
if [[ $(id -u) == 0 ]] && "$HPCPIPE_MPIEXEC" --version 2>/dev/null | grep -q "Open MPI\|OpenRTE"; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
say "mpiexec: ${MPIEXEC:-none found}"

decision() {
    "$PY" - >"$WORK/decision.json" <<'PYEOF'
import json, os
from mpi4py import MPI
from hpcpipe.backend import detect_cuda_aware
aware, why = detect_cuda_aware(os.environ.get("HPCPIPE_GPU_CUDA_AWARE", "auto"))
print(json.dumps({"mpi": MPI.Get_library_version().splitlines()[0].strip(),
                  "cuda_aware": aware, "reason": why}))
PYEOF
}
export -f decision
run_step cuda-aware 60 decision
cat "$WORK/decision.json" >>"$LOG" 2>/dev/null
MPIR_CVAR_ENABLE_GPU=1 "$PY" -c "
from mpi4py import MPI
from hpcpipe.backend import detect_cuda_aware
print('with MPIR_CVAR_ENABLE_GPU=1:', detect_cuda_aware('auto'))" >>"$LOG" 2>&1

# ----------------------------------------------------------------------------------- 3. tests
tests() {
    local timeout_opt=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout=240)
    "$PY" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider "${timeout_opt[@]}" \
        --junitxml="$WORK/junit.xml" 2>&1 | tee "$OUT/pytest.txt"
    return "${PIPESTATUS[0]}"
}
export -f tests
run_step tests 270 tests

# ----------------------------------------------------------------------------------- 4. p2p
run_step p2p 150 "$HPCPIPE_MPIEXEC" -n 2 "$PY" tests/gpu/bench_gpu.py p2p \
    --min 1Mi --max 256Mi --repeats 3 --json "$WORK/p2p.json"

# ----------------------------------------------------------------------------------- 5. pipeline
MEDIUM=(--set model.d_model=256 --set model.n_heads=8 --set model.d_ff=1024
    --set model.seq_len=128 --set data.global_batch=32)
pipeline() {
    local device=$1 size=$2 schedules=$3
    shift 3
    "$HPCPIPE_MPIEXEC" -n 2 "$PY" -m hpcpipe bench pipeline inputs/gpt_pp4.toml \
        --set "device.kind=\"$device\"" --schedules "$schedules" --steps 3 --repeats 2 \
        --json "$WORK/pipeline_${device}_${size}.json" "$@"
}
export -f pipeline
run_step pipeline-gpu-small 90 pipeline cuda small 1f1b,zb-v
run_step pipeline-cpu-small 90 pipeline cpu small 1f1b,zb-v
run_step pipeline-gpu-medium 90 pipeline cuda medium 1f1b "${MEDIUM[@]}"
run_step pipeline-cpu-medium 120 pipeline cpu medium 1f1b "${MEDIUM[@]}"

# ----------------------------------------------------------------------------------- 6. sweep
run_step sweep-1rank 90 "$HPCPIPE_MPIEXEC" -n 1 "$PY" tests/gpu/bench_gpu.py sweep --n 32 \
    --json "$WORK/sweep_1rank.json"
run_step sweep-2ranks 90 "$HPCPIPE_MPIEXEC" -n 2 "$PY" tests/gpu/bench_gpu.py sweep --n 32 \
    --json "$WORK/sweep_2ranks.json"

# ----------------------------------------------------------------------------------- results
"$PY" - "$WORK" "$OUT" "$((SECONDS - START))" <<'PYEOF' || cp "$WORK/status.tsv" "$OUT/summary.txt"
import json, sys
from pathlib import Path
work, out, seconds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
steps = [dict(zip(("step", "status", "seconds"), line.split("\t")))
         for line in (work / "status.tsv").read_text().splitlines() if line]
results = {"seconds": seconds, "steps": steps}
for f in sorted(work.glob("*.json")):
    try:
        results[f.stem] = json.loads(f.read_text())
    except ValueError as exc:
        results[f.stem] = f"unreadable: {exc}"
(out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
lines = [f"device check: {seconds}s"]
lines += [f"  {s['step']:<20} {s['status']:<16} {s['seconds']}s" for s in steps]
d = results.get("decision")
if isinstance(d, dict):
    lines.append(f"MPI: {d['mpi']}; CUDA-aware: {d['cuda_aware']} ({d['reason']})")
p2p = results.get("p2p")
def gbps(v):
    return "n/a" if v is None else f"{v:.2f} GB/s"
if isinstance(p2p, dict):
    for r in p2p.get("rows", []):
        lines.append(
            f"  p2p {r['bytes'] >> 20:>4} MiB: host {gbps(r['host_gbps'])}, direct "
            f"{gbps(r['direct_gbps'])}, staged {gbps(r['staged_gbps'])}")
for name in sorted(k for k in results if k.startswith("pipeline_")):
    rep = results[name]
    if isinstance(rep, dict):
        for r in rep.get("rows", []):
            lines.append(f"  {name} {r.get('schedule')}: full step {r.get('step_ms') or 0:.2f} ms")
for name in ("sweep_1rank", "sweep_2ranks"):
    rep = results.get(name)
    if isinstance(rep, dict):
        for r in rep.get("rows", []):
            lines.append(f"  {name} {r['case']} ({r['kernel']}, blocks {r['z_block']}x"
                         f"{r['angle_block']}): grind {r['grind_ns']:.3f} ns, "
                         f"sweep {r['sweep_ms']:.3f} ms")
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
cat "$OUT/summary.txt" >>"$LOG" 2>/dev/null
failed=$(awk -F'\t' '$2 != "ok"' "$WORK/status.tsv" | wc -l)
say "device check finished in $((SECONDS - START))s; steps not ok: $failed (see $OUT/summary.txt)"
rm -rf "$WORK"
exit $((failed > 0 ? 1 : 0))
