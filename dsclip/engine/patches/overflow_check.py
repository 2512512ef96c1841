"""ZeRO-1/2's inf/NaN check before each step: a few multi-tensor kernels instead of a dozen per parameter.

With fp16, and with bf16 by default (``bf16.check_grad_overflow``), ZeRO-1/2's ``step()`` first asks
``has_overflow_partitioned_grads_serial`` whether any gradient of this rank's partition is non-finite.
DeepSpeed answers one parameter at a time (``amax``, ``amin``, two ``isfinite``, ``logical_and``,
``logical_not``, an add): for ViT-B-32's 302 tensors ~3,600 small kernel launches, measured at 66 ms of host
time per step on an H200 while the GPU waits (bench/gpu_profile.py --cprofile; docs/deepspeed-notes.md).
Every ZeRO-1/2 run on GPUs pays it, one GPU or many; ZeRO-3 checks its one flat buffer and is left alone.

The patch asks the same question of the same tensors: over the flat partition when the gradients came
from the ``local_flush`` patch, else with torch's multi-tensor AMP check
(``_amp_foreach_non_finite_check_and_unscale_``, what ``torch.amp.GradScaler`` uses) at an unscale factor of
exactly 1, which leaves every value as it was. Anything it does not know (sparse gradients, a missing
group) goes to DeepSpeed's method. The DeepSpeed change that would retire it: a foreach check upstream.
"""

from __future__ import annotations

from collections import defaultdict

import torch

NAME = "overflow_check"
SUMMARY = "ZeRO-1/2: the pre-step inf/NaN check in multi-tensor kernels instead of ~12 launches per parameter"
VERIFIED = ("0.19.2", "0.19.8")  # the same sources in both (tests on CI's oldest: make test-ds-floor)
METHOD = "has_overflow_partitioned_grads_serial"
_Z = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
STAGES = (1, 2)
TARGETS = {
    _Z + METHOD: frozenset({"6141630b8b45"}),
    _Z + "has_overflow": frozenset({"53a5fc9ff81a"}),  # calls it (the cpu_offload branch aside)
}


def applies(engine) -> bool:
    """A ZeRO-1/2 optimizer (DeepSpeedZeroOptimizer) whose pre-step check is the per-parameter one."""
    opt = getattr(engine, "optimizer", None)
    return (
        engine.zero_optimization_stage() in (1, 2)
        and hasattr(opt, METHOD)
        and isinstance(getattr(opt, "averaged_gradients", None), dict)
        and hasattr(opt, "bit16_groups")
    )


def install(engine) -> None:
    opt = engine.optimizer
    setattr(opt, METHOD, _fast_overflow_check(opt, getattr(opt, METHOD)))


def _fast_overflow_check(opt, deepspeed_check):
    def has_overflow_partitioned_grads_serial() -> torch.Tensor:
        groups = [opt.averaged_gradients.get(i) for i in range(len(opt.bit16_groups))]
        if any(g is None for g in groups):
            return deepspeed_check()
        flags = []
        for grads in groups:
            flat = getattr(grads, "flat_partition", None)
            if flat is not None:  # the local_flush patch: the partition holds exactly these gradients
                flags.append(non_finite(flat))
                continue
            tensors = [g for g in grads if g is not None and g.numel() > 0]
            if any(g.is_sparse for g in tensors):
                return deepspeed_check()
            flags += _foreach_non_finite(tensors)
        device = opt.bit16_groups_flat[0].device
        found = torch.zeros([1], dtype=torch.float, device=device)
        for flag in flags:
            found += flag.to(device)
        return found.bool()  # shape [1], as DeepSpeed's

    return has_overflow_partitioned_grads_serial


def non_finite(flat: torch.Tensor) -> torch.Tensor:
    """1.0 (shape [1]) if the flat partition holds an inf or NaN.

    float32 (checked only on the steps that skip the norm: the grad_norm patch) in one pass: a float32 sum
    is inf/NaN exactly when an element is, or when finite gradients sum past float32's range (~3.4e38),
    where DeepSpeed's fp32 norm, whose overflow skips the step, is inf already. 16-bit: an fp16 sum
    overflows at 65504, so every element is checked."""
    if flat.dtype == torch.float32:
        return (~torch.isfinite(flat.sum())).float().reshape(1)
    return (~torch.isfinite(flat)).any().float().reshape(1)


def _foreach_non_finite(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One float flag per (device, dtype) bucket: 1.0 if any element of any tensor is inf or NaN."""
    buckets = defaultdict(list)
    for t in tensors:
        buckets[(t.device, t.dtype)].append(t)
    flags = []
    for (device, _), ts in buckets.items():
        flag = torch.zeros(1, dtype=torch.float, device=device)
        # multiplies every element by exactly 1 (no value changes) and sets flag where one is non-finite
        torch._amp_foreach_non_finite_check_and_unscale_(ts, flag, torch.ones(1, dtype=torch.float, device=device))
        flags.append(flag)
    return flags
