#!/usr/bin/env bash
# A real one-node Slurm cluster in a folder, for drmas's Slurm tests (tests/slurm/) and for
# anyone who wants to try docs/deploy.md's Slurm commands on one machine.
#
#   scripts/slurm_cluster.sh start  [DIR]   munged, slurmctld, slurmd from a generated slurm.conf
#   scripts/slurm_cluster.sh status [DIR]   sinfo and squeue of the cluster in DIR
#   scripts/slurm_cluster.sh stop   [DIR]   cancel its jobs, stop the three daemons it started
#
# DIR (or DRMAS_SLURM_DIR) holds everything: slurm.conf, gres.conf, the munge key and
# socket, the controller's state, slurmd's spool, logs and pid files; nothing outside it is
# written. After `start`, `source DIR/env` points sinfo/sbatch/squeue at this cluster
# (SLURM_CONF). It installs nothing: on Debian/Ubuntu `apt-get install slurm-wlm munge`.
#
# The cluster: one node (this machine, named localhost) in two partitions standing in for
# GPU and CPU nodes, `learners` (the default) and `actors`; no cgroups
# (proctrack/linuxproc, task/none), no accounting database (finished jobs are written to
# DIR/jobcomp.txt by jobcomp/filetxt). Settings, all optional:
#   DRMAS_SLURM_CPUS   CPUs the node offers (default: this machine's, nproc). More than the
#                      machine has is allowed (SlurmdParameters=config_overrides): a 2-core
#                      machine can then hold 2 learner groups of 2 ranks plus actors at once.
#   DRMAS_SLURM_MEM_MB memory the node offers, in MB (default: 90% of this machine's; more
#                      is allowed as for CPUs: memory is not a consumable resource here).
#   DRMAS_SLURM_GPUS   GPUs the node declares as generic resources (default 0), backed by
#                      empty files in DIR/fake-gpus (Slurm wants a file per GPU; with no
#                      cgroups nothing is bound): jobs asking for GPUs (--gpus-per-node)
#                      are scheduled on a GPU-less machine and run on its CPU.
#   DRMAS_SLURM_PORT   slurmctld's port (default 16817; slurmd uses the next one).
#   DRMAS_SLURM_TIMEOUT  seconds `start` waits for the node to be idle, `stop` for the
#                      daemons to exit (default 60).
# Runs as root (CI) or as a plain user (then the daemons and every job run as that user).
set -euo pipefail

usage() {
  echo "usage: $0 start|stop|status [DIR]   (DIR defaults to \$DRMAS_SLURM_DIR)" >&2
  exit 2
}

[ $# -ge 1 ] || usage
action=$1
dir=${2:-${DRMAS_SLURM_DIR:-}}
[ -n "$dir" ] || usage
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
timeout_s=${DRMAS_SLURM_TIMEOUT:-60}
export SLURM_CONF="$dir/slurm.conf"

need_binaries() {
  local missing=()
  for b in munged slurmctld slurmd sinfo squeue scontrol scancel sbatch srun; do
    command -v "$b" > /dev/null || missing+=("$b")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "slurm_cluster: not installed: ${missing[*]}; install with" \
      "\`apt-get install slurm-wlm munge\` (Debian/Ubuntu, as root)" >&2
    exit 3
  fi
}

alive() {  # alive PIDFILE: the process the pid file names still runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null
}

write_config() {
  local node cpus mem gpus port user
  # the node is called localhost, a name every machine resolves (a job's first host is its
  # learners' MASTER_ADDR); the controller must be called by this machine's own name
  node=localhost
  cpus=${DRMAS_SLURM_CPUS:-$(nproc)}
  # default 90% of the machine's memory, in MB: a job's --mem must fit into it
  mem=${DRMAS_SLURM_MEM_MB:-$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)}
  gpus=${DRMAS_SLURM_GPUS:-0}
  port=${DRMAS_SLURM_PORT:-16817}
  user=$(id -un)
  local gres_node="" gres_types=""
  if [ "$gpus" -gt 0 ]; then
    gres_node="Gres=gpu:$gpus"
    gres_types="GresTypes=gpu"
    mkdir -p "$dir/fake-gpus"
    for i in $(seq 0 $((gpus - 1))); do
      touch "$dir/fake-gpus/gpu$i"
    done
    printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/fake-gpus/gpu[0-%s]\n' \
      "$node" "$dir" "$((gpus - 1))" > "$dir/gres.conf"
  else
    rm -f "$dir/gres.conf"
  fi
  cat > "$SLURM_CONF" << EOF
# Written by scripts/slurm_cluster.sh: a one-node test cluster, everything under $dir
ClusterName=drmastest
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
MinJobAge=600
$gres_types
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem $gres_node State=UNKNOWN
PartitionName=learners Nodes=$node Default=YES MaxTime=INFINITE State=UP
PartitionName=actors Nodes=$node MaxTime=INFINITE State=UP
EOF
  echo "export SLURM_CONF=$SLURM_CONF" > "$dir/env"
}

start_munge() {
  mkdir -p "$dir/munge"
  chmod 755 "$dir/munge"  # munged wants its socket's folder reachable by every user
  if [ ! -s "$dir/munge/munge.key" ]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
  fi
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/munged.seed"
}

wait_idle() {
  local deadline=$((SECONDS + timeout_s)) state=""
  while [ $SECONDS -lt $deadline ]; do
    state=$(sinfo -h -N -p learners -o %T 2> /dev/null | head -1 || true)
    if [ "$state" = "idle" ]; then
      return 0
    fi
    sleep 1
  done
  echo "slurm_cluster: the node is not idle after ${timeout_s}s (sinfo says '${state:-nothing}');" \
    "logs in $dir/log:" >&2
  tail -n 20 "$dir"/log/*.log >&2 || true
  return 1
}

start() {
  need_binaries
  if alive "$dir/slurmctld.pid" || alive "$dir/slurmd.pid" || alive "$dir/munge/munged.pid"; then
    echo "slurm_cluster: already running in $dir; run \`$0 stop $dir\` first" >&2
    exit 1
  fi
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  write_config
  start_munge
  # -i: ignore state left by an earlier run in this folder (a fresh cluster every start)
  slurmctld -i -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF" -N localhost
  if ! wait_idle; then
    stop
    exit 1
  fi
  echo "slurm_cluster: up ($(slurmctld -V)); \`source $dir/env\` to use it"
}

stop_pid() {  # stop_pid PIDFILE NAME: TERM, then KILL after the timeout
  local pidfile=$1 name=$2 pid deadline
  alive "$pidfile" || return 0
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2> /dev/null || true
  deadline=$((SECONDS + timeout_s))
  while kill -0 "$pid" 2> /dev/null && [ $SECONDS -lt $deadline ]; do
    sleep 0.5
  done
  if kill -0 "$pid" 2> /dev/null; then
    echo "slurm_cluster: $name (pid $pid) ignored TERM for ${timeout_s}s: killing it" >&2
    kill -KILL "$pid" 2> /dev/null || true
  fi
}

cancel_jobs() {  # the cluster's jobs end before slurmd does, so no job step outlives it
  alive "$dir/slurmctld.pid" || return 0
  local jobs deadline
  jobs=$(squeue -h -o %A 2> /dev/null || true)
  [ -n "$jobs" ] || return 0
  # shellcheck disable=SC2086
  scancel $jobs 2> /dev/null || true
  deadline=$((SECONDS + timeout_s))
  while [ -n "$(squeue -h -o %A 2> /dev/null || true)" ] && [ $SECONDS -lt $deadline ]; do
    sleep 1
  done
}

stop() {
  [ -f "$SLURM_CONF" ] || { echo "slurm_cluster: nothing started in $dir" >&2; return 0; }
  cancel_jobs
  stop_pid "$dir/slurmd.pid" slurmd
  stop_pid "$dir/slurmctld.pid" slurmctld
  stop_pid "$dir/munge/munged.pid" munged
  echo "slurm_cluster: stopped (state and logs stay in $dir)"
}

status() {
  if ! alive "$dir/slurmctld.pid"; then
    echo "slurm_cluster: not running in $dir" >&2
    exit 1
  fi
  sinfo
  squeue
}

case "$action" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac
