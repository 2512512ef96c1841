#!/usr/bin/env bash
# Multi-node dsclip training with the DeepSpeed launcher and a hostfile.
#
#   pdsh/ssh (default): run once, on any node that can ssh to all hosts of the hostfile
#       HOSTFILE=launch/hostfile launch/deepspeed_hostfile.sh [dsclip train flags...]
#   one launcher per node, no ssh (--no_ssh --node_rank): run on every node, NODE_RANK = its line
#   in the hostfile (0 = the first host, which also is MASTER_ADDR)
#       NODE_RANK=0 HOSTFILE=launch/hostfile launch/deepspeed_hostfile.sh ...   # on the 1st host
#       NODE_RANK=1 HOSTFILE=launch/hostfile launch/deepspeed_hostfile.sh ...   # on the 2nd host
#   Both forms run the launcher under `dsclip launch`: SIGTERM/SIGUSR1 to this script reach every
#   rank (save; exit 143/85; in the pdsh form over pdsh, to each host's ranks) and it exits after them
#   (docs/clusters.md, "Stop signals and the DeepSpeed launcher").
#
# Every variable below can be set in the environment; trailing arguments go to `dsclip train`
# (e.g. --epochs 3 --batch-size 256 --resume latest). Options for the DeepSpeed launcher itself
# (--include, --exclude, --num_nodes, --bind_cores_to_rank, ...) go in DS_LAUNCHER_ARGS or before a
# `--` separator:
#       launch/deepspeed_hostfile.sh --include node1:0,1@node2:0,1 -- --epochs 3
#       DS_LAUNCHER_ARGS="--bind_cores_to_rank" launch/deepspeed_hostfile.sh --epochs 3
set -euo pipefail

# ---- knobs -------------------------------------------------------------------------------------
HOSTFILE=${HOSTFILE:-launch/hostfile}      # "<host> slots=<GPUs>" per line (launch/hostfile.example)
NUM_GPUS=${NUM_GPUS:-}                     # ranks per node; empty = the hostfile's slots
MASTER_ADDR=${MASTER_ADDR:-}               # empty = first host of the hostfile. Always passed
                                           # explicitly: DeepSpeed would otherwise ask `ssh host
                                           # hostname -I` and may pick an unreachable interface.
MASTER_PORT=${MASTER_PORT:-29500}          # rendezvous port on MASTER_ADDR; one per concurrent job
NODE_RANK=${NODE_RANK:-}                   # set → `--no_ssh --node_rank=$NODE_RANK` (per-node form)
LAUNCHER=${LAUNCHER:-pdsh}                 # DeepSpeed multi-node backend (pdsh, openmpi, ...)
SSH_PORT=${SSH_PORT:-}                     # if your sshd is not on 22
RECIPE=${RECIPE:-dsclip/recipes/demo.yaml} # dsclip train --config; none: no recipe, dsclip train's
                                           # defaults and your flags (what `dsclip plan` prints)
DS_CONFIG=${DS_CONFIG:-}                   # dsclip train --deepspeed-config (empty = recipe's)
LOGS=${LOGS:-$PWD/logs}                    # run folders go to $LOGS/$NAME
if [[ $RECIPE == none ]]; then NAME=${NAME:-run}; else NAME=${NAME:-$(basename "$RECIPE" .yaml)}; fi
                                           # same NAME + --resume latest continues a run
MODULE=${MODULE:-dsclip}                   # python -m $MODULE train ... on every rank
DEEPSPEED_TIMEOUT=${DEEPSPEED_TIMEOUT:-}   # process-group timeout in minutes (dsclip: 30)
DS_LAUNCHER_ARGS=${DS_LAUNCHER_ARGS:-}     # extra `deepspeed` launcher options (word-split)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$REPO/.venv}                  # activated here; remote ranks get its PATH
# Variables remote ranks need besides PYTHON*/NCCL*/UCX* (which DeepSpeed forwards by itself):
# written to DS_ENV_FILE, which DeepSpeed reads and exports on every node. DSCLIP_* and TORCH_NCCL_*
# (TORCH_NCCL_ASYNC_ERROR_HANDLING, ...) are added.
DS_ENV_VARS=${DS_ENV_VARS:-"PATH LD_LIBRARY_PATH TORCH_EXTENSIONS_DIR OMP_NUM_THREADS DEEPSPEED_TIMEOUT
  CUDA_HOME HF_HOME TRITON_CACHE_DIR GLOO_SOCKET_IFNAME TP_SOCKET_IFNAME"}
# -------------------------------------------------------------------------------------------------

die() { echo "deepspeed_hostfile.sh: $*" >&2; exit 2; }

# launcher options: DS_LAUNCHER_ARGS, plus everything before a `--` (then the rest is dsclip's)
read -r -a launcher_args <<<"$DS_LAUNCHER_ARGS"
for a in "$@"; do
  if [[ $a == -- ]]; then
    while [[ $1 != -- ]]; do launcher_args+=("$1"); shift; done
    shift
    break
  fi
done

[[ -f $HOSTFILE ]] || die "no hostfile at $HOSTFILE (copy launch/hostfile.example)"
HOSTFILE=$(cd "$(dirname "$HOSTFILE")" && pwd)/$(basename "$HOSTFILE")
first_host=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")
[[ -n $first_host ]] || die "$HOSTFILE lists no host"
MASTER_ADDR=${MASTER_ADDR:-$first_host}
if [[ -n $NUM_GPUS ]]; then
  # deepspeed takes the first NUM_GPUS slots of every host: more than a host has cannot start
  short=$(awk -v n="$NUM_GPUS" '!/^[[:space:]]*(#|$)/ {s = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) s = substr($i, 7)
    if (s + 0 < n + 0) {print $1 " has slots=" s; exit}}' "$HOSTFILE")
  [[ -z $short ]] || die "NUM_GPUS=$NUM_GPUS but in $HOSTFILE $short; set NUM_GPUS to at most the smallest slots (or empty: the hostfile's slots), or fix the hostfile"
fi

if [[ -f $VENV/bin/activate ]]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"              # its python, deepspeed and ninja first on PATH
fi
command -v deepspeed >/dev/null || die "deepspeed not on PATH (set VENV)"
# `python -m dsclip` from a checkout that is not pip-installed: ranks import from the repo
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
[[ -n $DEEPSPEED_TIMEOUT ]] && export DEEPSPEED_TIMEOUT

ds_args=(--hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
[[ -n $NUM_GPUS ]] && ds_args+=(--num_gpus "$NUM_GPUS")
if [[ -n $NODE_RANK ]]; then
  ds_args+=(--no_ssh --node_rank "$NODE_RANK")
else
  ds_args+=(--launcher "$LAUNCHER")
  [[ -n $SSH_PORT ]] && ds_args+=(--ssh_port "$SSH_PORT")
  # pdsh starts remote ranks with a bare environment: hand them ours through DS_ENV_FILE.
  env_file=$(mktemp "${TMPDIR:-/tmp}/dsclip-ds-env.XXXXXX")
  trap 'rm -f "$env_file"' EXIT
  for v in $DS_ENV_VARS $(compgen -e | grep -E '^(DSCLIP_|TORCH_NCCL_)' || true); do
    [[ -n ${!v:-} ]] && printf '%s=%s\n' "$v" "${!v}" >>"$env_file"
  done
  export DS_ENV_FILE=$env_file             # an absolute path: DeepSpeed's os.path.join keeps it
fi

train_args=(train)
[[ $RECIPE != none ]] && train_args+=(--config "$RECIPE")
train_args+=(--logs "$LOGS" --name "$NAME")
[[ -n $DS_CONFIG ]] && train_args+=(--deepspeed-config "$DS_CONFIG")

echo "deepspeed_hostfile.sh: hosts $(awk '!/^[[:space:]]*(#|$)/ {printf "%s ", $1}' "$HOSTFILE")| master" \
  "$MASTER_ADDR:$MASTER_PORT | ${NODE_RANK:+node_rank $NODE_RANK (no ssh) | }run $LOGS/$NAME" >&2
if [[ -z $NODE_RANK ]]; then
  # Under `dsclip launch` (see the per-node form below): a stop signal reaches the ranks on every host over
  # pdsh, and the supervisor exits after them with their code. Not exec: the EXIT trap removes the env file,
  # so this shell passes its stop signals on to the supervisor and waits for it (`wait` returns early when a
  # trapped signal arrives: wait again until the supervisor has exited).
  python -m dsclip launch -- \
    deepspeed "${ds_args[@]}" ${launcher_args[@]+"${launcher_args[@]}"} --module "$MODULE" "${train_args[@]}" "$@" &
  supervisor=$!
  trap 'kill -TERM "$supervisor" 2>/dev/null || true' TERM
  trap 'kill -USR1 "$supervisor" 2>/dev/null || true' USR1
  rc=0
  while true; do
    wait "$supervisor" && rc=0 || rc=$?
    kill -0 "$supervisor" 2>/dev/null || break
  done
  exit "$rc"
fi

# Per-node form, under `dsclip launch` (dsclip/launch/supervise.py). SLURM delivers signals to every
# process of a task (srun forwarding, scancel, --signal=USR1@T). DeepSpeed's launchers would die of
# SIGUSR1 (runner.py and launch.py have no handler), and on SIGTERM runner.py dies at once while
# launch.py SIGTERMs the ranks, SIGKILLs them 30 s later and exits 1. The supervisor runs them with
# both signals blocked, forwards each to the ranks (save; exit 85 or 143), and exits only after the
# ranks have, with their code: the job step ends when the save has.
# launch.py renumbers the node's GPUs 0..N-1 in CUDA_VISIBLE_DEVICES; the ranks map the ids back
# onto the ones SLURM (or whoever set CUDA_VISIBLE_DEVICES for this node) gave us.
[[ -n ${CUDA_VISIBLE_DEVICES:-} ]] && export DSCLIP_NODE_GPUS=$CUDA_VISIBLE_DEVICES
exec python -m dsclip launch -- \
  deepspeed "${ds_args[@]}" ${launcher_args[@]+"${launcher_args[@]}"} --module "$MODULE" "${train_args[@]}" "$@"
