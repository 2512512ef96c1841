"""Run config section ``ema`` (no torch: the config parser stays light); the EMA itself is dsclip.engine.ema.

OpenCLIP main has no EMA flags (its ``TrainingTask.setup_ema(decay=0.9999)`` is an API call; timm's trainer
names them ``--model-ema-decay``); dsclip's names: ``--ema-decay``, ``--ema-start-step``, ``--eval-ema``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsclip.config_base import ConfigError, opt


@dataclass
class EmaArgs:
    """Run config section ``ema``: an exponential moving average of the weights, sharded like the fp32 master."""

    ema_decay: float | None = opt(
        None,
        "Keep an EMA of the weights with this decay (e.g. 0.9999; timm ModelEmaV3's default, as OpenCLIP main's "
        "setup_ema), updated after every applied step; each rank averages only the fp32 master partition it owns "
        "(4 bytes/param / world). Saved with every checkpoint; `dsclip convert --ema` exports it. Off when unset.",
    )
    ema_start_step: int = opt(
        0, "Until this optimizer step the EMA copies the weights (timm's update_after_step), then it averages."
    )
    eval_ema: bool = opt(False, "Zero-shot and retrieval evaluations run on the EMA weights (needs --ema-decay).")

    def check(self) -> None:
        d = self.ema_decay
        if d is not None and not (0.0 < d < 1.0 and math.isfinite(d)):
            raise ConfigError(f"--ema-decay {d:g} is outside (0, 1): use e.g. 0.9999 (or leave it unset for no EMA)")
        if self.ema_start_step < 0:
            raise ConfigError(f"--ema-start-step must be >= 0, got {self.ema_start_step}")
        if self.eval_ema and d is None:
            raise ConfigError("--eval-ema needs --ema-decay (there is no EMA to evaluate)")

    @property
    def enabled(self) -> bool:
        return self.ema_decay is not None
