"""The configuration ``dsclip plan`` (and ``dsclip train --deepspeed-config auto``) chooses: the highest
predicted samples/s that fits, over everything that leaves the training mathematics unchanged.

Searched: the ZeRO stage (1, 2, 3), ZeRO-Offload (none, the optimizer, the optimizer and the parameters),
activation checkpointing, the InfoNCE implementation (global, local with gathered gradients, tiled: one
loss value, dsclip/losses) and the micro-batch x --accum-freq split of each rank's rows (the gradient cache
makes every split the same step). Never changed: the precision, patch dropout, the global batch and the
GPUs; SigLIP is another loss, so it is searched only as itself. A candidate is a shipped DeepSpeed JSON
(ds_configs/) for the stage, offload and precision, so every choice has a command that runs. Each
candidate is one :func:`dsclip.plan.planner.make_plan` (its memory and speed models); for a configuration the
largest micro-batch that fits is its fastest split (fewer chunks re-forward less,
dsclip.plan.efficiency.extra_forwards).

What the user fixed (a stage, a JSON, a loss, checkpointing, a micro-batch) stays fixed. When that does not
fit, :func:`cheapest_change` relaxes it in the order of what a change costs the step: the tiled loss,
checkpointing or another split first, then ZeRO-3, then offload; when nothing fits at all,
:func:`smallest_fit` finds the largest global batch, or the fewest GPUs, that do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsclip.config_base import ConfigError
from dsclip.engine.ds_config import SHIPPED_DS_CONFIGS
from dsclip.plan.memory import OFFLOADS, offload_of
from dsclip.plan.planner import Plan, make_plan, shipped_ds_config

SEARCHED_LOSSES = ("infonce", "infonce_local", "infonce_tiled")  # one loss value; siglip is another loss
DIMENSIONS = ("zero", "offload", "grad_checkpointing", "loss", "micro_batch")
# what relaxing a fixed setting costs, in the order: the loss and checkpointing (a re-forward) and
# the split before ZeRO-3 (gathers every weight in every pass), ZeRO-3 before offload (PCIe + a host Adam)
CHANGE_COST = {"loss": 1, "grad_checkpointing": 1, "micro_batch": 1, "zero": 3, "offload": 10}


def shipped_candidates(precision: str) -> list[tuple[int, str, tuple[str, dict]]]:
    """(stage, offload, (name, JSON)) of every shipped DeepSpeed JSON that runs ``precision``: zeroN_PREC.json
    (or zeroN.json, which takes --precision) and zeroN_offload_PREC.json."""
    import json

    out = []
    for zero in (1, 2, 3):
        if any((SHIPPED_DS_CONFIGS / f).is_file() for f in (f"zero{zero}_{precision}.json", f"zero{zero}.json")):
            name, cfg = shipped_ds_config(zero, precision)
            out.append((zero, offload_of(cfg), (name, cfg)))
        path = SHIPPED_DS_CONFIGS / f"zero{zero}_offload_{precision}.json"
        if path.is_file():
            cfg = json.loads(path.read_text())
            out.append((zero, offload_of(cfg), (f"ds_configs/{path.name}", cfg)))
    return out


@dataclass
class Search:
    chosen: Plan
    rows: list[Plan]  # every candidate planned, best first (those that fit first)
    fixed: dict[str, str] = field(default_factory=dict)  # dimension -> the flag that fixed it

    @property
    def fitting(self) -> list[Plan]:
        return [p for p in self.rows if p.fits]


def rank_key(p: Plan):
    """Fits first, then the highest predicted samples/s, then the least memory (ZeRO-2 over ZeRO-1 at one rate);
    exact ties (equal rate and memory) go to the lower stage, less offload, no checkpointing, then the loss's
    and micro-batch's order, so the choice never depends on the order the candidates were planned in."""
    return (not p.fits, -p.samples_per_s_per_gpu, p.memory_gb.get("total", 0.0), p.zero, OFFLOADS.index(p.offload),
            p.grad_checkpointing, p.loss, p.micro_batch)  # fmt: skip


def _value(p: Plan, dim: str):
    return {"zero": p.zero, "offload": p.offload, "grad_checkpointing": p.grad_checkpointing, "loss": p.loss,
            "micro_batch": p.micro_batch}[dim]  # fmt: skip


def search(model, *, fixed: dict | None = None, precision: str = "bf16", **base) -> Search:
    """Plan every candidate the user's ``fixed`` settings leave open and rank them.

    ``fixed``: any of ``zero`` (int), ``ds_config`` ((name, JSON): fixes the stage and the offload),
    ``loss``, ``grad_checkpointing``, ``micro_batch``; plus ``flags``: dimension -> the flag that fixed it,
    for the output. ``base``: :func:`make_plan`'s other keywords (gpus, gpu_memory_gb, batch_size, ...)."""
    fixed = dict(fixed or {})
    flags = fixed.pop("flags", {})
    if "ds_config" in fixed:
        name, cfg = fixed["ds_config"]
        stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
        configs = [(stage, offload_of(cfg), (name, cfg))]
    else:
        configs = [c for c in shipped_candidates(precision) if fixed.get("zero") in (None, c[0])]
    if not configs:
        raise ConfigError(
            f"no shipped DeepSpeed JSON runs ZeRO-{fixed.get('zero')} in {precision}: name one with --deepspeed-config"
        )
    ckpts = [fixed["grad_checkpointing"]] if "grad_checkpointing" in fixed else [False, True]
    losses = [fixed["loss"]] if "loss" in fixed else list(SEARCHED_LOSSES)
    rows = []
    for zero, _, ds in configs:
        for ckpt in ckpts:
            for loss in losses:
                rows.append(make_plan(model, zero=zero, ds_config=ds, grad_checkpointing=ckpt, loss=loss,
                                      precision=precision, micro_batch=fixed.get("micro_batch"), **base))  # fmt: skip
    rows.sort(key=rank_key)
    return Search(rows[0], rows, flags)


def cheapest_change(model, *, fixed: dict, precision: str = "bf16", **base) -> tuple[Plan, list[str]] | None:
    """The fitting plan that changes the least of what the user fixed (by :data:`CHANGE_COST`; then the
    fastest), and the dimensions it changes; None when nothing fits even with everything open."""
    user = {k: v for k, v in fixed.items() if k != "flags"}
    want = {}
    if "ds_config" in user:
        cfg = user["ds_config"][1]
        want["zero"] = int(cfg.get("zero_optimization", {}).get("stage", 0))
        want["offload"] = offload_of(cfg)
    for k in ("zero", "loss", "grad_checkpointing", "micro_batch"):
        if k in user:
            want[k] = user[k]
    open_rows = search(model, fixed={}, precision=precision, **base).rows
    if "micro_batch" in user:  # the user's split under every other change too
        open_rows += search(model, fixed={"micro_batch": user["micro_batch"]}, precision=precision, **base).rows
    best, best_key = None, None
    for p in open_rows:
        if not p.fits:
            continue
        changed = [d for d, v in want.items() if _value(p, d) != v]
        key = (sum(CHANGE_COST[d] for d in changed), rank_key(p))
        if best_key is None or key < best_key:
            best, best_key = (p, changed), key
    return best


def smallest_fit(model, *, precision: str = "bf16", **base) -> dict[str, Plan]:
    """When nothing fits: the largest global batch that fits these GPUs (halving, whole rows per rank) and
    the fewest GPUs (doubling, up to 64x) that fit this batch, each with everything open."""
    out = {}
    gpus, batch = base["gpus"], base["batch_size"]
    b = batch // 2
    while b >= gpus:
        if b % gpus == 0:
            s = search(model, precision=precision, **{**base, "batch_size": b})
            if s.chosen.fits:
                out["global_batch"] = s.chosen
                break
        b //= 2
    g = gpus * 2
    while g <= gpus * 64 and batch % g == 0:
        s = search(model, precision=precision, **{**base, "gpus": g})
        if s.chosen.fits:
            out["gpus"] = s.chosen
            break
        g *= 2
    return out
