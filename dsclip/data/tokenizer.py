"""SentencePiece tokenizer: text -> fixed-length LongTensor with EOS appended and padding.

Token layout per row: ``[t_1, ..., t_k, EOS, PAD, ..., PAD]`` (no BOS). Long texts are truncated to
``context_length - 1`` pieces so that EOS is always present — the text tower pools at EOS
(``pool_type="eos"`` with ``eos_id``), so a row without EOS would pool the wrong token.

Models trained by :func:`train_sentencepiece` use pad=0, unk=1, eos=2 and no BOS. sentencepiece's
own default has no pad piece (pad_id = -1); a model like that is still accepted: we then pad with 0
(whatever piece that is) — the text tower's causal mask and EOS pooling never look past EOS.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
import torch

PAD_ID, UNK_ID, EOS_ID = 0, 1, 2


class SentencePieceTokenizer:
    """``tok(list[str]) -> LongTensor (N, context_length)``; attrs ``vocab_size``, ``eos_id``, ``pad_id``.

    Picklable (the serialized model travels, not the path), so it can tokenize in DataLoader workers.
    """

    def __init__(self, model_path: str | os.PathLike, context_length: int = 77):
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"sentencepiece model not found: {path}")
        if context_length < 2:
            raise ValueError(f"context_length must be >= 2 (at least one token + EOS), got {context_length}")
        self.model_path = str(path)
        self.context_length = int(context_length)
        self._load(path.read_bytes())

    def _load(self, proto: bytes) -> None:

        self._proto = proto
        self.sp = spm.SentencePieceProcessor()
        self.sp.LoadFromSerializedProto(proto)
        self.vocab_size = int(self.sp.GetPieceSize())
        if self.sp.eos_id() < 0:
            raise ValueError(f"{self.model_path}: sentencepiece model has no EOS piece (train it with --eos_id)")
        self.eos_id = int(self.sp.eos_id())
        self.pad_id = int(self.sp.pad_id()) if self.sp.pad_id() >= 0 else 0
        self.unk_id = int(self.sp.unk_id())

    def __getstate__(self):
        return {"model_path": self.model_path, "context_length": self.context_length, "proto": self._proto}

    def __setstate__(self, state):
        self.model_path = state["model_path"]
        self.context_length = state["context_length"]
        self._load(state["proto"])

    def __repr__(self) -> str:
        return (
            f"SentencePieceTokenizer({self.model_path!r}, context_length={self.context_length}, "
            f"vocab_size={self.vocab_size}, eos_id={self.eos_id}, pad_id={self.pad_id})"
        )

    def encode(self, text: str) -> list[int]:
        """Piece ids of ``text`` without EOS or padding."""
        return self.sp.EncodeAsIds(text)

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        return self.tokenize_counting(texts, context_length)[0]

    def tokenize_counting(self, texts: str | list[str], context_length: int | None = None) -> tuple[torch.Tensor, int]:
        """``(tokens, number of texts cut)``: a text is cut when its pieces + EOS exceed the context."""
        if isinstance(texts, str):
            texts = [texts]
        length = context_length or self.context_length
        out = torch.full((len(texts), length), self.pad_id, dtype=torch.long)
        cut = 0
        for i, ids in enumerate(self.sp.EncodeAsIds(list(texts))):
            cut += len(ids) > length - 1
            ids = ids[: length - 1] + [self.eos_id]  # truncation keeps EOS
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out, cut

    def decode(self, tokens) -> list[str]:
        """Inverse of ``__call__`` (row-wise; stops at EOS)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        if tokens and isinstance(tokens[0], int):
            tokens = [tokens]
        out = []
        for row in tokens:
            if self.eos_id in row:
                row = row[: row.index(self.eos_id)]
            out.append(self.sp.DecodeIds([t for t in row if t != self.pad_id]))
        return out


# bad-data counter key of captions cut by the context length (counted apart from skipped samples)
TRUNCATED = "truncated_caption"


def tokenize_counting(tokenizer, texts: list[str]) -> tuple[torch.Tensor, int]:
    """``(tokens, captions cut by the context length)`` for any dsclip tokenizer."""
    if hasattr(tokenizer, "tokenize_counting"):
        return tokenizer.tokenize_counting(texts)
    tokens = tokenizer(texts)
    return tokens, 0


def length_summary(tokenizer: SentencePieceTokenizer, texts: Iterable[str], *, limit: int = 200_000) -> str:
    """The caption length distribution (pieces + EOS) and the share cut at the tokenizer's context."""
    lengths = []
    for text in texts:
        lengths.append(len(tokenizer.encode(text)) + 1)
        if len(lengths) >= limit:
            break
    if not lengths:
        return "no captions to measure"
    lengths.sort()
    n, ctx = len(lengths), tokenizer.context_length
    cut = sum(v > ctx for v in lengths)

    def q(p: float) -> int:
        return lengths[min(n - 1, int(p * n))]

    return (
        f"caption length in tokens incl. EOS over {n} captions: min {lengths[0]}, median {q(0.5)}, "
        f"p90 {q(0.9)}, p99 {q(0.99)}, max {lengths[-1]}; cut at context length {ctx}: {cut} ({100 * cut / n:.1f}%)"
    )


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "unigram",
    character_coverage: float = 0.9995,
    input_sentence_size: int = 2_000_000,
    hard_vocab_limit: bool = False,
    extra_options: dict | None = None,
) -> str:
    """Train a sentencepiece model on ``texts``; returns ``<model_prefix>.model``.

    Ids: pad=0, unk=1, eos=2, no BOS. ``hard_vocab_limit=False`` lets a small corpus yield fewer
    pieces than ``vocab_size`` instead of failing; read the real size from the tokenizer. The
    ``.model``/``.vocab`` files appear atomically (trained in a temp dir, then renamed), and
    training is single-threaded so the same corpus always gives the same model.
    """

    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=prefix.parent, prefix=".spm-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        n = 0
        with open(corpus, "w", encoding="utf-8") as f:
            for t in texts:
                t = " ".join(str(t).split())  # one caption per line: newlines inside a caption would split it
                if t:
                    f.write(t + "\n")
                    n += 1
        if n == 0:
            raise ValueError("train_sentencepiece: no non-empty texts to train on")
        tmp_prefix = str(Path(tmp) / "spm")
        opts = dict(
            input=str(corpus),
            model_prefix=tmp_prefix,
            vocab_size=int(vocab_size),
            model_type=model_type,
            character_coverage=character_coverage,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            hard_vocab_limit=hard_vocab_limit,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            eos_id=EOS_ID,
            bos_id=-1,
            num_threads=1,
            minloglevel=2,
        )
        opts.update(extra_options or {})
        spm.SentencePieceTrainer.Train(**opts)
        for ext in (".vocab", ".model"):  # .model last: its presence means "done"
            os.replace(tmp_prefix + ext, str(prefix) + ext)
    return str(prefix) + ".model"


def text_cfg_for(tokenizer: SentencePieceTokenizer) -> dict:
    """The ``text_cfg`` values a model needs for this tokenizer (pass them to ``create_model``)."""
    return {
        "vocab_size": tokenizer.vocab_size,
        "context_length": tokenizer.context_length,
        "pool_type": "eos",
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
    }


def check_text_cfg(tokenizer: SentencePieceTokenizer, text_cfg: dict) -> None:
    """Raise ValueError (one line) when a model's text_cfg cannot consume this tokenizer's rows."""
    vocab, ctx = int(text_cfg.get("vocab_size", 0)), int(text_cfg.get("context_length", 0))
    if vocab < tokenizer.vocab_size:
        raise ValueError(f"text vocab_size {vocab} < tokenizer vocab_size {tokenizer.vocab_size}")
    if ctx and ctx < tokenizer.context_length:
        raise ValueError(f"text context_length {ctx} < tokenizer context_length {tokenizer.context_length}")
    pool = text_cfg.get("pool_type", "argmax")
    if pool == "eos" and text_cfg.get("eos_id") != tokenizer.eos_id:
        raise ValueError(f"text_cfg eos_id {text_cfg.get('eos_id')} != tokenizer eos_id {tokenizer.eos_id}")
    if pool == "argmax" and tokenizer.eos_id != tokenizer.vocab_size - 1:
        raise ValueError(
            f"pool_type 'argmax' needs EOS to be the largest id, but this sentencepiece model has eos_id "
            f"{tokenizer.eos_id}: use pool_type 'eos' with eos_id {tokenizer.eos_id}"
        )
    if pool in ("last", "first"):
        raise ValueError(f"pool_type {pool!r} pools a padding/first token with padded sentencepiece rows: use 'eos'")
