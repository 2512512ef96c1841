"""dsclip.model: CLIP towers in plain PyTorch + timm (never imports deepspeed).

    from dsclip.model import create_model, list_models, load_model
    model = create_model("ViT-B-32", vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id)
    out = model(image=images, text=tokens)  # image_features, text_features, logit_scale, logit_bias

- Architectures: ``configs/*.json`` in OpenCLIP's schema (``list_models()``, ``get_model_config``).
- Weights: ``save_model`` / ``load_model`` (``model.safetensors`` + ``config.json``, see ``weights``).
- OpenCLIP interop: ``dsclip.model.openclip`` (``to_openclip_state_dict``, ``from_openclip_state_dict``,
  ``openclip_model_config``, ``export_openclip``).
"""

from __future__ import annotations

from dsclip.lazy_exports import lazy_exports

# Light (no torch): the run config's parser and the checks before the process group read these.
from .config import resolve_model_config
from .factory import ModelArgs, UnknownModelError, UnsupportedModelError, get_model_config, list_models

# The rest loads torch and timm, so it is imported on first use (PEP 562): `dsclip train --help` and a
# misconfigured run must not pay for it (issue #33). name -> submodule.
_LAZY = {
    "CLIP": "clip",
    "create_model": "factory",
    "StateDictMismatchError": "openclip",
    "export_openclip": "openclip",
    "from_openclip_state_dict": "openclip",
    "load_openclip_checkpoint": "openclip",
    "openclip_model_config": "openclip",
    "to_openclip_name": "openclip",
    "to_openclip_state_dict": "openclip",
    "load_model": "weights",
    "save_model": "weights",
}


# Every lazy name loads the towers (torch + timm) as the eager package did: callers rely on
# `from dsclip.model import create_model` having imported timm before zero.Init patches torch.Tensor.
__getattr__ = lazy_exports(__name__, _LAZY, first="clip")


__all__ = [
    "CLIP",
    "ModelArgs",
    "StateDictMismatchError",
    "UnknownModelError",
    "UnsupportedModelError",
    "create_model",
    "export_openclip",
    "from_openclip_state_dict",
    "get_model_config",
    "list_models",
    "load_model",
    "load_openclip_checkpoint",
    "openclip_model_config",
    "resolve_model_config",
    "save_model",
    "to_openclip_name",
    "to_openclip_state_dict",
]
