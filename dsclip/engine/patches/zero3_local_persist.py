"""One rank, ZeRO-3: the persistent tensors stay in place across the step instead of released and re-gathered.

ZeRO-3's ``step()`` starts by releasing every parameter (``_partition_all_parameters``), the persistent ones
too (``stage3_param_persistence_threshold``: biases, norms; ~450 tensors in ViT-H-14), and ends by gathering
the persistent ones again (``_post_step``), because at more than one rank the update changes each rank's
shard and the whole tensor must be rebuilt. At one rank there is nothing to rebuild: DeepSpeed's one-rank
"gather" (``NoGatherCoalescedHandle``) makes the parameter a view of its own partition
(``param.data = ds_tensor.view(ds_shape)``), and the optimizer writes the update into that partition (the
flat 16-bit buffer ``ds_tensor`` is a slice of). So the release and the gather are a round trip of
per-tensor Python: on CPU, thin model at ViT-H-14's depth, ~40 % of ZeRO-3's step time at one rank
(bench/results/zero3-local-flush_cpu2_2026-12-05.md), host time a one-GPU ZeRO-3 run (bigG on one H200)
waits for.

The patch leaves out of the step's release each persistent parameter that is such a view (available, its
data at its partition's address, same size and dtype): DeepSpeed's ``release_and_reset_all`` skips a
parameter that is not available, so for the length of that call those parameters are marked not available,
and then marked available again. After the update, a kept parameter whose partition DeepSpeed moved (the
step re-points each partition at its slice of the flat buffer; normally the same address) is made a view of
it again, as the one-rank gather would; then DeepSpeed's ``_post_step`` runs and finds nothing to gather.
Every number is DeepSpeed's, bit for bit (tests/dist/test_zero3_one_rank.py runs both patches against
DeepSpeed's paths).

More than one rank keeps DeepSpeed's release and gather (the gather is the work there), and so do offload
(the partition is on the CPU or NVMe, not the parameter's storage), ZeRO++'s quantized or secondary
partitions, and any persistent tensor that is not a view of its partition when the step starts.
"""

from __future__ import annotations

import torch.distributed as dist

from dsclip.engine.patches.zero3_local_flush import partition_world

NAME = "zero3_local_persist"
SUMMARY = "one rank, ZeRO-3: persistent tensors kept in place across the step, not released and re-gathered"
VERIFIED = ("0.19.8",)
STAGES = (3,)
_Z = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
_C = "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator."
_I = "deepspeed.runtime.zero.partition_parameters:"
_O = "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload."
TARGETS = {
    _Z + "step": frozenset({"1dfecf4f2fb7"}),  # releases everything, updates the partitions, then _post_step
    _Z + "_partition_all_parameters": frozenset({"a146f85c0b0c"}),
    _Z + "_post_step": frozenset({"feaee230b6a1"}),
    _Z + "_unflatten_partitioned_parameters": frozenset({"7a42ba4d6bdb"}),  # re-points each partition
    _O + "partition_all_parameters": frozenset({"b5a95f70abee"}),
    _C + "release_and_reset_all": frozenset({"40a4b2424248"}),
    _C + "_PartitionedParameterCoordinator__release_param": frozenset({"c20a973e72bd"}),  # skips unavailable
    _I + "NoGatherCoalescedHandle.__init__": frozenset({"bb90a75a8ca2"}),  # the one-rank gather: a view
    _I + "Init._all_gather": frozenset({"f262c3705f32"}),  # skips tensors already available
}


def _world(opt) -> int:
    return dist.get_world_size(group=opt.dp_process_group) if dist.is_initialized() else 1


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    try:
        persistent = list(opt.persistent_parameters)
        return (
            engine.zero_optimization_stage() == 3
            and bool(persistent)
            and hasattr(opt, "_partition_all_parameters")
            and hasattr(opt, "_post_step")
            and not opt.offload_optimizer
            and not opt.offload_param
            and engine.zero_hpz_partition_size() <= 1  # ZeRO++ hpZ: secondary partitions
            and not engine.zero_quantized_weights()  # ZeRO++ qwZ
            and _world(opt) == 1
            and all(partition_world(opt, p) == 1 for p in persistent)
        )
    except AttributeError:
        return False


def can_be_view_of_partition(param) -> bool:
    """What does not change between steps: the partition is the whole tensor, a plain device tensor."""
    part = param.ds_tensor
    return (
        part.numel() == param.ds_numel
        and part.dtype == param.dtype
        and part.device == param.device
        and not hasattr(part, "ds_quant_scale")
        and getattr(param, "ds_secondary_tensor", None) is None
    )


def is_view_of_partition(param) -> bool:
    """The parameter's data is its whole partition, in place: what DeepSpeed's one-rank gather leaves."""
    return can_be_view_of_partition(param) and _in_place(param)


def _in_place(param) -> bool:
    # the per-step part (every persistent tensor, every step): the parameter's own methods, no .data wrapper
    return param.data_ptr() == param.ds_tensor.data_ptr() and param.numel() == param.ds_numel


def install(engine) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    opt = engine.optimizer
    candidates = [p for p in opt.persistent_parameters if can_be_view_of_partition(p)]
    deepspeed_partition_all = opt._partition_all_parameters
    deepspeed_post_step = opt._post_step
    kept: list = []  # the persistent parameters this step leaves in place
    available, not_available = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE

    def partition_all_parameters() -> None:
        kept[:] = [p for p in candidates if p.ds_status == available and _in_place(p)]
        for p in kept:  # DeepSpeed's release (and its final check) skip what is not available
            p.ds_status = not_available
        try:
            deepspeed_partition_all()
        finally:
            for p in kept:
                p.ds_status = available

    def post_step(timer_names) -> None:
        for p in kept:
            if p.data_ptr() != p.ds_tensor.data_ptr():  # the step moved its partition: follow it
                p.data = p.ds_tensor.data.view(p.ds_shape)
        kept.clear()
        deepspeed_post_step(timer_names)  # its gather finds every kept tensor available

    opt._partition_all_parameters = partition_all_parameters
    opt._post_step = post_step
