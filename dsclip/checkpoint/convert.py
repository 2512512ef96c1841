"""``dsclip convert``: a ZeRO checkpoint (any stage, any training precision) -> one ``.safetensors`` file.

    dsclip convert RUN_DIR | CHECKPOINTS_DIR | TAG_DIR [--tag step_000000120] -o OUT
                   [--dtype fp32|bf16|fp16] [--format dsclip|open_clip|hf] [--model-config FILE]

- ``--format dsclip`` (default): ``OUT/model.safetensors`` + ``OUT/config.json`` ({"model_cfg": ...,
  "preprocess_cfg": the run's image settings, when set}), the
  format ``dsclip.model.load_model`` and ``dsclip eval --model OUT`` read. ``OUT`` may also name the
  ``.safetensors`` file itself; the config goes beside it.
- ``--format open_clip``: OpenCLIP's native keys and shapes (0-dim ``logit_scale``, fused ``in_proj_weight``,
  ``[width, embed]`` projections) in ``OUT/open_clip_model.safetensors`` + ``OUT/open_clip_config.json``:
  ``open_clip.create_model_and_transforms("local-dir:OUT")``, or for a standard architecture
  ``open_clip.create_model_and_transforms("ViT-B-32", pretrained="OUT/open_clip_model.safetensors")``.
  Its ``preprocess_cfg`` carries the run's ``--image-mean``/``--image-std``/``--image-interpolation``/
  ``--image-resize-mode`` (from ``RUN/run_config.yaml``), so OpenCLIP's eval transform is the run's.
- ``--format hf``: a folder ``transformers.CLIPModel.from_pretrained(OUT)`` loads (SigLIP: ``SiglipModel``),
  with the tokenizer and image processor ``CLIPProcessor.from_pretrained(OUT)`` reads; what transformers cannot
  express is refused in one line (``dsclip.checkpoint.hf_export``). It also takes a weights file or an export
  folder (dsclip's or OpenCLIP's layout, ``--pretrained``-style) in place of a run.
- The run's tokenizer (``<run>/tokenizer.model``, recorded by the training loop) is copied to
  ``OUT/tokenizer.model`` (``dsclip eval`` picks it up from there). With ``--format open_clip`` it is also
  written as Hugging Face ``tokenizer.json`` (+ config) and ``text_cfg.hf_tokenizer_name`` is set, so
  ``open_clip.get_tokenizer("local-dir:OUT")`` tokenizes exactly as dsclip (``dsclip.data.hf_tokenizer``).

The weights are the fp32 master copies the optimizer holds (not the bf16/fp16 compute copies),
consolidated by DeepSpeed's own ``zero_to_fp32`` in its lazy mode and streamed into the output one
tensor at a time: no training world, no GPU, and at most about one copy of the weights in memory
(ZeRO-3: one parameter at a time, the shards are memory-mapped; ZeRO-1/2: one fp32 copy, the size
of the flat partitions). Tags without a ``COMPLETE`` marker (an interrupted save) are refused, and so
are tags that fail their manifest (a flipped, truncated or missing file: one line naming it); a tag
written by an older dsclip (no manifest) is converted with a note that it is unverified. An existing
output (a file, or a folder that is not empty) is never overwritten without ``--force``; with it, the
files convert writes are replaced and other files in the folder are left alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from dsclip.checkpoint.convert_cli import DTYPE_NAMES, main_convert  # noqa: F401 (re-exported: the entry point)
from dsclip.checkpoint.ds_checkpoint import (
    COMPLETE,
    LATEST,
    MODEL_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_SPEC_FILE,
    complete_tags,
    latest_complete,
    verify_tag,
)
from dsclip.checkpoint.layout import RUN_CONFIG_FILE
from dsclip.checkpoint.safe_load import data_only, load_data
from dsclip.config_base import ConfigError
from dsclip.data.transforms import openclip_preprocess_cfg
from dsclip.model import create_model, get_model_config
from dsclip.model.openclip import (
    check_state_dict,
    expected_shapes,
    openclip_model_config,
    to_openclip_name,
    to_openclip_tensor,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert sorted(DTYPES) == list(DTYPE_NAMES)  # the flag's choices, spelled in convert_cli without torch
_ST_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# --- which checkpoint -------------------------------------------------------------------------------
def find_checkpoint(path: str | os.PathLike, tag: str | None = None) -> tuple[Path, str]:
    """A run folder, its ``checkpoints`` folder or one tag folder (+ optional ``--tag``) -> (ckpt_dir, tag).

    Without ``--tag``: the tag itself, or the newest complete one (what ``latest`` names). A tag
    without ``COMPLETE`` raises ``ConfigError`` (its shards may be partial)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path not found: {p}")
    is_tag_dir = (p / COMPLETE).exists() or any(p.glob("*model_states.pt"))
    if is_tag_dir and tag is None:
        ckpt_dir, tag = p.parent, p.name
    else:
        ckpt_dir = (
            p if (p / LATEST).exists() or complete_tags(p) or not (p / "checkpoints").is_dir() else p / "checkpoints"
        )
        if tag is None:
            tag = latest_complete(ckpt_dir)
            if tag is None:
                raise ConfigError(f"no complete checkpoint in {ckpt_dir}")
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"checkpoint tag not found: {tag_dir}")
    if not (tag_dir / COMPLETE).exists():
        others = ", ".join(complete_tags(ckpt_dir)) or "none"
        raise ConfigError(
            f"checkpoint {tag_dir} is incomplete (no {COMPLETE} marker: its save was interrupted); "
            f"complete tags: {others}"
        )
    return ckpt_dir, tag


def checkpoint_model_config(ckpt_dir: Path, tag: str, override: str | None = None) -> dict:
    """The resolved model config the run trained (``<tag>/model_config.json``), or ``--model-config``."""

    if override:
        p = Path(override)
        cfg = json.loads(p.read_text()) if p.is_file() else get_model_config(override)
        cfg = cfg.get("model_cfg", cfg)
    else:
        f = ckpt_dir / tag / MODEL_CONFIG_FILE
        if not f.is_file():
            raise ConfigError(
                f"{f} not found (checkpoint written before dsclip recorded the model config): "
                "pass --model-config CONFIG.json (the run's resolved model config)"
            )
        cfg = json.loads(f.read_text())["model_cfg"]
    return create_model(cfg, device="meta").config  # resolved, as save_model writes it


# --- reading the shards lazily -----------------------------------------------------------------------
@dataclass
class LazyTensor:
    shape: torch.Size
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]


def lazy_fp32_state_dict(ckpt_dir: Path, tag: str) -> dict[str, LazyTensor]:
    """name -> LazyTensor of the consolidated fp32 master weights (DeepSpeed's zero_to_fp32, lazy mode).

    Without ZeRO optimizer shards (ZeRO-0 / no ZeRO) the module weights of the model-states file are
    used (memory-mapped), in the dtype they were saved in."""
    tag_dir = ckpt_dir / tag
    with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints progress; keep stdout for our result
        if any(tag_dir.glob("*_optim_states.pt")):
            sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag, lazy_mode=True)
        else:
            files = sorted(tag_dir.glob("*model_states.pt"))
            if not files:
                raise FileNotFoundError(f"no DeepSpeed model states in {tag_dir}")
            sd = load_data(files[0], map_location="cpu", mmap=True)["module"]
    return {name: LazyTensor(torch.Size(t.shape), t.dtype, t.contiguous) for name, t in sd.items()}


# --- writing safetensors one tensor at a time --------------------------------------------------------
def write_safetensors_streaming(path: Path, items: list[tuple[str, LazyTensor]], metadata: dict[str, str]) -> None:
    """Write a safetensors file materialising one tensor at a time (the header is computed from shapes
    first). Written to a temporary name and renamed, so the output is never half a file."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in items:
        nbytes = math.prod(t.shape) * torch.empty((), dtype=t.dtype).element_size()
        header[name] = {
            "dtype": _ST_DTYPE[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, t in items:
                value = t.load()
                if tuple(value.shape) != tuple(t.shape) or value.dtype != t.dtype:
                    raise RuntimeError(
                        f"{name}: got {value.dtype} {tuple(value.shape)}, expected {t.dtype} {tuple(t.shape)}"
                    )
                f.write(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                del value
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written weights left beside the output
        raise
    os.replace(tmp, path)


def ema_state_dict(tag_dir: Path) -> dict[str, LazyTensor]:
    """name -> the EMA weights, reassembled from every rank's ``ema_rankNNNNN.pt`` (their segments say which
    elements of which parameter each rank's flat partition holds); no DeepSpeed needed."""
    from dsclip.engine.ema import assemble

    files = sorted(tag_dir.glob("ema_rank*.pt"))
    if not files:
        raise ConfigError(f"{tag_dir} holds no EMA (the run had no --ema-decay): convert without --ema")
    try:
        full = assemble([load_data(f, map_location="cpu") for f in files])
    except ValueError as e:
        raise ConfigError(f"{tag_dir}: {e}") from None
    return {k: LazyTensor(t.shape, t.dtype, lambda t=t: t) for k, t in full.items()}


def _cast(t: LazyTensor, dtype: torch.dtype) -> LazyTensor:
    if not t.dtype.is_floating_point or t.dtype == dtype:
        return t
    return LazyTensor(t.shape, dtype, lambda: t.load().to(dtype))


def _to_openclip(name: str, t: LazyTensor, cfg: dict) -> tuple[str, LazyTensor]:
    oc_name, oc_shape = to_openclip_name(name, t.shape, cfg)  # the layout (timm tower, custom text) is cfg's
    return oc_name, LazyTensor(oc_shape, t.dtype, lambda: to_openclip_tensor(name, t.load(), cfg)[1])


# --- the conversion ----------------------------------------------------------------------------------
CONVERT_FIX = "convert an earlier tag with --tag ({earlier})"


def _weights_path(out: Path, fmt: str) -> Path:
    default_name = "open_clip_model.safetensors" if fmt == "open_clip" else "model.safetensors"
    return out if out.suffix == ".safetensors" else out / default_name


def check_output(out: Path, fmt: str, *, force: bool) -> None:
    """Refuse (one line) an output that exists, unless ``force``: a file, a folder with anything in it (an
    empty folder, e.g. from mktemp -d, overwrites nothing), or for ``-o X.safetensors`` that file or the
    config beside it. With ``force``, a plain file where the output folder goes is removed, so the folder
    can be made."""
    weights = _weights_path(out, fmt)
    if fmt == "hf" and out.suffix == ".safetensors":
        raise ConfigError(f"--format hf writes a folder (config, weights, tokenizer): pass -o FOLDER, not {out}")
    if out.suffix == ".safetensors":  # the weights file and the config beside it
        config = weights.parent / ("config.json" if fmt == "dsclip" else "open_clip_config.json")
        taken = next((p for p in (weights, config) if p.exists()), None)
    else:
        taken = out if out.is_file() or (out.is_dir() and any(out.iterdir())) else None
    if taken is None:
        return
    if not force:
        what = "a file" if taken.is_file() else "a folder that is not empty"
        raise ConfigError(f"output {taken} already exists ({what}); pass --force to overwrite it, or choose another -o")
    if taken.is_file() and taken != weights:
        taken.unlink()


def _checked_tensors(
    ckpt_dir: Path, tag: str, cfg: dict, dtype: torch.dtype, *, ema: bool = False
) -> list[tuple[str, LazyTensor]]:
    """The tag's consolidated fp32 tensors (with ``ema``, the sharded EMA's in place of the trained ones), lazily
    read, shape-checked against ``cfg`` and cast to ``dtype``."""
    try:
        with data_only():  # DeepSpeed's zero_to_fp32 calls torch.load itself: data only (dsclip.checkpoint.safe_load)
            lazy = lazy_fp32_state_dict(ckpt_dir, tag)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:  # a damaged shard of an unverified (old) tag
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"checkpoint {ckpt_dir / tag} cannot be read ({first}); convert an earlier tag with --tag"
        ) from e
    if ema:  # the sharded EMA (dsclip.engine.ema) in place of the trained weights; locked ones never move
        lazy = {**lazy, **ema_state_dict(ckpt_dir / tag)}
    meta = {k: torch.empty(t.shape, device="meta") for k, t in lazy.items()}
    check_state_dict(meta, expected_shapes(cfg), f"checkpoint {ckpt_dir / tag}")
    return [(k, _cast(t, dtype)) for k, t in lazy.items()]


def _ship_tokenizer(
    ckpt_dir: Path, folder: Path, fmt: str, cfg: dict, config: dict, hf_tokenizer_name: str | None
) -> None:
    """Copy the run's tokenizer beside the weights; for OpenCLIP, as files OpenCLIP's ``get_tokenizer``
    reads (a Hugging Face tokenizer, announced in ``config``'s text_cfg.hf_tokenizer_name)."""
    _copy_tokenizer(ckpt_dir, folder)
    spm, spec = folder / TOKENIZER_FILE, folder / TOKENIZER_SPEC_FILE
    text_cfg = config.get("model_cfg", {}).get("text_cfg", {})
    if fmt == "open_clip" and not spm.is_file() and spec.is_file() and text_cfg.get("hf_tokenizer_name"):
        # a model fine-tuned from an OpenCLIP model with a Hugging Face tokenizer (hf-hub:...): ship those
        # tokenizer files (they replace the {"tokenizer": spec} note, which OpenCLIP would misread)
        _save_hf_tokenizer(json.loads(spec.read_text())["tokenizer"], folder, text_cfg["context_length"])
        if hf_tokenizer_name:
            text_cfg["hf_tokenizer_name"] = hf_tokenizer_name
    if fmt == "open_clip" and spm.is_file():
        # OpenCLIP's own get_tokenizer("local-dir:OUT") must give dsclip's ids: a Hugging Face tokenizer.json
        # built from the sentencepiece model, announced by text_cfg.hf_tokenizer_name (OpenCLIP's mechanism).
        from dsclip.data.hf_tokenizer import write_hf_tokenizer

        try:
            write_hf_tokenizer(spm, folder, cfg["text_cfg"]["context_length"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        text_cfg = config["model_cfg"]["text_cfg"]
        text_cfg["hf_tokenizer_name"] = hf_tokenizer_name or str(folder.resolve())


def convert_checkpoint(
    ckpt_dir: Path,
    tag: str,
    out: str | os.PathLike,
    *,
    dtype: str = "fp32",
    fmt: str = "dsclip",
    model_config: str | None = None,
    hf_tokenizer_name: str | None = None,
    force: bool = False,
    ema: bool = False,
) -> Path:
    """Consolidate one complete tag into ``out`` (see the module docstring); returns the weights path.
    The tag is checked against its manifest first, and an existing ``out`` needs ``force``."""

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fmt not in ("dsclip", "open_clip", "hf"):
        raise ConfigError(f"--format must be dsclip, open_clip or hf, got {fmt!r}")
    out = Path(out)
    check_output(out, fmt, force=force)  # before reading gigabytes
    # stdout is for the result line: the unverified note (older dsclip) goes to stderr
    verify_tag(ckpt_dir / tag, "", fix=CONVERT_FIX, say=lambda m: print(m, file=sys.stderr, flush=True))
    cfg = checkpoint_model_config(ckpt_dir, tag, model_config)
    items = _checked_tensors(ckpt_dir, tag, cfg, DTYPES[dtype], ema=ema)
    if fmt == "hf":  # transformers' layout: its own module (the tensors above are read lazily, while it writes)
        from dsclip.checkpoint.hf_export import export_hf, run_tokenizer

        tokenizer = run_tokenizer(ckpt_dir.parent, cfg["text_cfg"]["context_length"])
        pre = run_preprocess_cfg(ckpt_dir.parent)
        return export_hf(items, cfg, out, preprocess_cfg=pre, tokenizer=tokenizer, say=_say_stderr)

    weights = _weights_path(out, fmt)
    weights.parent.mkdir(parents=True, exist_ok=True)
    state = _read_state(ckpt_dir / tag)
    source = {"source": str((ckpt_dir / tag).resolve()), "step": state.get("step")}
    if fmt == "dsclip":
        write_safetensors_streaming(weights, items, {"format": "dsclip"})
        config_file, config = weights.parent / "config.json", {"model_cfg": cfg, **source}
        if pre := run_preprocess_cfg(ckpt_dir.parent):  # dsclip eval evaluates with the run's preprocessing
            config["preprocess_cfg"] = pre
    else:
        write_safetensors_streaming(weights, [_to_openclip(k, t, cfg) for k, t in items], {"format": "pt"})
        config_file = weights.parent / "open_clip_config.json"
        config = openclip_model_config(cfg, run_preprocess_cfg(ckpt_dir.parent))
    _ship_tokenizer(ckpt_dir, weights.parent, fmt, cfg, config, hf_tokenizer_name)
    config_file.write_text(json.dumps(config, indent=2))
    return weights


def _say_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # stdout is for the result line


def run_preprocess_cfg(run_dir: Path) -> dict:
    """OpenCLIP ``preprocess_cfg`` entries from the run's ``--image-mean``/``--image-std``/
    ``--image-interpolation``/``--image-resize-mode`` (``RUN/run_config.yaml``, data section), so
    ``create_model_and_transforms("local-dir:OUT")`` evaluates images as the run did. No run config
    (a tag folder copied elsewhere): OpenCLIP's defaults."""
    f = run_dir / RUN_CONFIG_FILE
    if not f.is_file():
        return {}
    return openclip_preprocess_cfg((yaml.safe_load(f.read_text()) or {}).get("data", {}))


def _save_hf_tokenizer(spec: str, out_dir: Path, context_length: int) -> None:
    from dsclip.data.openclip_tokenizer import OpenCLIPTokenizer

    hf = getattr(OpenCLIPTokenizer(spec, context_length).tok, "tokenizer", None)
    if hf is None:
        raise ConfigError(f"the run's tokenizer {spec} is not a Hugging Face tokenizer, but its text_cfg names one")
    hf.save_pretrained(str(out_dir))


def _read_state(tag_dir: Path) -> dict:
    f = tag_dir / "dsclip_state.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _copy_tokenizer(ckpt_dir: Path, out_dir: Path) -> None:
    run_dir = ckpt_dir.parent
    if (run_dir / TOKENIZER_FILE).is_file():
        shutil.copyfile(run_dir / TOKENIZER_FILE, out_dir / TOKENIZER_FILE)
    elif (run_dir / TOKENIZER_SPEC_FILE).is_file():
        shutil.copyfile(run_dir / TOKENIZER_SPEC_FILE, out_dir / TOKENIZER_SPEC_FILE)
