#!/usr/bin/env bash
# Run hpcpipe on this machine with mpiexec (laptops, CI): the same settings as the sbatch
# scripts, without Slurm.
#
#   jobscripts/local.sh 4 inputs/gpt_pp4.toml [--set key=value ...] [--resume]
#
# NP ranks; the mpiexec is $HPCPIPE_MPIEXEC, else the one beside $HPCPIPE_PYTHON, else on PATH.
# Open MPI gets --oversubscribe (and --allow-run-as-root as root) added.
set -euo pipefail

np=${1:?usage: jobscripts/local.sh NP DECK [hpcpipe run options]}
deck=${2:?usage: jobscripts/local.sh NP DECK [hpcpipe run options]}
shift 2
python=${HPCPIPE_PYTHON:-python3}
if [ -n "${HPCPIPE_MPIEXEC:-}" ]; then
  read -r -a mpiexec <<< "$HPCPIPE_MPIEXEC"
else
  beside="$(dirname "$(command -v "$python")")/mpiexec"
  if [ -x "$beside" ]; then mpiexec=("$beside"); else mpiexec=(mpiexec); fi
fi
if "${mpiexec[@]}" --version 2>/dev/null | grep -q -e "Open MPI" -e OpenRTE; then
  mpiexec+=(--oversubscribe)
  [ "$(id -u)" -eq 0 ] && mpiexec+=(--allow-run-as-root)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${mpiexec[@]}" -n "$np" "$python" -m hpcpipe run "$deck" "$@" < /dev/null
