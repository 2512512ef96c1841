"""A dsclip SentencePiece tokenizer as Hugging Face tokenizer files, so OpenCLIP tokenizes like dsclip.

OpenCLIP's ``get_tokenizer("local-dir:DIR")`` returns ``HFTokenizer(DIR)`` (``transformers.AutoTokenizer``)
when ``DIR/open_clip_config.json`` has a non-empty ``text_cfg.hf_tokenizer_name``; otherwise its BPE
tokenizer, whose ids (up to 49407) do not fit a sentencepiece-trained text tower. ``write_hf_tokenizer``
builds the same tokenizer with the ``tokenizers`` library from the sentencepiece model itself:

- model: ``Unigram`` with the sentencepiece pieces and scores (same Viterbi segmentation), or for BPE
  models (the demo tokenizer) ``BPE`` with merges ranked by the merged piece's score;
- normalizer: sentencepiece's precompiled NFKC char map, outer whitespace stripped, runs of spaces
  collapsed (``remove_extra_whitespaces``); pre-tokenizer: ``Metaspace`` ("▁", prefix always added:
  ``add_dummy_prefix``);
- post-processor: ``$A </s>`` — dsclip's row layout ``[pieces..., EOS, PAD...]`` (no BOS); HF truncation
  keeps room for EOS exactly as dsclip's ``ids[: L - 1] + [EOS]``; padding with the pad piece's id.

Unigram (``dsclip tokenizer train``'s default) and BPE models are converted; other model types (word,
char) get a clear error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_UNIGRAM, _BPE = 1, 2  # sentencepiece TrainerSpec.ModelType


def bpe_merges(pieces: list[tuple[str, float]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """sentencepiece BPE merges highest-score symbols first; as ranked merges: every split of every piece
    into two known pieces, ordered by the merged piece's score (then by the parts' ids), as
    ``transformers``' SentencePieceExtractor derives them."""
    merges = []
    for piece, score in pieces:
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: ties keep the order above
    return [(a, b) for a, b, _ in merges]


def write_hf_tokenizer(spm_model: str | os.PathLike, out_dir: str | os.PathLike, context_length: int) -> list[Path]:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` into ``out_dir``."""
    try:
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import Tokenizer  # noqa: F401  (checked here: one message for either missing package)
    except ImportError as e:
        raise ValueError(
            f"exporting a sentencepiece tokenizer for OpenCLIP needs the 'tokenizers' and 'protobuf' packages "
            f"(pip install 'dsclip[openclip]'): {e}"
        ) from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(spm_model).read_bytes())
    trainer = proto.trainer_spec
    if trainer.model_type not in (_UNIGRAM, _BPE):
        raise ValueError(
            f"{spm_model}: only unigram and BPE sentencepiece models can be exported for OpenCLIP "
            f"(this one has model_type {trainer.model_type})"
        )
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if trainer.eos_id < 0:
        raise ValueError(f"{spm_model}: sentencepiece model has no EOS piece")
    eos = pieces[trainer.eos_id][0]
    pad_id = trainer.pad_id if trainer.pad_id >= 0 else 0  # dsclip pads with 0 when the model has no pad piece
    pad, unk = pieces[pad_id][0], pieces[trainer.unk_id][0]
    tok = _hf_tokenizer(proto, pieces, eos, unk)
    return _save(tok, Path(out_dir), context_length, {"eos_token": eos, "pad_token": pad, "unk_token": unk})


def _hf_tokenizer(proto, pieces: list[tuple[str, float]], eos: str, unk: str):
    """A ``tokenizers.Tokenizer`` giving the sentencepiece model's ids: its unigram or BPE model, its
    normalizer (precompiled charsmap, whitespace folding), the ``▁`` pre-tokenizer and EOS appended."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type == _UNIGRAM:
        model = models.Unigram(pieces, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
    else:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        model = models.BPE(
            vocab, bpe_merges(pieces, vocab), unk_token=unk, fuse_unk=True, byte_fallback=trainer.byte_fallback
        )
    tok = Tokenizer(model)
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if steps:
        tok.normalizer = normalizers.Sequence(steps)
    scheme = "always" if norm.add_dummy_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, trainer.eos_id)])
    return tok


def _save(tok, out: Path, context_length: int, special: dict) -> list[Path]:
    """tokenizer.json and the two files transformers' PreTrainedTokenizerFast reads beside it."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    tok.save(str(written[0]))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(context_length),
        "padding_side": "right",
        "truncation_side": "right",
        "clean_up_tokenization_spaces": False,
        **special,
    }
    written[1].write_text(json.dumps(config, indent=2))
    written[2].write_text(json.dumps(special, indent=2))
    return written
