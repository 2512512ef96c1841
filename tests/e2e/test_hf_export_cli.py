"""A trained demo run -> ``dsclip convert RUN --format hf`` (the real command) -> transformers' CLIPModel and
CLIPProcessor, used as a transformers user would (PIL images and prompt strings through the processor), give
dsclip's zero-shot accuracy on the held-out demo set.

Reuses the session's trained tiny run (tests/e2e/conftest.py ``tiny_const_lr_run``: the tiny model on the demo
data with the demo sentencepiece tokenizer, 3 steps). The two sides compute the same fp32 network in another sum
order, so each image-class similarity may differ by rounding (``tests.tolerances.embedding_tol`` per embedding
entry, summed over a D-term dot product): an image's top-1 class can change only where dsclip's two best classes
are closer than that. Those images are counted, and the accuracies may differ by at most that many samples
(the predictions of every other image must agree).
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.e2e.test_train_cli import PY, ROOT, env
from tests.tolerances import embedding_tol

transformers = pytest.importorskip("transformers")
N_IMAGES = 200


def _dsclip_side(run, tmp_path, tokenizer):
    """dsclip's own export and evaluator: (image features, classifier, labels, top-1 from evaluate_demo_zeroshot)."""
    from dsclip.checkpoint.convert import main_convert
    from dsclip.data.demo import DemoDataset, demo_zeroshot_classes, demo_zeroshot_templates
    from dsclip.eval.evaluator import evaluate_demo_zeroshot, zeroshot_classifier
    from dsclip.model import load_model

    assert main_convert([str(run), "-o", str(tmp_path / "ds")]) == 0
    model = load_model(tmp_path / "ds")
    official = evaluate_demo_zeroshot(model, tokenizer, image_size=32, num_samples=N_IMAGES)["top1"]
    demo = DemoDataset.heldout(N_IMAGES, image_size=32)
    with torch.no_grad():
        images = model.encode_image(torch.stack([demo[i][0] for i in range(N_IMAGES)]))
    classifier = zeroshot_classifier(model, tokenizer, demo_zeroshot_classes(), demo_zeroshot_templates())
    labels = torch.tensor([demo.label(i) for i in range(N_IMAGES)])
    return model, images, classifier, labels, official


def _transformers_side(folder):
    from PIL import Image

    from dsclip.data.demo import DemoDataset, demo_zeroshot_classes, demo_zeroshot_templates
    from dsclip.eval.zero_shot import class_embeddings, expand_prompts

    model = transformers.CLIPModel.from_pretrained(folder).eval()
    processor = transformers.CLIPProcessor.from_pretrained(folder)
    demo = DemoDataset.heldout(N_IMAGES, image_size=32)
    classes = demo_zeroshot_classes()
    prompts = processor(text=expand_prompts(classes, demo_zeroshot_templates()), padding=True, return_tensors="pt")
    pixels = processor(images=[Image.fromarray(demo.render(i)) for i in range(N_IMAGES)], return_tensors="pt")
    with torch.no_grad():
        text = model.get_text_features(**prompts).pooler_output
        images = model.get_image_features(**pixels).pooler_output
    return torch.nn.functional.normalize(images, dim=-1), class_embeddings(text, len(classes))


def test_trained_demo_run_zero_shot_in_transformers_equals_dsclip(tmp_path, tiny_const_lr_run):
    from dsclip.data.tokenizer import SentencePieceTokenizer
    from dsclip.eval.zero_shot import zeroshot_topk

    out = tmp_path / "hf"
    cmd = [PY, "-m", "dsclip", "convert", str(tiny_const_lr_run), "--format", "hf", "-o", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = p.stdout.strip().splitlines()[-1]  # (DeepSpeed's accelerator line may come first)
    assert result.startswith("converted ") and result.endswith("fp32, hf)"), p.stdout
    assert "token ids 2 (EOS) and 1 exchanged" in p.stderr  # the demo tokenizer's EOS at 2, renumbered

    tok = SentencePieceTokenizer(tiny_const_lr_run / "tokenizer.model", 32)
    model, ds_images, ds_classes, labels, official = _dsclip_side(tiny_const_lr_run, tmp_path, tok)
    hf_images, hf_classes = _transformers_side(out)
    ds_top1 = zeroshot_topk(ds_images, labels, ds_classes, ks=(1,))["top1"]
    hf_top1 = zeroshot_topk(hf_images, labels, hf_classes, ks=(1,))["top1"]
    assert ds_top1 == official  # the features above are dsclip's evaluator's

    # images whose top-1 may flip: dsclip's best two classes closer than twice a similarity's rounding. A similarity
    # is a D-term dot product of two unit vectors, each entry off by up to embedding_tol: off by up to
    # 2 * sqrt(D) * embedding_tol (Cauchy-Schwarz), the class mean's renormalisation adding within the same bound.
    sim_tol = 2 * model.config["embed_dim"] ** 0.5 * embedding_tol(model.config)
    ds_sims, hf_sims = ds_images @ ds_classes.T, hf_images @ hf_classes.T
    assert (hf_sims - ds_sims).abs().max() <= sim_tol
    top2 = ds_sims.topk(2, dim=1).values
    sure = top2[:, 0] - top2[:, 1] >= 2 * sim_tol
    fragile = int((~sure).sum())
    assert abs(hf_top1 - ds_top1) <= fragile / N_IMAGES, (hf_top1, ds_top1, fragile)
    assert torch.equal(hf_sims.argmax(1)[sure], ds_sims.argmax(1)[sure])
    assert sure.sum() >= N_IMAGES // 2, fragile  # a 3-step model's classes are close: most images still count

    # the same from dsclip's own export folder (model.safetensors + config.json + tokenizer.model), --pretrained-style
    from safetensors.torch import load_file

    from dsclip.checkpoint.convert import main_convert

    assert main_convert([str(tmp_path / "ds"), "--format", "hf", "-o", str(tmp_path / "hf2")]) == 0
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf2" / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
