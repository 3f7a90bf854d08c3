#!/usr/bin/env bash
# A one-node Slurm cluster on this host, for tests/test_slurm.py: Debian's slurm-wlm and
# munge, daemons started by hand (CI has no systemd). Idempotent: a second call finds the
# same configuration and live daemons and returns in well under a second.
#
# Partitions `cpu` (default) and `gpu` share the node, so a test can tell which one a job
# asked for. The node advertises two GPUs backed by dummy character devices: gres needs a
# File= per device (a count-only gres leaves the node INVAL), and nothing here opens them.
# No accounting database: jobs stay visible to squeue/scontrol for MinJobAge seconds, which
# is what the executor plugin polls (--slurm-status-command squeue) and the test reads.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurm-align
LOG_DIR=/var/log/slurm-align
GPU_DEVICES=(/dev/align-gpu0 /dev/align-gpu1)

log() { echo "slurm_up: $*" >&2; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  log "munged did not come up"
  return 1
}

make_gpu_devices() {
  local dev
  for dev in "${GPU_DEVICES[@]}"; do
    [[ -c $dev ]] || mknod -m 0666 "$dev" c 1 3
  done
}

node_memory_mb() {
  # Leave a fifth of the host to the daemons, the submitting snakemake and the OS.
  awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.8 }' /proc/meminfo
}

write_config() {
  local node cpus memory
  node=$(hostname -s)
  cpus=$(nproc)
  memory=$(node_memory_mb)
  install -d "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/d" "$LOG_DIR"
  cat >"$CONF_DIR/slurm.conf.new" <<EOF
# Written by .ci/slurm_up.sh: a one-node test cluster.
ClusterName=align-ci
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
ReturnToService=2
MinJobAge=3600
KillWait=10
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory Gres=gpu:${#GPU_DEVICES[@]} State=UNKNOWN
PartitionName=cpu Nodes=$node Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$node MaxTime=INFINITE State=UP
EOF
  {
    echo "# Written by .ci/slurm_up.sh: dummy devices, see there."
    local dev
    for dev in "${GPU_DEVICES[@]}"; do
      echo "NodeName=$node Name=gpu File=$dev"
    done
  } >"$CONF_DIR/gres.conf.new"
  local changed=1
  if cmp -s "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf" &&
    cmp -s "$CONF_DIR/gres.conf.new" "$CONF_DIR/gres.conf"; then
    changed=0
  fi
  mv "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
  mv "$CONF_DIR/gres.conf.new" "$CONF_DIR/gres.conf"
  return "$changed"
}

# The pid of a daemon this script started, if it still runs.
live_pid() {
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 1
  pid=$(<"$pidfile")
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

stop_daemon() {
  local pidfile=$1 pid
  pid=$(live_pid "$pidfile") || return 0
  kill "$pid"
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}

start_slurm() {
  local restart=$1
  if [[ $restart == 1 ]]; then
    stop_daemon "$STATE_DIR/slurmd.pid"
    stop_daemon "$STATE_DIR/slurmctld.pid"
  fi
  if ! live_pid "$STATE_DIR/slurmctld.pid" >/dev/null; then
    log "starting slurmctld"
    /usr/sbin/slurmctld
  fi
  if ! live_pid "$STATE_DIR/slurmd.pid" >/dev/null; then
    log "starting slurmd"
    /usr/sbin/slurmd
  fi
}

wait_idle() {
  local node state
  node=$(hostname -s)
  for _ in $(seq 150); do
    state=$(sinfo -h -n "$node" -o %t 2>/dev/null | head -1 || true)
    case $state in
      idle | mix | alloc) return 0 ;;
      drain* | down* | inval*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.2
  done
  log "node $node did not become idle (state '${state:-none}'); see $LOG_DIR"
  sinfo -N -l >&2 || true
  tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
  return 1
}

main() {
  install_packages
  start_munge
  make_gpu_devices
  local restart=0
  write_config || restart=1
  start_slurm "$restart"
  wait_idle
  log "ready: $(sinfo -h -o '%P %D %t %c cpus %m MiB %G' | tr '\n' ';')"
}

main "$@"
