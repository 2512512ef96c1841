"""ZeRO-3's optimizer state after a universal-checkpoint load, put back as saved (DeepSpeed 0.19.8's path).

``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`` copies the
hyper-parameters of param group 0 into every group (so the no-weight-decay group gets group 0's weight
decay) and sets every group's ``params`` to ``[]`` (so the wrapped torch optimizer updates nothing
afterwards); it also gives every flat fp32 partition the *same* ``step`` tensor, which torch's Adam
increments in place once per partition, so bias correction runs ahead by the number of partitions.
:func:`load_universal` puts back each group's own parameter list and saved hyper-parameters and gives each
partition its own ``step`` (tests/e2e/test_checkpoint_resume.py, ZeRO-3 world 2 -> 1 against an
uninterrupted run). Where the loader's source is not the one this was written against the repair is
left out, with one line: a fixed upstream loader needs none. Upstream: fix the loader (DeepSpeed issue
to file: "stage3 universal load overwrites param_groups and shares step").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dsclip.console import say
from dsclip.engine.fingerprint import mismatched_target
from dsclip.engine.versions import deepspeed_version

NAME = "universal_zero3"
VERIFIED = ("0.19.2", "0.19.8")
STAGES = (3,)
TARGETS = {
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3": (
        frozenset({"bcf61c804ca4", "461ec0c7c73f"})
    ),
}


def load_universal(engine, load_dir: Path, tag: str, *, enabled: bool = True) -> tuple[Any, Any]:
    """``engine.load_checkpoint`` of a universal tag, with the ZeRO-3 repair where it is known to be needed."""
    inner = getattr(engine.optimizer, "optimizer", None)
    repair = enabled and engine.zero_optimization_stage() == 3 and inner is not None
    if repair and (bad := mismatched_target(TARGETS)) is not None:
        say(
            f"[dsclip] patch {NAME} off: DeepSpeed {deepspeed_version()}'s {bad} is not the one it was written "
            f"against (verified: DeepSpeed {', '.join(VERIFIED)}); DeepSpeed's own path runs"
        )
        repair = False
    params_before = [list(g["params"]) for g in inner.param_groups] if repair else None
    path, client_state = engine.load_checkpoint(
        str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is not None and repair:
        from dsclip.checkpoint.safe_load import load_data  # a checkpoint is data: dsclip.checkpoint.safe_load

        optim_sd = load_data(Path(load_dir) / tag / "zero" / "optimizer_state.pt", map_location="cpu")
        saved_groups = optim_sd["optimizer_state_dict"]["param_groups"]
        if len(saved_groups) != len(inner.param_groups):
            raise RuntimeError(
                f"universal checkpoint has {len(saved_groups)} param groups, the optimizer {len(inner.param_groups)}"
            )
        for group, params, saved in zip(inner.param_groups, params_before, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["params"] = params
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
    return path, client_state
