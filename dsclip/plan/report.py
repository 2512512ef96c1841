"""What ``dsclip plan`` prints: one plan (``format_plan``), and the search's rows (``format_search``,
``describe``)."""

from __future__ import annotations

from dsclip.plan.planner import Plan
from dsclip.plan.search import Search


def format_plan(p: Plan) -> str:
    lines = [*_headline(p), ""]
    lines.append(
        "per-GPU memory (GiB):"
        if p.device != "cpu"
        else "per-rank peak resident memory, predicted (GiB; the larger of the loss and pass-2 phases):"
    )
    for k, v in p.memory_gb.items():
        lines.append(f"  {k:<38} {v:10.3f}")
    a = p.activation_per_sample_mb
    lines += [
        "",
        "activations per sample (MiB): " + ", ".join(f"{k} {v:.2f}" for k, v in a.items()),
        "loss memory per mode (GiB, this rank, whole step's rows): "
        + ", ".join(f"{k} {v:.3f}" for k, v in p.loss_memory_gb.items()),
        "",
    ]
    if p.fits:
        lines.append(
            f"fits: micro-batch {p.micro_batch} x --accum-freq {p.accum_freq} per GPU "
            f"(largest micro-batch that fits: {p.max_micro_batch})"
        )
    else:
        lines.append("does NOT fit")
    if p.device != "cpu":
        lines.append(
            f"host RAM for the step's inputs: {p.host_inputs_gb:.2f} GiB per GPU (--host-memory {p.host_memory_gb:g} "
            f"GiB per node); the asynchronous save's copy: {p.host_checkpoint_gb:.2f} GiB per GPU + "
            f"{p.host_checkpoint_module_gb:.2f} GiB module on one rank"
            + ("" if p.async_save else " (does not fit: --no-async-save)")
        )
    lines += _step_time_lines(p)
    lines += [f"note: {n}" for n in p.notes]
    if p.fits:  # a command the plan says does not fit is never printed (the CLI prints a change that fits)
        lines += ["", "recommended:", "  " + p.command]
    return "\n".join(lines)


def _headline(p: Plan) -> list[str]:
    """The plan's first line (what is planned) and, with locking, what the locked parameters save."""
    head = (
        f"dsclip plan: {p.model} ({p.params / 1e9:.3f} B params, {p.trainable_params / 1e9:.3f} B trainable) | "
        + (f"{p.gpus} GPUs x {p.gpu_memory_gb:g} GiB | " if p.device != "cpu" else f"{p.gpus} CPU ranks | ")
        + f"ZeRO-{p.zero}{'' if p.offload == 'none' else ' offload ' + p.offload} {p.precision} | "
        + f"global batch {p.batch_size} ({p.local_batch}/GPU) | loss {p.loss}"
        + (f" | grads {p.grad_reduction}" if p.zero >= 2 and p.device != "cpu" else "")
        + (" | grad-checkpointing" if p.grad_checkpointing else "")
        + (f" | patch-dropout {p.patch_dropout:g}" if p.patch_dropout else "")
        + (f" | image size {p.image_size}" if p.image_size else "")
    )
    if p.params == p.trainable_params:
        return [head]
    return [
        head,
        f"locked: {p.params - p.trainable_params:,} parameters ({', '.join(p.lock)}): "
        f"{p.locked_saving_gb:.3f} GiB/GPU of gradients + optimizer state not allocated",
    ]


def _step_time_lines(p: Plan) -> list[str]:
    """FLOPs, the MFU row and its world, and the step as compute + exposed communication (+ offload)."""
    f = p.forward_gflops_per_sample
    lines = [
        f"FLOPs per sample: forward {f['total']:.1f} GFLOP (vision {f['vision']:.1f}, text {f['text']:.1f}); "
        f"train (3x fwd) {p.train_gflops_per_sample:.1f}; "
        f"executed incl. recompute {p.executed_gflops_per_sample:.1f}",
        f"at MFU {p.mfu:g} of {p.peak_tflops:g} TFLOP/s: {p.step_time_s:.2f} s/step, "
        f"{p.samples_per_s_per_gpu:.1f} samples/s/GPU, "
        f"{p.samples_per_s_per_gpu * p.gpus:.0f} samples/s total "
        f"(hardware utilisation incl. recompute {p.hfu:.2f})",
        f"MFU {p.mfu:g}: {p.mfu_source}"
        + (
            f" (no row measured at world {p.gpus}: a world-{p.mfu_world} rank's compute, communication added below)"
            if p.mfu_world and p.mfu_world != p.gpus
            else ""
        ),
    ]
    if p.comm_link:
        lines += [
            f"step = compute {p.compute_s:.3f} s + exposed communication {p.comm_s:.3f} s "
            + (f"+ offload {p.offload_s:.3f} s " if p.offload_s else "")
            + f"(communication {p.comm_share:.1%} of the step; {p.comm_total_s:.3f} s back to back before "
            "overlap; dsclip/plan/comm.py)",
            f"links: {p.comm_link}",
        ]
    if p.offload_s:
        lines.append(
            f"ZeRO-Offload ({p.offload}) adds {p.offload_s:.2f} s/step: host Adam + PCIe copies "
            "(dsclip/plan/efficiency.py)"
        )
    return lines


def describe(p: Plan) -> str:
    """One line of a configuration: what the command changes, and its predicted rate."""
    off = "" if p.offload == "none" else f", offload {p.offload}"
    ckpt = ", checkpointing" if p.grad_checkpointing else ""
    return (
        f"ZeRO-{p.zero}{off}{ckpt}, loss {p.loss}, micro-batch {p.micro_batch} x --accum-freq {p.accum_freq}: "
        f"{p.memory_gb['total']:.1f} GiB, {p.samples_per_s_per_gpu * p.gpus:,.0f} samples/s"
    )


def format_search(s: Search, top: int = 6) -> str:
    """The search as rows the user can check: the chosen one first, the runners-up below it."""
    fits = s.fitting
    lines = [
        f"search: {len(s.rows)} configurations with the same training mathematics "
        f"({s.chosen.precision}, patch dropout {s.chosen.patch_dropout:g}, global batch {s.chosen.batch_size}, "
        f"{s.chosen.gpus} GPUs); {len(fits)} fit, the fastest is chosen"
    ]
    if s.fixed:
        lines.append("fixed by you: " + ", ".join(f"{d.replace('_', ' ')} ({flag})" for d, flag in s.fixed.items()))
    lines.append(f"  {'':2}{'stage':<6}{'offload':<17}{'ckpt':<5}{'loss':<15}{'mb x K':>12}{'GiB':>8}{'samples/s':>11}")
    shown = fits[:top] if fits else s.rows[:top]
    for p in shown:
        mark = "*" if p is s.chosen and p.fits else " "
        split = f"{p.micro_batch} x {p.accum_freq}" if p.fits else "-"
        lines.append(
            f"  {mark} {p.zero:<5} {p.offload:<16} {'yes' if p.grad_checkpointing else 'no':<4} {p.loss:<14}"
            f"{split:>12}{p.memory_gb['total']:>8.1f}{p.samples_per_s_per_gpu * p.gpus:>11,.0f}"
            + ("" if p.fits else "  does not fit")
        )
    rest = len(s.rows) - len(shown)
    if rest:
        lines.append(f"  ({rest} more; {len(s.rows) - len(fits)} of all do not fit)")
    return "\n".join(lines)
