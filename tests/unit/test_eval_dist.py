"""Zero-shot + retrieval on 2 gloo ranks equal the single-process result (every rank runs the forward)."""

import pytest
import torch

from dsclip.testing.gloo_world import run_world


def _evaluate(rank, world, tok_path):
    from dsclip.data.tokenizer import SentencePieceTokenizer
    from dsclip.eval import evaluate_demo_zeroshot
    from dsclip.model import create_model

    torch.manual_seed(0)
    model = create_model("tiny", vocab_size=256)
    tok = SentencePieceTokenizer(tok_path, 32)
    return evaluate_demo_zeroshot(model, tok, num_samples=23, batch_size=4, retrieval=True, task="color_shape")


@pytest.mark.dist
def test_demo_eval_two_ranks_matches_one(tmp_path):
    from dsclip.data.demo import ensure_demo_tokenizer

    tok_path = ensure_demo_tokenizer(tmp_path)
    r0, r1 = run_world(_evaluate, 2, tok_path, timeout=300)
    single = _evaluate(0, 1, tok_path)
    assert r0 == r1
    for k, v in single.items():
        assert abs(r0[k] - v) < 1e-6, k
