"""The global gradient norm only on the steps that need it: ZeRO-1/2 without gradient clipping.

ZeRO-1/2's ``step()`` computes the global gradient norm on every step (``zero_optimization.
compute_grad_norm``, default true): a float64 pass over this rank's partition and an all-reduce (plus, on a
GPU, the host sync of reading it). With ``gradient_clipping`` > 0 the step needs it. Without clipping
(OpenCLIP's default) it is only a number to report, and dsclip reports the norm of the last step of each
logging window (train/metrics.py); open_clip_train does not compute it at all. On the steps whose norm
nobody reads, :func:`norm_skipped` turns ``compute_grad_norm`` off for that one ``step()``, the switch
DeepSpeed itself offers (and validates: no clipping, no offload) in the JSON.

One thing the norm also did: in fp32 DeepSpeed skips a step whose norm is inf/NaN, where bf16 relies on
``bf16.check_grad_overflow`` and fp16 always checks. So in fp32 a step without the norm turns DeepSpeed's
pre-step inf/NaN check on instead (``check_grad_overflow``), and a non-finite gradient still skips the step on
every rank. Measured on CPU (ViT-B-32, one rank): the float64 norm ~70 ms of a 4.4 s step, the fp32 check
~20 ms. The DeepSpeed change that would retire it: a per-call ``step(compute_grad_norm=False)``.
"""

from __future__ import annotations

import contextlib

import torch

NAME = "grad_norm"
SUMMARY = "ZeRO-1/2 without clipping: the global gradient norm only on the steps that report it"
VERIFIED = ("0.19.8",)
STAGES = (1, 2)
TARGETS = {"deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step": frozenset({"279ae7c6a4e8"})}


def applies(engine) -> bool:
    """A ZeRO-1/2 optimizer whose step could run without the norm: no clipping, no offload, no ZenFlow."""
    opt = getattr(engine, "optimizer", None)
    try:
        return (
            engine.zero_optimization_stage() in (1, 2)
            and hasattr(opt, "compute_grad_norm")
            and hasattr(opt, "check_grad_overflow")
            and hasattr(opt, "has_overflow_partitioned_grads_serial")  # DeepSpeedZeroOptimizer (stage 1/2)
            and float(opt.clip_grad or 0.0) == 0.0
            and not opt.cpu_offload
            and not getattr(opt, "zenflow", False)
        )
    except AttributeError:
        return False


def install(engine) -> None:
    engine.dsclip_norm_optional = True  # read by norm_skipped: the step's switch is this engine's


@contextlib.contextmanager
def norm_skipped(engine):
    """One ``engine.step()`` without the global gradient norm where this patch is active (no-op elsewhere).

    The engine then reports no norm for that step (``get_global_grad_norm()`` is None)."""
    if not getattr(engine, "dsclip_norm_optional", False):
        yield
        return
    opt = engine.optimizer
    saved = opt.compute_grad_norm, opt.check_grad_overflow
    opt.compute_grad_norm = False
    if opt.dtype == torch.float32:  # the invalid-norm skip becomes the inf/NaN check (module docstring)
        opt.check_grad_overflow = True
    try:
        yield
    finally:
        opt.compute_grad_norm, opt.check_grad_overflow = saved
