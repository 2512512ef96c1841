"""ZeRO-3: the gradient norm over the flat gradient partition, in float64 blocks.

ZeRO-3's ``step()`` takes the global gradient norm on every step (``_get_norm_groups`` ->
``get_grad_norm_direct``): for each parameter a move, a float64 copy and a norm, then a stack, a power and
a sum. That is three kernel launches and a float64 temporary per parameter (ViT-H-14: ~1,100 tensors, so
~3,300 launches a step that the GPU waits for the host to issue), and the same loop is host time on any
device. The gradients it reads are not separate tensors: DeepSpeed keeps every parameter's gradient
partition as a slice of one flat buffer (``grad_partitions_flat_buffer``), end to end in group order. The
patch checks that layout on each call and then takes the sum of squares of the group's range of that
buffer in float64 blocks (the helper ZeRO-1/2's ``local_flush`` uses), all-reduces it over the partition
group as DeepSpeed does, and masks a non-finite norm to -1 as DeepSpeed does (its step then skips). The
terms are the same float64 squares summed in another order: the norm differs from DeepSpeed's in the last
float64 bits only (tests/dist/test_zero3_patches.py bounds it), and weights are bit for bit the same when the
norm clips nothing.

Anything outside the plain data-parallel case keeps DeepSpeed's method: offload (the norm is taken from the
CPU buffers), model or expert parallelism (other reductions), a norm other than L2, gradients that are not
the flat buffer's slices (e.g. a frozen parameter's zeros).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsclip.engine.patches.local_flush import sum_of_squares_fp64

NAME = "zero3_norm"
SUMMARY = "ZeRO-3: the step's gradient norm over the flat gradient partition in fp64 blocks, not per tensor"
VERIFIED = ("0.19.8",)
STAGES = (3,)
_Z = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
TARGETS = {
    _Z + "get_grad_norm_direct": frozenset({"c489acb30b5c"}),
    _Z + "_get_norm_groups": frozenset({"ece0a2b4a699"}),  # calls it with averaged_gradients[i], fp16_groups[i]
    _Z + "_get_param_partition_group": frozenset({"b21c55cefdce"}),  # the group the norm is all-reduced over
}


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    try:
        return (
            engine.zero_optimization_stage() == 3
            and isinstance(getattr(opt, "grad_partitions_flat_buffer", None), torch.Tensor)
            and not opt.offload_optimizer
            and opt.model_parallel_group is None
            and not any(
                getattr(p, "ds_zero_placement_family", "replicated") != "replicated"
                for group in opt.fp16_groups
                for p in group
            )
        )
    except AttributeError:
        return False


def install(engine) -> None:
    opt = engine.optimizer
    opt.get_grad_norm_direct = _flat_grad_norm(opt, opt.get_grad_norm_direct)


def flat_range(gradients, buffer: torch.Tensor) -> torch.Tensor | None:
    """The one 1-D range of ``buffer`` that the gradient views tile end to end, or None."""
    if not gradients:
        return None
    size = buffer.element_size()
    start = (gradients[0].data_ptr() - buffer.data_ptr()) // size
    expected = gradients[0].data_ptr()
    for g in gradients:
        if g.data_ptr() != expected or g.dtype != buffer.dtype or not g.is_contiguous():
            return None
        if g.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            return None
        expected += g.numel() * size
    numel = (expected - gradients[0].data_ptr()) // size
    if start < 0 or start + numel > buffer.numel():
        return None
    return buffer.narrow(0, start, numel)


def _flat_grad_norm(opt, deepspeed_norm):
    def get_grad_norm_direct(gradients, params, norm_type=2):
        flat = flat_range(gradients, opt.grad_partitions_flat_buffer) if float(norm_type) == 2.0 else None
        if flat is None:
            return deepspeed_norm(gradients, params, norm_type)
        total = sum_of_squares_fp64(flat)
        group = opt._get_param_partition_group(params[0])
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        total = total ** (1.0 / 2.0)
        # DeepSpeed's masking, with its dtypes: a float32 -1 where the float64 norm is inf or NaN
        err = torch.tensor(-1.0, device=opt.device, dtype=torch.float)
        return torch.where(total.isinf().logical_or(total.isnan()), err, total)

    return get_grad_norm_direct
