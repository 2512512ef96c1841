"""One rank, fp32 weights: AdamW reads each gradient where backward left it (no flat gradient copy).

At one rank ZeRO-1/2 have nothing to partition and nothing to reduce, yet their ``step()`` reads one
flat gradient buffer: dsclip's flush (dsclip/engine/local_flush.py) copies every ``.grad`` into it, and
the step's inf/NaN check and the fused AdamW kernel then read that copy. On CPU a step's optimizer
phase is memory-bound (the gradients, weights and moments are out of cache by then), so the copy is a
full extra write and read of the model's gradients. Measured on one CPU rank: the flush and the step
together 9.0 -> 4.6 ms of a ~90 ms demo-model step, 1.02-1.05x per step (bench/single_rank_step.py), and
371 -> 272 ms of a 3.5 s ViT-B-32 step (bench/README.md, "One rank: AdamW on the gradients in place").

From the second step on (the first creates the optimizer state through DeepSpeed's own step, and
links DeepSpeed's fragment mappings to it), the flush hands the step the gradients themselves
(``_ParamGrads``: the list DeepSpeed's ``averaged_gradients`` holds per group, whose entries DeepSpeed's
``safe_get_full_grad`` reads as before), and the step is DeepSpeed's ZeRO-1/2 ``step()`` for this case,
in the same order:

  inf/NaN check where DeepSpeed checks (``check_grad_overflow``) -> the global norm where it computes
  one (``compute_grad_norm``; fp64 squares as DeepSpeed's) -> a non-finite gradient or norm skips the
  step -> clipping by DeepSpeed's combined scale -> torch's fused AdamW kernel over per-parameter views
  of the flat fp32 master (at one rank it is the model's own flat weights: ``_alias_fp32_master``) and
  of the optimizer's flat moments.

The optimizer state stays the flat tensors DeepSpeed created, so checkpoints, ``safe_get_full_fp32_param``
and universal checkpoints see no difference. The update is AdamW's, element by element; the fused kernel
rounds the few elements at the end of each tensor in its scalar loop, so a parameter's moments can differ
from the flat step's in the last bit (tests/dist/test_single_rank_step.py compares to float tolerance;
the first step and everything outside this case are DeepSpeed's, bit for bit).

Only where all of this holds: one CPU rank, dsclip's flush with the aliased master (fp32 weights, no
offload), dsclip's ``FusedAdamW`` with float learning rates and no amsgrad/maximize, no loss scaling;
anything else keeps the flat path (on a GPU the copy is a device memcpy, and the per-tensor check and
norm here would each be hundreds of kernel launches of host time).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.utils import is_invalid_grad_norm
from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

from dsclip.engine.local_flush import _layout, sum_of_squares_fp64
from dsclip.engine.optim import FusedAdamW
from dsclip.engine.overflow_check import sum_non_finite


class _ParamGrads(list):
    """``averaged_gradients[i]`` for the in-place step: each parameter's own gradient, in group order."""


def single_rank_step_supported(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    try:
        return (
            getattr(engine, "_dsclip_local_flush", None) == "none"
            and getattr(engine, "_dsclip_master_aliased", False)
            and type(opt.optimizer) is FusedAdamW
            and opt.dtype == torch.float32
            and not opt.dynamic_loss_scale
            and float(opt.loss_scale) == 1.0
            and not getattr(opt, "torch_autocast_gradscaler", None)
            and not getattr(opt, "zenflow", False)
            and len(opt.optimizer.param_groups) == len(opt.bit16_groups)
            # CPU only: there the step is memory-bound and the copy a full pass over the gradients; on a GPU
            # the copy is one device memcpy, and per-tensor checks and norms would cost host launches
            and all(flat.device.type == "cpu" for flat in opt.bit16_groups_flat)
        )
    except AttributeError:  # another DeepSpeed optimizer class
        return False


def install_single_rank_step(engine) -> None:
    """Wrap the engine's (dsclip) flush and the ZeRO optimizer's ``step`` (call only if supported)."""
    opt = engine.optimizer
    layouts = [_layout(opt, i) for i in range(len(opt.bit16_groups))]
    flat_flush = engine._flush_coalesced_reduction_zero12
    deepspeed_step = opt.step
    views = _StateViews(opt, layouts)

    def flush(optimizer) -> None:
        if not _ready(opt):  # no optimizer state yet: the first step creates it, through DeepSpeed's step
            return flat_flush(optimizer)
        for i, params in enumerate(opt.bit16_groups):
            grads = _ParamGrads()
            for p in params:
                # an unused parameter (no gradient this step) is stepped with a zero gradient, as the flat
                # buffer would give it
                grads.append(torch.zeros_like(p) if p.grad is None else p.grad)
                p.grad = None  # as DeepSpeed's flush leaves it: the step owns the gradient now
            opt.averaged_gradients[i] = grads
        return None

    def step(closure=None):
        grads = [opt.averaged_gradients.get(i) for i in range(len(opt.bit16_groups))]
        if not all(isinstance(g, _ParamGrads) for g in grads):
            return deepspeed_step(closure)
        return _step_in_place(opt, grads, views)

    engine._flush_coalesced_reduction_zero12 = flush
    opt.step = step
    engine._dsclip_single_rank_step = True


def _ready(opt) -> bool:
    """Every group's master has AdamW state, and the groups ask for what the fused kernel does here."""
    state = opt.optimizer.state
    for master, group in zip(opt.single_partition_of_fp32_groups, opt.optimizer.param_groups):
        if "exp_avg_sq" not in state.get(master, {}):
            return False
        if not isinstance(group["lr"], float) or group.get("amsgrad") or group.get("maximize"):
            return False
        if group.get("capturable") or group.get("differentiable"):
            return False
    return True


class _StateViews:
    """Per-parameter views of each group's flat master and flat moments, rebuilt when a tensor is replaced
    (a checkpoint load gives the optimizer new state tensors)."""

    def __init__(self, opt, layouts):
        self.opt, self.layouts, self.cache = opt, layouts, {}

    def __call__(self, i: int):
        master = self.opt.single_partition_of_fp32_groups[i]
        state = self.opt.optimizer.state[master]
        tensors = (master, state["exp_avg"], state["exp_avg_sq"])
        key = tuple(t.data_ptr() for t in tensors)
        hit = self.cache.get(i)
        if hit is None or hit[0] != key:
            shapes = [p.shape for p in self.opt.bit16_groups[i]]
            hit = (
                key,
                [[t.detach().narrow(0, o, n).view(s) for (o, n), s in zip(self.layouts[i], shapes)] for t in tensors],
            )
            self.cache[i] = hit
        return hit[1]


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """DeepSpeed's L2 norm (get_grad_norm_direct): every square summed in float64, rounded to float32.
    In cache-sized float64 blocks per tensor (local_flush.sum_of_squares_fp64): ``torch._foreach_norm`` with
    dtype=float64 converts element by element, ~3x slower on CPU."""
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        total += sum_of_squares_fp64(g.reshape(-1))
    return total.float().pow(0.5)


def _step_in_place(opt, grads_by_group: list[_ParamGrads], views: _StateViews) -> None:
    """DeepSpeedZeroOptimizer.step() (stage 1/2, no offload) at one rank, on the per-parameter gradients."""
    opt.micro_step_id = INITIAL_MICRO_STEP_ID
    if not opt.compute_grad_norm:
        opt._global_grad_norm = None
    every = [g for grads in grads_by_group for g in grads]
    # one float32 sum per tensor (overflow_check.py's rule; torch._foreach_norm's L1 norm is ~4x slower on CPU,
    # and an L2 norm in float32 would overflow at gradients of ~1e19, which DeepSpeed's float64 norm lets through)
    opt.overflow = bool(opt.check_grad_overflow) and bool(sum_non_finite(every))
    norm = None
    if opt.compute_grad_norm and not opt.overflow:
        norm = _global_norm(every)
        if is_invalid_grad_norm(norm):  # fp32: DeepSpeed skips a step whose norm is inf/NaN
            opt.overflow = True
    prev_scale = opt.loss_scale
    opt._update_scale(opt.overflow)
    if opt.overflow:
        if opt.compute_grad_norm:
            opt._global_grad_norm = float("inf")
        opt.zero_grad(set_to_none=True)
        for i in range(len(grads_by_group)):
            opt.averaged_gradients[i] = None
            opt.all_grad_tensors[i] = None
        return
    if norm is not None:
        opt._global_grad_norm = norm / prev_scale
    opt.unscale_and_clip_grads([every], norm)  # DeepSpeed's clipping: a list entry is scaled tensor by tensor
    for i, (grads, group) in enumerate(zip(grads_by_group, opt.optimizer.param_groups)):
        params, exp_avgs, exp_avg_sqs = views(i)
        step = opt.optimizer.state[opt.single_partition_of_fp32_groups[i]]["step"]
        step += 1  # torch's fused AdamW: the step count first, then the kernel reads it
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            [step] * len(params),
            lr=group["lr"],
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )
        opt.averaged_gradients[i] = None
        opt.all_grad_tensors[i] = None
        # DeepSpeed's copy of the master into the model's flat weights: nothing to do while the master is
        # those weights (_alias_fp32_master), but a load that gave the master its own storage must not leave
        # the model behind
        weights = opt.parallel_partitioned_bit16_groups[i][0]
        master = opt.single_partition_of_fp32_groups[i]
        if weights.data_ptr() != master.data_ptr():
            weights.data.copy_(master.data)
        # one rank has nothing to gather; every parameter is already its view of the flat weights (checked)
        opt._update_model_bit16_weights(i)
