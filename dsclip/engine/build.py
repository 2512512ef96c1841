"""Build the DeepSpeed engine around a plain-PyTorch CLIP.

The model code never imports DeepSpeed; everything DeepSpeed-specific (ZeRO-3 construction under
``zero.Init``, DeepSpeed's activation checkpointing, the optimizer hand-off) happens here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from dsclip.console import say
from dsclip.dist import rank_world
from dsclip.engine import optim
from dsclip.engine.compile import compile_towers
from dsclip.engine.ds_config import TrainArgs, grad_reduction_of, precision_of, zero_stage
from dsclip.engine.input_grads import needs_input_grads, require_input_grads
from dsclip.engine.optim import OptimArgs
from dsclip.engine.patches import PatchReport, install_patches, parse_selection
from dsclip.engine.shm_workspace import release_shm_workspace
from dsclip.engine.versions import deepspeed_version
from dsclip.engine.world import process_group
from dsclip.engine.world.devices import DeviceBindingError


@dataclass
class EngineBundle:
    engine: DeepSpeedEngine
    zero_stage: int
    precision: str  # "fp32" | "bf16" | "fp16"
    patches: PatchReport | None = None  # dsclip's changes to DeepSpeed internals active on this engine
    # how the gradient cache reduces K chunk gradients here (engine/accumulation.py: sharded | coalesced)
    grad_reduction: str = "coalesced"

    @property
    def module(self) -> nn.Module:
        return self.engine.module


def device_type() -> str:
    return get_accelerator().device_name()  # "cuda" | "cpu" | ...


def optimizer_offloaded(ds_config: dict) -> bool:
    """ZeRO-Offload of the optimizer: its states and step live in host memory."""
    off = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return off.get("device", "none") not in ("none", None)


def construction_context(ds_config: dict):
    """ZeRO-3: partition parameters as they are created, so no rank ever holds the full model."""
    if zero_stage(ds_config) == 3:
        return deepspeed.zero.Init(config_dict_or_path=ds_config)
    return contextlib.nullcontext()


@contextlib.contextmanager
def init_redone_after():
    """Construction under ``zero.Init`` whose caller re-runs the weight init (or loads the weights) next:
    the model's warning that partitioned layers kept torch's default init does not apply, so it is not
    printed on every rank of every ZeRO-3 run."""
    clip_log = logging.getLogger("dsclip.model.clip")
    level = clip_log.level
    clip_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        clip_log.setLevel(level)


def enable_activation_checkpointing(model: nn.Module, ds_config: dict) -> None:
    """Checkpoint every transformer block.

    ZeRO-0/1/2: through DeepSpeed's implementation, because the JSON ``activation_checkpointing``
    block does nothing by itself: DeepSpeed only reads it in ``deepspeed.checkpointing.configure`` and
    only applies it inside its own checkpoint functions. We use the non-reentrant variant: the
    reentrant one has produced "Gradient computed twice for this partition" under ZeRO-2.
    ZeRO-3: DeepSpeed 0.19's non-reentrant recomputation sees the partitioned (empty) parameters of
    larger layers ("The size of tensor a (0) must match ..."), so torch's non-reentrant checkpoint is
    used there; ZeRO-3's own parameter hooks gather weights for the recomputation.
    """
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
    if zero_stage(ds_config) == 3:
        model.set_grad_checkpointing(True, checkpoint_fn=partial(torch_checkpoint, use_reentrant=False))
        return
    model.set_grad_checkpointing(True, checkpoint_fn=ds_ckpt.non_reentrant_checkpoint)


def build_engine(
    ds_config: dict,
    train: TrainArgs,
    optim_args: OptimArgs,
    model_factory: Callable[[], nn.Module],
    *,
    grad_checkpointing: bool = False,
    total_steps: int,
    steps_per_epoch: int,
    after_construction: Callable[[nn.Module], None] | None = None,
) -> EngineBundle:
    # zero.Init and activation checkpointing read the world from deepspeed.comm, which must exist
    # before them (a no-op after dsclip.engine.world.process_group.init_distributed; needed when a caller
    # set up torch.distributed directly, as the multi-process tests do).
    selection = parse_selection(train.engine_patches)  # a typo fails before any work
    deepspeed.init_distributed(dist_backend="nccl" if device_type() == "cuda" else "gloo")
    release_shm_workspace()  # DeepSpeed's CPU all-reduce segment would outlive the run in /dev/shm
    with construction_context(ds_config), init_redone_after():  # init_weights(gather=...) below
        model = model_factory()
    if zero_stage(ds_config) == 3:
        # zero.Init partitions each layer as soon as it is built, so the model's own weight init ran on
        # empty placeholders; redo it one layer at a time with that layer gathered.
        model.init_weights(gather=lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0))
    if after_construction is not None:
        after_construction(model)
    if zero_stage(ds_config) == 3 and needs_input_grads(model):  # LiT's locked towers (input_grads.py)
        require_input_grads(model)
    if grad_checkpointing:
        enable_activation_checkpointing(model, ds_config)
    if train.torchcompile:
        n = compile_towers(model, train.torchcompile_backend, train.torchcompile_mode, device_type())
        if rank_world()[0] == 0:
            say(
                f"dsclip: --torchcompile: {n} transformer blocks compiled in place with "
                f"{train.torchcompile_backend} (the first steps include compilation)"
            )

    def scheduler(opt):
        return optim.build_scheduler(opt, optim_args, total_steps, steps_per_epoch)

    kwargs: dict[str, Any] = {"model": model, "config": ds_config, "lr_scheduler": scheduler}
    if "optimizer" in ds_config:
        kwargs["model_parameters"] = optim.param_groups(model, optim_args.wd, optim_args)
    else:
        kwargs["optimizer"] = optim.build_optimizer(
            model, optim_args, device_type(), cpu_offload=optimizer_offloaded(ds_config)
        )
    # DeepSpeed binds set_device(LOCAL_RANK) unless told otherwise: with one GPU per task
    # (--gpus-per-task=1) local rank 3 would ask for device 3 of 1. Hand it the index process_group bound.
    dev = process_group.device_rank()
    if dev is not None:
        kwargs["args"] = SimpleNamespace(device_rank=dev)
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    check_engine_device(engine, dev)
    rank = rank_world()[0]
    patches = install_patches(engine, selection, log=say)
    say(f"[dsclip] rank {rank} {patches.describe()} (DeepSpeed {deepspeed_version()})")
    reduction = grad_reduction_of(ds_config, train, rank_world()[1])
    return EngineBundle(engine, zero_stage(ds_config), precision_of(ds_config).name, patches, reduction)


def check_engine_device(engine, bound: int | None) -> None:
    """The device binding cannot fall back (a wrong GPU is not a slower path), so check its result: the
    engine must sit on the index dsclip bound (``device_rank``, read by DeepSpeed's _set_distributed_vars)."""
    if bound is None or device_type() != "cuda":
        return
    got = torch.device(engine.device)
    if got.index is not None and got.index != bound:
        raise DeviceBindingError(
            f"DeepSpeed {deepspeed_version()} put this rank's engine on {got}, but dsclip bound cuda:{bound}; "
            f"this DeepSpeed ignores args.device_rank: launch one process per visible GPU "
            f"(CUDA_VISIBLE_DEVICES / --gpus-per-task=1 with LOCAL_RANK=0) or use a tested DeepSpeed (setup.py)"
        )


def autocast_dtype(bundle: EngineBundle) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(bundle.precision, torch.float32)
