"""How the gradient cache reduces K backwards per optimizer step on this engine, or that it may not.

Not a patch (it changes nothing in DeepSpeed): the engine's answer to the gradient cache
(dsclip/train/gradcache.py asks here), the capability probe behind its exactness promise. It reads
private DeepSpeed state (the optimizer's ``_coalesce_grad_reduction``), which the engine package owns.

Two ways to reduce the K chunk gradients of one step (``--grad-reduction``):

- ``sharded``: DeepSpeed's own gradient-accumulation path. Every chunk's backward is marked "not the
  boundary" but not coalesced, so ZeRO-2/3 reduce each chunk's gradients as they are produced (buckets on
  the reduction stream, overlapping the backward) into this rank's partition, where they are summed in
  ``data_types.grad_accum_dtype`` (fp32: ds_config.py sets it for 16-bit runs). No rank holds more than
  the buckets of the whole gradient; ZeRO-3 holds its partition, 4 B x P / N. K reductions per step.
- ``coalesced``: ``engine.coalesce_grad_reduction`` (DeepSpeed >= 0.19.2, PR #7992): the K backwards sum
  into the whole ``param.grad`` of every rank (its dtype: the model's), reduced once at the boundary.
  One reduction per step, the whole gradient held per rank. In 16-bit that sum rounds to bf16/fp16 at
  every chunk; :data:`MAX_16BIT_SUM_CHUNKS` is the K up to which this is allowed.

Besides these two, what :func:`accumulation_mode` answers for the engine: ``boundary`` (ZeRO-0 and the
bf16 + ZeRO-1 ``BF16_Optimizer`` wrapper reduce only at the accumulation boundary, so boundary flags alone
are exact) and ``unsupported`` (no coalesced reduction in this DeepSpeed: on 0.18.9, ZeRO-2 + CPU offload,
world 1, accum 2 gave gradients off by a relative 2.2, DeepSpeed #7981, so ``--accum-freq > 1`` is
refused).
"""

from __future__ import annotations

from dsclip.config_base import ConfigError
from dsclip.engine.versions import deepspeed_version

COALESCE_API_VERSION = "0.19.2"  # DeepSpeedEngine.coalesce_grad_reduction (PR #7992)

GRAD_REDUCTIONS = ("auto", "sharded", "coalesced")

# The largest K for which coalesced 16-bit summing is allowed. Derivation (u = 2^-8, bf16's unit roundoff;
# |G| the big-batch gradient): summing K chunk gradients into a 16-bit buffer rounds K - 1 partial sums, each
# with a uniform relative error of variance u^2/3 of a partial sum whose size grows like |G| i / K (chunks of
# one batch share the gradient's direction), so the sum's error is ~ u |G| sqrt(K/9) (sum_i (i/K)^2 ~ K/3).
# The error bf16 compute already makes (the gradient's own rounding) is >= u |G| / sqrt(3). Both add in
# quadrature; keeping the total within 1.2x of compute's alone (the bar, tests/dist/
# test_grad_reduction.py) needs K/9 <= 0.44/3, K <= 1.32: no K > 1 may sum in 16-bit. Measured (tiny model,
# world 1, Linear layers, against float64): 1.5x at K = 16, 3.2x at K = 1024 (issue #57).
MAX_16BIT_SUM_CHUNKS = 1


class AccumulationUnsupportedError(ConfigError):
    pass


def choose_grad_reduction(requested: str, *, stage: int, world: int, accum_freq: int, precision: str) -> str:
    """The reduction a run of this shape gets for ``--grad-reduction requested``; a refusal where it cannot be exact.

    ``auto``: ZeRO-0/1 coalesced (they hold the whole gradient anyway and reduce at the boundary); 16-bit with
    K > 1 sharded (the fp32 sum); world 1 coalesced (nothing to shard); ZeRO-3 sharded (its point is the 1/N
    gradient); ZeRO-2 with K = 1 sharded (DeepSpeed's overlapped path, the same single reduction); ZeRO-2 fp32 with
    K > 1 coalesced (one reduction instead of K; ``dsclip plan`` says where the whole fp32 gradient does not fit)."""
    if requested not in GRAD_REDUCTIONS:
        raise ConfigError(f"--grad-reduction {requested!r}: choose one of {', '.join(GRAD_REDUCTIONS)}")
    half = precision in ("bf16", "fp16")
    if requested == "sharded" and stage < 2:
        raise ConfigError(
            f"--grad-reduction sharded needs ZeRO-2 or ZeRO-3 (the gradient partitioned in backward); this run is "
            f"ZeRO-{stage}, which reduces once at the boundary: use --grad-reduction auto or coalesced"
        )
    if requested == "coalesced" and half and accum_freq > MAX_16BIT_SUM_CHUNKS and stage >= 2:
        raise ConfigError(
            f"--grad-reduction coalesced with --precision {precision} and --accum-freq {accum_freq} would sum "
            f"{accum_freq} chunk gradients in {precision} (error growing like sqrt(K): 1.5x bf16's own at K = 16); "
            f"use --grad-reduction sharded (summed in fp32, dsclip/engine/accumulation.py) or --precision fp32"
        )
    if requested != "auto":
        return requested
    if stage < 2:
        return "coalesced"
    if half and accum_freq > 1:
        return "sharded"
    if world == 1:
        return "coalesced"
    if stage == 3 or accum_freq == 1:
        return "sharded"
    return "coalesced"


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


def require_exact_accumulation(engine, accum_freq: int, grad_reduction: str = "coalesced") -> str:
    """The mode for ``accum_freq`` micro-batches per step, or a one-line error where it would not be exact."""
    mode = accumulation_mode(engine, grad_reduction)
    if accum_freq > 1 and mode == "unsupported":
        raise refusal(accum_freq)
    if accum_freq > 1 and mode == "sharded" and not _accumulates_in_fp32(engine):
        raise AccumulationUnsupportedError(
            f"--grad-reduction sharded with --accum-freq {accum_freq}: this engine sums gradients in "
            f"{engine.get_data_types()[1]}, not fp32; set data_types.grad_accum_dtype to fp32 in the DeepSpeed "
            f"JSON (or leave it unset: dsclip fills it)"
        )
    return mode
