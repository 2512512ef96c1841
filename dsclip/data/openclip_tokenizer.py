"""OpenCLIP's tokenizer behind dsclip's tokenizer interface (optional: needs ``open_clip_torch``).

``--tokenizer open_clip:ViT-B-32`` trains/evaluates with the tokenizer an imported OpenCLIP text tower
was trained with (BPE, 49408 tokens, ``<start_of_text> ... <end_of_text>`` then zeros; the text tower
pools at the end-of-text token, the largest id, so configs use ``pool_type: argmax``).
``open_clip:hf-hub:ORG/NAME`` and ``open_clip:local-dir:DIR`` give whatever ``open_clip.get_tokenizer``
gives for that model (its Hugging Face tokenizer when the config names one).
Same interface as ``SentencePieceTokenizer``: ``tok(list[str]) -> LongTensor (N, context_length)`` and
``vocab_size``, ``eos_id``, ``pad_id``; picklable (rebuilt from its name in DataLoader workers).
"""

from __future__ import annotations

import torch

PREFIX = "open_clip:"


class OpenCLIPTokenizer:
    def __init__(self, name: str, context_length: int = 77):
        if name.startswith(PREFIX):
            name = name[len(PREFIX) :]
        try:  # lazy: open_clip_torch is an optional dependency (extra 'openclip')
            import open_clip
        except ImportError as e:
            raise ValueError(f"--tokenizer {PREFIX}{name} needs open_clip_torch (pip install open_clip_torch)") from e
        self.name = name
        self.spec = PREFIX + name  # recorded in the run folder (dsclip.checkpoint.ds_checkpoint.record_tokenizer)
        self.context_length = int(context_length)
        self.tok = open_clip.get_tokenizer(name, context_length=self.context_length)
        hf = getattr(self.tok, "tokenizer", None)  # open_clip.tokenizer.HFTokenizer (hf_tokenizer_name models)
        if hf is not None:
            self.vocab_size = len(hf)
            self.eos_id = int(hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id)
            self.pad_id = int(hf.pad_token_id or 0)
        else:  # OpenCLIP's BPE SimpleTokenizer
            self.vocab_size = int(getattr(self.tok, "vocab_size", 0) or len(self.tok.encoder))
            self.eos_id = int(self.tok.eot_token_id)
            self.pad_id = 0  # OpenCLIP pads with zeros

    def __getstate__(self):
        return {"name": self.name, "context_length": self.context_length}

    def __setstate__(self, state):
        self.__init__(state["name"], state["context_length"])

    def __repr__(self) -> str:
        return f"OpenCLIPTokenizer({self.name!r}, context_length={self.context_length})"

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        return self.tok(list(texts), context_length=context_length or self.context_length).long()

    def tokenize_counting(self, texts: list[str]) -> tuple[torch.Tensor, int]:
        """``(tokens, rows that fill the whole context)``: OpenCLIP's tokenizers pad with 0 after EOT and
        do not report truncation, so a caption that fits exactly is counted as cut too."""
        tokens = self(texts)
        return tokens, int((tokens[:, -1] != 0).sum())
