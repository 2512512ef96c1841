"""`dsclip train --distill-model tiny --distill-pretrained FILE` on the demo data, 2 ranks (deepspeed launcher).

The teacher is a saved tiny model (another seed) using the run's tokenizer. After training: the teacher's
file is unchanged, the checkpoint holds exactly the student's tensors (the consolidated ZeRO state dict
has no teacher key and nothing more), and the first step's loss exceeds the same run's without a teacher
(the session's shared plain run, tests/e2e/conftest.py) by the distillation term (same initial weights,
same data, same seed: the contrastive part is equal).
Bad input: one-line errors before any work, exit code 2 (a config error in-process, the teacher check
through a real `dsclip train` process).
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from dsclip.cli import main
from tests.e2e.test_checkpoint_resume import _train_args
from tests.e2e.test_finetune import demo_tokenizer_path
from tests.e2e.test_train_cli import losses, run_cli

pytestmark = pytest.mark.dist


def write_teacher(tmp_path, image_size=None):
    from dsclip.data.tokenizer import SentencePieceTokenizer
    from dsclip.model import create_model, get_model_config, save_model

    tok = SentencePieceTokenizer(demo_tokenizer_path(), 32)
    cfg = get_model_config("tiny")
    if image_size:
        cfg["vision_cfg"]["image_size"] = image_size
    torch.manual_seed(7)
    model = create_model(cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id)
    return save_model(model, tmp_path / f"teacher{image_size or ''}")  # .../model.safetensors


def _args(tmp_path, name):
    return ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", name, "--max-steps", "2"]
    # tiny recipe: demo data, batch 16 per rank, ZeRO-2 fp32, a checkpoint at the end


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_distill_run_trains_student_only(tmp_path, zero2_world2_run):
    """Against the session's shared plain run (tests/e2e/conftest.py zero2_world2_run: same recipe, data, seed and
    initial weights, 2 ranks, ZeRO-2 fp32, global batch 16), of which only step 1, before any update, is compared."""
    teacher = write_teacher(tmp_path)
    before = _sha(teacher)
    args = _train_args(tmp_path, "distill", "zero2_fp32", 2, "--distill-model", "tiny", "--distill-pretrained")
    args[args.index("--max-steps") + 1] = "2"  # the reference trains 8; step 1 is the same in both
    p = run_cli([*args, str(teacher)], world=2)
    assert (
        "dsclip: distilling from tiny" in p.stdout and "whole on every rank; outside the student's engine" in p.stdout
    )
    assert _sha(teacher) == before  # the teacher is only read
    plain = zero2_world2_run

    with_teacher, without = losses(tmp_path / "distill"), losses(plain)
    assert sorted(with_teacher) == [1, 2] and all(math.isfinite(v) for v in with_teacher.values())
    # step 1: same student weights and batch, so the difference is the distillation term, the cross-entropy
    # of the student's 16 x 16 logit rows against a random teacher's softmax: about log(16) = 2.8
    extra = with_teacher[1] - without[1]
    assert 2.0 < extra < 6.0, (with_teacher, without)
    # the logged parts (OpenCLIP's names): the contrastive part is the plain run's loss, the rest is distill_loss
    first = json.loads((tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["contrastive_loss"] == pytest.approx(without[1], abs=1e-4)
    assert first["distill_loss"] == pytest.approx(extra, abs=1e-4)
    plain_first = json.loads((plain / "metrics.jsonl").read_text().splitlines()[0])
    assert "distill_loss" not in plain_first

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dsclip.model import create_model

    ckpt = tmp_path / "distill" / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    saved = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag)
    assert set(saved) == set(create_model("tiny", device="meta").state_dict())  # the student's tensors only


def test_distill_zero3_bf16_teacher_partitioned(tmp_path):
    """ZeRO-3 bf16: the teacher is partitioned in its own forward-only engine, in bf16; the run trains and
    saves the student only."""
    teacher = write_teacher(tmp_path)
    flags = ["--distill-model", "tiny", "--distill-pretrained", str(teacher), "--save-every-n-steps", "2"]
    flags += ["--deepspeed-config", "ds_configs/zero3_bf16.json", "--precision", "auto"]
    p = run_cli(_args(tmp_path, "z3") + flags, world=2)
    assert "partitioned by ZeRO-3 in a forward-only engine" in p.stdout, p.stdout[-3000:]
    curve = losses(tmp_path / "z3")
    assert sorted(curve) == [1, 2] and all(math.isfinite(v) for v in curve.values())

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dsclip.model import create_model

    ckpt = tmp_path / "z3" / "checkpoints"
    saved = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), (ckpt / "latest").read_text().strip())
    assert set(saved) == set(create_model("tiny", device="meta").state_dict())


def test_distill_model_without_pretrained_is_one_line_before_any_work(tmp_path, capsys):
    """A config error: the CLI's entry point in this process (the subprocess test below covers the real exit)."""
    code = main(_args(tmp_path, "bad") + ["--distill-model", "tiny"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("dsclip train: error:")]
    assert len(lines) == 1 and "--distill-model without --distill-pretrained" in lines[0], err[-3000:]
    assert not (tmp_path / "bad").exists()


def test_distill_teacher_image_size_mismatch_is_one_line_before_any_work(tmp_path):
    # the saved folder: its config.json says 48 px (a bare file would be loaded into --distill-model's 32 px
    # architecture with its position embeddings resampled, as --pretrained does)
    folder = write_teacher(tmp_path, image_size=48).parent
    flags = ["--distill-model", "tiny", "--distill-pretrained", str(folder)]
    p = run_cli(_args(tmp_path, "bad") + flags, check=False, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    err = [line for line in p.stderr.splitlines() if line.startswith("dsclip train: error:")]
    assert len(err) == 1 and "takes 48 px images but the run trains on 32 px" in err[0], p.stderr[-3000:]
    assert not (tmp_path / "bad" / "checkpoints").exists()
