"""Divergence stops: a run whose steps keep being skipped or producing a non-finite loss ends, before it
saves (or rotates away) anything good.

With ``--lr 1e6`` the first step's loss is finite, its update blows the weights up and every later step
is NaN and skipped ("OVERFLOW! Skipping step"); the run used to go on to the end, exit 0, save the
blown-up weights at every cadence and prune the good checkpoints. Now:

- a step that was skipped or whose loss is not finite makes the state not good to save until an applied
  step with a finite loss follows (the loop skips a due save, with one line);
- each good step confirms the weights it started from (``Checkpointer.certify``), which is what
  ``--keep-last`` keeps and what ``latest`` falls back to;
- ``--max-skipped-steps`` such steps in a row stop the run: the checkpointer marks the tags it had not
  confirmed ``DIVERGED``, points ``latest`` at the last confirmed one, and the run ends with one line
  naming it (:class:`DivergedError`, exit code 2).

A divergence can also stay finite (issue 52): with ``--lr 1e6`` under a long warm-up the update drives
``logit_scale`` to about -47,000, the scale exp(-47,000) is 0, every logit is 0 and the loss sits at
ln(batch), finite and chance-level, while the weights reach 1e8. So a step counts as *unhealthy* (like
a skipped one: not good to save, confirms nothing, counts toward ``--max-skipped-steps``, and a run
whose last step is unhealthy ends with exit code 2) when any of :class:`HealthRule`'s bounds breaks:

- the loss is above ``median + k * max(1.4826 * MAD, 0.05 * median)`` of the last ``window`` healthy
  losses (once 10 are in it; ``--divergence-window 50 --divergence-k 6``). The MAD is robust to the
  noise and to the decline of a healthy curve; its floor keeps a flat plateau's tiny MAD from turning
  ordinary noise into an alarm;
- the logit scale (``exp`` of the clamped parameter, what the loss used) is below ``min_scale``
  (``--divergence-min-scale 1``: CLIP starts at 14.3, SigLIP at 10, a trained model near 100; below 1
  the cosine logits in [-1, 1] can no longer separate pairs);
- the logit scale moved more than ``max_scale_step`` in log space since the previous step
  (``--divergence-scale-step 0.05``: AdamW moves the log-scale by about the learning rate per step, and
  CLIP learning rates are <= 5e-3, so a healthy step moves it 10x less; ``--lr 1e3`` moves it 0.1-0.3).

The gradient norm is not a bound: it is computed only on logged steps unless clipping needs it
(dsclip.engine.patches.grad_norm), and a collapsed model's gradients are small, not large.
The rule never fires on the recorded healthy curves of tests/unit/data/healthy_curves.json (the demo
recipe's 384 steps, warm-up included, and a resume at a 5x higher --lr; tests/unit/test_divergence.py).

The loss and ``applied`` of a step are the same on every rank (the loss is reduced over ranks, the
overflow decision is global), so every rank counts the same streak and stops at the same step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dsclip.config_base import ConfigError


class DivergedError(ConfigError):
    """The run stopped on a streak of skipped or non-finite steps (one line naming the good checkpoint)."""


def is_good(result) -> bool:
    """The step was applied and its loss is finite."""
    return bool(result.applied) and math.isfinite(result.loss)


MIN_HISTORY = 10  # healthy losses in the window before the loss bound applies (warm-up's first steps)
MAD_FLOOR = 0.05  # of the median: a plateau's tiny MAD does not make ordinary noise an alarm
MAD_SIGMA = 1.4826  # MAD -> standard deviation of a normal distribution


@dataclass
class HealthRule:
    """The bounds of a healthy finite step (module docstring); ``window`` 0 switches the loss bound off."""

    window: int = 50
    k: float = 6.0
    min_scale: float = 1.0
    max_scale_step: float = 0.05
    losses: deque = field(default_factory=deque)
    last_scale: float | None = None

    def problem(self, loss: float, scale: float, *, applied: bool = True) -> str | None:
        """Why a step with a finite loss is unhealthy (None: healthy); a healthy applied one joins the window.
        A skipped step is judged too (its weights are the previous step's): ``--lr 1e6`` drives the scale to 0
        and then every step is skipped for its non-finite gradients, which alone would read as fp16 overflows."""
        why = None
        if not math.isfinite(scale) or scale < self.min_scale:
            why = f"logit scale {scale:.4g} below --divergence-min-scale {self.min_scale:g}"
        elif self.last_scale is not None and self.last_scale > 0:
            moved = abs(math.log(scale / self.last_scale)) if scale > 0 else math.inf
            if moved > self.max_scale_step:
                why = (
                    f"logit scale {self.last_scale:.4g} -> {scale:.4g} in one step (log change {moved:.3g} > "
                    f"--divergence-scale-step {self.max_scale_step:g})"
                )
        if why is None and self.window and len(self.losses) >= MIN_HISTORY:
            bound = self.loss_bound()
            if loss > bound:
                why = f"loss {loss:.4g} above {bound:.4g} (median + {self.k:g} MAD of the last {len(self.losses)})"
        self.last_scale = scale if math.isfinite(scale) else self.last_scale
        if why is None and self.window and applied:
            self.losses.append(loss)
            while len(self.losses) > self.window:
                self.losses.popleft()
        return why

    def loss_bound(self) -> float:
        med = statistics.median(self.losses)
        mad = statistics.median(abs(x - med) for x in self.losses)
        return med + self.k * max(MAD_SIGMA * mad, MAD_FLOOR * abs(med))


@dataclass
class DivergenceGuard:
    """Counts consecutive bad steps (skipped, non-finite, or unhealthy by ``rule``); ``max_skipped`` 0 never
    stops."""

    max_skipped: int
    rule: HealthRule | None = None
    streak: int = 0
    first_bad: int | None = None
    last_loss: float = float("nan")
    last_reason: str | None = None
    unhealthy: bool = False  # the streak holds a non-finite or rule-breaking loss (not only fp16 overflows)

    def observe(self, step: int, result) -> bool:
        """Record optimizer step ``step`` (1-based); True when the state after it is good to save."""
        problem = None
        if self.rule is not None and math.isfinite(result.loss):
            problem = self.rule.problem(result.loss, result.logit_scale, applied=bool(result.applied))
        if is_good(result) and problem is None:
            self.streak, self.first_bad, self.unhealthy = 0, None, False
            return True
        self.streak += 1
        if self.first_bad is None:
            self.first_bad = step
        self.last_loss = result.loss
        self.unhealthy |= problem is not None or not math.isfinite(result.loss)
        self.last_reason = (
            problem or result.skip_reason or ("non-finite loss" if not math.isfinite(result.loss) else None)
        )
        return False

    def final_weights_bad(self, step: int, why: str, loss: float) -> None:
        """The weights after the last step ``step`` (loss ``loss``) break the rule (``why``): its update diverged."""
        self.last_loss = loss
        self.streak, self.first_bad, self.unhealthy = self.streak + 1, self.first_bad or step, True
        self.last_reason = f"the weights after it: {why}"

    @property
    def ended_unhealthy(self) -> bool:
        """The last steps were unhealthy (not just fp16 overflow skips): the run must not end as a success."""
        return self.streak > 0 and self.unhealthy

    @property
    def good_to_save(self) -> bool:
        return self.streak == 0

    @property
    def diverged(self) -> bool:
        return self.max_skipped > 0 and self.streak >= self.max_skipped

    def describe(self, step: int) -> str:
        why = f"loss {self.last_loss:.4g}" + (f", {self.last_reason}" if self.last_reason else "")
        steps = f"step {step}" if self.first_bad == step else f"steps {self.first_bad}-{step}"
        return f"{self.streak} consecutive steps skipped, non-finite or unhealthy ({steps}: {why})"

    def error(self, step: int, good: Path | None, *, at_end: bool = False) -> DivergedError:
        if good is None:
            where = (
                "no checkpoint from before the divergence is left (any saved since it is marked DIVERGED); "
                "start again with a lower --lr"
            )
        else:
            where = (
                f"last good checkpoint: {good} (latest names it; later ones are marked DIVERGED); resume from it "
                "with a lower --lr"
            )
        if at_end:  # the run reached its last step inside the streak: it is no success
            return DivergedError(
                f"training diverged: the run ended after {self.describe(step)}; no checkpoint was saved from them; "
                f"{where}, or loosen the --divergence-* bounds (docs/checkpoints.md) if this curve is healthy"
            )
        return DivergedError(
            f"training diverged: {self.describe(step)}; no checkpoint was saved from them; {where}, or raise "
            f"--max-skipped-steps (now {self.max_skipped}; 0: never stop)"
        )

    def not_saved_line(self, step: int, latest: str | None) -> str:
        kept = f"latest still names {latest}" if latest else "no checkpoint yet"
        return f"checkpoint at step {step} not saved: {self.describe(step)}; {kept}"


def loaded_scale(engine) -> float | None:
    """The logit scale the next step will use (``exp`` of the clamped parameter) of the weights in ``engine``
    (collective under ZeRO-3: the one-element parameter is gathered); None for a model without one."""
    import torch

    from dsclip.model.clip import LOGIT_SCALE_MAX

    param = getattr(getattr(engine, "module", None), "logit_scale", None)
    if not isinstance(param, torch.nn.Parameter):
        return None
    if hasattr(param, "ds_id"):  # ZeRO-3 partitioned
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            value = float(param.detach().float().reshape(-1)[0])
    else:
        value = float(param.detach().float().reshape(-1)[0])
    return math.exp(min(value, LOGIT_SCALE_MAX)) if math.isfinite(value) else float("nan")


def resumed_problem(rule: HealthRule | None, scale: float | None) -> str | None:
    """Why the weights a run resumed from are not to be trained on: what the rule says of their logit scale
    (a tag saved by a run that blew up without being stopped, e.g. by an older dsclip)."""
    if rule is None or scale is None:
        return None
    if not math.isfinite(scale) or scale < rule.min_scale:
        return f"its logit scale {scale:.4g} is below --divergence-min-scale {rule.min_scale:g}"
    rule.last_scale = scale  # the first step's scale change is measured from here
    return None
