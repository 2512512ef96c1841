#!/usr/bin/env bash
# tests/cluster.sh up|down|status|env
#
# A real two-node SLURM cluster and two real ssh "hosts" on ONE machine, for the launch e2e tests
# (tests/e2e/test_launch.py). Debian 12, root, no systemd (the CI machine).
#
#   up      install what is missing (apt-get), then start, each recorded by PID under $ROOT:
#             munged (unless one already answers), slurmctld, slurmd -N node1, slurmd -N node2
#             (Debian's slurm supports several slurmd per machine; each node declares fake GPU gres
#             and the machine's cores, bound with task/affinity), and one sshd on 127.0.0.2 and
#             one on 127.0.0.3 (`node1`, `node2` in /etc/hosts, marked lines) with a private key;
#             pre-build DeepSpeed's CPU shm comm op into $TORCH_EXTENSIONS_DIR;
#             write $ROOT/env.sh (SLURM_CONF, PATH with an `ssh` wrapper using a private config,
#             TORCH_EXTENSIONS_DIR). Idempotent: a second `up` while up only re-checks.
#             If any step fails, everything started so far is torn down again.
#   down    scancel our jobs, stop what `up` started (by PID only), remove the /etc/hosts lines
#             and $ROOT. Idempotent; safe when nothing is up.
#   status  exit 0 when SLURM has 2 idle/allocated nodes and both ssh hosts answer; print details.
#   env     print the path of env.sh (source it to use sbatch/srun/deepspeed --hostfile by hand).
#
# Knobs (environment): DSCLIP_CLUSTER_ROOT (/tmp/dsclip-cluster), DSCLIP_CLUSTER_SSH_PORT (2222),
# DSCLIP_CLUSTER_SLURMCTLD_PORT (6817), DSCLIP_CLUSTER_SLURMD_PORTS (6818-6819),
# DSCLIP_CLUSTER_GPUS (4 fake GPUs per node), DSCLIP_VENV (repo's .venv), TORCH_EXTENSIONS_DIR (~/.cache/dsclip/torch_extensions: kept across
# up/down on purpose, the JIT build of the shm op costs 30-80 s on 2 cores).
#
# Only files outside $ROOT that it touches: marked lines in /etc/hosts (removed by down),
# /etc/munge/munge.key (created only if absent), /run/munge and /run/sshd (runtime dirs).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=${DSCLIP_CLUSTER_ROOT:-/tmp/dsclip-cluster}
MARK="# dsclip-cluster:$ROOT"   # /etc/hosts lines of this cluster (sed pattern: no | in ROOT)
SSH_PORT=${DSCLIP_CLUSTER_SSH_PORT:-2222}
CTLD_PORT=${DSCLIP_CLUSTER_SLURMCTLD_PORT:-6817}
SLURMD_PORTS=${DSCLIP_CLUSTER_SLURMD_PORTS:-6818-6819}
VENV=${DSCLIP_VENV:-$REPO/.venv}
EXT_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/dsclip/torch_extensions}
NODES=(node1 node2)
GPUS=${DSCLIP_CLUSTER_GPUS:-4}   # fake GPUs per node
ADDRS=(127.0.0.2 127.0.0.3)

log() { printf '[cluster %(%T)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

alive() {  # pid; a zombie (exited, not yet reaped by PID 1) counts as gone
  local s
  s=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ $s != Z* ]]
}

wait_gone() {  # pid seconds
  local i
  for ((i = 0; i < $2 * 10; i++)); do alive "$1" || return 0; sleep 0.1; done
  return 1
}

stop_pidfile() {  # pidfile what
  local f=$1 pid
  [[ -s $f ]] || { rm -f "$f"; return 0; }
  pid=$(<"$f")
  if [[ $pid =~ ^[0-9]+$ ]] && alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_gone "$pid" 10; then
      log "$2 (pid $pid) ignored SIGTERM; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      wait_gone "$pid" 5 || true
    fi
    log "stopped $2 (pid $pid)"
  fi
  rm -f "$f"
}

port_busy() {  # addr:port already listening (by anyone)?
  ss -Hltn "sport = :${1##*:}" 2>/dev/null | awk '{print $4}' | grep -qE "^(\*|0\.0\.0\.0|\[::\]|${1%:*}):${1##*:}$"
}

install_packages() {
  local need=() c
  for c in munged slurmctld slurmd srun sbatch scontrol sshd pdsh ss; do
    command -v "$c" >/dev/null 2>&1 || [[ -x /usr/sbin/$c ]] || need+=("$c")
  done
  ((${#need[@]})) || return 0
  log "installing packages (missing: ${need[*]})"
  apt-get update -qq
  # Services are not started by postinst (policy-rc.d); --no-install-recommends skips ~35 plugins.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    munge slurmctld slurmd slurm-client openssh-server pdsh iproute2 >/dev/null
}

hosts_entries() {
  sed -i "\|$MARK\$|d" /etc/hosts
  {
    # slurmd/slurmctld resolve this machine's own short name
    getent hosts "$(hostname -s)" >/dev/null || echo "127.0.1.1 $(hostname -s) $MARK"
    local i
    for i in "${!NODES[@]}"; do echo "${ADDRS[$i]} ${NODES[$i]} $MARK"; done
  } >>/etc/hosts
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already answers: reusing it (down will not stop it)"
    return
  fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged          # daemonises, writes /run/munge/munged.pid
  cp /run/munge/munged.pid "$ROOT/munged.pid"
  munge -n | unmunge >/dev/null || die "munged does not answer"
  log "munged (pid $(<"$ROOT/munged.pid"))"
}

write_slurm_conf() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) / 4 ))
  mkdir -p "$ROOT/slurm/state" "$ROOT/slurm/spool" "$ROOT/slurm/log"
  cat >"$ROOT/slurm/slurm.conf" <<EOF
# written by tests/cluster.sh: 2 virtual nodes on one machine
ClusterName=dsclipci
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$ROOT/slurm/state
SlurmdSpoolDir=$ROOT/slurm/spool/%n
SlurmctldPidFile=$ROOT/slurm/slurmctld.pid
SlurmdPidFile=$ROOT/slurm/slurmd-%n.pid
SlurmctldLogFile=$ROOT/slurm/log/slurmctld.log
SlurmdLogFile=$ROOT/slurm/log/slurmd-%n.log
MpiDefault=none
ProctrackType=proctrack/pgid
# CPU binding as on a real cluster: each task is pinned to the cores it asked for (--cpus-per-task)
TaskPlugin=task/affinity
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
InactiveLimit=0
KillWait=5
# sbatch --wait polls every 2 s only while 2 >= MinJobAge/2; with the default it polls after
# 2, 8, 32 s and a 5 s job takes 42 s.
MinJobAge=4
# lets the virtual nodes declare the CPUs of the machine twice
SlurmdParameters=config_overrides
# ${GPUS} fake GPUs per node (gres.conf): SLURM hands them out by index, sets CUDA_VISIBLE_DEVICES /
# SLURM_STEP_GPUS and applies --gpus-per-task / --gpu-bind, as it does with real ones.
GresTypes=gpu
NodeName=node[1-2] NodeHostname=${host} Port=${SLURMD_PORTS} CPUs=${cpus} Sockets=1 CoresPerSocket=${cpus} ThreadsPerCore=1 RealMemory=${mem} Gres=gpu:${GPUS} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # Device files SLURM can hand out: slurmd insists on character devices (a plain file is "not a
  # valid character or block device" and the gres is dropped) but never opens them. Major 240 is in
  # the "local/experimental" range, so no driver is behind them; there is no CUDA here either (dsclip
  # reports the index it would bind on a CPU machine). AutoDetect=off: no NVML to ask.
  mkdir -p "$ROOT/slurm/gpus"
  local i
  for ((i = 0; i < GPUS; i++)); do
    [[ -c $ROOT/slurm/gpus/nvidia$i ]] || mknod "$ROOT/slurm/gpus/nvidia$i" c 240 "$i"
  done
  cat >"$ROOT/slurm/gres.conf" <<EOF
AutoDetect=off
NodeName=node[1-2] Name=gpu File=$ROOT/slurm/gpus/nvidia[0-$((GPUS - 1))]
EOF
}

start_slurm() {
  local n i
  for n in "127.0.0.1:$CTLD_PORT" "0.0.0.0:${SLURMD_PORTS%-*}" "0.0.0.0:${SLURMD_PORTS#*-}"; do
    ! port_busy "$n" || die "port ${n##*:} is already in use (set DSCLIP_CLUSTER_SLURM*_PORT*)"
  done
  write_slurm_conf
  export SLURM_CONF=$ROOT/slurm/slurm.conf
  slurmctld -f "$SLURM_CONF"                   # daemonises; pid in $ROOT/slurm/slurmctld.pid
  for n in "${NODES[@]}"; do slurmd -f "$SLURM_CONF" -N "$n"; done
  for ((i = 0; i < 100; i++)); do
    [[ $(sinfo -h -o '%t %D' 2>/dev/null) == "idle 2" ]] && break
    sleep 0.2
  done
  if ! sinfo -h -o '%t %D' 2>/dev/null | grep -qx 'idle 2'; then
    sinfo || true
    tail -n 20 "$ROOT"/slurm/log/*.log >&2 || true
    die "SLURM nodes did not come up idle"
  fi
  log "slurm: $(sinfo -h -o '%P %a %D %t %N')"
}

start_ssh() {
  local d=$ROOT/ssh i n
  for n in "${ADDRS[@]}"; do ! port_busy "$n:$SSH_PORT" || die "$n:$SSH_PORT is in use (set DSCLIP_CLUSTER_SSH_PORT)"; done
  mkdir -p "$d" /run/sshd
  chmod 700 "$d"
  [[ -s $d/id_ed25519 ]] || ssh-keygen -q -t ed25519 -N '' -C dsclip-cluster -f "$d/id_ed25519"
  [[ -s $d/host_ed25519_key ]] || ssh-keygen -q -t ed25519 -N '' -C dsclip-cluster -f "$d/host_ed25519_key"
  cp "$d/id_ed25519.pub" "$d/authorized_keys"
  chmod 600 "$d/authorized_keys"
  : >"$d/known_hosts"
  for i in "${!NODES[@]}"; do
    cat >"$d/sshd_${NODES[$i]}.conf" <<EOF
ListenAddress ${ADDRS[$i]}
Port ${SSH_PORT}
HostKey $d/host_ed25519_key
PidFile $d/sshd_${NODES[$i]}.pid
AuthorizedKeysFile $d/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
# the launched ranks inherit sshd's environment; let them see the caller's locale only
AcceptEnv LANG LC_*
EOF
    /usr/sbin/sshd -f "$d/sshd_${NODES[$i]}.conf" -E "$d/sshd_${NODES[$i]}.log"
  done
  cat >"$d/ssh_config" <<EOF
Host ${NODES[*]}
    Port ${SSH_PORT}
    User root
    IdentityFile $d/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $d/known_hosts
    StrictHostKeyChecking accept-new
    BatchMode yes
    ConnectTimeout 5
    LogLevel ERROR
EOF
  mkdir -p "$ROOT/bin"
  # DeepSpeed's ssh check and pdsh both exec plain `ssh` from PATH: this wrapper keeps root's own
  # ~/.ssh untouched.
  printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$d/ssh_config" >"$ROOT/bin/ssh"
  chmod +x "$ROOT/bin/ssh"
  for n in "${NODES[@]}"; do
    for ((i = 0; i < 50; i++)); do "$ROOT/bin/ssh" "$n" true 2>/dev/null && break; sleep 0.1; done
    "$ROOT/bin/ssh" "$n" true || die "ssh $n does not answer"
  done
  log "ssh: ${NODES[*]} = ${ADDRS[*]} port $SSH_PORT"
}

write_env() {
  # Same PATH for local and remote ranks (via DS_ENV_FILE): the venv's ninja must win over
  # Debian's, or the shm op is rebuilt from scratch every time the two alternate.
  cat >"$ROOT/env.sh" <<EOF
# source me: the dsclip test cluster (tests/cluster.sh)
export DSCLIP_CLUSTER_ROOT=$ROOT
export SLURM_CONF=$ROOT/slurm/slurm.conf
export PATH=$ROOT/bin:$VENV/bin:\$PATH
export PDSH_RCMD_TYPE=ssh
export TORCH_EXTENSIONS_DIR=$EXT_DIR
EOF
}

prebuild_shm_op() {
  [[ -x $VENV/bin/python ]] || { log "no venv at $VENV: not pre-building DeepSpeed's shm op"; return; }
  local t0=$SECONDS
  mkdir -p "$EXT_DIR"
  # shellcheck disable=SC1091
  (source "$ROOT/env.sh" && OMP_NUM_THREADS=1 python -c \
    "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()" \
    >"$ROOT/shm_op_build.log" 2>&1) || { tail -n 30 "$ROOT/shm_op_build.log" >&2; die "building the shm comm op failed"; }
  log "DeepSpeed shm comm op ready in $EXT_DIR ($((SECONDS - t0)) s)"
}

is_up() {
  [[ -s $ROOT/env.sh && -s $ROOT/slurm/slurmctld.pid ]] || return 1
  alive "$(<"$ROOT/slurm/slurmctld.pid")" || return 1
  local n
  for n in "${NODES[@]}"; do
    [[ -s $ROOT/slurm/slurmd-$n.pid ]] && alive "$(<"$ROOT/slurm/slurmd-$n.pid")" || return 1
    [[ -s $ROOT/ssh/sshd_$n.pid ]] && alive "$(<"$ROOT/ssh/sshd_$n.pid")" || return 1
  done
  SLURM_CONF=$ROOT/slurm/slurm.conf sinfo -h -o '%D %t' 2>/dev/null | awk '{n += $1} END {exit !(n == 2)}' || return 1
  for n in "${NODES[@]}"; do "$ROOT/bin/ssh" "$n" true 2>/dev/null || return 1; done
}

up() {
  [[ $EUID -eq 0 ]] || die "needs root (daemons, /etc/hosts)"
  if is_up; then
    log "already up ($ROOT)"
    prebuild_shm_op
    return
  fi
  local t0=$SECONDS t1
  # a half-started cluster from an earlier crash: clean it before starting again
  [[ -d $ROOT ]] && down
  trap 'rc=$?; if ((rc)); then log "up failed (rc $rc): tearing down"; down; fi' EXIT
  install_packages
  t1=$SECONDS
  mkdir -p "$ROOT"
  hosts_entries
  start_munge
  start_slurm
  start_ssh
  write_env
  prebuild_shm_op
  trap - EXIT
  log "up in $((SECONDS - t0)) s (packages $((t1 - t0)) s); use: source $ROOT/env.sh"
}

down() {
  local f i
  if [[ -s $ROOT/slurm/slurmctld.pid ]] && alive "$(<"$ROOT/slurm/slurmctld.pid")"; then
    # a running job keeps slurmstepd and its tasks alive after slurmd stops
    export SLURM_CONF=$ROOT/slurm/slurm.conf
    scancel --user="$(id -un)" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.2; done
  fi
  for f in "$ROOT"/ssh/sshd_*.pid; do [[ -e $f ]] && stop_pidfile "$f" sshd; done
  for f in "$ROOT"/slurm/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$ROOT/slurm/slurmctld.pid" slurmctld   # its child slurmscriptd exits with it
  stop_pidfile "$ROOT/munged.pid" munged               # absent when we reused a running munged
  sed -i "\|$MARK\$|d" /etc/hosts
  rm -rf "$ROOT"
  log "down"
}

status() {
  local f
  for f in "$ROOT"/munged.pid "$ROOT"/slurm/*.pid "$ROOT"/ssh/*.pid; do
    [[ -s $f ]] && printf '%-45s %-8s %s\n' "$f" "$(<"$f")" "$(alive "$(<"$f")" && echo alive || echo dead)"
  done
  [[ -s $ROOT/slurm/slurm.conf ]] && SLURM_CONF=$ROOT/slurm/slurm.conf sinfo 2>&1 || true
  if is_up; then echo "up: source $ROOT/env.sh"; else echo "down"; return 1; fi
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  env) is_up && echo "$ROOT/env.sh" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
