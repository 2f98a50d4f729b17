#!/usr/bin/env bash
# A real Slurm cluster on this one machine, to try llmtrain on one box and to test it:
# munge, slurmctld, and two slurmd as the fake nodes node1 and node2, each in its own UTS
# namespace (so `hostname` in a job says node1/node2) on its own loopback address. Root only.
#
#   bash cluster/local-cluster.sh install     # Debian packages (slurmctld slurmd slurm-client munge)
#   bash cluster/local-cluster.sh start       # prints the SLURM_CONF to export
#   bash cluster/local-cluster.sh stop        # cancels its jobs, stops its daemons by pid, and
#                                             # removes the /etc/hosts lines start added
set -euo pipefail

STATE="${LLMTRAIN_CLUSTER_DIR:-/tmp/llmtrain-cluster}"
readonly STATE CONF="$STATE/etc/slurm.conf"
readonly NODES=(node1 node2) ADDRS=(127.0.0.2 127.0.0.3) PORTS=(17001 17002)
# Declared, not real: lets several small jobs share the fake nodes. The nodes share this
# machine's cores, so a job on both asks for its real share (doc/overview.md: slurm.cpus_per_node=1
# on 2 cores): 8 threads a process on 2 cores trains several times slower.
readonly CPUS_PER_NODE=8

usage() {
  echo "Usage: bash cluster/local-cluster.sh install|start|stop|status" >&2
}

die() { echo "local-cluster.sh: $*" >&2; exit 1; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
  mkdir -p "$STATE"/{etc,ctld,spool,run,log}
  local host
  host="$(hostname)"
  cat >"$CONF.tmp" <<EOF
# Written by cluster/local-cluster.sh: a one-machine test cluster.
ClusterName=llmtrain-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldPort=6817
# No cgroups or systemd here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
# Scheduling in about a second; a requeued job restarts in ~12 s instead of ~157 s.
SchedulerParameters=sched_interval=2,bf_interval=1,batch_sched_delay=0,sched_min_interval=0
AuthInfo=cred_expire=10
# Finished jobs stay visible to scontrol for 10 minutes; end states also go to a text file.
MinJobAge=600
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.txt
ReturnToService=2
MpiDefault=none
KillWait=10
EOF
  local i
  for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[i]} NodeAddr=${ADDRS[i]} Port=${PORTS[i]} CPUs=$CPUS_PER_NODE RealMemory=4000 State=UNKNOWN" >>"$CONF.tmp"
  done
  local nodes
  nodes="$(IFS=,; echo "${NODES[*]}")"
  {
    echo "PartitionName=debug Nodes=$nodes Default=YES MaxTime=INFINITE State=UP"
    # A partition with a time limit, for the requests that exceed it (tests/test_slurm.py).
    echo "PartitionName=short Nodes=$nodes MaxTime=00:10:00 State=UP"
    # A partition for some accounts and QOS only, one node a job (the same tests).
    echo "PartitionName=restricted Nodes=$nodes AllowAccounts=physics AllowQos=high MaxNodes=1 State=UP"
  } >>"$CONF.tmp"
  mv -f "$CONF.tmp" "$CONF"
  # The node names resolve to their addresses; stop removes exactly the lines added here.
  mkdir -p "$STATE/run"
  for i in "${!NODES[@]}"; do
    grep -qx "${ADDRS[i]} ${NODES[i]}" /etc/hosts && continue
    echo "${ADDRS[i]} ${NODES[i]}" | tee -a /etc/hosts >>"$STATE/run/hosts-added"
  done
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return  # already running (ours or the machine's)
  fi
  mkdir -p /run/munge
  chown munge:munge /run/munge
  chmod 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  cp /run/munge/munged.pid "$STATE/run/munged.pid"  # ours: stop ends it
  munge -n | unmunge >/dev/null || die "munged does not answer"
}

# Whether pid $1 is a live (not zombie) process running the daemon named $2.
runs() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  [[ "$stat" == *"($2) "[^Z]* ]]
}

# Whether the pid in pidfile $1 (slurmctld.pid, slurmd-node1.pid, munged.pid) still runs its daemon.
recorded_runs() {
  local name
  name="$(basename "$1" .pid)"
  runs "$(<"$1")" "${name%%-*}"
}

# What is left of a cluster that ended without stop: its pidfiles may name pids that now belong
# to other processes, so a daemon is ended only if that pid still runs the daemon it recorded.
forget_dead_cluster() {
  local pidfile
  for pidfile in "$STATE"/run/slurmd-*.pid "$STATE/run/munged.pid"; do
    [[ -f "$pidfile" ]] || continue
    if recorded_runs "$pidfile"; then
      kill "$(<"$pidfile")" 2>/dev/null || true
      while recorded_runs "$pidfile"; do sleep 0.2; done
    fi
    rm -f "$pidfile"
  done
  rm -f "$STATE/run/slurmctld.pid"
  rm -rf "$STATE/spool"  # the dead slurmd's job files
}

start() {
  [[ $(id -u) -eq 0 ]] || die "must run as root"
  install_packages
  if [[ -f "$STATE/run/slurmctld.pid" ]] && recorded_runs "$STATE/run/slurmctld.pid"; then
    echo "already running; export SLURM_CONF=$CONF"
    return
  fi
  forget_dead_cluster
  write_conf
  start_munge
  # -c: a fresh controller. Jobs saved by one that died without stop (a machine reset, a
  # killed session) would be recovered as running and hold the nodes for good.
  slurmctld -f "$CONF" -c
  local i
  for i in "${!NODES[@]}"; do
    # shellcheck disable=SC2016  # $1/$2 are expanded by the inner sh, on purpose
    unshare --uts /bin/sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' _ "${NODES[i]}" "$CONF"
  done
  local deadline=$((SECONDS + 60)) states
  until states="$(SLURM_CONF="$CONF" sinfo -h -o %T 2>/dev/null)" && [[ -n "$states" ]] \
      && ! grep -qv '^idle$' <<<"$states"; do
    ((SECONDS < deadline)) || die "nodes did not become idle (sinfo: ${states:-no answer}); see $STATE/log"
    sleep 0.5
  done
  echo "cluster up: ${NODES[*]}; export SLURM_CONF=$CONF"
}

stop() {
  if [[ -f "$STATE/run/slurmctld.pid" ]]; then
    SLURM_CONF="$CONF" scancel --full --user "$(id -un)" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while [[ -n "$(SLURM_CONF="$CONF" squeue -h -t running,completing 2>/dev/null)" ]] && ((SECONDS < deadline)); do
      sleep 0.5
    done
  fi
  local pidfile
  for pidfile in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid" "$STATE/run/munged.pid"; do
    [[ -f "$pidfile" ]] || continue
    ! recorded_runs "$pidfile" || kill "$(<"$pidfile")"
    rm -f "$pidfile"
  done
  if [[ -f "$STATE/run/hosts-added" ]]; then
    local kept
    kept="$(grep -vxF -f "$STATE/run/hosts-added" /etc/hosts || true)"
    printf '%s\n' "$kept" >/etc/hosts  # rewritten in place: /etc/hosts may be a mount point
    rm -f "$STATE/run/hosts-added"
  fi
  echo "cluster stopped"
}

status() {
  SLURM_CONF="$CONF" sinfo
  SLURM_CONF="$CONF" squeue
}

main() {
  case "${1:-}" in
    install) install_packages ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    -h | --help) usage ;;
    *) usage; exit 2 ;;
  esac
}

main "$@"
