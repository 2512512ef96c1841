"""Locking semantics against OpenCLIP's own ``lock_image_tower`` / ``lock_text_tower`` on the same
architecture, the bad-input errors, the optimizer groups, and ``dsclip plan``'s trainable count."""

from __future__ import annotations

import pytest
import torch

from dsclip.engine.optim import param_groups
from dsclip.model import create_model, get_model_config, openclip_model_config, to_openclip_state_dict
from dsclip.model.lock import LockConfig, LockError, apply_locking, check_lock_config
from dsclip.plan import planner as P
from dsclip.plan import report as R

open_clip = pytest.importorskip("open_clip")


def _frozen_openclip_names(model) -> set[str]:
    """dsclip names of the parameters that do not require grad, via the OpenCLIP key map."""
    sd = {n: torch.empty(p.shape, device="meta") for n, p in model.named_parameters() if not p.requires_grad}
    return set(to_openclip_state_dict(sd)) if sd else set()


@pytest.mark.parametrize("groups", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("layers", [0, 1, 2, 3, 4])
def test_groups_equal_openclip_lock(groups, layers):
    cfg = get_model_config("tiny")  # 2 blocks per tower: 4 groups each
    ds = create_model(cfg, device="meta")
    oc = open_clip.CLIP(**openclip_model_config(ds.config)["model_cfg"])
    oc.lock_image_tower(unlocked_groups=groups)
    oc.lock_text_tower(unlocked_layers=layers, freeze_layer_norm=True)  # OpenCLIP's native tower needs True
    image = LockConfig(lock_image=True, lock_image_unlocked_groups=groups)
    text = LockConfig(lock_text=True, lock_text_unlocked_layers=layers, lock_text_freeze_layer_norm=True)
    apply_locking(ds, image)  # one tower at a time: both towers entirely locked is refused (tested below)
    apply_locking(ds, text)
    oc_frozen = {n for n, p in oc.named_parameters() if not p.requires_grad}
    assert _frozen_openclip_names(ds) == oc_frozen
    assert bool(oc_frozen) == (groups < 4 or layers < 4)


def test_text_layer_norms_stay_trainable_without_freeze_flag():
    m = create_model("tiny", device="meta")
    counts = apply_locking(m, LockConfig(lock_text=True))
    trainable_text = {n for n, p in m.text.named_parameters() if p.requires_grad}
    norms = {f"blocks.{i}.norm{j}.{p}" for i in (0, 1) for j in (1, 2) for p in ("weight", "bias")}
    assert trainable_text == norms | {"ln_final.weight", "ln_final.bias"}
    assert all(p.requires_grad for p in m.visual.parameters()) and m.logit_scale.requires_grad
    assert counts["locked"] == sum(p.numel() for p in m.parameters() if not p.requires_grad) > 0


def test_locked_parameters_are_not_in_optimizer_groups():
    m = create_model("tiny")
    apply_locking(m, LockConfig(lock_image=True))
    in_groups = {id(p) for g in param_groups(m, 0.1) for p in g["params"]}
    assert all(id(p) not in in_groups for p in m.visual.parameters())
    assert all(id(p) in in_groups for p in m.text.parameters())


@pytest.mark.parametrize(
    "lock, message",
    [
        (LockConfig(lock_image=True, lock_image_unlocked_groups=5), "--lock-image-unlocked-groups 5 is out of range"),
        (LockConfig(lock_text=True, lock_text_unlocked_layers=-1), "--lock-text-unlocked-layers -1 is out of range"),
        (LockConfig(lock_image_unlocked_groups=1), "needs --lock-image"),
        (LockConfig(lock_image=True, lock_text=True, lock_text_freeze_layer_norm=True), "nothing is left to train"),
    ],
)
def test_bad_locking_is_one_line_error(lock, message):
    with pytest.raises(LockError, match=message) as e:
        check_lock_config(lock, create_model("tiny", device="meta").config)
    assert "\n" not in str(e.value)


def test_plan_reports_trainable_parameters_and_saving():
    full = P.make_plan("ViT-B-32", gpus=8, gpu_memory_gb=80, batch_size=1024)
    lit = P.make_plan("ViT-B-32", gpus=8, gpu_memory_gb=80, batch_size=1024, lock=LockConfig(lock_image=True))
    m = create_model("ViT-B-32", device="meta")
    assert lit.params == full.params == sum(p.numel() for p in m.parameters())
    assert lit.trainable_params == full.params - sum(p.numel() for p in m.visual.parameters())
    # bf16 ZeRO-2 on 8 GPUs, sharded reduction (the planner's choice at K = 1): per locked parameter the fp32
    # gradient partition (4 B / 8) and the optimizer's 4+8 B / 8 are not allocated
    assert full.grad_reduction == lit.grad_reduction == "sharded"
    locked = full.params - lit.trainable_params
    assert lit.locked_saving_gb == pytest.approx(locked * (4 + 12) / 8 / 2**30, abs=1e-3)
    assert "--lock-image" in lit.command and "trainable" in R.format_plan(lit)
    sized = P.make_plan("ViT-B-32", gpus=8, gpu_memory_gb=80, batch_size=1024, image_size=320)
    assert sized.params == full.params + (100 - 49) * 768 and "--force-image-size 320" in sized.command
