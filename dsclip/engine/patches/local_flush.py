"""One rank, ZeRO-1/2: the coalesced gradient reduction as one multi-tensor copy into a flat partition.

At the exit of ``engine.coalesce_grad_reduction()`` DeepSpeed runs ``_flush_coalesced_reduction_zero12``:
every parameter's gradient goes through the reduction bucket (per-parameter Python bookkeeping, a copy
into the bucket, a copy into the partition), and ``step()`` then flattens the per-parameter gradients
into a new flat tensor. At one rank there is nothing to reduce, and on a GPU those per-parameter loops are
host time the device waits for: ViT-B-32 bf16 on an H200 went from 0.94x to 1.19x open_clip_train's
samples/s with this patch and ``overflow_check`` (bench/results/, "GPU"; docs/deepspeed-notes.md).

The patch replaces the flush: each ``.grad`` is copied once (``torch._foreach_copy_``) into a flat buffer
kept across steps and laid out like the flat 16-bit weights (parameters end to end, checked in
``applies``). The partition is handed to ``step()`` through the interface DeepSpeed's own step reads for a
pre-flattened partition (``averaged_gradients[i].flat_partition``, read by
``_get_preflattened_grad_partition``), and the list holds each parameter's gradient view, which is what
``deepspeed.utils.safe_get_full_grad`` reads. The gradient norm is taken over the same flat buffer in
float64 blocks (DeepSpeed's own makes an fp64 copy per parameter), and the step's re-pointing of every
parameter at its slice is skipped while they already are. Bit for bit DeepSpeed's numbers
(tests/dist/test_local_flush.py). More than one rank keeps DeepSpeed's flush: NCCL's reduce-scatter is the
right tool there. Anything outside the plain case (offload, a separate gradient-accumulation dtype, MoE,
Muon, round-robin padding, sequence parallelism, a layout that is not the parameters end to end) too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "local_flush"
SUMMARY = "one rank, ZeRO-1/2: the coalesced flush as one copy into a flat partition; its norm in fp64 blocks"
VERIFIED = ("0.19.8",)
_Z = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
_E = "deepspeed.runtime.engine:DeepSpeedEngine."
STAGES = (1, 2)
TARGETS = {
    _E + "coalesce_grad_reduction": frozenset({"79db9ff01808"}),
    _E + "_flush_coalesced_reduction_zero12": frozenset({"03b969f7dd4c"}),
    _Z + "step": frozenset({"279ae7c6a4e8"}),
    _Z + "_get_preflattened_grad_partition": frozenset({"75f8c8cb089b"}),
    _Z + "_update_model_bit16_weights": frozenset({"2c709994f476"}),
    _Z + "get_grad_norm_direct": frozenset({"8e1ffafc3841"}),
}


class _FlatGrads(list):
    """``averaged_gradients[i]``: per-parameter views (norm, safe_get_full_grad) + the flat partition (step)."""

    flat_partition: torch.Tensor


def _group_world(opt, i: int) -> int:
    pg = opt.real_dp_process_group[i]
    return dist.get_world_size(group=pg) if dist.is_initialized() else 1


def _layout(opt, i: int) -> list[tuple[int, int]] | None:
    """(offset, numel) of every parameter of group i in its flat 16-bit buffer, if they lie end to end
    from offset 0 and fit the one partition a single rank holds."""
    params, flat = opt.bit16_groups[i], opt.bit16_groups_flat[i]
    out, expected = [], 0
    for p in params:
        offset = (p.data.data_ptr() - flat.data_ptr()) // flat.element_size()
        if offset != expected or not p.data.is_contiguous():
            return None
        out.append((offset, p.numel()))
        expected += p.numel()
    if expected > int(opt.partition_size[i]) or list(opt.params_in_partition[i]) != list(params):
        return None
    return out


# Elements per fp64 block of the gradient norm: on a GPU each block is a few kernel launches and the host's
# launch rate is what bounds the step (ViT-B-32: ~10 blocks, a 128 MiB fp64 temporary), on CPU a block
# whose fp64 copy stays in cache.
NORM_BLOCK = 1 << 20
NORM_BLOCK_GPU = 1 << 24


def sum_of_squares_fp64(flat: torch.Tensor) -> torch.Tensor:
    """sum(x^2) of a flat tensor, every term squared and summed in float64 (DeepSpeed's norm precision)."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for block in flat.split(NORM_BLOCK if flat.device.type == "cpu" else NORM_BLOCK_GPU):
        total += torch.linalg.vector_norm(block.double()).square()
    return total


def _flat_grad_norm(opt, deepspeed_norm):
    """``get_grad_norm_direct`` over the flat partition: DeepSpeed's float64 L2 norm, in blocks (the same
    terms summed in another order, then rounded to float32 as DeepSpeed does). Other norms, or gradients
    that are not this flush's, go to DeepSpeed's method."""

    def grad_norm(gradients, params, norm_type=2):
        flat = getattr(gradients, "flat_partition", None)
        if flat is None or float(norm_type) != 2.0:
            return deepspeed_norm(gradients, params, norm_type)
        total = sum_of_squares_fp64(flat).float().pow(0.5)  # one rank: no sum over ranks
        # DeepSpeed masks a non-finite norm to -1 (mask_nan_or_inf_with_val_inplace): its step then skips
        return torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0))

    return grad_norm


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    if engine.zero_optimization_stage() not in (1, 2) or not hasattr(opt, "bit16_groups_flat"):
        return False
    try:
        plain = (
            not opt.cpu_offload
            and not opt.use_grad_accum_attribute
            and not getattr(opt, "use_separate_grad_accum", False)
            and not getattr(opt, "has_moe_layers", False)
            and getattr(opt, "gradient_predivide_factor", 1.0) == 1.0
            and getattr(opt, "sequence_parallel_size", 1) == 1
            and not any(any(pads) for pads in opt.round_robin_bit16_padding)
            and not any(getattr(p, "use_muon", False) for g in opt.bit16_groups for p in g)
        )
        groups = range(len(opt.bit16_groups))
        return plain and all(_group_world(opt, i) == 1 and _layout(opt, i) is not None for i in groups)
    except AttributeError:  # another DeepSpeed optimizer class: keep its own flush
        return False


def install(engine) -> None:
    opt = engine.optimizer
    layouts = [_layout(opt, i) for i in range(len(opt.bit16_groups))]
    groups = []
    for i, (params, layout) in enumerate(zip(opt.bit16_groups, layouts)):
        # zeros: the alignment padding after the last parameter is never written and must stay 0
        flat = torch.zeros(int(opt.partition_size[i]), dtype=opt.dtype, device=opt.bit16_groups_flat[i].device)
        views = [flat.narrow(0, off, n).view(p.shape) for p, (off, n) in zip(params, layout)]
        groups.append((flat, views))

    def flush(optimizer) -> None:  # the signature of DeepSpeedEngine._flush_coalesced_reduction_zero12
        for i, params in enumerate(optimizer.bit16_groups):
            flat, views = groups[i]
            dst, src = [], []
            for p, v in zip(params, views):
                if p.grad is None:  # unused in this step's graph: its gradient is zero
                    v.zero_()
                else:
                    dst.append(v)
                    src.append(p.grad)
                p.grad = None  # as DeepSpeed's epilogue leaves it: the gradient lives in the partition now
            # one multi-tensor copy instead of a copy per parameter (302 launches for ViT-B-32 on a GPU)
            torch._foreach_copy_(dst, src)
            grads = _FlatGrads(views)
            grads.flat_partition = flat
            optimizer.averaged_gradients[i] = grads

    engine._flush_coalesced_reduction_zero12 = flush
    opt._update_model_bit16_weights = _skip_if_views_in_place(opt, opt._update_model_bit16_weights, layouts)
    opt.get_grad_norm_direct = _flat_grad_norm(opt, opt.get_grad_norm_direct)


def all_at(tensors, base: int, byte_offsets: list[int]) -> bool:
    """Every tensor's storage starts ``byte_offsets[i]`` bytes after ``base``: each still is its slice of a flat
    buffer (what a step's re-pointing of tensors at their slices would leave)."""
    return len(tensors) == len(byte_offsets) and all(t.data_ptr() == base + o for t, o in zip(tensors, byte_offsets))


def _skip_if_views_in_place(opt, update, layouts):
    """``_update_model_bit16_weights`` that does nothing when every parameter already is its view.

    ZeRO-1/2's step ends by re-pointing every parameter's ``.data`` at its slice of the flat 16-bit
    buffer (two views and a ``.data`` assignment per parameter, every step), although the step wrote into
    that buffer in place. The step skips it while every parameter's storage still starts where its slice
    does; anything else (a checkpoint load, a ``.data`` set by someone else) takes DeepSpeed's method."""
    byte_offsets = [
        [off * opt.bit16_groups_flat[i].element_size() for off, _ in layout] for i, layout in enumerate(layouts)
    ]

    def update_model_bit16_weights(group_index: int) -> None:
        base = opt.bit16_groups_flat[group_index].data_ptr()
        if not all_at(opt.bit16_groups[group_index], base, byte_offsets[group_index]):
            update(group_index)

    return update_model_bit16_weights
