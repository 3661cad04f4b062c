#!/usr/bin/env bash
# A one-node Slurm cluster on loopback, for trying the sbatch examples and for tests/e2e/test_slurm.py.
#
#   sudo scripts/slurm_local_cluster.sh start    # installs slurm-wlm + munge with apt if missing, starts the daemons
#   export SLURM_CONF=/tmp/slurm-local/slurm.conf  # printed by `start`; sbatch/srun/squeue read it
#   sudo scripts/slurm_local_cluster.sh stop     # stops the daemons this script started
#   scripts/slurm_local_cluster.sh status        # exit 0 when the node accepts jobs
#
# Runs slurmctld, slurmd and munged as root (Slurm's daemons must run as root to launch jobs as other users), with no
# cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none) so it also works inside containers. Its
# configuration, state and logs live in $SLURM_LOCAL_DIR (default /tmp/slurm-local); /etc/slurm is left alone, so a
# machine that is already a Slurm client keeps its real cluster. `start` is idempotent: daemons already running are
# kept. Environment: SLURM_LOCAL_DIR, SLURM_LOCAL_CTLD_PORT (6817), SLURM_LOCAL_SLURMD_PORT (6818),
# SLURM_LOCAL_NO_INSTALL=1 (never run apt-get).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
CONF=$DIR/slurm.conf
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
HOST=$(hostname -s)

die() {
  echo "slurm_local_cluster.sh: $*" >&2
  exit 1
}

alive() { # alive PIDFILE: the process named in PIDFILE is running
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  local missing=()
  for tool in slurmctld slurmd sbatch munged; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  ((${#missing[@]} == 0)) && return 0
  [[ ${SLURM_LOCAL_NO_INSTALL:-0} == 1 ]] && die "missing ${missing[*]} and SLURM_LOCAL_NO_INSTALL=1: install slurm-wlm and munge"
  command -v apt-get >/dev/null || die "missing ${missing[*]}: no apt-get here; install Slurm (slurmctld, slurmd, client) and munge"
  echo "installing slurm-wlm and munge with apt-get (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed: no network or no Debian archive reachable"
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null ||
    die "apt-get install slurm-wlm munge failed"
}

start_munge() {
  local pidfile=/run/munge/munged.pid
  if alive "$pidfile" && munge -n </dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge /etc/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile /etc/munge/munge.key; else
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  # munged refuses to run as root; the Debian service runs it as the munge user too.
  runuser -u munge -- /usr/sbin/munged --pid-file="$pidfile" || die "munged did not start (see /var/log/munge/munged.log)"
  mkdir -p "$DIR"
  touch "$DIR/munged.started" # `stop` stops munged only when this cluster started it
  for _ in $(seq 50); do
    munge -n </dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged started but does not answer (see /var/log/munge/munged.log)"
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool"
  cat >"$CONF.new" <<EOF
# Written by scripts/slurm_local_cluster.sh: one node on loopback, no cgroups.
ClusterName=local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
# Start pending and requeued jobs within seconds (the defaults poll every 30-60 s).
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Jobs requeued by examples/pretrain_gpt.sbatch wait CredExpire before they may start again; keep that short here.
AuthInfo=cred_expire=5
KillWait=10
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.new" "$CONF"
}

wait_ready() {
  for _ in $(seq 100); do
    if SLURM_CONF=$CONF sinfo -h -N -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      return 0
    fi
    sleep 0.2
  done
  die "the node did not become idle; see $DIR/slurmctld.log and $DIR/slurmd.log"
}

start() {
  [[ $(id -u) == 0 ]] || die "start needs root (slurmd launches jobs and munged's key is root-owned)"
  install_packages
  start_munge
  write_conf
  if ! alive "$DIR/slurmctld.pid"; then
    slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/slurmctld.log"
  fi
  if ! alive "$DIR/slurmd.pid"; then
    slurmd -f "$CONF" || die "slurmd did not start; see $DIR/slurmd.log"
  fi
  wait_ready
  SLURM_CONF=$CONF scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  echo "Slurm is up on $HOST ($(nproc) CPUs). Use it with: export SLURM_CONF=$CONF"
}

stop_pidfile() { # stop_pidfile NAME PIDFILE
  alive "$2" || return 0
  local pid
  pid=$(cat "$2")
  kill "$pid"
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  echo "$1 ($pid) did not stop within 5 s" >&2
}

stop() {
  stop_pidfile slurmd "$DIR/slurmd.pid"
  stop_pidfile slurmctld "$DIR/slurmctld.pid"
  if [[ -f $DIR/munged.started ]]; then
    stop_pidfile munged /run/munge/munged.pid
    rm -f "$DIR/munged.started"
  fi
}

status() {
  [[ -f $CONF ]] || die "not set up: run start"
  SLURM_CONF=$CONF sinfo -N
  SLURM_CONF=$CONF sinfo -h -N -o '%t' | grep -qE '^(idle|mix|alloc)'
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) status ;;
*) die "usage: $0 start|stop|status" ;;
esac
