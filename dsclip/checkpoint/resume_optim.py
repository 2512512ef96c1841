"""On resume, this run's optimizer settings win over the checkpoint's, and the run says so in one line.

``engine.load_checkpoint`` restores the LR scheduler's state (its ``base_lrs``: the checkpoint's ``--lr``)
and the optimizer's param groups (their ``weight_decay``: the checkpoint's ``--wd``), while the schedule's
shape (warm-up, kind, length) is the function this run built. So a new ``--lr`` or ``--wd`` on resume was
recorded in run_config.yaml and ignored, and a new ``--warmup``/``--epochs`` took effect one step late,
unannounced. Here the values this run was built with are put back after the load and the scheduler is
re-positioned at the resume step, with one line naming each change (old and new value).

What a checkpoint was trained with is recorded in its dsclip state (``"optim"``, from :func:`recorded`).
A checkpoint of an older dsclip has no record: its ``--lr`` and ``--wd`` are read off the loaded engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsclip.checkpoint.universal import set_schedule_step

# the OptimArgs fields that shape the learning rate and weight decay of every later step
SETTINGS = ("lr", "wd", "warmup", "lr_scheduler", "skip_scheduler", "epochs_cooldown", "lr_cooldown_power",
            "lr_cooldown_end")  # fmt: skip
SCHEDULE_STEPS = "schedule_steps"  # the schedule's length, from --epochs and --max-steps


LAYER_DECAY = "layer_decay"  # [--image-layer-decay, --text-layer-decay]: they shape the optimizer's param groups


def recorded(optim, schedule_steps: int) -> dict:
    """What a checkpoint records of the optimizer settings (``optim``: the run's OptimArgs)."""
    decay = [getattr(optim, "image_layer_decay", None), getattr(optim, "text_layer_decay", None)]
    return {**{k: getattr(optim, k) for k in SETTINGS}, SCHEDULE_STEPS: int(schedule_steps), LAYER_DECAY: decay}


def check_layer_decay(saved: dict | None, current: dict) -> None:
    """Layer-wise lr decay splits the param groups (dsclip.engine.optim.param_groups), and ZeRO stores optimizer
    state per group: a resume with other layer-decay flags cannot load it. One line naming both, before loading."""

    def norm(v):
        return [None if d in (None, 1.0) else float(d) for d in (v or [None, None])]

    old, new = norm((saved or {}).get(LAYER_DECAY)), norm(current.get(LAYER_DECAY))
    if old != new:
        from dsclip.config_base import ConfigError

        def say(v):
            return f"--image-layer-decay {v[0]} --text-layer-decay {v[1]}".replace(" None", " unset")

        raise ConfigError(
            f"the checkpoint was trained with {say(old)}, this run has {say(new)}: the optimizer's param groups "
            f"differ, so its state cannot be loaded; resume with the checkpoint's layer-decay flags"
        )


@dataclass(frozen=True)
class Built:
    """The engine's learning rates and weight decays as this run built them, before a checkpoint is loaded."""

    base_lrs: tuple[float, ...]
    weight_decays: tuple[float, ...]


def _groups(engine) -> list[dict]:
    sched = engine.lr_scheduler
    return (sched.optimizer if sched is not None else engine.optimizer).param_groups


def snapshot(engine) -> Built:
    sched = engine.lr_scheduler
    groups = _groups(engine)
    base = tuple(sched.base_lrs) if sched is not None else tuple(g["lr"] for g in groups)
    return Built(base, tuple(float(g.get("weight_decay", 0.0)) for g in groups))


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def changes(saved: dict | None, current: dict, built: Built, engine) -> list[str]:
    """One phrase per setting that differs between the checkpoint and this run, e.g.
    ``--lr 0.0001 (checkpoint had 0.0005)``."""
    if saved:
        out = []
        for key in (*SETTINGS, SCHEDULE_STEPS):
            old, new = saved.get(key), current.get(key)
            if key not in saved or old == new:
                continue
            if key == SCHEDULE_STEPS:
                out.append(f"schedule length {new} steps (--epochs/--max-steps; checkpoint had {old})")
            else:
                out.append(f"{_flag(key)} {new:g} (checkpoint had {old:g})" if isinstance(new, float) and
                           isinstance(old, float) else f"{_flag(key)} {new} (checkpoint had {old})")  # fmt: skip
        return out
    loaded = snapshot(engine)  # an older dsclip's checkpoint: what the load put into the engine
    out = []
    if loaded.base_lrs != built.base_lrs:
        out.append(f"--lr {max(built.base_lrs):g} (checkpoint had {max(loaded.base_lrs):g})")
    if loaded.weight_decays != built.weight_decays:
        out.append(f"--wd {max(built.weight_decays):g} (checkpoint had {max(loaded.weight_decays):g})")
    return out


def apply(engine, built: Built, step: int) -> None:
    """Put this run's learning rates and weight decays back and re-position the schedule at ``step``."""
    groups = _groups(engine)
    for group, wd in zip(groups, built.weight_decays):
        if "weight_decay" in group:
            group["weight_decay"] = wd
    sched = engine.lr_scheduler
    if sched is None:
        for group, lr in zip(groups, built.base_lrs):
            group["lr"] = lr
        return
    sched.base_lrs = list(built.base_lrs)
    set_schedule_step(engine, step)


def reconcile(
    engine, built: Built, saved: dict | None, current: dict, step: int, say: Callable[[str], None]
) -> list[str]:
    """After the load: apply this run's settings where they differ from the checkpoint's, and ``say`` so in
    one line. Returns the changes (empty: the engine is left exactly as loaded)."""
    found = changes(saved, current, built, engine)
    if found:
        apply(engine, built, step)
        say(f"resume: {', '.join(found)}: applied from step {step + 1}")
    return found
