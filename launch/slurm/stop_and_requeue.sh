# Sourced by launch/slurm/*.sbatch (not run on its own): what both batch scripts do with stop signals
# and how they end. The job's srun runs in the background as $srun_pid.
#
#   stop_signals_go_to_srun TAG    trap SIGUSR1/SIGTERM and forward each to srun (which passes it to
#                                  every process of every task); TAG prefixes the log lines
#   wait_srun                      wait until srun is really gone (a trapped signal interrupts `wait`);
#                                  returns srun's code
#   requeue_or_exit TAG RC STATUS  requeue the job if dsclip asked for it (or a USR1-warned run failed
#                                  while stopping), else exit RC; STATUS is dsclip's exit_status.json
#
# The codes are dsclip's (dsclip.engine.world.stop): 85 = saved after SIGUSR1, requeue; 143 = saved after
# SIGTERM (scancel, scheduler preemption), never requeued.

EXIT_REQUEUE=85
EXIT_TERMINATED=143
preempted=0 terminated=0 interrupted=0 srun_pid=

stop_signals_go_to_srun() {
  _stop_tag=$1
  trap '_on_stop_signal USR1' USR1
  trap '_on_stop_signal TERM' TERM
}

_on_stop_signal() {
  interrupted=1
  # USR1 = the time-limit warning: requeue. TERM (scancel, scheduler preemption): save, never requeue.
  [[ $1 == USR1 ]] && preempted=1
  [[ $1 == TERM ]] && terminated=1
  echo "[$_stop_tag $(date +%T)] got SIG$1: forwarding it to the ranks"
  [[ -n $srun_pid ]] && kill -"$1" "$srun_pid" 2>/dev/null
}

wait_srun() {
  local r r2
  while :; do
    interrupted=0
    wait "$srun_pid"; r=$?
    if ((interrupted)) && kill -0 "$srun_pid" 2>/dev/null; then continue; fi
    if ((interrupted)); then wait "$srun_pid"; r2=$?; ((r2 != 127)) && r=$r2; fi
    return "$r"
  done
}

requeue_or_exit() {
  local tag=$1 rc=$2 exit_status=$3 asked
  # Requeue only what dsclip asked for (85 = saved after SIGUSR1), or a USR1-warned run that failed
  # while stopping. SIGTERM (scancel, preemption by the scheduler) ends the job: ranks save, exit 143.
  # srun's code alone cannot tell: with --kill-on-bad-exit the first task to exit 85 makes srun SIGTERM
  # the tasks still tearing down, and srun reports their 143. dsclip's exit_status.json says what it asked.
  asked=$(sed -n 's/.*"exit_code": *\([0-9]*\).*/\1/p' "$exit_status" 2>/dev/null)
  if [[ $rc -ne $EXIT_REQUEUE && $asked == "$EXIT_REQUEUE" && $terminated -eq 0 ]]; then
    echo "[$tag $(date +%T)] srun exited $rc, but dsclip saved and asked for a requeue ($exit_status)"
    rc=$EXIT_REQUEUE
  fi
  if [[ $rc -eq $EXIT_REQUEUE || ($preempted -eq 1 && $terminated -eq 0 && $rc -ne 0 && $rc -ne $EXIT_TERMINATED) ]]; then
    echo "[$tag $(date +%T)] srun exited $rc after preemption: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "[$tag $(date +%T)] requeue failed"
  fi
  echo "[$tag $(date +%T)] srun exited $rc"
  exit "$rc"
}
