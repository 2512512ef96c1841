"""--distill-model / --distill-pretrained: flags, teacher checks (one-line errors before any work), world 1.

The multi-rank numbers (world 2 against OpenCLIP's DistillClipLoss, a gradient-cache step under ZeRO-2/3)
are in tests/dist/test_distill.py; the CLI run in tests/e2e/test_distill_cli.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsclip.config import ConfigError, make_run_config
from dsclip.losses import DistillInfoNCELoss, LossArgs, LossConfig, build_loss
from dsclip.model import ModelArgs, create_model, get_model_config, save_model
from dsclip.train.teacher import Teacher, build_teacher
from tests.tolerances import loss_size, loss_terms, worst_case
from tests.unit.test_losses import loss_and_grads, make_batch

oc_loss = pytest.importorskip("open_clip.loss")

TOK = SimpleNamespace(vocab_size=256, eos_id=2, pad_id=0, context_length=32)


@pytest.mark.parametrize(
    "values,expect",
    [
        ({"distill_model": "tiny"}, "--distill-model without --distill-pretrained"),
        ({"distill_pretrained": "t.safetensors"}, "--distill-pretrained without --distill-model"),
        ({"distill_model": "tiny", "distill_pretrained": "t", "siglip": True}, "drop --siglip"),
        ({"distill_model": "tiny", "distill_pretrained": "t", "tiled_loss": True}, "drop --tiled-loss"),
    ],
)
def test_bad_flag_combinations_are_one_line_config_errors(values, expect):
    with pytest.raises(ConfigError, match=expect) as e:
        make_run_config(values)
    assert "\n" not in str(e.value)


def test_flags_select_the_distillation_loss():
    cfg = make_run_config(
        {"distill_model": "tiny", "distill_pretrained": "t", "local_loss": True, "gather_with_grad": True}
    )
    lc = cfg.loss.loss_config()
    assert lc.distill and lc.name == "infonce_local"
    loss = build_loss(lc)
    assert isinstance(loss, DistillInfoNCELoss) and loss.local
    assert not isinstance(build_loss(LossArgs().loss_config()), DistillInfoNCELoss)
    with pytest.raises(ValueError, match="not siglip"):
        LossConfig(name="siglip", distill=True)


@pytest.mark.parametrize("local", [False, True])
def test_world1_equals_openclip_distill_clip_loss(local):
    """float64, one process: contrastive + distill and the gradients of OpenCLIP's DistillClipLoss; the
    teacher's embedding width (4) differs from the student's (6)."""
    x, y, s, _ = make_batch(9, 6, seed=3)
    tx, ty, _, _ = make_batch(9, 4, seed=4)
    ts = torch.tensor(11.0, dtype=torch.float64)
    loss = build_loss(LossConfig(name="infonce_local" if local else "infonce", distill=True))
    got, g = loss_and_grads(
        lambda a, b, c, _: loss(a, b, c, teacher_image_features=tx, teacher_text_features=ty, teacher_logit_scale=ts),
        x,
        y,
        s,
        None,
    )
    want, w = loss_and_grads(lambda a, b, c, _: sum(oc_loss.DistillClipLoss()(a, b, c, tx, ty, ts)), x, y, s, None)
    tol = worst_case(2 * loss_terms(9, 6), loss_size(9, 11.0), torch.float64)  # two logit matrices, two CE pairs
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    for a, b in zip(g[:3], w[:3]):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
    # the two parts, as OpenCLIP returns (and logs) them
    oc_contrastive, oc_distill = oc_loss.DistillClipLoss()(x, y, s, tx, ty, ts)
    assert loss.last_terms.keys() == {"contrastive_loss", "distill_loss"}
    torch.testing.assert_close(loss.last_terms["contrastive_loss"], oc_contrastive.detach(), atol=tol, rtol=0)
    torch.testing.assert_close(loss.last_terms["distill_loss"], oc_distill.detach(), atol=tol, rtol=0)
    # and the teacher matters: another teacher gives another loss
    other, _ = loss_and_grads(
        lambda a, b, c, _: loss(a, b, c, teacher_image_features=ty, teacher_text_features=tx, teacher_logit_scale=ts),
        x,
        y,
        s,
        None,
    )
    assert abs(float(other - got)) > 1e-3


def _teacher_file(tmp_path, *, embed_dim=24, image_size=None, vocab=256, context=32, seed=5):
    cfg = get_model_config("tiny")
    cfg["embed_dim"] = embed_dim
    if image_size:
        cfg["vision_cfg"]["image_size"] = image_size
    torch.manual_seed(seed)
    m = create_model(cfg, vocab_size=vocab, eos_id=2, pad_id=0, context_length=context)
    out = tmp_path / f"teacher_{embed_dim}_{image_size}_{vocab}_{context}"
    save_model(m, out)
    return m, out


def _student_cfg():
    return create_model("tiny", device="meta", vocab_size=256, eos_id=2, pad_id=0).config


def _args(model, pretrained):
    return LossArgs(distill_model=model, distill_pretrained=str(pretrained)), ModelArgs()


def test_teacher_is_frozen_in_eval_mode_with_the_files_weights(tmp_path):
    m, folder = _teacher_file(tmp_path)
    teacher = build_teacher(*_args("tiny", folder), TOK, _student_cfg())  # a folder: its config.json decides
    assert isinstance(teacher, Teacher) and not teacher.model.training
    assert all(not p.requires_grad for p in teacher.model.parameters())
    want = m.state_dict()
    got = teacher.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    images, tokens = torch.randn(3, 3, 32, 32), torch.randint(3, 200, (3, 32))
    tokens[:, 10] = 2
    out = teacher(images, tokens)
    assert out["image_features"].shape == (3, 24) and out["image_features"].grad_fn is None
    m.eval()
    torch.testing.assert_close(out["image_features"], m(image=images)["image_features"], atol=0, rtol=0)
    assert build_teacher(LossArgs(), ModelArgs(), TOK, _student_cfg()) is None


def test_teacher_file_with_a_registered_architecture(tmp_path):
    _, folder = _teacher_file(tmp_path, embed_dim=32)  # tiny as registered
    teacher = build_teacher(*_args("tiny", folder / "model.safetensors"), TOK, _student_cfg())
    assert teacher.model.embed_dim == 32


@pytest.mark.parametrize(
    "case,expect",
    [
        ("image_size", "takes 48 px images but the run trains on 32 px"),
        ("vocab", "the teacher must use the run's tokenizer"),
        ("context", "reads at most 16 tokens but the run's captions have 32"),
        ("missing", "pretrained weights not found"),
        ("unknown_arch", "unknown model 'ViT-Q-99'"),
        ("wrong_arch", "do not fit --model ViT-B-32"),
    ],
)
def test_teacher_that_cannot_work_is_a_one_line_error(tmp_path, case, expect):
    if case == "image_size":
        _, path = _teacher_file(tmp_path, image_size=48)
        model = "tiny"
    elif case == "vocab":
        _, path = _teacher_file(tmp_path, vocab=300)
        model = "tiny"
    elif case == "context":
        _, path = _teacher_file(tmp_path, context=16)
        model = "tiny"
    elif case == "missing":
        path, model = tmp_path / "none.safetensors", "tiny"
    elif case == "unknown_arch":
        _, folder = _teacher_file(tmp_path, embed_dim=32)
        path, model = folder / "model.safetensors", "ViT-Q-99"
    else:
        _, folder = _teacher_file(tmp_path, embed_dim=32)
        path, model = folder / "model.safetensors", "ViT-B-32"
    with pytest.raises(ConfigError, match=expect) as e:
        build_teacher(*_args(model, path), TOK, _student_cfg())
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--distill-model {model}")
