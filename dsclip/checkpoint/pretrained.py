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

import os
from collections.abc import Callable
from pathlib import Path

import deepspeed
import torch
from safetensors import safe_open
from torch import nn

from dsclip.config_base import ConfigError
from dsclip.dist import rank_world
from dsclip.model import (
    StateDictMismatchError,
    create_model,
    from_openclip_state_dict,
    load_model,
    to_openclip_state_dict,
)
from dsclip.model.openclip import check_state_dict, expected_shapes, unwrap_state_dict

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

    def is_openclip(self) -> bool:
        return "visual.conv1.weight" in self.shapes or "visual.class_embedding" in self.shapes


def _strip(key: str) -> str:
    return key[len("module.") :] if key.startswith("module.") else key


def _meta(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


class PretrainedMismatchError(StateDictMismatchError, ConfigError):
    """The ``--pretrained`` file doesn't fit the model (a user error: printed without a traceback)."""


def plan_pretrained(source: WeightSource, model_config: dict) -> dict[str, str]:
    """dsclip state-dict name -> name in ``source``, after checking keys and shapes in full."""
    try:
        return _plan(source, model_config)
    except StateDictMismatchError as e:
        msg = str(e)
        if "token_embedding" in msg:
            msg += (
                "\n  hint: the text vocabulary differs; train/evaluate with the tokenizer these weights were "
                "trained with (OpenCLIP weights: --tokenizer open_clip:<model name>)"
            )
        raise PretrainedMismatchError(msg) from None


def _plan(source: WeightSource, model_config: dict) -> dict[str, str]:

    expected = expected_shapes(model_config)
    if source.is_openclip():
        from_openclip_state_dict(_meta(source.shapes), model_config)  # raises with OpenCLIP's names
        plan = {}
        for name, shape in expected.items():
            ((oc_name, _),) = to_openclip_state_dict({name: torch.empty(shape, device="meta")}).items()
            plan[name] = oc_name
        return plan
    check_state_dict(_meta(source.shapes), expected, f"pretrained weights {source.path}")
    return {name: name for name in expected}


def _is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")  # a ZeRO-3 (zero.Init) parameter


def load_pretrained_into(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy ``path``'s weights into ``model`` (a dsclip ``CLIP``, possibly ZeRO-3 partitioned), in place.

    Collective under ZeRO-3 (every rank must call it); otherwise each rank loads on its own."""
    source = WeightSource(path)
    plan = plan_pretrained(source, model.config)
    rank, _ = rank_world()
    copied = 0
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        params = {n: p for n, p in module.named_parameters(recurse=False) if prefix + n in plan}
        buffers = {n: b for n, b in module.named_buffers(recurse=False) if prefix + n in plan}
        if not params and not buffers:
            continue
        partitioned = [p for p in params.values() if _is_partitioned(p)]
        if partitioned:
            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
                if rank == 0:
                    copied += _copy(source, plan, prefix, params)
        else:
            copied += _copy(source, plan, prefix, params)
        copied += _copy(source, plan, prefix, buffers)  # buffers are never partitioned
    if rank == 0 and copied != len(plan):  # every checked key must have found its tensor in the model
        raise RuntimeError(f"copied {copied} of {len(plan)} tensors from {source.path}")


@torch.no_grad()
def _copy(source: WeightSource, plan: dict[str, str], prefix: str, tensors: dict[str, torch.Tensor]) -> int:
    for name, t in tensors.items():
        value = source.get(plan[prefix + name])
        t.copy_(value.reshape(t.shape))  # OpenCLIP's 0-dim logit_scale / (1,1,W) class token -> dsclip shapes
    return len(tensors)


def load_pretrained_model(path: str | os.PathLike, model: str | dict | None = None, device: str = "cpu"):
    """A plain (non-distributed) ``CLIP`` from ``path``: with ``model`` (an architecture name or config),
    that architecture loaded with ``load_pretrained_into`` (bare OpenCLIP checkpoints have no config);
    else ``dsclip.model.load_model`` (a config.json / open_clip_config.json beside the weights)."""

    if model is None:
        return load_model(path, device=device)
    m = create_model(model, device=device)
    load_pretrained_into(m, path)
    return m.eval()
