"""ZeRO-3: a gathered parameter released by dropping its full copy, without DeepSpeed's debug-string path.

ZeRO-3 releases every gathered weight after its module's forward, again after its backward, and releases
every parameter (the persistent ones too) at each step: at ViT-H-14's depth ~700 releases a step. Each one
goes through ``param.partition()`` -> ``Init._partition`` -> ``Init._partition_param``, which for a
parameter whose shard already exists (every release after the first) does one thing, ``free_param`` (the
full tensor replaced by an empty one) and the status set to NOT_AVAILABLE. On the way it builds six
f-strings for ``print_rank_0`` calls that print nothing (each formats the parameter's id, status, shape
and device and asks torch.distributed for the rank) and two ``see_memory_usage`` calls that return at
once: ~6 % of a two-rank ZeRO-3 step's host time at ViT-H-14's depth (bench/zero3_host.py,
bench/results/zero3-host_cpu2_2026-12-05.md), time a GPU waits for.

This patch gives each parameter of the engine a ``partition`` that does that one thing directly when the
call is that case (the parameter available, its shard present, not "has been updated", which re-copies the
shard) and hands every other call to DeepSpeed's own ``partition``, per parameter for a list. The state
after it is DeepSpeed's: the same ``free_param`` (with its stream bookkeeping on a GPU), the same status.
NVMe, offloaded parameters and ZeRO++'s secondary partitions (hpZ) keep DeepSpeed's path for every call.
tests/dist/test_zero3_patches.py checks the run bit for bit against DeepSpeed's paths;
tests/dist/test_zero3_release.py checks each kind of call against DeepSpeed's on a twin linear.
"""

from __future__ import annotations

NAME = "zero3_release"
SUMMARY = "ZeRO-3: a release drops the gathered copy directly, without DeepSpeed's unprinted debug strings"
VERIFIED = ("0.19.2", "0.19.8")
STAGES = (3,)
_I = "deepspeed.runtime.zero.partition_parameters:"
TARGETS = {
    # defines the per-parameter ``partition`` closure this replaces
    _I + "Init._convert_to_deepspeed_param": frozenset({"109d5ce0cfbc", "c3add13fd7bf"}),
    _I + "Init._partition": frozenset({"0608009311cf", "37e8079a1f4e"}),
    _I + "Init._partition_param": frozenset({"27e1b17a9064", "860d63c6accb"}),
    _I + "free_param": frozenset({"96cebaaa6607"}),
}


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    try:
        return (
            engine.zero_optimization_stage() == 3
            and not opt.offload_param  # CPU / NVMe parameter offload: shards live elsewhere
            and engine.zero_hpz_partition_size() <= 1  # ZeRO++ hpZ: a secondary partition to update too
            and all(hasattr(p, "partition") and hasattr(p, "ds_tensor") for p in engine.module.parameters())
        )
    except AttributeError:
        return False


def install(engine) -> None:
    for param in engine.module.parameters():  # each shared parameter once
        param.partition = _direct_release(param, param.partition)


def _direct_release(param, deepspeed_partition):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

    available = ZeroParamStatus.AVAILABLE

    def releasable(p) -> bool:
        # the branch of Init._partition_param that returns after free_param: shard present, nothing to copy
        return (
            p.ds_status is available
            and p.ds_tensor is not None
            and getattr(p.ds_tensor, "final_location", None) is None
            and getattr(p, "ds_secondary_tensor", None) is None
        )

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        # free_data=False (DeepSpeed's fast_sharding_for_leaf_module) is honoured by 0.19.8 and ignored by
        # 0.19.2: DeepSpeed's own path keeps each release's behaviour
        if has_been_updated or not free_data:
            return deepspeed_partition(param_list, hierarchy, has_been_updated, free_data)
        for p in (param,) if param_list is None else param_list:
            if releasable(p):
                free_param(p)  # and NOT_AVAILABLE, the status Init._partition would set
            else:
                deepspeed_partition([p], hierarchy, has_been_updated, free_data)

    partition.dsclip_direct_release = True
    return partition
