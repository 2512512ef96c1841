"""ZeRO-3: the persistent parameters gathered after each step in one collective, not one per tensor.

ZeRO-3 keeps small tensors (``stage3_param_persistence_threshold``: biases, norms) whole on every rank, but
its step still partitions them, updates the shards and gathers them again in ``_post_step``. That gather
(``persistent_parameters[0].all_gather(...)``, the synchronous path of ``Init._all_gather``) starts one
``all_gather_into_tensor`` per tensor: ViT-H-14 has ~450 such tensors, so ~450 collectives a step, each with
its launch and its allocation (measured on CPU: 90 ms of a 318 ms step at two ranks, bench/zero3_host.py).
The forward's fetches already use DeepSpeed's coalesced gather (``all_gather_coalesced``: the shards
concatenated, one collective, then split), and so does this patch for the persistent set, before
DeepSpeed's own ``_post_step`` runs, which then finds every persistent tensor available and gathers none.
The bytes are the same shards in the same places: weights are bit for bit DeepSpeed's
(tests/dist/test_zero3_patches.py).

Offload, NVMe and ZeRO++'s secondary partitions keep DeepSpeed's gather (their shards are not plain device
tensors); so does any persistent tensor that is not in the partitioned state the coalesced gather expects.
"""

from __future__ import annotations

NAME = "zero3_gather"
SUMMARY = "ZeRO-3: the persistent (small) tensors gathered after each step in one collective, not one each"
VERIFIED = ("0.19.8",)
STAGES = (3,)
_Z = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
_I = "deepspeed.runtime.zero.partition_parameters:"
TARGETS = {
    _Z + "_post_step": frozenset({"feaee230b6a1"}),
    _Z + "step": frozenset({"1dfecf4f2fb7"}),  # partitions every parameter before the update, _post_step after
    _I + "Init._all_gather": frozenset({"f262c3705f32"}),  # skips tensors already available
    # the per-parameter all_gather_coalesced it calls is defined inside this one; its handle's wait
    _I + "Init._convert_to_deepspeed_param": frozenset({"109d5ce0cfbc"}),
    _I + "AllGatherCoalescedHandle.wait": frozenset({"bc6d1f20613a"}),
}


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    try:
        persistent = list(opt.persistent_parameters)
        return (
            engine.zero_optimization_stage() == 3
            and hasattr(opt, "_post_step")
            and not opt.offload_optimizer
            and not opt.offload_param
            and engine.zero_hpz_partition_size() <= 1  # ZeRO++ hpZ: secondary partitions
            and not engine.zero_quantized_weights()  # ZeRO++ qwZ
            and all(hasattr(p, "all_gather_coalesced") for p in persistent)
        )
    except AttributeError:
        return False


def install(engine) -> None:
    opt = engine.optimizer
    opt._post_step = _coalesced_post_step(opt, opt._post_step)


def _coalesced_post_step(opt, deepspeed_post_step):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def _post_step(timer_names):
        partitioned = [p for p in opt.persistent_parameters if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if partitioned:
            partitioned[0].all_gather_coalesced(partitioned).wait()
        deepspeed_post_step(timer_names)  # the rest of DeepSpeed's; its gather finds nothing left to do

    return _post_step
