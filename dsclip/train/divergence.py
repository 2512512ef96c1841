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

The loss and ``applied`` of a step are the same on every rank (the loss is reduced over ranks, the
overflow decision is global), so every rank counts the same streak and stops at the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dsclip.config_base import ConfigError


class DivergedError(ConfigError):
    """The run stopped on a streak of skipped or non-finite steps (one line naming the good checkpoint)."""


def is_good(result) -> bool:
    """The step was applied and its loss is finite."""
    return bool(result.applied) and math.isfinite(result.loss)


@dataclass
class DivergenceGuard:
    """Counts consecutive bad steps; ``max_skipped`` 0 never stops."""

    max_skipped: int
    streak: int = 0
    first_bad: int | None = None
    last_loss: float = float("nan")
    last_reason: str | None = None

    def observe(self, step: int, result) -> bool:
        """Record optimizer step ``step`` (1-based); True when the state after it is good to save."""
        if is_good(result):
            self.streak, self.first_bad = 0, None
            return True
        self.streak += 1
        if self.first_bad is None:
            self.first_bad = step
        self.last_loss = result.loss
        self.last_reason = result.skip_reason or ("non-finite loss" if not math.isfinite(result.loss) else None)
        return False

    @property
    def good_to_save(self) -> bool:
        return self.streak == 0

    @property
    def diverged(self) -> bool:
        return self.max_skipped > 0 and self.streak >= self.max_skipped

    def describe(self, step: int) -> str:
        why = f"loss {self.last_loss:.4g}" + (f", {self.last_reason}" if self.last_reason else "")
        steps = f"step {step}" if self.first_bad == step else f"steps {self.first_bad}-{step}"
        return f"{self.streak} consecutive steps skipped or with a non-finite loss ({steps}: {why})"

    def error(self, step: int, good: Path | None) -> DivergedError:
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
        return DivergedError(
            f"training diverged: {self.describe(step)}; no checkpoint was saved from them; {where}, or raise "
            f"--max-skipped-steps (now {self.max_skipped}; 0: never stop)"
        )

    def not_saved_line(self, step: int, latest: str | None) -> str:
        kept = f"latest still names {latest}" if latest else "no checkpoint yet"
        return f"checkpoint at step {step} not saved: {self.describe(step)}; {kept}"
