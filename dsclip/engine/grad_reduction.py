"""Which gradient reduction a job of a given shape gets (``--grad-reduction``): a pure rule, shared by the run
(dsclip/engine/accumulation.py, which also says what each reduction does in DeepSpeed) and the planner
(dsclip/plan/), which imports no engine.
"""

from __future__ import annotations

from dsclip.config_base import ConfigError

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
