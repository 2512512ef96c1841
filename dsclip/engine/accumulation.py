"""How the gradient cache may run K backwards per optimizer step on this engine, or that it may not.

Not a patch (it changes nothing in DeepSpeed): the engine's answer to the gradient cache
(dsclip/train/gradcache.py asks here), the capability probe behind its exactness promise. It reads
private DeepSpeed state (the optimizer's ``_coalesce_grad_reduction``), which the engine package owns. Three answers:

- ``coalesced``: ZeRO-1/2/3 with ``engine.coalesce_grad_reduction`` (DeepSpeed >= 0.19.2, PR #7992): one
  reduction per step over the summed gradients (tests/dist/test_gradcache.py, every stage, offload too);
- ``boundary``: ZeRO-0 and the bf16 + ZeRO-1 ``BF16_Optimizer`` wrapper reduce only at the accumulation
  boundary, so boundary flags alone are exact (test_gradcache_other_zero_stages_and_offload);
- ``unsupported``: no coalesced reduction in this DeepSpeed. Boundary flags alone are not exact for ZeRO-2/3
  there: on 0.18.9, ZeRO-2 + CPU offload, world 1, accum 2 gave the reference loss with gradients off by a
  relative 2.2 (DeepSpeed #7981). So ``--accum-freq > 1`` is refused (:func:`require_exact_accumulation`).
  Versions without the API are also outside setup.py's range; the refusal is for a site DeepSpeed.
"""

from __future__ import annotations

from dsclip.config_base import ConfigError
from dsclip.engine.versions import deepspeed_version

COALESCE_API_VERSION = "0.19.2"  # DeepSpeedEngine.coalesce_grad_reduction (PR #7992)


class AccumulationUnsupportedError(ConfigError):
    pass


def accumulation_mode(engine) -> str:
    if not hasattr(engine, "coalesce_grad_reduction"):
        return "unsupported"
    if engine.zero_optimization_stage() == 0 or not hasattr(engine.optimizer, "_coalesce_grad_reduction"):
        return "boundary"
    return "coalesced"


def refusal(accum_freq: int) -> AccumulationUnsupportedError:
    return AccumulationUnsupportedError(
        f"--accum-freq {accum_freq} needs DeepSpeed >= {COALESCE_API_VERSION} (engine.coalesce_grad_reduction); "
        f"DeepSpeed {deepspeed_version()} has no exact way to reduce several backwards per step. "
        f"Upgrade DeepSpeed (pip install 'deepspeed>={COALESCE_API_VERSION}'), or pass --accum-freq 1 with a "
        f"larger --batch-size (dsclip plan --max-batch shows what fits)"
    )


def require_exact_accumulation(engine, accum_freq: int) -> str:
    """The mode for ``accum_freq`` micro-batches per step, or a one-line error where it would not be exact."""
    mode = accumulation_mode(engine)
    if accum_freq > 1 and mode == "unsupported":
        raise refusal(accum_freq)
    return mode
