"""dsclip.model: CLIP towers in plain PyTorch + timm (never imports deepspeed).

    from dsclip.model import create_model, list_models, load_model
    model = create_model("ViT-B-32", vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id)
    out = model(image=images, text=tokens)  # image_features, text_features, logit_scale, logit_bias

- Architectures: ``configs/*.json`` in OpenCLIP's schema (``list_models()``, ``get_model_config``).
- Weights: ``save_model`` / ``load_model`` (``model.safetensors`` + ``config.json``, see ``weights``).
- OpenCLIP interop: ``dsclip.model.openclip`` (``to_openclip_state_dict``, ``from_openclip_state_dict``,
  ``openclip_model_config``, ``export_openclip``).
"""

from .clip import CLIP
from .config import resolve_model_config
from .factory import (
    ModelArgs,
    UnknownModelError,
    UnsupportedModelError,
    create_model,
    get_model_config,
    list_models,
)
from .openclip import (
    StateDictMismatchError,
    export_openclip,
    from_openclip_state_dict,
    load_openclip_checkpoint,
    openclip_model_config,
    to_openclip_name,
    to_openclip_state_dict,
)
from .weights import load_model, save_model

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
