#!/usr/bin/env bash
# Start a real single-node Slurm (slurmctld + slurmd + munge) on this machine, for testing the
# job scripts. Idempotent: safe to run again; it (re)writes the config and starts what is not
# running. Needs root and Debian's slurmd, slurmctld and munge packages (installed if missing).
#
#   sudo tests/slurm/start-local-slurm.sh         # then: sinfo; sbatch ...; squeue
#   CPUS=8 MEMORY_MB=4000 tests/slurm/start-local-slurm.sh
set -euo pipefail

CPUS=${CPUS:-8}                 # CPUs the node advertises (oversubscribed on small machines)
MEMORY_MB=${MEMORY_MB:-4000}    # RealMemory the node advertises
CONF_DIR=${CONF_DIR:-/etc/slurm}
STATE_DIR=${STATE_DIR:-/var/spool/slurmctld}
SPOOL_DIR=${SPOOL_DIR:-/var/spool/slurmd}
LOG_DIR=${LOG_DIR:-/var/log/slurm}

if [ "$(id -u)" -ne 0 ]; then
  echo "start-local-slurm: must run as root (it starts system daemons)" >&2
  exit 2
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmd slurmctld munge >/dev/null
fi

host=$(hostname)
mkdir -p "$CONF_DIR" "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR" /etc/munge /run/munge /var/lib/munge /var/log/munge

# munge: a key owned by munge, mode 400; the daemon once.
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- munged --force 2>/dev/null || munged --force
  else
    munged --force
  fi
fi

cat > "$CONF_DIR/slurm.conf" <<CONF
# Written by tests/slurm/start-local-slurm.sh: a single-node cluster for testing job scripts.
ClusterName=hpcpipe-test
SlurmctldHost=$host
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
SlurmdParameters=config_overrides
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=5
MinJobAge=300
NodeName=$host CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd

# Wait for the controller, then make sure the node is usable.
for _ in $(seq 1 60); do
  if scontrol ping 2>/dev/null | grep -q UP; then break; fi
  sleep 0.5
done
scontrol update nodename="$host" state=resume 2>/dev/null || true
for _ in $(seq 1 60); do
  state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
  case "$state" in idle*|mixed*|allocated*) break ;; esac
  sleep 0.5
done
sinfo
