"""Parameter groups (weight-decay exclusions) and learning-rate schedules, as OpenCLIP defines them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

# the run-config section lives in a module without torch, so the config parser stays light (issue #33)
from dsclip.engine.optim_config import OptimArgs, timm_optimizer_info  # noqa: F401 (re-exported)


def param_groups(model: nn.Module, weight_decay: float, layer_decay: OptimArgs | None = None) -> list[dict]:
    """Two groups: decayed matrices, and everything that must not decay.

    Excluded from decay: every tensor with ndim <= 1 (biases, norm gains, class token, logit
    scale/bias) and the names the model lists in ``no_weight_decay()`` (positional and token
    embeddings), matching OpenCLIP's exclusion rule plus embeddings.

    ``layer_decay`` (the run's OptimArgs) with ``--image-layer-decay`` / ``--text-layer-decay`` set: the two
    groups are split further by learning-rate scale (dsclip.engine.layer_decay), as OpenCLIP main keys its
    groups by (lr_scale, no_wd); each group carries ``lr = --lr * scale``, which the LambdaLR schedule
    multiplies (it scales every group's own initial lr), so the ratios hold at every step and ZeRO stage.
    Groups go head first (largest scale), so ``get_lr()[0]`` stays the peak learning rate.
    """
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    scales: dict[int, float] = {}
    if layer_decay is not None:
        from dsclip.engine.layer_decay import lr_scales

        scales = lr_scales(model, layer_decay.image_layer_decay, layer_decay.text_layer_decay)
    buckets: dict[tuple[float, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # ZeRO-3 partitions parameters at construction: p.ndim is then 1 (flat shard); ds_shape is the real one.
        ndim = len(getattr(p, "ds_shape", p.shape))
        decays = not (ndim <= 1 or name in skip or name.endswith(".bias"))
        buckets.setdefault((scales.get(id(p), 1.0), decays), []).append(p)
    if not scales:  # the layout every checkpoint so far has (PARAM_ORDER): no-decay group, then decayed
        return [
            {"params": aligned_order(buckets.get((1.0, False), [])), "weight_decay": 0.0},
            {"params": aligned_order(buckets.get((1.0, True), [])), "weight_decay": weight_decay},
        ]
    return [
        {
            "params": aligned_order(params),
            "weight_decay": weight_decay if decays else 0.0,
            "lr": layer_decay.lr * scale,
            "lr_scale": scale,
        }
        for (scale, decays), params in sorted(buckets.items(), key=lambda kv: (-kv[0][0], kv[0][1]))
    ]


# ZeRO-1/2 (and DeepSpeed's bf16 optimizer) flatten each group into one buffer and make every parameter a
# view into it, in group order. A tensor whose size is not a multiple of 8 elements (logit_scale: 1)
# shifts every later view off 16-byte alignment, and cuBLAS then falls back to alignment-1 GEMM kernels
# for them: on an H200 that made a ViT-B-32 bf16 step 2.4x slower than the same model outside DeepSpeed
# (bench/gpu_profile.py: 856 us per bias GEMM in cutlass_75 ... align1 kernels vs 95 us). Such tensors go
# last in their group, so all the others start on a 16-byte boundary.
ALIGN_ELEMENTS = 8
# Version of the parameter order inside the groups, saved with each checkpoint (dsclip state "param_order").
# ZeRO-2 optimizer state is stored as flat partitions in this order, so a checkpoint written with another
# order is resumed through a universal checkpoint (mapped by parameter name), never loaded flat.
PARAM_ORDER = 2


def aligned_order(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """``params`` with those whose element count is not a multiple of ``ALIGN_ELEMENTS`` moved to the end
    (stable: the relative order within both parts is kept)."""

    def numel(p):  # ZeRO-3 partitions at construction: ds_numel is the real size
        return getattr(p, "ds_numel", p.numel())

    return [p for p in params if numel(p) % ALIGN_ELEMENTS == 0] + [p for p in params if numel(p) % ALIGN_ELEMENTS]


def build_optimizer(
    model: nn.Module, o: OptimArgs, device_type: str, *, cpu_offload: bool = False
) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups`, in the implementation that is fastest where the step runs.

    ``cpu_offload`` (ZeRO-Offload: the fp32 master weights and the step live in host memory): DeepSpeed's
    ``DeepSpeedCPUAdam``, its vectorised C++ AdamW (JIT-built ``cpu_adam`` op), with the same
    hyperparameters and the same per-group weight decay; torch's per-tensor AdamW would otherwise
    dominate offloaded steps (bench/optimizer_step.py).
    """
    groups = param_groups(model, o.wd, o)
    if o.opt != "adamw":
        # OpenCLIP's timm path (open_clip_train/main.py): create_optimizer_v2 with --lr/--wd/--eps (+ betas,
        # momentum). Given parameter groups, timm keeps them as they are: dsclip's no-decay group stays at 0.
        from timm.optim import create_optimizer_v2

        kw = {"betas": (o.beta1, o.beta2)}  # timm drops betas/eps for optimizers that take none
        if o.momentum is not None:
            kw["momentum"] = o.momentum
        return create_optimizer_v2(groups, o.opt.split("/", 1)[1], lr=o.lr, weight_decay=o.wd, eps=o.eps, **kw)
    if cpu_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # adamw_mode: decoupled decay p -= lr·wd·p, as torch.optim.AdamW (and OpenCLIP) do.
        return DeepSpeedCPUAdam(
            groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.wd, adamw_mode=True
        )
    hyper = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
    if device_type in FUSED_DEVICES:
        return FusedAdamW(groups, **hyper)
    return torch.optim.AdamW(groups, **hyper)


# Devices with torch's fused AdamW kernel that dsclip trains on (torch also has it for mps/xpu/hpu).
FUSED_DEVICES = ("cpu", "cuda")


class FusedAdamW(torch.optim.AdamW):
    """torch's AdamW with its fused kernel: one pass over memory per tensor, on CPU as on CUDA.

    ZeRO-1/2/3 hand the optimizer one flat fp32 partition per parameter group (all of the model at
    world 1). torch's default CPU AdamW (single-tensor, what open_clip_train gets on CPU) runs six
    elementwise kernels per tensor, each streaming the tensor from main memory; the fused kernel reads
    and writes each element once. Measured over a 151 M-element partition (ViT-B-32) on one core:
    0.09 s per step against 0.85 s (bench/optimizer_step.py). Same update as torch.optim.AdamW to
    float32 rounding (tests/unit/test_optim.py), and the same state_dict.

    Checkpoints store each group's ``fused``/``foreach`` flags and loading copies them back (torch's
    ``load_state_dict`` and DeepSpeed's universal-checkpoint loader both do), so a checkpoint written by
    another AdamW would silently switch the kernel; ``step`` puts the fused kernel back first.
    """

    def __init__(self, params, **kw):
        super().__init__(params, fused=True, **kw)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["fused"], group["foreach"] = True, None
        return super().step(closure)


def lr_multiplier(o: OptimArgs, total_steps: int, steps_per_epoch: int) -> Callable[[int], float]:
    """Step -> multiplier of the peak lr; step s is the multiplier used for optimizer step s (0-based).

    Same shapes as open_clip_train/scheduler.py: linear warm-up (step+1)/warmup, then cosine to 0,
    constant, or constant with a polynomial cool-down over the last ``epochs_cooldown`` epochs.
    """
    if o.skip_scheduler:  # OpenCLIP --skip-scheduler: the optimizer keeps --lr, warm-up included
        return lambda step: 1.0
    warmup = o.warmup

    def warm(step: int) -> float | None:
        return (step + 1) / warmup if step < warmup else None

    if o.lr_scheduler == "cosine":

        def fn(step: int) -> float:
            w = warm(step)
            if w is not None:
                return w
            e, es = step - warmup, max(total_steps - warmup, 1)
            return 0.5 * (1 + math.cos(math.pi * min(e, es) / es))

    elif o.lr_scheduler == "const":

        def fn(step: int) -> float:
            w = warm(step)
            return 1.0 if w is None else w

    elif o.lr_scheduler == "const-cooldown":
        cooldown = int(round(o.epochs_cooldown * steps_per_epoch))
        start = total_steps - cooldown
        end = o.lr_cooldown_end / o.lr

        def fn(step: int) -> float:
            w = warm(step)
            if w is not None:
                return w
            if step < start:
                return 1.0
            e, es = step - start, max(cooldown, 1)
            decay = (1 - min(e, es) / es) ** o.lr_cooldown_power
            return end + decay * (1.0 - end)

    else:  # validated in config
        raise ValueError(o.lr_scheduler)
    return fn


def build_scheduler(optimizer, o: OptimArgs, total_steps: int, steps_per_epoch: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(o, total_steps, steps_per_epoch))
