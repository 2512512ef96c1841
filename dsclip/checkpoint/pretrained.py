"""``--pretrained FILE``: initial weights from a dsclip or OpenCLIP checkpoint, loaded without surprises.

Accepted files: ``.safetensors`` (dsclip's ``model.safetensors``, OpenCLIP's
``open_clip_model.safetensors``), ``.pt``/``.pth``/``.bin`` state dicts (OpenCLIP training checkpoints
``{"epoch", "state_dict": {"module.*"}}``, bare state dicts, ``{"model": ...}``), or a folder holding one.
The layout (dsclip or OpenCLIP native keys) is detected from the key names.

Before anything is copied, the file's key set and every shape are checked against the model
(``StateDictMismatchError`` lists every missing, unexpected and mismatched key; with OpenCLIP files
the names are OpenCLIP's). Tensors are then read lazily (safetensors ``safe_open``; ``torch.load``
with ``mmap=True``) and copied one module at a time. Under ZeRO-3 (parameters partitioned by
``zero.Init``) each module's parameters are gathered with ``deepspeed.zero.GatheredParameters(...,
modifier_rank=0)``, rank 0 copies the file's tensors in and DeepSpeed re-partitions them on exit, so
no rank ever holds more than one module's full weights, and only rank 0 reads the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch
from safetensors import safe_open
from torch import nn

from dsclip.config_base import ConfigError
from dsclip.dist import rank_world
from dsclip.model import (
    StateDictMismatchError,
    to_openclip_name,
)
from dsclip.model.openclip import expected_shapes, is_openclip_state_dict, unwrap_state_dict

WEIGHT_CANDIDATES = (
    "model.safetensors",
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.bin",
    "pytorch_model.bin",
)


class WeightSource:
    """Names and shapes of a checkpoint's tensors without reading them; ``get(name)`` reads one."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if p.is_dir():
            found = next((p / n for n in WEIGHT_CANDIDATES if (p / n).is_file()), None)
            if found is None:
                raise FileNotFoundError(f"no weights file ({', '.join(WEIGHT_CANDIDATES)}) in {p}")
            p = found
        if not p.is_file():
            raise FileNotFoundError(f"pretrained weights not found: {p}")
        self.path = p
        self.resample = {}
        self._get: Callable[[str], torch.Tensor]
        if p.suffix == ".safetensors":
            self._file = safe_open(str(p), framework="pt", device="cpu")
            raw = {k: k for k in self._file.keys()}  # noqa: SIM118 (safe_open is not a dict)
            self.shapes = {}
            for k in raw:
                self.shapes[_strip(k)] = torch.Size(self._file.get_slice(k).get_shape())
            names = {_strip(k): k for k in raw}
            self._get = lambda name: self._file.get_tensor(names[name])
        else:
            try:  # memory-mapped: tensors are read when touched
                obj = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # legacy (non-zip) torch.save format cannot be mapped
                obj = torch.load(p, map_location="cpu", weights_only=True)
            sd = unwrap_state_dict(obj)
            self.shapes = {k: v.shape for k, v in sd.items()}
            self._get = sd.__getitem__

    def get(self, name: str) -> torch.Tensor:
        return self._get(name)

    resample: dict  # names whose tensors may be resampled to the model's grid (set by load_pretrained_into)

    def is_openclip(self) -> bool:
        return is_openclip_state_dict(self.shapes)  # by key names only (OpenCLIP's ViT or a timm trunk)


def _strip(key: str) -> str:
    return key[len("module.") :] if key.startswith("module.") else key


class PretrainedMismatchError(StateDictMismatchError, ConfigError):
    """The ``--pretrained`` file doesn't fit the model (a user error: printed without a traceback)."""


POS_EMBED = {"visual.pos_embed", "visual.positional_embedding"}  # dsclip (1+N, W) / OpenCLIP (1+N, W)


def _resamplable(got: torch.Size, want: torch.Size) -> bool:
    """Image position embeddings of another square grid (another image size): resampled on load."""
    got, want = tuple(got), tuple(want)
    if len(got) != len(want) or got[-1] != want[-1] or len(got) not in (2, 3):
        return False
    g, w = got[-2] - 1, want[-2] - 1
    return g > 0 and w > 0 and math.isqrt(g) ** 2 == g and math.isqrt(w) ** 2 == w


def plan_pretrained(source: WeightSource, model_config: dict, model_name: str | None = None) -> dict[str, str]:
    """dsclip state-dict name -> name in ``source``, after checking keys and shapes in full.

    A mismatch raises a one-line ``PretrainedMismatchError`` naming the first mismatching tensor with
    both shapes (and how many others differ). Image position embeddings of another grid are allowed:
    ``load_pretrained_into`` resamples them (``--force-image-size``)."""

    expected = expected_shapes(model_config)
    plan, want_shapes = {}, {}  # dsclip name -> source name / source-layout shape
    for name, shape in expected.items():
        if source.is_openclip():
            plan[name], want_shapes[name] = to_openclip_name(name, shape, model_config)
        else:
            plan[name], want_shapes[name] = name, shape
    have = {k: tuple(v) for k, v in source.shapes.items()}
    if source.is_openclip():
        for key in ("logit_scale", "logit_bias"):  # OpenCLIP stores 0-dim or (1,)
            if key in have and math.prod(have[key]) == 1:
                have[key] = ()
    want = {plan[n]: tuple(want_shapes[n]) for n in plan}
    missing = [k for k in want if k not in have]
    unexpected = sorted(k for k in have if k not in want)
    shape_bad = [
        k for k in want if k in have and have[k] != want[k] and not (k in POS_EMBED and _resamplable(have[k], want[k]))
    ]
    if missing or unexpected or shape_bad:
        arch = f"--model {model_name}" if model_name else "the model"
        if shape_bad:
            k = shape_bad[0]
            first = f"first mismatch {k}: file {have[k]} vs model {want[k]}"
        elif missing:
            first = f"first missing tensor {missing[0]} {want[missing[0]]}"
        else:
            first = f"first unexpected tensor {unexpected[0]} {have[unexpected[0]]}"
        counts = f"{len(shape_bad)} shape mismatch(es), {len(missing)} missing, {len(unexpected)} unexpected"
        msg = f"pretrained weights {source.path} do not fit {arch}: {first} ({counts})"
        if any("token_embedding" in k for k in shape_bad):
            msg += (
                "; the text vocabulary differs: use the tokenizer the weights were trained with "
                "(OpenCLIP weights: --tokenizer open_clip:<model name>)"
            )
        raise PretrainedMismatchError(msg)
    return plan


def resample_pos_embed(value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """(1+N, W) or (1, 1+N, W) class token + square grid -> ``shape``'s grid, with timm's
    ``resample_abs_pos_embed`` (bicubic, antialiased; the class token is kept)."""
    from timm.layers import resample_abs_pos_embed

    v = value.reshape(1, -1, value.shape[-1]).float()
    n_new = shape[-2] - 1
    side = math.isqrt(n_new)
    out = resample_abs_pos_embed(v, new_size=[side, side], num_prefix_tokens=1)
    return out.reshape(shape).to(value.dtype)


def _is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")  # a ZeRO-3 (zero.Init) parameter


def load_pretrained_into(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy ``path``'s weights into ``model`` (a dsclip ``CLIP``, possibly ZeRO-3 partitioned), in place.

    Collective under ZeRO-3 (every rank must call it); otherwise each rank loads on its own."""
    source = WeightSource(path)
    plan = plan_pretrained(source, model.config)
    for n in plan:  # position embeddings of another image size: resampled (timm) while copying
        if n == "visual.pos_embed":
            source.resample[plan[n]] = model.config["vision_cfg"]
    rank, world = rank_world()
    copied = 0
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = {n: p for n, p in module.named_parameters(recurse=False) if prefix + n in plan}
        buffers = {n: b for n, b in module.named_buffers(recurse=False) if prefix + n in plan}
        if not params and not buffers:
            continue
        partitioned = [p for p in params.values() if _is_partitioned(p)]
        if partitioned:
            _check_zero3_import(world)
            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
                if rank == 0:
                    copied += _copy(source, plan, prefix, params)
        else:
            copied += _copy(source, plan, prefix, params)
        copied += _copy(source, plan, prefix, buffers)  # buffers are never partitioned
    if rank == 0 and copied != len(plan):  # every checked key must have found its tensor in the model
        raise RuntimeError(f"copied {copied} of {len(plan)} tensors from {source.path}")


# The oldest DeepSpeed this import is proven on under ZeRO-3 with more than one rank. On 0.19.2 (CI's oldest),
# 0.19.5 and 0.19.7 rank 0's copies inside GatheredParameters(modifier_rank=0) did not all reach the other
# ranks (ZeRO-3 persistent parameters; copying on every rank instead fixed 0.19.7 but not 0.19.2): their
# embeddings were off OpenCLIP's by up to 0.1 (tests/dist/test_convert.py). Refused there, in one line.
ZERO3_IMPORT_MIN = "0.19.8"


def _check_zero3_import(world: int) -> None:
    from dsclip.engine.versions import at_least, deepspeed_version

    if world > 1 and not at_least(ZERO3_IMPORT_MIN):
        raise ConfigError(
            f"--pretrained under ZeRO-3 on {world} ranks needs DeepSpeed >= {ZERO3_IMPORT_MIN}: DeepSpeed "
            f"{deepspeed_version()} loses part of the copied weights; upgrade DeepSpeed, or start from the weights "
            f"under ZeRO-2 (--deepspeed-config zero2_bf16) or on one rank"
        )


@torch.no_grad()
def _copy(source: WeightSource, plan: dict[str, str], prefix: str, tensors: dict[str, torch.Tensor]) -> int:
    for name, t in tensors.items():
        value = source.get(plan[prefix + name])
        if value.numel() != t.numel() and plan[prefix + name] in source.resample:
            value = resample_pos_embed(value, t.shape)
        t.copy_(value.reshape(t.shape))  # OpenCLIP's 0-dim logit_scale / (1,1,W) class token -> dsclip shapes
    return len(tensors)


# --- --pretrained by name: OpenCLIP tags and hf-hub models, through open_clip's own registry -------------
HF_HUB = "hf-hub:"
OPEN_CLIP = "open_clip:"
OPENCLIP_BPE_VOCAB = 49408  # OpenCLIP's SimpleTokenizer (OpenAI BPE)
_WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


@dataclass
class ResolvedPretrained:
    path: str  # a local weights file
    model: str  # the architecture name the weights belong to (for messages and run names)
    model_cfg: dict | None  # the weights' own architecture (hf-hub: the repo's open_clip_config.json)
    tokenizer: str | None  # the dsclip tokenizer spec those weights were trained with
    quick_gelu: bool = False  # OpenCLIP's pretrained cfg asks for QuickGELU (OpenAI weights)


def _open_clip(what: str):
    try:
        import open_clip
    except ImportError:
        raise ConfigError(
            f"--pretrained {what} needs OpenCLIP's registry: pip install 'dsclip[openclip]' (or open_clip_torch)"
        ) from None
    return open_clip


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _export_folder(p: Path) -> ResolvedPretrained:
    """An export folder (dsclip convert, OpenCLIP local-dir): its architecture and tokenizer come with it."""
    cfg_file = p / "open_clip_config.json" if (p / "open_clip_config.json").is_file() else p / "config.json"
    cfg = json.loads(cfg_file.read_text())
    tokenizer = None
    if (p / "tokenizer.model").is_file():
        tokenizer = str(p / "tokenizer.model")
    elif cfg_file.name == "open_clip_config.json":
        tokenizer = f"{OPEN_CLIP}local-dir:{p}"
    return ResolvedPretrained(str(p), str(p), cfg.get("model_cfg", cfg), tokenizer)


def _weights_file(model: str, pretrained: str) -> ResolvedPretrained:
    """A weights file, used as is; an OpenCLIP file with OpenCLIP's BPE vocabulary was trained with
    OpenCLIP's tokenizer."""
    src = WeightSource(Path(pretrained))
    vocab = src.shapes.get("token_embedding.weight", (0,))[0] if src.is_openclip() else 0
    return ResolvedPretrained(pretrained, model, None, f"{OPEN_CLIP}{model}" if vocab == OPENCLIP_BPE_VOCAB else None)


def _hf_hub(pretrained: str, cache_dir: str | None) -> ResolvedPretrained:
    """``hf-hub:ORG/NAME`` through open_clip's own download (Hugging Face cache, HF_HUB_OFFLINE honoured)."""
    repo = pretrained[len(HF_HUB) :].strip("/")
    _open_clip(pretrained)
    from open_clip.pretrained import download_pretrained_from_hf

    try:
        cfg_path = download_pretrained_from_hf(repo, filename="open_clip_config.json", cache_dir=cache_dir)
        weights = download_pretrained_from_hf(repo, cache_dir=cache_dir)
    except Exception as e:  # huggingface_hub raises many types (offline, 404, gated, ...)
        raise ConfigError(
            f"--pretrained {pretrained}: no OpenCLIP model found on the Hugging Face hub or in its cache "
            f"({_first_line(e)})"
        ) from None
    cfg = json.loads(Path(cfg_path).read_text())
    model_cfg = cfg.get("model_cfg", cfg)
    return ResolvedPretrained(weights, pretrained, model_cfg, OPEN_CLIP + pretrained)


def _registry_name(model: str, pretrained: str) -> tuple[str, str]:
    """(architecture, tag) of ``open_clip:MODEL/TAG`` or of a bare TAG of ``--model``; a path-like name
    that is not a file is a missing file, not a tag."""
    if pretrained.startswith(OPEN_CLIP):
        rest = pretrained[len(OPEN_CLIP) :]
        if "/" not in rest:
            raise ConfigError(
                f"--pretrained {pretrained}: expected open_clip:MODEL/TAG (e.g. open_clip:ViT-B-32/openai)"
            )
        model, tag = rest.rsplit("/", 1)
        return model, tag
    if pretrained.endswith(_WEIGHT_SUFFIXES) or "/" in pretrained or os.sep in pretrained:
        raise FileNotFoundError(f"pretrained weights not found: {pretrained}")
    return model, pretrained


def _openclip_registry(model: str, pretrained: str, cache_dir: str | None) -> ResolvedPretrained:
    """OpenCLIP's pretrained registry: ``get_pretrained_cfg`` + ``download_pretrained`` (OpenCLIP's cache)."""
    model, tag = _registry_name(model, pretrained)
    oc = _open_clip(pretrained)
    pcfg = oc.get_pretrained_cfg(model, tag)
    if not pcfg:
        tags = oc.list_pretrained_tags_by_model(model)
        if tags:
            raise ConfigError(
                f"--pretrained {tag!r} is neither a file nor an OpenCLIP tag of {model}; its tags: {', '.join(tags)}"
            )
        raise ConfigError(
            f"--pretrained {tag!r} is neither a file nor an OpenCLIP tag: OpenCLIP has no pretrained weights for "
            f"{model!r} (open_clip.list_pretrained() lists them)"
        )
    try:
        weights = oc.download_pretrained(pcfg, cache_dir=cache_dir)
    except Exception as e:
        raise ConfigError(f"--pretrained {model}/{tag}: download failed ({_first_line(e)})") from None
    if not weights:
        raise ConfigError(f"--pretrained {model}/{tag}: OpenCLIP's registry gives no download location")
    return ResolvedPretrained(weights, model, None, OPEN_CLIP + model, bool(pcfg.get("quick_gelu", False)))


def resolve_pretrained(model: str, pretrained: str, cache_dir: str | None = None) -> ResolvedPretrained:
    """``--pretrained`` -> a local weights file, the architecture and the tokenizer that go with it.

    - an existing file: used as is (architecture = ``--model``; tokenizer: ``open_clip:MODEL`` for an
      OpenCLIP file with OpenCLIP's 49408-token vocabulary, else ``--tokenizer``);
    - an export folder (``open_clip_config.json`` or dsclip's ``config.json``): its architecture, and its
      ``tokenizer.model`` (else OpenCLIP's tokenizer for that folder);
    - ``hf-hub:ORG/NAME``: the repo's ``open_clip_config.json`` and weights through open_clip's own
      ``download_pretrained_from_hf`` (Hugging Face cache; ``HF_HUB_OFFLINE=1`` works from a filled cache);
    - ``open_clip:MODEL/TAG`` or a bare ``TAG`` of ``--model``: ``open_clip.get_pretrained_cfg`` +
      ``open_clip.download_pretrained`` (``cache_dir`` = OpenCLIP's ``--cache-dir``).
    Every failure is a one-line ``ConfigError`` (an unknown tag lists the tags of that architecture)."""
    p = Path(pretrained)
    if p.is_dir() and any((p / n).is_file() for n in ("open_clip_config.json", "config.json")):
        return _export_folder(p)
    if p.exists():
        return _weights_file(model, pretrained)
    if pretrained.startswith(HF_HUB):
        return _hf_hub(pretrained, cache_dir)
    return _openclip_registry(model, pretrained, cache_dir)
