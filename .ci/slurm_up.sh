#!/usr/bin/env bash
# A two-node Slurm cluster on this host, for tests/test_slurm.py: Debian's slurm-wlm and
# munge, daemons started by hand (CI has no systemd). Idempotent: a second call finds the
# same configuration and live daemons and returns in well under a second.
#
# The two nodes are two slurmd on one host, each started with -N for its node name and
# listening on its own port (NodeName ... Port=), so a multi-node job really spans two
# slurmd with a step on each. Each advertises the host's CPUs and a share of its memory.
# Partitions `cpu` (default) and `gpu` share the nodes, so a test can tell which one a job
# asked for. Each node advertises two GPUs backed by dummy character devices: gres needs a
# File= per device (a count-only gres leaves the node INVAL), and nothing here opens them.
# No accounting database: jobs stay visible to squeue/scontrol for MinJobAge seconds, which
# is what the executor plugin polls (--slurm-status-command squeue) and the test reads.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurm-align
LOG_DIR=/var/log/slurm-align
GPU_DEVICES=(/dev/align-gpu0 /dev/align-gpu1)
SLURMD_PORTS=(6818 6819)

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
  # Two nodes share the host: two fifths each, the last fifth for the daemons, the
  # submitting snakemake and the OS.
  awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.4 }' /proc/meminfo
}

# The nodes' names: the host's, then the host's with a suffix.
node_names() {
  local host
  host=$(hostname -s)
  echo "$host ${host}-b"
}

write_config() {
  local host cpus memory nodes name i
  host=$(hostname -s)
  cpus=$(nproc)
  memory=$(node_memory_mb)
  read -ra nodes <<<"$(node_names)"
  install -d "$CONF_DIR" "$STATE_DIR/ctld" "$LOG_DIR"
  {
    cat <<EOF
# Written by .ci/slurm_up.sh: a two-node test cluster on one host.
ClusterName=align-ci
SlurmctldHost=$host(127.0.0.1)
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
SlurmdSpoolDir=$STATE_DIR/d-%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
EOF
    for i in "${!nodes[@]}"; do
      echo "NodeName=${nodes[$i]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${SLURMD_PORTS[$i]}" \
        "CPUs=$cpus RealMemory=$memory Gres=gpu:${#GPU_DEVICES[@]} State=UNKNOWN"
    done
    echo "PartitionName=cpu Nodes=$(echo "${nodes[@]}" | tr ' ' ,) Default=YES MaxTime=INFINITE State=UP"
    echo "PartitionName=gpu Nodes=$(echo "${nodes[@]}" | tr ' ' ,) MaxTime=INFINITE State=UP"
  } >"$CONF_DIR/slurm.conf.new"
  {
    echo "# Written by .ci/slurm_up.sh: dummy devices, see there."
    local dev
    for name in "${nodes[@]}"; do
      for dev in "${GPU_DEVICES[@]}"; do
        echo "NodeName=$name Name=gpu File=$dev"
      done
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
  local restart=$1 name
  if [[ $restart == 1 ]]; then
    for name in $(node_names); do
      stop_daemon "$STATE_DIR/slurmd-$name.pid"
    done
    stop_daemon "$STATE_DIR/slurmd.pid" # a one-node cluster this script started before
    stop_daemon "$STATE_DIR/slurmctld.pid"
  fi
  if ! live_pid "$STATE_DIR/slurmctld.pid" >/dev/null; then
    log "starting slurmctld"
    /usr/sbin/slurmctld
  fi
  for name in $(node_names); do
    if ! live_pid "$STATE_DIR/slurmd-$name.pid" >/dev/null; then
      log "starting slurmd for node $name"
      install -d "$STATE_DIR/d-$name"
      /usr/sbin/slurmd -N "$name"
    fi
  done
}

node_ready() {
  local name=$1 state
  state=$(sinfo -h -n "$name" -o %t 2>/dev/null | head -1 || true)
  case $state in
    idle | mix | alloc) return 0 ;;
    drain* | down* | inval*) scontrol update nodename="$name" state=resume 2>/dev/null || true ;;
  esac
  return 1
}

wait_idle() {
  local name pending
  for _ in $(seq 150); do
    pending=0
    for name in $(node_names); do
      node_ready "$name" || pending=1
    done
    ((pending)) || return 0
    sleep 0.2
  done
  log "nodes $(node_names) did not all become idle; see $LOG_DIR"
  sinfo -N -l >&2 || true
  tail -n 20 "$LOG_DIR"/*.log >&2 || true
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
