"""One rank, ZeRO-3: the coalesced gradient flush as one multi-tensor copy into the gradient partitions.

At the exit of ``engine.coalesce_grad_reduction()`` DeepSpeed runs ``_flush_coalesced_reduction_zero3``: for
every parameter, ``reduce_ready_partitions_and_remove_grads`` copies its ``.grad`` into the reduction bucket
(per-parameter Python: dtype and group lookups, a stream switch, a narrow, a copy); each full bucket is
concatenated (``reduce_scatter_coalesced`` slices every tensor per rank and ``torch.cat``s them), divided by
the world size, reduce-scattered, and each parameter's slice is then copied into its gradient partition
(``partition_grads``, a copy or an add per parameter). At one rank the reduce-scatter is the identity and the
division is by 1, so all of that is three copies per parameter and ~30 Python calls. That is host time
the GPU waits for on a one-GPU ZeRO-3 run (bigG on one H200): on CPU, thin model at ViT-H-14's depth, 16 ms
of a 84 ms step, the largest gap left to ZeRO-2, which runs ``local_flush`` for the same flush
(bench/results/zero3-local-flush_cpu2_2026-12-05.md).

The patch replaces the flush at one rank: every ``.grad`` goes straight into its slice of DeepSpeed's flat
gradient partition (the tensors ``__param_id_to_grad_partition`` hands out, read again on every flush since
DeepSpeed rebuilds them when states are offloaded and reloaded) with one ``torch._foreach_copy_``, or one
``torch._foreach_add_`` where DeepSpeed would accumulate (``micro_step_id != 0``). It casts as DeepSpeed's path
casts (to the communication dtype, then to the gradient-accumulation dtype), clears each ``.grad`` as
``partition_grads`` does, and then runs DeepSpeed's own ``independent_gradient_partition_epilogue`` (its
buckets are empty, so it only does its bookkeeping: ``averaged_gradients``, the epilogue flag). The values
are bit for bit DeepSpeed's: dividing by 1 and a one-rank reduce-scatter change no bit
(tests/dist/test_zero3_one_rank.py).

More than one rank keeps DeepSpeed's flush (the reduce-scatter is the work there), and so does anything
outside the plain case: optimizer offload (gradients go to the CPU per parameter), ZenFlow, Muon, qgZ's
all-to-all, AutoEP/AutoTP folding corrections, a gradient predivide factor. A flush that meets a gradient
DeepSpeed would reject (its size is not the parameter's) or skip (``ds_grad_is_ready`` false) hands the whole
flush to DeepSpeed before touching anything, so DeepSpeed's own error or rule applies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "zero3_local_flush"
SUMMARY = "one rank, ZeRO-3: the coalesced flush as one copy into the gradient partitions, not a bucket pass"
VERIFIED = ("0.19.8",)
STAGES = (3,)
_E = "deepspeed.runtime.engine:DeepSpeedEngine."
_Z = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
_M = "_DeepSpeedZeroOptimizer_Stage3__"  # DeepSpeed's name-mangled private methods and attributes
TARGETS = {
    _E + "coalesce_grad_reduction": frozenset({"79db9ff01808"}),
    _E + "_flush_coalesced_reduction_zero3": frozenset({"4ac69331427d"}),
    _Z + "reduce_ready_partitions_and_remove_grads": frozenset({"b72d0645c8b3"}),
    _Z + "reduce_independent_p_g_buckets_and_remove_grads": frozenset({"2649861dd2df"}),
    _Z + _M + "add_grad_to_ipg_bucket": frozenset({"eb320ee1df52"}),
    _Z + _M + "reduce_and_partition_ipg_grads": frozenset({"ad6856c4cdf1"}),
    _Z + _M + "avg_scatter_grads": frozenset({"5f37b9f8659e"}),
    _Z + "partition_grads": frozenset({"3ca6b17c5709"}),
    _Z + "independent_gradient_partition_epilogue": frozenset({"e8bc243cb6b9"}),
    "deepspeed.runtime.comm.coalesced_collectives:reduce_scatter_coalesced": frozenset({"d05c7b944514"}),
}
PARTITIONS = _M + "param_id_to_grad_partition"  # ds_id -> this rank's slice of grad_partitions_flat_buffer


def partition_world(opt, param) -> int:
    """How many ranks share ``param``'s partitions (DeepSpeed's partition group for it)."""
    group = opt._get_param_partition_group(param)
    return dist.get_world_size(group=group) if dist.is_initialized() else 1


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    try:
        params = [p for group in opt.fp16_groups for p in group]
        return (
            engine.zero_optimization_stage() == 3
            and hasattr(engine, "_flush_coalesced_reduction_zero3")
            and hasattr(opt, "_coalesce_grad_reduction")
            and isinstance(getattr(opt, PARTITIONS, None), dict)
            and not opt.offload_optimizer
            and not getattr(opt, "zenflow", False)
            and not opt.use_muon
            and opt.reduce_scatter  # the other path divides by the sequence-parallel size
            and getattr(opt, "sequence_parallel_size", 1) == 1
            and opt.all2all_process_group is None
            and opt.autoep_folding_tp_group is None
            and float(opt.gradient_predivide_factor) == 1.0
            and all(getattr(p, "ds_zero_placement_family", "replicated") == "replicated" for p in params)
            and all(partition_world(opt, p) == 1 for p in params)
        )
    except AttributeError:  # another optimizer class, or a DeepSpeed without these attributes
        return False


def install(engine) -> None:
    opt = engine.optimizer
    deepspeed_flush = engine._flush_coalesced_reduction_zero3  # bound: the fallback
    params = [p for group in opt.fp16_groups for p in group]
    # the dtype each gradient travels in through DeepSpeed's bucket (fixed per parameter at init)
    comm_dtypes = [opt.get_param_comm_dtype(p) for p in params]

    @torch.no_grad()
    def flush(optimizer) -> None:  # the signature of DeepSpeedEngine._flush_coalesced_reduction_zero3
        if optimizer.autoep_folding_tp_group is not None:  # configured after init: DeepSpeed corrects grads
            return deepspeed_flush(optimizer)
        partitions = getattr(optimizer, PARTITIONS)
        done, dst, src = [], [], []
        for p, comm_dtype in zip(params, comm_dtypes):
            grad = p.grad
            if grad is None or not p.requires_grad:
                continue
            if grad.numel() != p.ds_numel or not getattr(p, "ds_grad_is_ready", True):
                return deepspeed_flush(optimizer)  # nothing changed yet: DeepSpeed raises or skips as it does
            done.append(p)
            if p.ds_numel == 0:  # no gradient partition to write (DeepSpeed's "contains_real_data" is false)
                continue
            dst.append(partitions[p.ds_id])
            src.append(grad.reshape(-1).to(comm_dtype))  # the bucket's dtype: a no-op where they agree
        if optimizer.micro_step_id == 0:
            torch._foreach_copy_(dst, src)  # casts to the accumulation dtype as DeepSpeed's copy_ does
        elif dst:
            torch._foreach_add_(dst, [s.to(d.dtype) for s, d in zip(src, dst)])
        for p in done:
            p.grad = None
        optimizer.independent_gradient_partition_epilogue()

    engine._flush_coalesced_reduction_zero3 = flush
