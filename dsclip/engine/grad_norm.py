"""The global gradient norm only on the steps that need it: ZeRO-1/2 without gradient clipping.

ZeRO-1/2's ``step()`` computes the global gradient norm on every step (``zero_optimization.
compute_grad_norm``, default true): a float64 pass over this rank's gradient partition and an
all-reduce (plus, on a GPU, the host sync of reading it). With ``gradient_clipping`` > 0 the step needs
it. Without clipping (OpenCLIP's default: no ``--grad-clip-norm``) it is only a number to report, and
dsclip reports the norm of the last step of each logging window (train/metrics.py); open_clip_train does
not compute it at all. On the steps whose norm nobody reads, ``without_grad_norm`` turns
``compute_grad_norm`` off for that one ``step()``, the switch DeepSpeed itself offers (and validates:
no clipping, no offload) in the JSON.

One thing the norm also did: in fp32 DeepSpeed skips a step whose norm is inf/NaN (a non-finite
gradient anywhere), where bf16 relies on ``bf16.check_grad_overflow`` and fp16 always checks. So in fp32
a step without the norm turns DeepSpeed's pre-step inf/NaN check on instead (``check_grad_overflow``:
one reduction over the flat partition with dsclip's flush, dsclip/engine/overflow_check.py), and a
non-finite gradient still skips the step on every rank. Measured on CPU (ViT-B-32, one rank): the
float64 norm was ~70 ms of a 4.4 s step, the fp32 check ~20 ms (bench/README.md, "Utilisation").
"""

from __future__ import annotations

import contextlib

import torch


def grad_norm_optional(opt) -> bool:
    """A ZeRO-1/2 optimizer whose step could run without the norm: no clipping, no offload, no ZenFlow."""
    try:
        return (
            hasattr(opt, "compute_grad_norm")
            and hasattr(opt, "check_grad_overflow")
            and hasattr(opt, "has_overflow_partitioned_grads_serial")  # DeepSpeedZeroOptimizer (stage 1/2)
            and float(opt.clip_grad or 0.0) == 0.0
            and not opt.cpu_offload
            and not getattr(opt, "zenflow", False)
        )
    except AttributeError:
        return False


@contextlib.contextmanager
def without_grad_norm(opt):
    """One ``step()`` of ``opt`` without the global gradient norm (``grad_norm_optional(opt)`` must hold).

    The engine then reports no norm for that step (``get_global_grad_norm()`` is None)."""
    saved = opt.compute_grad_norm, opt.check_grad_overflow
    opt.compute_grad_norm = False
    if opt.dtype == torch.float32:  # the invalid-norm skip becomes the inf/NaN check (module docstring)
        opt.check_grad_overflow = True
    try:
        yield
    finally:
        opt.compute_grad_norm, opt.check_grad_overflow = saved
