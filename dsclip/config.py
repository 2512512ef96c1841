"""Run settings: the sections assembled, a YAML recipe, CLI flags on top, one validation pass.

Precedence is dataclass default < YAML recipe < command-line flag. The recipe is flat (keys are the
flag names with underscores, as in OpenCLIP's ``params``), so a recipe line and a flag are the same
thing; internally each key lives in exactly one section, each section is defined next to the
component that consumes it, and each builder receives only its section (torchtitan's lesson: a
god-config leaks everywhere):

=========== ================================ =====================================
section     defined in                       consumed by
=========== ================================ =====================================
model       dsclip.model.factory.ModelArgs   model factory, engine (checkpointing)
loss        dsclip.losses.config.LossArgs    build_loss (+ SigLIP's initial bias)
optim       dsclip.engine.optim_config       optimizer, schedule, DeepSpeed JSON
train       dsclip.engine.ds_config.TrainArgs DeepSpeed JSON, engine, loop, step
data        dsclip.data.config.DataConfig    data loaders, evaluator
lock        dsclip.model.lock.LockConfig     fine-tuning set-up (train/finetune.py)
log         dsclip.train.metrics.LogArgs     run folder, metrics, evaluation cadence
checkpoint  dsclip.checkpoint.ds_checkpoint  Checkpointer (save cadence, resume)
remote      dsclip.checkpoint.remote_sync    --remote-sync (the run folder copied to URL/NAME)
ema         dsclip.engine.ema_config         sharded EMA of the weights (dsclip.engine.ema)
=========== ================================ =====================================

:func:`validate` only checks. The one default that needs the clock (the run name) is decided by
:func:`settle_run_name` on rank 0 and broadcast, once the process group exists.

No section's module imports torch, timm, torchvision, DeepSpeed or webdataset at import time, so
``dsclip train --help`` and the checks before the process group stay cheap (tests/unit/test_light_imports.py).

Every field's ``help`` becomes ``dsclip train --help``. Unknown recipe keys and unknown flags are
errors that name the key, never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from dsclip.checkpoint.ds_checkpoint import CheckpointArgs
from dsclip.checkpoint.remote_sync import RemoteSyncArgs
from dsclip.config_base import ConfigError, opt
from dsclip.data.config import DataConfig
from dsclip.dist import from_rank0
from dsclip.engine.ds_config import TrainArgs
from dsclip.engine.ema_config import EmaArgs
from dsclip.engine.optim_config import OptimArgs
from dsclip.losses.config import LossArgs
from dsclip.model.factory import ModelArgs
from dsclip.model.lock import LockConfig
from dsclip.train.metrics import LogArgs

__all__ = ["ConfigError", "RunConfig", "make_run_config", "opt", "parse_run_config", "validate"]


SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "loss": LossArgs,
    "optim": OptimArgs,
    "train": TrainArgs,
    "data": DataConfig,
    "lock": LockConfig,
    "log": LogArgs,
    "checkpoint": CheckpointArgs,
    "remote": RemoteSyncArgs,
    "ema": EmaArgs,
}


@dataclass
class RunConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    loss: LossArgs = field(default_factory=LossArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    data: DataConfig = field(default_factory=DataConfig)
    lock: LockConfig = field(default_factory=LockConfig)
    log: LogArgs = field(default_factory=LogArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    remote: RemoteSyncArgs = field(default_factory=RemoteSyncArgs)
    ema: EmaArgs = field(default_factory=EmaArgs)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @property
    def run_dir(self) -> Path:
        return Path(self.log.logs) / str(self.log.name)

    @property
    def loss_name(self) -> str:
        return self.loss.name


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
            items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
            elem = (get_args(base) or (str,))[0]
            return [elem(v) for v in items] if elem in (int, float) else items
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
                if "nargs" in f.metadata:  # OpenCLIP's multi-word flags: --image-mean R G B, --aug-cfg k=v ...
                    kw["nargs"] = f.metadata["nargs"]
                group.add_argument(*flags, **kw)
    return parser


def parse_run_config(argv: list[str]) -> RunConfig:
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
        from dsclip.compat import refusal  # the compat table's reason and replacement, not a spelling guess

        if refusal(flag):
            raise ConfigError(refusal(flag))
        close = difflib.get_close_matches(flag, [a for a in parser._option_string_actions if a.startswith("--")], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown flag {flag}{hint}; see 'dsclip train --help'")
    values: dict[str, Any] = {}
    if ns.config:
        values.update(load_recipe(ns.config))
    cli = {k: v for k, v in vars(ns).items() if k not in ("config", "local_rank")}
    values.update(cli)
    return make_run_config(values, where=f"recipe {ns.config}" if ns.config else "settings")


def make_run_config(values: dict[str, Any], *, where: str = "settings") -> RunConfig:
    """Flat settings -> validated RunConfig. Nothing in the run config depends on the world; DeepSpeed's
    batch triad is checked where the world is known (dsclip.engine.ds_config)."""
    index = _field_index()
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in values.items():
        if key not in index:
            raise _unknown_key_error(key, where)
        section, f, tp = index[key]
        value = _coerce(key, value, tp)
        unset = value is None and f.default is None  # an optional choice left unset (saved run configs hold it)
        if "choices" in f.metadata and value not in f.metadata["choices"] and not unset:
            raise ConfigError(f"'{key}' must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
        sections[section][key] = value
    cfg = RunConfig(**{s: SECTIONS[s](**kv) for s, kv in sections.items()})
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Check every section (in section order); raises ConfigError naming the first problem. Changes nothing."""
    for name in ("train", "optim", "loss", "model", "data", "lock", "log", "checkpoint", "remote", "ema"):
        getattr(cfg, name).check()


def default_run_name(cfg: RunConfig, when: time.struct_time) -> str:
    """OpenCLIP's default run name: date-model-lr-batch-precision."""
    return "-".join(
        [
            time.strftime("%Y_%m_%d-%H_%M_%S", when),
            f"model_{Path(cfg.model.model).stem}",
            f"lr_{cfg.optim.lr:g}",
            f"b_{cfg.train.batch_size}",
            f"p_{cfg.train.precision}",
        ]
    )


def settle_run_name(cfg: RunConfig, *, now: float | None = None) -> RunConfig:
    """The run config with its run name decided: ``--name``, or the default stamped from rank 0's clock
    and broadcast, so ranks that start seconds apart write into one run folder. Collective when the name
    is not given (call it on every rank after the process group exists). ``now``: seconds since the epoch
    (default: this rank's clock)."""
    if cfg.log.name is not None:
        return cfg
    name = from_rank0(default_run_name(cfg, time.localtime(now)))
    return dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, name=name))


def save_run_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
