"""Write docs/cli-reference.md from the real parsers: every ``dsclip`` command's ``--help``.

Run by ``make docs`` (and checked by tests/unit/test_docs.py), so the reference cannot drift from the
code. ``help_text`` and ``option_strings`` are also what the docs test checks flags against.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from functools import cache
from pathlib import Path

# (command words, one-line purpose); the words are what follows ``dsclip`` on a command line
COMMANDS = [
    (("train",), "train a CLIP model"),
    (("eval",), "zero-shot classification and retrieval"),
    (("convert",), "ZeRO checkpoint -> one safetensors file, or OpenCLIP's layout"),
    (("data", "write"), "write webdataset shards"),
    (("data", "inspect"), "count samples and broken samples in shards"),
    (("data", "index"), "build the shard index a training resume replays on"),
    (("tokenizer", "train"), "train a sentencepiece tokenizer"),
    (("plan",), "memory and throughput planner"),
    (("launch",), "run a launcher so that stop signals reach every rank"),
]
OUT = Path(__file__).resolve().parent / "cli-reference.md"


@cache
def help_text(words: tuple[str, ...]) -> str:
    """``dsclip WORDS --help`` as the user sees it, at a fixed width (stable across terminals)."""
    from dsclip.cli import main

    os.environ["COLUMNS"] = "100"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main([*words, "--help"])
        except SystemExit as e:  # argparse exits 0 after printing the help
            if e.code not in (0, None):
                raise
    # DeepSpeed's import-time log lines ("Setting accelerator to CPU") are not part of the help
    text = "\n".join(ln for ln in buf.getvalue().splitlines() if not re.match(r"\[\d{4}-\d\d-\d\d [\d:,]+\] \[", ln))
    return text.rstrip() + "\n"


def option_strings(words: tuple[str, ...]) -> set[str]:
    """Every ``--flag`` the command's parser accepts (``--no-X`` of boolean flags included)."""
    return set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", help_text(words))) | {"--help"}


def render() -> str:
    lines = [
        "# CLI reference",
        "",
        "Generated from the parsers by `docs/gen_cli_reference.py` (`make docs`); do not edit by hand.",
        "",
    ]
    for words, purpose in COMMANDS:
        lines += [
            f"## dsclip {' '.join(words)}",
            "",
            purpose + ".",
            "",
            "```text",
            help_text(words).rstrip(),
            "```",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    text = render()
    if OUT.exists() and OUT.read_text() == text:
        print(f"{OUT}: already in sync")
    else:
        OUT.write_text(text)
        print(f"{OUT}: written")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
