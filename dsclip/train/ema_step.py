"""The training step with the sharded EMA (dsclip.engine.ema) taken in after it: only applied steps count."""

from __future__ import annotations

from functools import partial

from dsclip.config_base import ConfigError
from dsclip.engine.ema import ShardedEMA, swapped_into
from dsclip.engine.ema_config import EmaArgs


class EmaStep:
    """Wraps a GradCacheStep: the same call and attributes, then ``ema.update`` when the step was applied
    (a skipped step, fp16 overflow or non-finite features, leaves the EMA as it was)."""

    def __init__(self, inner, ema: ShardedEMA, start_step: int = 0):
        self.inner, self.ema, self.step = inner, ema, start_step

    def __call__(self, *args, **kwargs):
        result = self.inner(*args, **kwargs)
        self.step += 1  # every optimizer step counts, applied or not, as the loop's step counter does
        self.ema.update(self.step, bool(result.applied))
        return result

    def __getattr__(self, name):  # compute_dtype, ... of the wrapped step
        return getattr(self.inner, name)


def attach_eval(args: EmaArgs, step_fn, evaluator) -> None:
    """--eval-ema: the evaluator's zero-shot / retrieval / demo evaluations see the EMA weights."""
    if args.eval_ema and isinstance(step_fn, EmaStep):
        evaluator.weights = partial(swapped_into, step_fn.ema)


def attach(args: EmaArgs, engine, step_fn, checkpointer):
    """``step_fn`` with the EMA of ``engine``'s master weights (saved and resumed by ``checkpointer``), or
    ``step_fn`` itself without --ema-decay. Call before ``checkpointer.resume``; set ``.step`` after it."""
    if not args.enabled:
        return step_fn
    if not any(p.requires_grad for p in engine.module.parameters()):
        raise ConfigError("--ema-decay with every parameter frozen: nothing to average; drop --ema-decay")
    try:
        ema = ShardedEMA(engine, args.ema_decay, args.ema_start_step)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    checkpointer.rank_state["ema"] = ema
    return EmaStep(step_fn, ema)
