"""``dsclip convert``'s flags and entry point; the conversion itself is dsclip.checkpoint.convert.

Why apart: the converter imports torch and DeepSpeed's zero_to_fp32 at module level, and ``dsclip convert
--help`` or a flag error must print without loading them (issue #33).
"""

from __future__ import annotations

import argparse

from dsclip.config_base import ConfigError

# the --dtype choices (dsclip.checkpoint.convert.DTYPES maps them to torch dtypes and checks it is these)
DTYPE_NAMES = ("bf16", "fp16", "fp32")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsclip convert", description="Consolidate a ZeRO checkpoint into one .safetensors file."
    )
    p.add_argument(
        "path",
        help="Run folder, its checkpoints/ folder, or one checkpoint tag folder; with --format hf also a weights "
        "file or export folder (dsclip's or OpenCLIP's layout, as --pretrained takes).",
    )
    p.add_argument("--tag", help="Checkpoint tag (e.g. step_000000120). Default: the newest complete one.")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="Output folder (or a .safetensors file name; the config goes beside it).",
    )
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES, help="Dtype of the floating tensors.")
    p.add_argument(
        "--format",
        default="dsclip",
        choices=["dsclip", "open_clip", "hf"],
        help="dsclip: model.safetensors + config.json; open_clip: OpenCLIP's layout + open_clip_config.json; "
        "hf: a folder transformers' CLIPModel (SigLIP: SiglipModel) and CLIPProcessor load.",
    )
    p.add_argument(
        "--hf-tokenizer-name",
        help="open_clip format, sentencepiece runs: text_cfg.hf_tokenizer_name written to open_clip_config.json "
        "(default: the output folder; set ORG/NAME when you upload the folder to the Hugging Face hub).",
    )
    p.add_argument(
        "--model-config",
        help="Model config (JSON file or architecture name) for checkpoints that lack model_config.json.",
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="Export the EMA weights (a run trained with --ema-decay) instead of the trained ones.",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="Overwrite an existing output (the files convert writes; other files in the folder stay).",
    )
    return p


def main_convert(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    # after the flags: the converter loads torch, DeepSpeed's zero_to_fp32 and the model
    from dsclip.checkpoint.convert import convert_checkpoint, find_checkpoint
    from dsclip.model import StateDictMismatchError

    if a.format == "hf" and _is_weights_input(a.path, a.tag):
        return _convert_weights_file(a)
    ckpt_dir, tag = find_checkpoint(a.path, a.tag)
    try:
        weights = convert_checkpoint(
            ckpt_dir,
            tag,
            a.output,
            dtype=a.dtype,
            fmt=a.format,
            model_config=a.model_config,
            hf_tokenizer_name=a.hf_tokenizer_name,
            force=a.force,
            ema=a.ema,
        )
    except StateDictMismatchError as e:  # a --model-config that doesn't fit: say which keys, no traceback
        raise ConfigError(str(e).replace("\n", "; ")) from e
    size = weights.stat().st_size
    what = f"{a.dtype}, {a.format}" + (", EMA weights" if a.ema else "")
    print(f"converted {ckpt_dir / tag} -> {weights} ({size / 2**20:.1f} MiB, {what})", flush=True)
    return 0


def _is_weights_input(path: str, tag: str | None) -> bool:
    from pathlib import Path

    from dsclip.checkpoint.hf_export import is_weights_input

    return tag is None and is_weights_input(Path(path))


def _convert_weights_file(a: argparse.Namespace) -> int:
    """``--format hf`` of a weights file or export folder (``--pretrained``-style input)."""
    import sys
    from pathlib import Path

    from dsclip.checkpoint.convert import DTYPES, check_output
    from dsclip.checkpoint.hf_export import convert_weights_file
    from dsclip.model import StateDictMismatchError

    if a.ema:
        raise ConfigError(f"--ema needs a run's checkpoint; {a.path} is a weights file")
    check_output(Path(a.output), "hf", force=a.force)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # stdout is for the result line
    try:
        weights = convert_weights_file(a.path, a.output, dtype=DTYPES[a.dtype], model_config=a.model_config, say=say)
    except StateDictMismatchError as e:
        raise ConfigError(str(e).replace("\n", "; ")) from e
    print(f"converted {a.path} -> {weights} ({weights.stat().st_size / 2**20:.1f} MiB, {a.dtype}, hf)", flush=True)
    return 0
