"""Layer-wise lr decay: every parameter's learning rate against OpenCLIP main's assignment.

The expected assignment is re-derived here from parameter names, from what OpenCLIP main's code says
(mlfoundations/open_clip, src/open_clip_train/optim.py: ``lr_scale = decay ** (n - 1 - idx)`` over a
tower's ordered groups; src/open_clip/transformer.py ``VisionTransformer.layer_groups``: embeddings
[conv1, class/pos embeddings, ln_pre], one group per block with ln_post in the last, proj;
``_text_layer_groups``: embeddings [token, positional], blocks with ln_final in the last, proj;
src/open_clip/timm_model.py ``TimmModel.layer_groups``: timm's group_matcher groups of the trunk — stem
(cls/reg token, pos_embed, patch_embed, norm_pre), ``blocks.N``, ``norm`` (ordinal 99999: timm's
MATCH_PREV_GROUP, merged into the last block's group), then what the
matcher leaves unmatched (attention pool) last — and the adapter head on top). It does not call
dsclip.engine.layer_decay, so a wrong grouping there fails here.
"""

import re

import pytest
import torch

from dsclip.config import ConfigError, make_run_config
from dsclip.engine.optim import OptimArgs, build_scheduler, param_groups
from dsclip.model import create_model, get_model_config
from dsclip.model.lock import LockConfig, apply_locking

LR = 1e-3


def openclip_main_depth(name: str, vision_layers: int, text_layers: int, timm: bool) -> tuple[str, int] | None:
    """(tower, groups below the head) for a dsclip parameter name, as OpenCLIP main groups that tower."""
    if name.startswith("visual."):
        n = name[len("visual.") :]
        if timm:  # groups: stem, blocks 0..L-1 (norm joins the last), unmatched (attn_pool) [, proj]
            if re.match(r"(cls_token|reg_token|pos_embed|patch_embed|norm_pre)", n):
                return "image", vision_layers + 1
            if m := re.match(r"blocks\.(\d+)\.", n):
                return "image", vision_layers - int(m.group(1))
            if n.startswith("norm."):
                return "image", 1
            return "image", 0
        if n == "proj":
            return "image", 0
        if n.startswith("norm."):
            return "image", 1  # ln_post rides with the last block, one below proj
        if m := re.match(r"blocks\.(\d+)\.", n):
            return "image", vision_layers - int(m.group(1))
        return "image", vision_layers + 1  # patch conv, class token, positions, ln_pre
    if name.startswith("text."):
        n = name[len("text.") :]
        if n.startswith("text_projection"):
            return "text", 0
        if n.startswith("ln_final."):
            return "text", 1
        if m := re.match(r"blocks\.(\d+)\.", n):
            return "text", text_layers - int(m.group(1))
        return "text", text_layers + 1
    return None  # logit_scale / logit_bias: not in a tower, lr_scale 1.0


def lr_of(model, groups) -> dict[str, tuple[float, float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g.get("lr", LR), g["weight_decay"]) for g in groups for p in g["params"]}


def expected(model, name, image_decay, text_decay, timm=False) -> float:
    cfg = model.config
    where = openclip_main_depth(name, cfg["vision_cfg"]["layers"], cfg["text_cfg"]["layers"], timm)
    if where is None:
        return LR
    decay = {"image": image_decay, "text": text_decay}[where[0]]
    return LR * (decay or 1.0) ** where[1]


@pytest.mark.parametrize(
    "lock",
    [
        LockConfig(),
        LockConfig(lock_image=True, lock_image_unlocked_groups=2),
        LockConfig(lock_text=True, lock_text_unlocked_layers=3),
    ],
    ids=["unlocked", "image-locked-but-2", "text-locked-but-3"],
)
def test_every_parameter_lr_is_openclip_mains(lock):
    model = create_model("tiny")
    apply_locking(model, lock)
    o = OptimArgs(lr=LR, wd=0.1, image_layer_decay=0.6, text_layer_decay=0.8)
    got = lr_of(model, param_groups(model, o.wd, o))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == trainable  # locked parameters reach no group; every trainable one exactly one
    plain = lr_of(model, param_groups(model, o.wd))  # weight-decay split without layer decay
    for name, (lr, wd) in got.items():
        assert lr == pytest.approx(expected(model, name, 0.6, 0.8), rel=1e-12), name
        assert wd == plain[name][1], name  # the weight-decay groups are unchanged by the split
    # the head keeps --lr; the embeddings are the deepest group
    assert got.get("visual.proj", (LR,))[0] == LR and got["text.text_projection"][0] == LR
    assert len({lr for lr, _ in got.values()}) > 4


def test_timm_tower_groups_as_openclip_main_timm_model():
    cfg = get_model_config("ViT-B-16-SigLIP")
    model = create_model(cfg, device="meta")
    o = OptimArgs(lr=LR, image_layer_decay=0.75)
    got = lr_of(model, param_groups(model, o.wd, o))
    for name, (lr, _) in got.items():
        assert lr == pytest.approx(expected(model, name, 0.75, None, timm=True), rel=1e-12), name
    assert got["visual.attn_pool.latent"][0] == LR  # unmatched by timm's matcher: the top trunk group
    assert got["visual.pos_embed"][0] == pytest.approx(LR * 0.75**13)


def test_one_tower_only_and_off_at_one():
    model = create_model("tiny")
    o = OptimArgs(lr=LR, text_layer_decay=0.5)
    got = lr_of(model, param_groups(model, o.wd, o))
    assert all(lr == LR for n, (lr, _) in got.items() if n.startswith("visual."))
    assert got["text.token_embedding.weight"][0] < LR
    # 1.0 is "off", exactly the historical two groups (the checkpoint layout)
    groups = param_groups(model, 0.2, OptimArgs(lr=LR, image_layer_decay=1.0))
    assert len(groups) == 2 and "lr" not in groups[0]


def test_schedule_keeps_the_ratios():
    model = create_model("tiny")
    o = OptimArgs(lr=LR, warmup=3, image_layer_decay=0.5, text_layer_decay=0.9)
    opt = torch.optim.AdamW(param_groups(model, o.wd, o), lr=o.lr)
    sched = build_scheduler(opt, o, total_steps=10, steps_per_epoch=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(LR / 3)  # warm-up step 0; the head group first
    for _ in range(6):
        ratios = [g["lr"] / opt.param_groups[0]["lr"] for g in opt.param_groups]
        assert ratios == pytest.approx([g["lr_scale"] for g in opt.param_groups], rel=1e-9)
        opt.step()
        sched.step()


@pytest.mark.parametrize(
    "key,value", [("image_layer_decay", 1.5), ("visual_layer_decay", 0.0), ("text_layer_decay", -0.5)]
)
def test_out_of_range_is_one_line_before_anything_is_built(key, value):
    values = {("image_layer_decay" if key == "visual_layer_decay" else key): value}
    with pytest.raises(ConfigError, match=r"outside \(0, 1\]") as e:
        make_run_config(values)
    assert "\n" not in str(e.value)


def test_resume_with_other_layer_decay_flags_is_one_line_before_loading():
    from dsclip.checkpoint.resume_optim import check_layer_decay, recorded

    with_decay = recorded(OptimArgs(image_layer_decay=0.7), 10)
    check_layer_decay(with_decay, recorded(OptimArgs(image_layer_decay=0.7), 20))  # same groups: fine
    check_layer_decay({}, recorded(OptimArgs(text_layer_decay=1.0), 10))  # older checkpoint, 1.0 is off: fine
    with pytest.raises(ConfigError, match="--image-layer-decay 0.7 --text-layer-decay unset, this run has") as e:
        check_layer_decay(with_decay, recorded(OptimArgs(), 10))
    assert "\n" not in str(e.value)
