import pickle

import pytest
import torch

from dsclip.data.demo import all_demo_captions, ensure_demo_tokenizer
from dsclip.data.tokenizer import SentencePieceTokenizer, train_sentencepiece


@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory):
    return SentencePieceTokenizer(ensure_demo_tokenizer(tmp_path_factory.mktemp("tok")), context_length=16)


def test_layout_eos_pad(demo_tok):
    t = demo_tok(["a small red circle on the left", "a star."])
    assert t.shape == (2, 16) and t.dtype == torch.long
    for row in t.tolist():
        k = row.index(demo_tok.eos_id)
        assert all(x != demo_tok.eos_id and x != demo_tok.pad_id for x in row[:k])
        assert all(x == demo_tok.pad_id for x in row[k + 1 :])
    assert (demo_tok.pad_id, demo_tok.eos_id) == (0, 2)


def test_round_trip(demo_tok):
    caps = all_demo_captions()[:50]
    assert demo_tok.decode(demo_tok(caps)) == caps
    # the demo tokenizer keeps demo words whole
    assert len(demo_tok.encode("a small red circle on the left")) == 7


def test_truncation_keeps_eos(demo_tok):
    long = " ".join(["red circle"] * 50)
    row = demo_tok([long], context_length=8)[0]
    assert row[-1].item() == demo_tok.eos_id and (row != demo_tok.pad_id).all()


def test_pickle_and_cache(tmp_path, demo_tok):
    tok2 = pickle.loads(pickle.dumps(demo_tok))
    assert torch.equal(tok2(["a blue ring."]), demo_tok(["a blue ring."]))
    p1 = ensure_demo_tokenizer(tmp_path)
    mtime = __import__("os").path.getmtime(p1)
    assert ensure_demo_tokenizer(tmp_path) == p1 and __import__("os").path.getmtime(p1) == mtime


def test_train_sentencepiece_generic(tmp_path):
    texts = [f"the {c} dog number {i} runs fast" for i in range(200) for c in ("brown", "black", "white")]
    path = train_sentencepiece(texts, tmp_path / "m" / "spm", vocab_size=100)
    tok = SentencePieceTokenizer(path, context_length=20)
    assert tok.vocab_size <= 100 and tok.eos_id == 2 and tok.pad_id == 0
    assert tok.decode(tok(["the brown dog runs fast"])) == ["the brown dog runs fast"]
    assert not list((tmp_path / "m").glob(".spm-*"))  # temp dir cleaned


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        SentencePieceTokenizer(tmp_path / "nope.model")
    with pytest.raises(ValueError):
        train_sentencepiece(["", "  "], tmp_path / "x", 50)


def test_text_cfg_checks(demo_tok):
    from dsclip.data.tokenizer import check_text_cfg, text_cfg_for

    cfg = text_cfg_for(demo_tok)
    check_text_cfg(demo_tok, cfg)
    check_text_cfg(demo_tok, {**cfg, "vocab_size": 1000, "context_length": 32})
    for bad, msg in (
        ({"vocab_size": 10}, "vocab_size"),
        ({"pool_type": "argmax"}, "argmax"),
        ({"eos_id": 5}, "eos_id"),
        ({"pool_type": "last"}, "last"),
    ):
        with pytest.raises(ValueError, match=msg):
            check_text_cfg(demo_tok, {**cfg, **bad})
