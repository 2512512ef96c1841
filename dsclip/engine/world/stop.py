"""Stop requests (SLURM ``--signal=B:USR1@120`` → batch script forwards ``SIGUSR1`` to the ranks;
``scancel`` → ``SIGTERM``): :func:`install_preemption_handler` records them; the gradient cache folds
:func:`local_stop_flags` into the all-reduce it makes every step, so every rank sees the same
:func:`stop_reason` at the same step without an extra host sync; the loop saves a checkpoint and
exits :data:`EXIT_REQUEUE` (USR1: the batch script requeues, the job resumes with ``--resume
latest``) or :data:`EXIT_TERMINATED` (TERM: not requeued).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from dsclip.dist import rank_world
from dsclip.launch import supervise

# Exit code of a run that stopped early on request (preemption signal) after saving a checkpoint:
# the launch scripts requeue the job when they see it. 0 = finished, anything else = failure.
EXIT_REQUEUE = 85
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

# --- stop requests: SIGUSR1 (requeue), SIGTERM (stop, no requeue), a second SIGTERM (now) --------------
#
# One meaning per signal, the same for every launcher and documented in README ("Signals"):
#   SIGUSR1  time-limit warning (sbatch --signal=B:USR1@120, forwarded by the batch scripts): finish
#            the step, save a checkpoint, exit EXIT_REQUEUE (85); the batch scripts requeue on 85 only.
#   SIGTERM  scancel, scheduler preemption, the time limit itself: finish the step, save, exit
#            EXIT_TERMINATED (143 = 128 + SIGTERM); never requeued.
#   SIGTERM again, more than TERM_REPEAT_S after the first one (or after SIGUSR1): stop now (default
#            action). SLURM delivers one scancel twice within milliseconds (to the step and through
#            srun's forwarding), which must not count as a second request. Once the stop's checkpoint is
#            safe (stop_saved), "now" exits with the stop's own code (85/143) instead of dying of the
#            signal: a launcher would report the death (-15, pdsh 241) as a failure of a job that saved.
# TERM wins over USR1 when ranks disagree (someone cancelled the job).

EXIT_TERMINATED = 128 + signal.SIGTERM
TERM_REPEAT_S = 1.0
STOP_NONE, STOP_REQUEUE, STOP_TERMINATE = None, "requeue", "terminate"

_preempt = {"signum": None, "usr1": False, "term": False, "first_at": None, "saved_code": None}


def install_preemption_handler(signals=PREEMPT_SIGNALS) -> None:
    """Record ``SIGUSR1``/``SIGTERM`` (the loop acts at the end of the step, on every rank together);
    a later ``SIGTERM`` ends the process at once (see the table above)."""

    def handler(signum, frame):
        now = time.monotonic()
        first = _preempt["first_at"]
        if signum == signal.SIGTERM and first is not None and now - first > TERM_REPEAT_S:
            code = _preempt["saved_code"]
            if code is not None:  # asked twice after the stop's save: nothing is left to lose, end with its code
                supervise.report_exit(code)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # asked twice: stop now
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if first is None:
            _preempt["first_at"] = now
        _preempt["signum"] = signum
        _preempt["usr1" if signum == signal.SIGUSR1 else "term"] = True

    for s in signals:
        signal.signal(s, handler)
    # `dsclip launch` starts the launcher with them blocked (its own SIGTERM handler would end the ranks
    # early), and the mask is inherited: dsclip.cli unblocks them at start, this covers other callers.
    # A rank whose supervisor dies stops as on SIGTERM.
    supervise.release_stop_signals()
    supervise.watch_supervisor()


def stop_saved(code: int) -> None:
    """The stop's checkpoint is safe and this rank now exits with ``code``: a second SIGTERM from here on ends
    the process at once with that code rather than by the signal, and one that comes while the interpreter
    shuts down is ignored (see :func:`_ignore_stop_signals_at_exit`)."""
    if _preempt["saved_code"] is None:
        atexit.register(_ignore_stop_signals_at_exit)
    _preempt["saved_code"] = int(code)


def _ignore_stop_signals_at_exit() -> None:
    """After the atexit callbacks CPython puts every signal with a Python handler back to its default action
    (``_PySignal_Fini``), and then tears the modules down, which for a rank (process groups, DeepSpeed, data
    workers) takes long enough for a late SIGTERM to arrive: it killed the rank with -15 after its save, and
    DeepSpeed's launch.py reported -15 (pdsh 241) for a job that had saved (tests/e2e/test_launch.py's pdsh
    SIGTERM case, intermittently). An ignored signal keeps its disposition through that teardown, so the
    rank ends with the stop's own code; SIGKILL, which launchers send 30 s after SIGTERM, still ends it."""
    if _preempt["saved_code"] is not None:
        for s in PREEMPT_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def local_stop_flags() -> tuple[float, float]:
    """(SIGUSR1 seen, SIGTERM seen) on this rank, as numbers to fold into a collective the step makes."""
    return float(_preempt["usr1"]), float(_preempt["term"])


def stop_reason(flags) -> str | None:
    """``STOP_*`` from flags summed over all ranks (every rank gets the same answer from the same sums)."""
    usr1, term = (float(f) for f in list(flags)[:2])  # further flags are other owners' (the background save)
    if term > 0:
        return STOP_TERMINATE
    if usr1 > 0:
        return STOP_REQUEUE
    return STOP_NONE


def exit_code(reason: str | None) -> int:
    return {STOP_REQUEUE: EXIT_REQUEUE, STOP_TERMINATE: EXIT_TERMINATED}.get(reason, 0)


def preemption_requested(sync: bool = True) -> str | None:
    """The stop reason (truthy) once any rank got SIGUSR1/SIGTERM. With ``sync`` (default) this is a
    collective (a SUM all-reduce of two numbers plus a host sync) so all ranks stop at the same step —
    call it on every rank. The training loop does not: the gradient cache folds the same flags into
    the all-reduce every step already makes (see dsclip/train/gradcache.py;
    bench/results/host-syncs_cpu2_2026-11-30.md counted the host syncs per step)."""
    local = local_stop_flags()
    if not sync:
        return stop_reason(local)
    if rank_world()[1] == 1:
        return stop_reason(local)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor(local, dtype=torch.float32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    return stop_reason(flags.tolist())
