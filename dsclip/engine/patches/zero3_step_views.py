"""ZeRO-3: the step's per-tensor flatten and re-pointing, done on the flat buffers the tensors already are.

Two loops over every parameter in ZeRO-3's ``step()`` handle tensors that DeepSpeed keeps as slices of one
flat buffer anyway:

- ``_prepare_fp32_grad_for_sub_group`` flattens the group's gradient partitions (``averaged_gradients[i]``,
  one tensor per parameter) into a new tensor for the fp32 optimizer: a ``torch.cat`` of ~1,100 tensors for
  ViT-H-14, and a ``record_stream`` per tensor on a GPU. Those partitions are consecutive slices of
  ``grad_partitions_flat_buffer`` (what ``zero3_norm`` reads too), so the patch copies that one range
  instead: the same elements in the same order, one copy, as the cat made (a copy, so the step's in-place
  clipping never touches the gradient buffer, as before);
- ``_unflatten_partitioned_parameters`` ends the update by re-pointing every parameter's partition
  (``ds_tensor.data``) at its slice of the flat 16-bit buffer (a view and a ``.data`` set per tensor), although
  the update wrote into that buffer in place and the partitions already are those slices. The patch skips it
  while every partition of the group starts where its slice does (the check ZeRO-1/2's ``local_flush`` makes
  for the same re-pointing); anything else (a checkpoint load, states offloaded and reloaded) takes
  DeepSpeed's method.

Both are host time per step at any world size (bench/results/zero3-local-flush_cpu2_2026-12-05.md). Bit for
bit DeepSpeed's numbers (tests/dist/test_zero3_patches.py). Offload and
NVMe keep DeepSpeed's methods (their gradients and partitions are not these device buffers).
"""

from __future__ import annotations

import torch

from dsclip.engine.patches.local_flush import all_at
from dsclip.engine.patches.zero3_norm import flat_range

NAME = "zero3_step_views"
SUMMARY = "ZeRO-3: the step's gradient flatten as one copy of the flat range; no re-pointing of partitions in place"
VERIFIED = ("0.19.8",)
STAGES = (3,)
_Z = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
TARGETS = {
    _Z + "_prepare_fp32_grad_for_sub_group": frozenset({"1697b83f6423"}),
    _Z + "_unflatten_partitioned_parameters": frozenset({"7a42ba4d6bdb"}),
    _Z + "_reassign_or_swap_out_partitioned_parameters": frozenset({"0caffa936674"}),  # update, then unflatten
    _Z + "independent_gradient_partition_epilogue": frozenset({"e8bc243cb6b9"}),  # averaged_gradients: slices
}


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    try:
        return (
            engine.zero_optimization_stage() == 3
            and isinstance(getattr(opt, "grad_partitions_flat_buffer", None), torch.Tensor)
            and not opt.offload_optimizer
            and not opt.offload_param
            and all(flat is not None for flat in opt.fp16_partitioned_groups_flat)
        )
    except AttributeError:
        return False


def install(engine) -> None:
    opt = engine.optimizer
    opt._prepare_fp32_grad_for_sub_group = _flat_prepare(opt, opt._prepare_fp32_grad_for_sub_group)
    opt._unflatten_partitioned_parameters = _skip_if_in_place(opt, opt._unflatten_partitioned_parameters)


def _flat_prepare(opt, deepspeed_prepare):
    def prepare_fp32_grad_for_sub_group(sub_group_id: int) -> None:
        fp32_flat = opt.fp32_partitioned_groups_flat[sub_group_id]
        grads = opt.averaged_gradients[sub_group_id]
        flat = flat_range(grads, opt.grad_partitions_flat_buffer) if grads else None
        if flat is None or flat.numel() != fp32_flat.numel():
            return deepspeed_prepare(sub_group_id)  # its layout, or its error message
        # one copy, as DeepSpeed's flatten makes one: the step scales this tensor in place
        fp32_flat.grad = flat.to(fp32_flat.dtype, copy=True)
        opt.averaged_gradients[sub_group_id] = None

    return prepare_fp32_grad_for_sub_group


def _skip_if_in_place(opt, deepspeed_unflatten):
    """DeepSpeed's method only where some partition is not (or no longer) at its slice of the flat buffer."""
    offsets = []  # per group: each partition's byte offset in its flat 16-bit buffer (None: always DeepSpeed's)
    for flat, parts in zip(opt.fp16_partitioned_groups_flat, opt.fp16_partitioned_groups):
        starts, at = [], 0
        for part in parts:
            starts.append(at * flat.element_size())
            at += part.numel()
        # a partition of another dtype than the buffer (DeepSpeed's torch autocast) is re-typed by the method
        offsets.append(starts if all(part.dtype == flat.dtype for part in parts) else None)

    def unflatten_partitioned_parameters(sub_group_id: int) -> None:
        starts = offsets[sub_group_id]
        base = opt.fp16_partitioned_groups_flat[sub_group_id].data_ptr()
        if starts is None or not all_at(opt.fp16_partitioned_groups[sub_group_id], base, starts):
            deepspeed_unflatten(sub_group_id)

    return unflatten_partitioned_parameters
