# shellcheck shell=bash
# Shared body of the hpcpipe sbatch scripts (sourced, not run). It checks the allocation against
# the deck, launches `hpcpipe run` with srun, forwards the time-limit signal to the ranks (which
# finish their step, checkpoint and exit 0), and requeues the job so it resumes from there.
#
# Settings (environment, each with its default):
#   HPCPIPE_PYTHON      Python that has hpcpipe installed            (python3 on PATH)
#   HPCPIPE_VENV        a virtualenv to activate first               (none)
#   HPCPIPE_MPI_PLUGIN  srun --mpi= plugin: pmi2, pmix, ...          (pmi2)
#   HPCPIPE_OUTPUT      run directory (run.output)                   (runs/<job name>-<job id>)
#   HPCPIPE_SET         extra --set overrides, space separated       (none)
#   GPUS_PER_NODE       GPUs per node; >0 binds one GPU per local rank (0)
#   HPCPIPE_DRY_RUN     1 = print the srun command and the resolved deck, run nothing (0)
#   HPCPIPE_MAX_REQUEUES  stop requeueing after this many restarts   (10)

set -euo pipefail

hpcpipe_main() {
  local deck=${1:?usage: sbatch jobscripts/<workload>.sbatch DECK.toml}
  local python=${HPCPIPE_PYTHON:-python3}
  local plugin=${HPCPIPE_MPI_PLUGIN:-pmi2}
  local output=${HPCPIPE_OUTPUT:-runs/${SLURM_JOB_NAME:-hpcpipe}-${SLURM_JOB_ID:-local}}
  local gpus=${GPUS_PER_NODE:-0}
  local restarts=${SLURM_RESTART_COUNT:-0}
  local max_requeues=${HPCPIPE_MAX_REQUEUES:-10}

  if [ -n "${HPCPIPE_VENV:-}" ]; then
    # shellcheck disable=SC1091
    source "$HPCPIPE_VENV/bin/activate"
  fi
  [ -f "$deck" ] || { echo "hpcpipe job: deck $deck not found (run sbatch from the repository)" >&2; exit 2; }

  # Without these, every rank starts one BLAS thread per core and the node is oversubscribed.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
  export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$OMP_NUM_THREADS}

  local -a sets=(--set "run.output=$output")
  local item
  for item in ${HPCPIPE_SET:-}; do sets+=(--set "$item"); done
  local -a args=(run "$deck" "${sets[@]}")
  if [ "$restarts" -gt 0 ]; then
    args+=(--resume)  # requeued: continue from the latest complete checkpoint
  fi

  echo "hpcpipe job ${SLURM_JOB_ID:-?}: deck=$deck nodes=${SLURM_JOB_NUM_NODES:-?}" \
       "tasks=${SLURM_NTASKS:-?} gpus/node=$gpus mpi=$plugin restart=$restarts output=$output"

  # The deck must fit the allocation before any rank starts (no MPI needed for this check).
  "$python" -m hpcpipe plan "$deck" --world "${SLURM_NTASKS:?not inside a Slurm job}" \
      "${sets[@]}" --rows 0 >/dev/null || {
    echo "hpcpipe job: the deck's [topology] does not fit $SLURM_NTASKS tasks (see above)" >&2
    exit 2
  }

  local -a launch=(srun --mpi="$plugin" --kill-on-bad-exit=1 --distribution=block)
  if [ "$gpus" -gt 0 ]; then
    launch+=(--gpus-per-node="$gpus")
    # one GPU per local rank: rank binds the GPU numbered by its node-local id
    # shellcheck disable=SC2016  # expanded by the task's shell, not here
    launch+=(bash -c 'export CUDA_VISIBLE_DEVICES=$((SLURM_LOCALID % '"$gpus"')); exec "$@"' _)
  fi
  launch+=("$python" -m hpcpipe "${args[@]}")

  if [ "${HPCPIPE_DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${launch[@]}"; echo
    "$python" -m hpcpipe plan "$deck" --world "$SLURM_NTASKS" "${sets[@]}" --show-config
    return 0
  fi

  # Time limit: Slurm sends USR1 to this shell (--signal=B:USR1@T); forward it to the ranks,
  # which finish the current step, write a checkpoint and exit 0.
  local srun_pid=""
  local signalled=0
  trap 'signalled=1; echo "hpcpipe job: time limit near, asking the ranks to checkpoint";
        [ -n "$srun_pid" ] && kill -USR1 "$srun_pid" 2>/dev/null || true' USR1 TERM
  "${launch[@]}" &
  srun_pid=$!
  local rc=0
  while :; do
    wait "$srun_pid" && rc=0 || rc=$?
    # wait returns early (>128) when a trapped signal arrives; keep waiting for srun itself
    if kill -0 "$srun_pid" 2>/dev/null; then continue; fi
    break
  done

  local state=""
  if [ -f "$output/status.json" ]; then
    state=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["state"])' \
            "$output/status.json" 2>/dev/null || true)
  fi
  echo "hpcpipe job: ranks exited with $rc, run state '${state:-unknown}'"
  if [ "$rc" -eq 0 ] && [ "$state" = preempted ]; then
    if [ "$restarts" -ge "$max_requeues" ]; then
      echo "hpcpipe job: $restarts restarts already; not requeueing (HPCPIPE_MAX_REQUEUES)" >&2
      exit 1
    fi
    echo "hpcpipe job: requeueing ${SLURM_JOB_ID} to resume from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  if [ "$signalled" -eq 1 ] && [ "$rc" -eq 0 ]; then
    echo "hpcpipe job: the run finished before it had to stop"
  fi
  exit "$rc"
}
