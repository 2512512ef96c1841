#!/usr/bin/env bash
# Per-task wrapper: `srun launch/slurm/srun_dsclip.sh train --config ...` starts one dsclip process
# per SLURM task (= per GPU) with the torch.distributed variables DeepSpeed expects, mapped from
# SLURM's (DeepSpeed does not read SLURM_*; without them it tries mpi4py and fails):
#   SLURM_PROCID → RANK, SLURM_LOCALID → LOCAL_RANK, SLURM_STEP_NUM_TASKS/SLURM_NTASKS → WORLD_SIZE,
#   MASTER_ADDR = first node of the job (scontrol show hostnames), MASTER_PORT = 15000 + job id % 10000
# (both unless already set, e.g. by train.sbatch). dsclip.engine.world.discovery does the same mapping when
# started under srun without this wrapper; the wrapper also activates the venv and makes the
# mapping visible to any DeepSpeed script (MODULE=your.module).
set -euo pipefail

: "${SLURM_PROCID:?run me under srun}"
REPO=${DSCLIP_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
VENV=${VENV:-$REPO/.venv}
MODULE=${MODULE:-dsclip}

export RANK=$SLURM_PROCID
export LOCAL_RANK=$SLURM_LOCALID
export WORLD_SIZE=${SLURM_STEP_NUM_TASKS:-$SLURM_NTASKS}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | head -n1)}
export MASTER_PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 10000))}
# tasks on this node, from "2(x3),1"-style SLURM_STEP_TASKS_PER_NODE
export LOCAL_WORLD_SIZE=$(
  tpn=${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}
  awk -v s="$tpn" -v n="${SLURM_NODEID:-0}" 'BEGIN {
    k = split(s, parts, ","); i = 0
    for (j = 1; j <= k; j++) {
      c = parts[j]; r = 1
      if (match(c, /\(x[0-9]+\)/)) { r = substr(c, RSTART + 2, RLENGTH - 3); c = substr(c, 1, RSTART - 1) }
      for (m = 0; m < r; m++) { if (i == n) { print c; exit } i++ }
    }
    print 1 }')
export LOCAL_SIZE=$LOCAL_WORLD_SIZE
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

if [[ -f $VENV/bin/activate ]]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
# exec: srun's signals (SIGUSR1 forwarded by train.sbatch, SIGTERM at the time limit) reach python
exec python -u -m "$MODULE" "$@"
