"""The training evaluator's fast path (batched, inference mode, loaders kept alive) gives the numbers of
the plain one-sample-at-a-time computation.

Reference: every image and every prompt encoded alone (batch 1) under torch.no_grad, the classifier and
the top-1 predictions computed here. The evaluator encodes in batches of 256 (another GEMM blocking,
so another summation order) in torch.inference_mode, through a DataLoader whose worker survives
between evaluations. Embeddings must agree within tests.tolerances.embedding_tol (rounding over the
forward's chained sums, unit-norm features), and every image's top-1 class must be identical (the
reference's top-1 margins are checked to be far above that tolerance, so identity is the right test).
"""

from __future__ import annotations

import torch
from PIL import Image

from dsclip.config import make_run_config
from dsclip.data import build_tokenizer
from dsclip.eval.evaluator import Evaluator, encode_dataset
from dsclip.eval.zero_shot import class_embeddings, expand_prompts
from dsclip.model import create_model, get_model_config
from tests.tolerances import embedding_tol

CLASSES, PER_CLASS = ("red", "green", "blue"), 7
TEMPLATES = ["a photo of {c}.", "{c}", "a {c} thing."]


def _folder(tmp_path):
    g = torch.Generator().manual_seed(0)
    root = tmp_path / "zs"
    for ci, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for j in range(PER_CLASS):
            px = (torch.rand(40, 40, 3, generator=g) * 80).to(torch.uint8)
            px[..., ci] += 150  # a dominant channel per class
            Image.fromarray(px.numpy()).save(root / name / f"{j}.png")
    (tmp_path / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return root


def test_batched_inference_eval_equals_unbatched(tmp_path):
    cfg = make_run_config(
        {
            "name": "t",
            "zeroshot_data": str(_folder(tmp_path)),
            "zeroshot_templates": str(tmp_path / "templates.txt"),
            "workers": 1,
        }
    )
    tok = build_tokenizer(cfg.data, 16, tmp_path / "cache")  # the demo model's context length
    torch.manual_seed(0)
    model = create_model("demo", vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id).eval()
    ev = Evaluator(cfg.data, tokenizer=tok, image_size=32, batch_size=256)
    assert ev.inference and ev.workers == 1

    first = ev.zeroshot(model)
    ds, _, loader, tokens = ev._zs
    workers = [w.pid for w in loader._iterator._workers]  # persistent: the same processes next time
    second = ev.zeroshot(model)
    assert first == second
    alive = loader._iterator._workers
    assert [w.pid for w in alive] == workers and all(w.is_alive() for w in alive)

    # batched features, exactly as the evaluator computes them
    img_b = encode_dataset(model, ds, "image", loader=loader, inference=True)
    txt_b = encode_dataset(model, [tokens[i] for i in range(len(tokens))], "text", batch_size=256, inference=True)
    assert not img_b.is_inference() and not txt_b.is_inference()  # usable by ordinary autograd code
    # reference: one sample at a time, plain no_grad
    with torch.no_grad():
        img_r = torch.cat([model(image=ds[i][0][None])["image_features"] for i in range(len(ds))])
        assert torch.equal(tokens, tok(expand_prompts(ds.classnames, TEMPLATES)))
        txt_r = torch.cat([model(text=tokens[i : i + 1])["text_features"] for i in range(len(tokens))])
    tol = embedding_tol(get_model_config("demo"))
    assert tol < 1e-4  # the derived tolerance is tight enough to mean something
    assert (img_b - img_r).abs().max() <= tol and (txt_b - txt_r).abs().max() <= tol

    logits_r = img_r @ class_embeddings(txt_r, len(CLASSES)).T  # (N, C)
    logits_b = img_b @ class_embeddings(txt_b, len(CLASSES)).T
    top2 = logits_r.topk(2, dim=1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 10 * tol  # no near-ties: top-1 identity is well defined
    pred_r, pred_b = logits_r.argmax(1), logits_b.argmax(1)
    assert torch.equal(pred_r, pred_b)
    accuracy = (pred_r == torch.tensor(ds.labels)).sum().item() / len(ds)
    assert first["zeroshot-top1"] == accuracy
