"""The parts of the log that say where a run is and when it ends: the step line's timing and progress
fields, and the final summary line. Pure formatting, so the wording is tested without a run."""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``, ``2d03h``: two units at most, as an ETA is read at a glance."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def epoch_progress(step: int, epoch: int, steps_per_epoch: int, samples_per_step: int) -> str:
    """OpenCLIP's ``[samples/total (pct%)]`` of the epoch that step ``step`` (1-based) belongs to; ``epoch``
    is 0-based. Samples are global (all ranks, all accumulation micro-batches), as OpenCLIP counts them."""
    in_epoch = min(max(step - epoch * steps_per_epoch, 0), steps_per_epoch)
    total = steps_per_epoch * samples_per_step
    done = in_epoch * samples_per_step
    width = len(str(total))
    return f"[{done:>{width}}/{total} ({100 * in_epoch / steps_per_epoch:.0f}%)]"


def eta_seconds(avg_step_s: float, step: int, total_steps: int) -> float:
    """Time left for the run: the steps left at the average step time so far."""
    return max(total_steps - step, 0) * avg_step_s


def timing_text(step_s: float, data_s: float, eta_s: float) -> str:
    """Step time (OpenCLIP's batch time), the part of it spent waiting for the loader (seconds per step and
    share of the step), and the run's ETA."""
    share = 100 * data_s / step_s if step_s > 0 else 0.0
    return f"{step_s:.3f} s/step (data {data_s:.3f} s, {share:.0f}%) | eta {format_duration(eta_s)}"


def summary_line(
    *,
    step: int,
    steps_run: int,
    wall_s: float,
    samples_per_s: float,
    checkpoint: str | None,
    evaluation: str | None,
    preempted: bool = False,
    goodput: str | None = None,
) -> str:
    """The last line of a run: where it stopped, what it took, where the weights are, the last evaluation,
    and where the run's wall time went (``goodput``: dsclip.train.goodput.summary_text)."""
    how = "stopped (preempted)" if preempted else "done"
    ckpt = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (--save-frequency/--save-every-n-steps)"
    line = (
        f"{how}: step {step} ({steps_run} this run) in {format_duration(wall_s)} | "
        f"{samples_per_s:.1f} samples/s | {ckpt}"
    )
    line += f" | last eval {evaluation}" if evaluation else ""
    return line + (f" | {goodput}" if goodput else "")
