"""How the gradient cache reduces K backwards per optimizer step on this engine, or that it may not.

Not a patch (it changes nothing in DeepSpeed): the engine's answer to the gradient cache
(dsclip/train/gradcache.py asks here), the capability probe behind its exactness promise. It reads
private DeepSpeed state (the optimizer's ``_coalesce_grad_reduction``), which the engine package owns.

Two ways to reduce the K chunk gradients of one step (``--grad-reduction``; which one a run gets is
dsclip/engine/grad_reduction.py's rule, which the planner shares):

- ``sharded``: DeepSpeed's own gradient-accumulation path. Every chunk's backward is marked "not the
  boundary" but not coalesced, so ZeRO-2/3 reduce each chunk's gradients as they are produced (buckets on
  the reduction stream, overlapping the backward) into this rank's partition, where they are summed in
  ``data_types.grad_accum_dtype`` (fp32: ds_config.py sets it for 16-bit runs). No rank holds more than
  the buckets of the whole gradient; ZeRO-3 holds its partition, 4 B x P / N. K reductions per step.
- ``coalesced``: ``engine.coalesce_grad_reduction`` (DeepSpeed >= 0.19.2, PR #7992): the K backwards sum
  into the whole ``param.grad`` of every rank (its dtype: the model's), reduced once at the boundary.
  One reduction per step, the whole gradient held per rank. In 16-bit that sum rounds to bf16/fp16 at
  every chunk; ``MAX_16BIT_SUM_CHUNKS`` is the K up to which this is allowed.

Besides these two, what :func:`accumulation_mode` answers for the engine: ``boundary`` (ZeRO-0 and the
bf16 + ZeRO-1 ``BF16_Optimizer`` wrapper reduce only at the accumulation boundary, so boundary flags alone
are exact) and ``unsupported`` (no coalesced reduction in this DeepSpeed: on 0.18.9, ZeRO-2 + CPU offload,
world 1, accum 2 gave gradients off by a relative 2.2, DeepSpeed #7981, so ``--accum-freq > 1`` is
refused).
"""

from __future__ import annotations

from dsclip.config_base import ConfigError
from dsclip.engine.grad_reduction import GRAD_REDUCTIONS, MAX_16BIT_SUM_CHUNKS, choose_grad_reduction
from dsclip.engine.versions import deepspeed_version

__all__ = ["GRAD_REDUCTIONS", "MAX_16BIT_SUM_CHUNKS", "choose_grad_reduction", "require_exact_accumulation"]

COALESCE_API_VERSION = "0.19.2"  # DeepSpeedEngine.coalesce_grad_reduction (PR #7992)


class AccumulationUnsupportedError(ConfigError):
    pass


def accumulation_mode(engine, grad_reduction: str = "coalesced") -> str:
    """What the engine does with K backwards: sharded, coalesced, boundary or unsupported (module docstring)."""
    if not hasattr(engine, "coalesce_grad_reduction"):
        return "unsupported"
    if engine.zero_optimization_stage() == 0 or not hasattr(engine.optimizer, "_coalesce_grad_reduction"):
        return "boundary"
    return grad_reduction


def refusal(accum_freq: int) -> AccumulationUnsupportedError:
    return AccumulationUnsupportedError(
        f"--accum-freq {accum_freq} needs DeepSpeed >= {COALESCE_API_VERSION} (engine.coalesce_grad_reduction); "
        f"DeepSpeed {deepspeed_version()} has no exact way to reduce several backwards per step. "
        f"Upgrade DeepSpeed (pip install 'deepspeed>={COALESCE_API_VERSION}'), or pass --accum-freq 1 with a "
        f"larger --batch-size (dsclip plan --max-batch shows what fits)"
    )


def _accumulates_in_fp32(engine) -> bool:
    """Whether DeepSpeed sums this engine's partitioned gradients in fp32 (its gradient_accumulation_dtype)."""
    import torch

    dtype = getattr(engine, "get_data_types", lambda: (None, None))()[1]
    return dtype in (None, torch.float32) or not (engine.bfloat16_enabled() or engine.fp16_enabled())


def engine_grad_reduction(engine, accum_freq: int, requested: str = "auto") -> str:
    """``--grad-reduction requested`` resolved for this engine by the rule ``dsclip train`` applies (the same refusals:
    a library caller of the gradient cache gets what the CLI would give it, never a silent 16-bit sum)."""
    import torch.distributed as dist

    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    world = dist.get_world_size() if dist.is_initialized() else 1
    return choose_grad_reduction(
        requested, stage=engine.zero_optimization_stage(), world=world, accum_freq=accum_freq, precision=precision
    )


def require_exact_accumulation(engine, accum_freq: int, grad_reduction: str = "auto") -> str:
    """The mode for ``accum_freq`` micro-batches per step, or a one-line error where it would not be exact."""
    mode = accumulation_mode(engine, engine_grad_reduction(engine, accum_freq, grad_reduction))
    if accum_freq > 1 and mode == "unsupported":
        raise refusal(accum_freq)
    if accum_freq > 1 and mode == "sharded" and not _accumulates_in_fp32(engine):
        raise AccumulationUnsupportedError(
            f"--grad-reduction sharded with --accum-freq {accum_freq}: this engine sums gradients in "
            f"{engine.get_data_types()[1]}, not fp32; set data_types.grad_accum_dtype to fp32 in the DeepSpeed "
            f"JSON (or leave it unset: dsclip fills it)"
        )
    return mode


def held_gradient_storages(engine) -> dict[int, int]:
    """The gradient storages this rank holds right now (address -> bytes), each storage once: every ``param.grad`` (and
    ``grad_accum``), ZeRO-1/2's gradient partitions (``grads_in_partition``, ``averaged_gradients``) and ZeRO-3's
    flat partition buffer; the reduction buckets are left out (``dsclip plan`` counts them apart, and a
    ``.grad`` that is a view into a bucket is the bucket's). What the rehearsal holds beside the plan's gradient
    line (dsclip/rehearsal/room.py); DeepSpeed's attribute names, read here because the engine package owns them.
    """
    opt = engine.optimizer
    buckets = set()
    for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
        for buf in _tensors(getattr(bucket, "buffer", None)):
            buckets.add(buf.untyped_storage().data_ptr())
    found: dict[int, int] = {}

    def add(t) -> None:
        for x in _tensors(t):
            s = x.untyped_storage()
            if s.data_ptr() not in buckets and s.nbytes():
                found[s.data_ptr()] = s.nbytes()

    for p in engine.module.parameters():
        add(p.grad)
        add(getattr(p, "grad_accum", None))
    add(getattr(opt, "grads_in_partition", None))
    for v in (getattr(opt, "averaged_gradients", None) or {}).values():
        add(getattr(v, "flat_partition", v))
    add(getattr(opt, "grad_partitions_flat_buffer", None))
    return found


def _tensors(t) -> list:
    import torch

    if isinstance(t, torch.Tensor):
        return [t]
    if isinstance(t, list | tuple):
        return [x for item in t for x in _tensors(item)]
    return []
