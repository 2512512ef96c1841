"""Resume only into the architecture a checkpoint was trained as.

``--resume`` with another ``--model`` (or another tokenizer's vocabulary or context) used to fail inside
DeepSpeed's load with a 99-line size-mismatch traceback, after ``run_config.yaml`` had already been
rewritten to the new model next to the old checkpoints. The tag's ``model_config.json`` (the resolved
config its model was built from) is compared with the one this run builds, before anything is written:
a difference is one line naming both models, the keys that differ and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dsclip.checkpoint.layout import MODEL_CONFIG_FILE, RUN_CONFIG_FILE
from dsclip.config_base import ConfigError

# Regularisation rates: they change no weight (and --force-patch-dropout may differ on resume by design).
_NO_WEIGHT = {"patch_dropout", "dropout", "attn_dropout", "drop_path_rate"}


def _flat(cfg: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and k.endswith("_cfg"):
            out.update(_flat(v, f"{prefix}{k}."))
        elif k not in _NO_WEIGHT:
            out[prefix + k] = v
    return out


def differences(saved: dict, built: dict) -> list[str]:
    """``key: saved vs built`` for every architecture setting the two resolved configs disagree on."""
    a, b = _flat(saved), _flat(built)
    return [f"{k} {a.get(k, '-')} vs {b.get(k, '-')}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def saved_model_name(tag_dir: Path) -> str | None:
    """The --model of the run that wrote ``tag_dir`` (its RUN/run_config.yaml), when it can be read."""
    path = tag_dir.parent.parent / RUN_CONFIG_FILE
    try:
        return str(yaml.safe_load(path.read_text())["model"]["model"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def check_resumed_model(tag_dir: Path, built: dict, model_name: str) -> None:
    """ConfigError (one line) when the checkpoint at ``tag_dir`` was trained as another architecture than
    ``built`` (this run's resolved model config, from --model ``model_name``). A tag without a recorded
    config (older dsclip) is left to DeepSpeed's load."""
    path = tag_dir / MODEL_CONFIG_FILE
    if not path.is_file():  # older dsclip: the run's recorded --model (not yet rewritten: nothing is written yet)
        old = saved_model_name(tag_dir)
        if old is not None and old != model_name:
            recorded = tag_dir.parent.parent / RUN_CONFIG_FILE
            raise ConfigError(
                f"--resume: checkpoint {tag_dir} was trained as --model {old} ({recorded}), this run builds --model "
                f"{model_name}; resume with --model {old}, or train --model {model_name} as a new run (another --name)"
            )
        return  # the same name: torch's load checks the tensors (load_mismatch)
    saved = json.loads(path.read_text()).get("model_cfg", {})
    diffs = differences(saved, built)
    if not diffs:
        return
    old = saved_model_name(tag_dir) or "another architecture"
    shown = "; ".join(diffs[:4]) + (f"; ... ({len(diffs)} in all)" if len(diffs) > 4 else "")
    same_name = old == model_name
    fix = (
        "resume with the tokenizer and --force-* options that checkpoint was trained with"
        if same_name
        else f"resume with --model {old}, or train --model {model_name} as a new run (another --name)"
    )
    raise ConfigError(
        f"--resume: checkpoint {tag_dir} was trained as --model {old}, this run builds --model {model_name} "
        f"(checkpoint vs this run: {shown}); {fix}"
    )


_MISMATCH = ("size mismatch for", "Missing key(s) in state_dict", "Unexpected key(s) in state_dict")


def load_mismatch(error: RuntimeError, tag_dir: Path) -> ConfigError | None:
    """torch's strict-load error for a checkpoint of another architecture, as one line (None: another error)."""
    lines = [ln.strip() for ln in str(error).splitlines()]
    found = [ln for kind in _MISMATCH for ln in lines if ln.startswith(kind)]  # a size mismatch says most
    if not found:
        return None
    first = found[0] if len(found[0]) <= 200 else found[0][:200] + "..."
    return ConfigError(
        f"--resume: checkpoint {tag_dir} was trained as another architecture than this run's ({first}); resume "
        "with the --model, tokenizer and --force-* options it was trained with, or start a new run (another --name)"
    )
