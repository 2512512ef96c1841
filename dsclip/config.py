"""Run settings: typed sections, a YAML recipe, CLI flags on top, one validation pass.

Precedence is dataclass default < YAML recipe < command-line flag. The recipe is flat (keys are the
flag names with underscores, as in OpenCLIP's ``params``), so a recipe line and a flag are the same
thing; internally each key lives in exactly one section and each component receives only its
section (torchtitan's lesson: a god-config leaks everywhere).

Every field's ``help`` becomes ``dsclip train --help``. Unknown recipe keys and unknown flags are
errors that name the key, never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from dsclip.data.config import DataConfig


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it as one line and exits non-zero."""


def opt(default, help: str, choices: tuple | None = None, aliases: tuple[str, ...] = (), **kw):
    """A dataclass field carrying its --help text (and optional choices, and other flag spellings)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if aliases:
        meta["aliases"] = aliases
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


# OpenCLIP's pure_* keep no fp32 master copy; DeepSpeed's bf16/fp16 always do, so these are refused.
PURE_PRECISIONS = ("pure_bf16", "pure_fp16")


def normalize_half(p: str) -> str:
    return "bf16" if "bf16" in p else "fp16"


PRECISIONS = ("auto", "fp32", "bf16", "fp16", "amp", "amp_bf16", "amp_bfloat16", "pure_bf16", "pure_fp16")


@dataclass
class ModelArgs:
    model: str = opt("demo", "Architecture name (dsclip/model/configs/*.json, OpenCLIP schema) or a JSON path.")
    pretrained: str | None = opt(None, "Initial weights: a dsclip or OpenCLIP checkpoint (.safetensors/.pt/.bin).")
    siglip: bool = opt(False, "Use the sigmoid (SigLIP) loss with a learnable logit_bias.")
    force_patch_dropout: float | None = opt(
        None, "Override the architecture's patch-dropout rate (FLIP), as OpenCLIP's flag: training only."
    )
    grad_checkpointing: bool = opt(
        False,
        "Activation checkpointing of every transformer block (DeepSpeed's implementation, configured by "
        "the activation_checkpointing block of the DeepSpeed JSON).",
    )
    context_length: int | None = opt(
        None, "Override the text context length of the architecture.", aliases=("--force-context-length",)
    )
    force_quick_gelu: bool = opt(False, "Use QuickGELU activations whatever the architecture JSON says (OpenCLIP's).")


@dataclass
class LossArgs:
    local_loss: bool = opt(
        False, "InfoNCE over this rank's rows against all columns (OpenCLIP --local-loss); needs --gather-with-grad."
    )
    gather_with_grad: bool = opt(
        False,
        "Gather features with gradient (OpenCLIP --gather-with-grad). dsclip always gathers with "
        "gradient because anything else gives wrong gradients; the flag is accepted for compatibility.",
    )
    tiled_loss: bool = opt(
        False, "Memory-bounded InfoNCE: tiled online log-sum-exp over a ring of ranks; never builds the logit matrix."
    )
    loss_tile_size: int = opt(4096, "Tile edge of the tiled loss (rows/columns per tile).")
    label_smoothing: float = opt(0.0, "Label smoothing of the InfoNCE cross-entropies.")


@dataclass
class OptimArgs:
    lr: float = opt(5.0e-4, "Peak learning rate.")
    wd: float = opt(0.2, "Weight decay (not applied to biases, norms, embeddings, logit_scale/bias).")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.98, "Adam beta2.")
    eps: float = opt(1.0e-6, "Adam epsilon.")
    warmup: int = opt(10000, "Linear warm-up length in optimizer steps.")
    lr_scheduler: str = opt(
        "cosine", "Learning-rate schedule after warm-up.", choices=("cosine", "const", "const-cooldown")
    )
    epochs_cooldown: float | None = opt(None, "const-cooldown: length of the final cool-down, in epochs.")
    lr_cooldown_power: float = opt(1.0, "const-cooldown: power of the polynomial cool-down.")
    lr_cooldown_end: float = opt(0.0, "const-cooldown: learning rate at the end of the cool-down.")
    grad_clip_norm: float | None = opt(None, "Clip the global gradient norm to this value.")
    skip_scheduler: bool = opt(
        False, "Keep the learning rate at --lr throughout: no warm-up, no schedule (OpenCLIP's)."
    )
    momentum: float | None = opt(
        None,
        "Momentum for an optimizer that takes one (the DeepSpeed JSON's optimizer block: SGD, MuSGD); "
        "AdamW's is --beta1.",
    )


@dataclass
class TrainArgs:
    epochs: int = opt(32, "Number of epochs.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (default: epochs × steps per epoch).")
    batch_size: int = opt(64, "Micro-batch size per rank (OpenCLIP --batch-size).")
    accum_freq: int = opt(
        1,
        "Micro-batches per optimizer step. dsclip's gradient cache makes the contrastive batch "
        "batch_size × accum_freq × world with gradients equal to that big batch.",
    )
    precision: str = opt(
        "auto",
        "Numeric precision; 'auto' takes it from the DeepSpeed JSON (fp32 if that says auto too).",
        choices=PRECISIONS,
    )
    seed: int = opt(0, "Random seed (model init, data order, dropout; derived per step and rank).")
    deepspeed_config: str = opt(
        "ds_configs/zero2.json", "DeepSpeed JSON; 'auto' values are filled from these settings."
    )
    keep_last_graph: bool = opt(
        True, "Gradient cache: keep the last micro-batch's graph from the first pass instead of re-forwarding it."
    )
    torchcompile: bool = opt(
        False, "torch.compile every transformer block (OpenCLIP --torchcompile); compiled on first use."
    )
    torchcompile_backend: str = opt("inductor", "torch.compile backend for --torchcompile (e.g. inductor, aot_eager).")
    ddp_static_graph: bool = opt(
        False, "Accepted for OpenCLIP command lines; no effect: DeepSpeed, not DDP, reduces the gradients."
    )
    torchcompile_mode: str = opt(
        "default",
        "torch.compile mode for --torchcompile (CUDA-graph modes are not offered: the gradient cache re-forwards "
        "with restored RNG and ZeRO hooks run between blocks).",
        choices=("default", "max-autotune-no-cudagraphs"),
    )


@dataclass
class LogArgs:
    logs: str = opt("./logs", "Folder that holds run folders.")
    name: str | None = opt(None, "Run folder name (default: date-model-lr-batch).")
    log_every_n_steps: int = opt(100, "Console/TensorBoard/jsonl logging interval in optimizer steps.")
    report_to: str = opt(
        "", "Comma-separated extra loggers: tensorboard, wandb (all: both). metrics.jsonl is always written."
    )
    wandb_project_name: str = opt("open-clip", "wandb project (OpenCLIP's default name, so runs land side by side).")
    wandb_notes: str = opt("", "wandb run notes.")
    zeroshot_frequency: int = opt(1, "Zero-shot evaluation every N epochs (0: only at the end for the demo).")
    val_frequency: int = opt(1, "Retrieval evaluation on --val-data every N epochs.")
    log_local: bool = opt(
        False, "Every rank writes its own log file RUN/out-RANK.log (else rank 0 writes RUN/out.log)."
    )
    debug: bool = opt(False, "DEBUG-level logging.")
    copy_codebase: bool = opt(False, "Copy the dsclip package into RUN/code before training (reproducibility).")


@dataclass
class CheckpointArgs:
    save_frequency: int = opt(1, "Save a checkpoint every N epochs (0: never at epoch ends).")
    save_every_n_steps: int = opt(0, "Also save every N optimizer steps (0: off).")
    resume: str | None = opt(None, "'latest' (the newest complete checkpoint of this run) or a checkpoint path.")
    keep_last: int = opt(0, "Keep only the newest N checkpoints (0: keep all). Pruning happens after a save completes.")
    delete_previous_checkpoint: bool = opt(False, "OpenCLIP's flag: same as --keep-last 1.")
    save_most_recent: bool = opt(
        False,
        "Also save at every epoch end, removing the previous checkpoint saved only for this (OpenCLIP's "
        "epoch_latest.pt); --resume latest loads the newest.",
    )


SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "loss": LossArgs,
    "optim": OptimArgs,
    "train": TrainArgs,
    "data": DataConfig,
    "log": LogArgs,
    "checkpoint": CheckpointArgs,
}


@dataclass
class RunConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    loss: LossArgs = field(default_factory=LossArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogArgs = field(default_factory=LogArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @property
    def run_dir(self) -> Path:
        return Path(self.log.logs) / str(self.log.name)

    @property
    def loss_name(self) -> str:
        if self.model.siglip:
            return "siglip"
        if self.loss.tiled_loss:
            return "infonce_tiled"
        if self.loss.local_loss:
            return "infonce_local"
        return "infonce"


def _field_index() -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """flat key -> (section, field, resolved type); keys are unique across sections."""
    index: dict[str, tuple[str, dataclasses.Field, Any]] = {}
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"config key {f.name} defined twice"
            index[f.name] = (section, f, hints[f.name])
    return index


def _base_type(tp) -> tuple[type, bool]:
    """(scalar type, optional?) for annotations like `int | None`."""
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) is not None and args:
        return args[0], len(args) < len(get_args(tp))
    return tp, False


def _coerce(key: str, value: Any, tp) -> Any:
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"'{key}' must not be empty")
    if isinstance(value, str) and optional and value.lower() in ("none", "null"):
        return None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if base is float:
            return float(value)
        if base is str:
            return str(value)
        if get_origin(base) is list or base is list:
            if isinstance(value, str):
                return [v for v in value.replace(",", " ").split()]
            return list(value)
    except (TypeError, ValueError):
        raise ConfigError(f"'{key}': cannot read {value!r} as {getattr(base, '__name__', base)}") from None
    return value


def _unknown_key_error(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(_field_index()), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown setting '{key}' in {where}{hint}")


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        builtin = Path(__file__).parent / "recipes" / f"{p.stem if p.suffix else p.name}.yaml"
        if builtin.exists():
            p = builtin
        else:
            avail = ", ".join(sorted(x.stem for x in (Path(__file__).parent / "recipes").glob("*.yaml")))
            raise ConfigError(f"recipe not found: {path} (built-in recipes: {avail})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {p} must be a mapping of setting: value")
    # Sectioned recipes ({train: {...}, optim: {...}}) are accepted too and flattened.
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if k in SECTIONS and isinstance(v, dict):
            flat.update(v)
        else:
            flat[k.replace("-", "_")] = v
    return flat


def build_arg_parser(prog: str = "dsclip train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a CLIP model on DeepSpeed. Precedence: defaults < --config recipe < flags.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML recipe (path, or the name of a built-in recipe)")
    # The deepspeed launcher appends --local_rank=N; the rank itself comes from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            base, _ = _base_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata.get("help", "")}
            kw["help"] += f" [default: {default}]"
            if base is bool:
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
            else:
                kw["metavar"] = f.name.upper()
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
                group.add_argument(*flags, **kw)
    return parser


def parse_run_config(argv: list[str], *, world_size: int | None = None) -> RunConfig:
    """Recipe + flags -> validated RunConfig. Raises ConfigError with a one-line message."""
    parser = build_arg_parser()
    try:
        ns, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # argparse already printed its message (e.g. a bad choice)
        if e.code == 0:
            raise
        raise ConfigError("invalid command line (see the message above)") from None
    if unknown:
        flag = unknown[0]
        close = difflib.get_close_matches(flag, [a for a in parser._option_string_actions if a.startswith("--")], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown flag {flag}{hint}; see 'dsclip train --help'")
    values: dict[str, Any] = {}
    if ns.config:
        values.update(load_recipe(ns.config))
    cli = {k: v for k, v in vars(ns).items() if k not in ("config", "local_rank")}
    values.update(cli)
    return make_run_config(values, world_size=world_size, where=f"recipe {ns.config}" if ns.config else "settings")


def make_run_config(values: dict[str, Any], *, world_size: int | None = None, where: str = "settings") -> RunConfig:
    index = _field_index()
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in values.items():
        if key not in index:
            raise _unknown_key_error(key, where)
        section, f, tp = index[key]
        value = _coerce(key, value, tp)
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise ConfigError(f"'{key}' must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
        sections[section][key] = value
    cfg = RunConfig(**{s: SECTIONS[s](**kv) for s, kv in sections.items()})
    validate(cfg, world_size=world_size)
    return cfg


def validate(cfg: RunConfig, *, world_size: int | None = None) -> None:
    t, o, lo = cfg.train, cfg.optim, cfg.loss
    for key, v in (("batch_size", t.batch_size), ("accum_freq", t.accum_freq), ("epochs", t.epochs)):
        if v < 1:
            raise ConfigError(f"'{key}' must be >= 1, got {v}")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"'max_steps' must be >= 1, got {t.max_steps}")
    if o.lr <= 0 or not math.isfinite(o.lr):
        raise ConfigError(f"'lr' must be a positive number, got {o.lr}")
    if o.warmup < 0:
        raise ConfigError(f"'warmup' must be >= 0, got {o.warmup}")
    if o.lr_scheduler == "const-cooldown" and o.epochs_cooldown is None:
        raise ConfigError("--lr-scheduler const-cooldown needs --epochs-cooldown")
    if lo.local_loss and not lo.gather_with_grad:
        raise ConfigError(
            "--local-loss without --gather-with-grad computes wrong gradients (each rank would only see its own "
            "rows' contribution); add --gather-with-grad"
        )
    if cfg.model.siglip and (lo.tiled_loss or lo.local_loss):
        raise ConfigError("--siglip already uses a memory-bounded ring loss; drop --tiled-loss/--local-loss")
    if lo.loss_tile_size < 1:
        raise ConfigError(f"'loss_tile_size' must be >= 1, got {lo.loss_tile_size}")
    if not 0.0 <= lo.label_smoothing < 1.0:
        raise ConfigError(f"'label_smoothing' must be in [0, 1), got {lo.label_smoothing}")
    if cfg.model.force_patch_dropout is not None and not 0.0 <= cfg.model.force_patch_dropout < 1.0:
        raise ConfigError(f"'force_patch_dropout' must be in [0, 1), got {cfg.model.force_patch_dropout}")
    if cfg.log.log_every_n_steps < 1:
        raise ConfigError("'log_every_n_steps' must be >= 1")
    reporters = {r.strip() for r in cfg.log.report_to.split(",") if r.strip()}
    unknown = sorted(reporters - {"tensorboard", "wandb", "all"})
    if unknown:
        raise ConfigError(f"--report-to {unknown[0]!r} is not supported (supported: tensorboard, wandb, all)")
    if reporters & {"wandb", "all"} and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--report-to wandb needs the wandb package: pip install wandb (or drop wandb)")
    if t.precision in PURE_PRECISIONS:
        raise ConfigError(
            f"--precision {t.precision} (half-precision weights without fp32 master weights) has no DeepSpeed "
            f"equivalent here; use --precision {normalize_half(t.precision)} (DeepSpeed "
            f"{normalize_half(t.precision)}: fp32 master weights, as OpenCLIP's amp)"
        )
    if cfg.checkpoint.keep_last < 0:
        raise ConfigError("'keep_last' must be >= 0")
    if cfg.checkpoint.delete_previous_checkpoint and cfg.checkpoint.keep_last == 0:
        cfg.checkpoint.keep_last = 1
    if cfg.log.name is None:
        import time

        cfg.log.name = "-".join(
            [
                time.strftime("%Y_%m_%d-%H_%M_%S"),
                f"model_{Path(cfg.model.model).stem}",
                f"lr_{o.lr:g}",
                f"b_{t.batch_size}",
                f"p_{t.precision}",
            ]
        )
    if "/" in cfg.log.name:
        raise ConfigError(f"--name must be a folder name, not a path: {cfg.log.name!r}")


def save_run_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
