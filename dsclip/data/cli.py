"""``dsclip data`` and ``dsclip tokenizer`` entry points (implemented in dsclip.data.tools)."""

from .tools import main_data, main_tokenizer

__all__ = ["main_data", "main_tokenizer"]
