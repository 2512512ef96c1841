"""Load a DeepSpeed JSON, fill its "auto" values from the run config, and refuse anything inconsistent.

DeepSpeed silently ignores unknown top-level keys (EVA-CLIP shipped configs whose keys did nothing),
so we validate keys ourselves. Values both sides need (batch triad, lr, clipping, precision) are
"auto" in the shipped JSONs and come from the run config; an explicit value that disagrees with the
run config is an error rather than a silent override.

The gradient cache (dsclip/train/gradcache.py) owns accumulation: DeepSpeed is always told
``gradient_accumulation_steps = 1`` and a micro-batch of ``batch_size × accum_freq`` (all the rows
that make up one optimizer step on this rank), so its sample counters stay right and it never
rescales the loss by the accumulation count.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsclip.config_base import ConfigError, opt
from dsclip.console import say
from dsclip.engine.ds_schema import check_zero_and_compile
from dsclip.engine.grad_reduction import GRAD_REDUCTIONS, choose_grad_reduction
from dsclip.engine.optim_config import OptimArgs, timm_optimizer_info

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "amp", "amp_bf16", "amp_bfloat16", "pure_bf16", "pure_fp16")
# OpenCLIP's pure_* keep no fp32 master copy; DeepSpeed's bf16/fp16 always do, so these are refused.
PURE_PRECISIONS = ("pure_bf16", "pure_fp16")


@dataclass
class TrainArgs:
    """Run config section ``train``: the batch triad, precision, DeepSpeed JSON and step mechanics.

    Defined here because the DeepSpeed config is its first consumer (batch triad, precision, JSON);
    the loop reads epochs/max_steps/seed, the gradient cache keep_last_graph, the engine torchcompile*."""

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
        "Numeric precision; 'auto' takes it from the DeepSpeed JSON (fp32 if that says auto too). amp = DeepSpeed "
        "fp16, amp_bf16 = DeepSpeed bf16, both with fp32 master weights; pure_* (no master weights) are refused.",
        choices=PRECISIONS,
    )
    seed: int = opt(0, "Random seed (model init, data order, dropout; derived per step and rank).")
    deepspeed_config: str = opt(
        "ds_configs/zero2.json",
        "DeepSpeed JSON; 'auto' values are filled from these settings. 'auto' itself: the shipped JSON dsclip plan "
        "chooses for this run (stage, offload) from device memory, world size and batch; run_config.yaml records it",
    )
    grad_reduction: str = opt(
        "auto",
        "Gradient cache, how the accum_freq chunk gradients of a step are reduced: sharded (DeepSpeed's own "
        "accumulation: each chunk's backward reduce-scatters into this rank's partition, overlapped, summed in fp32; "
        "ZeRO-2/3), coalesced (summed in every rank's whole .grad, one reduction per step; 16-bit only at "
        "accum_freq 1) or auto (dsclip/engine/accumulation.py: sharded for 16-bit with accum_freq > 1, ZeRO-3 and "
        "accum_freq 1 at world > 1; coalesced otherwise). dsclip plan shows both.",
        choices=GRAD_REDUCTIONS,
    )
    keep_last_graph: bool = opt(
        True, "Gradient cache: keep the last micro-batch's graph from the first pass instead of re-forwarding it."
    )
    torchcompile: bool = opt(
        False, "torch.compile every transformer block (OpenCLIP --torchcompile); compiled on first use."
    )
    torchcompile_backend: str = opt("inductor", "torch.compile backend for --torchcompile (e.g. inductor, aot_eager).")
    torchcompile_mode: str = opt(
        "default",
        "torch.compile mode for --torchcompile (CUDA-graph modes are not offered: the gradient cache re-forwards "
        "with restored RNG and ZeRO hooks run between blocks).",
        choices=("default", "max-autotune-no-cudagraphs"),
    )
    engine_patches: str = opt(
        "all",
        "dsclip's changes to DeepSpeed internals (dsclip/engine/patches/): all (the default set), none, a comma "
        "list of names, all,-NAME to leave one out, or all,+NAME to add an opt-in one (zero3_step_views, "
        "zero3_hook_fns, overflow_check, grad_norm: under 3 percent of a world-8 step, docs/deepspeed-notes.md). Each "
        "checks the installed DeepSpeed first and otherwise leaves DeepSpeed's own path.",
    )
    ddp_static_graph: bool = opt(
        False, "Accepted for OpenCLIP command lines; no effect: DeepSpeed, not DDP, reduces the gradients."
    )
    use_bn_sync: bool = opt(
        False,
        "Accepted for OpenCLIP command lines; no effect: dsclip's towers (like OpenCLIP's ViTs) have no BatchNorm "
        "to convert to SyncBatchNorm.",
    )
    no_set_device_rank: bool = opt(
        False,
        "Accepted for OpenCLIP command lines; no effect: each rank already binds the GPU index valid in its own "
        "view, which with one GPU per process (this flag's use) is cuda:0, as OpenCLIP's flag gives.",
    )
    device: str | None = opt(
        None,
        "Device type (OpenCLIP's flag, e.g. cuda, cpu): checked against the DeepSpeed accelerator, which picks the "
        "device per local rank; default: the accelerator's. Choose GPUs with the launcher, not an index here.",
    )
    dist_backend: str | None = opt(
        None, "torch.distributed backend (OpenCLIP's flag); default nccl on CUDA, gloo otherwise."
    )
    dist_url: str | None = opt(
        None,
        "torch.distributed init_method (OpenCLIP's flag), e.g. tcp://HOST:PORT or file:///shared/path; "
        "default env:// (MASTER_ADDR/MASTER_PORT from the launcher).",
    )
    step_timeout: float = opt(
        180.0,
        "Hang watchdog, seconds: from the third step on, a step (data wait included) that runs longer than "
        "max(this, --step-timeout-factor × the slowest of the last 20 steps) ends the job with one line per rank "
        "naming the stuck rank, the last step and --resume latest (exit code 2; latest untouched). Checkpoint "
        "saves and evaluations get the process group's long timeout instead, unless a rank gives no sign of life "
        "for longer than this bound (docs/clusters.md, When a rank hangs). 0: no watchdog.",
    )
    step_timeout_factor: float = opt(
        10.0, "Hang watchdog: a step may take this many times the slowest of the last 20 steps (>= 1)."
    )
    collective_timeout: float = opt(
        300.0,
        "Seconds a collective may wait for its peers from the third step on (torch.distributed.set_timeout on "
        "every process group; at least --step-timeout-factor × the slowest of the first 2 steps); the long default "
        "(30 min, DSCLIP_DIST_TIMEOUT) comes back around checkpoint saves and evaluations. 0: keep the long one.",
    )

    def check(self) -> None:
        for key, v in (("batch_size", self.batch_size), ("accum_freq", self.accum_freq), ("epochs", self.epochs)):
            if v < 1:
                raise ConfigError(f"'{key}' must be >= 1, got {v}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"'max_steps' must be >= 1, got {self.max_steps}")
        for key, v in (("step_timeout", self.step_timeout), ("collective_timeout", self.collective_timeout)):
            if not v >= 0:  # NaN too
                raise ConfigError(f"'{key}' must be >= 0 seconds (0: off), got {v}")
        if not self.step_timeout_factor >= 1:
            raise ConfigError(
                f"'step_timeout_factor' must be >= 1 (a step may take that many times the slowest recent one), "
                f"got {self.step_timeout_factor}"
            )
        if self.device is not None and ":" in self.device:
            raise ConfigError(
                f"--device {self.device}: give the device type only (e.g. --device cuda); each rank uses the "
                f"device of its local rank, so pick GPUs with the launcher (CUDA_VISIBLE_DEVICES, deepspeed --include)"
            )
        if self.precision in PURE_PRECISIONS:
            alt = "bf16" if "bf16" in self.precision else "fp16"
            raise ConfigError(
                f"--precision {self.precision} (half-precision weights without fp32 master weights) has no DeepSpeed "
                f"equivalent here; use --precision {alt} (DeepSpeed {alt}: fp32 master weights, as OpenCLIP's amp)"
            )


# Top-level keys DeepSpeed 0.19 reads (docs: deepspeed.ai/docs/config-json). Anything else is a typo.
KNOWN_TOP_LEVEL = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "amp",
    "torch_autocast",
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "activation_checkpointing",
    "flops_profiler",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "memory_breakdown",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "data_types",
    "checkpoint",
    "aio",
    "elasticity",
    "autotuning",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "comms_logger",
    "disable_allgather",
    "dataloader_drop_last",
    "gradient_allreduce_op",
    "log_level",
    "managed_gradient_accumulation",
    "use_data_before_expert_parallel_",
    "use_node_local_storage",
    "load_universal",
    "nebula",
    "hybrid_engine",
    "compile",
    "timers",
    "weight_quantization",
    "pipeline",
    "zenflow",
    "sequence_parallel_size",
    "tensor_parallel",
    "graph_harvesting",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "disable_python_gc",
    "fp8",
    "deepcompile",
}
KNOWN_ACTIVATION_CHECKPOINTING = {
    "partition_activations",
    "contiguous_memory_optimization",
    "cpu_checkpointing",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
}
KNOWN_FP16 = {
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
}
KNOWN_BF16 = {
    "enabled",
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
}


@dataclass
class Precision:
    name: str  # "fp32" | "bf16" | "fp16"

    @property
    def torch_dtype(self):
        import torch  # here, not at the top: TrainArgs is a run-config section, parsed without torch (#33)

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.name]


def normalize_precision(p: str) -> str:
    if p in ("bf16", "amp_bf16", "amp_bfloat16", "pure_bf16"):
        return "bf16"
    if p in ("fp16", "amp", "pure_fp16"):
        return "fp16"
    return p  # fp32 | auto


def run_precision(precision: str, ds_json: dict | None = None) -> str:
    """The precision (bf16, fp16, fp32) a run of ``--precision`` trains in, as the engine decides it
    (``_fill_precision``): OpenCLIP's spellings mapped (amp = fp16, amp_bf16 / amp_bfloat16 = bf16); ``auto``
    takes the DeepSpeed JSON's (fp32 where it enables neither). Without a JSON (not chosen yet: ``dsclip plan``
    searching, ``--deepspeed-config auto``) ``auto`` stays ``auto`` for the caller to decide. What ``dsclip
    plan`` and ``--deepspeed-config auto`` plan with: one mapping, the one train uses."""
    p = normalize_precision(precision)
    if p != "auto" or ds_json is None:
        return p
    on = [k for k in ("bf16", "fp16") if ds_json.get(k, {}).get("enabled") is True]
    return on[0] if on else "fp32"


# Shipped inside the package (package data), so an installed dsclip has them from any directory.


def _shipped_ds_configs() -> Path:
    """The shipped JSONs: the top-level ds_configs/ of a source checkout (the folder users read and copy), or
    dsclip/ds_configs inside an installed wheel (setup.py maps the one onto the other as package data)."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "ds_configs"
    return installed if installed.is_dir() else package.parent / "ds_configs"


SHIPPED_DS_CONFIGS = _shipped_ds_configs()


def shipped_ds_config_path(name: str | Path) -> Path | None:
    """``zero3_bf16``, ``zero3_bf16.json`` or ``ds_configs/zero3_bf16.json`` → the shipped file (None if none)."""
    stem = Path(name).name
    for cand in (stem, f"{stem}.json"):
        if (SHIPPED_DS_CONFIGS / cand).is_file():
            return SHIPPED_DS_CONFIGS / cand
    return None


def load_ds_json(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed JSON: an existing path (relative to the working directory), else a shipped config
    by name (``zero3_bf16``; the historical ``ds_configs/<name>.json`` spelling works from any cwd)."""
    p = Path(path)
    if not p.is_file():
        shipped = shipped_ds_config_path(p)
        if shipped is None or (p.parent != Path(".") and p.parent.name != "ds_configs"):
            avail = ", ".join(sorted(x.stem for x in SHIPPED_DS_CONFIGS.glob("*.json")))
            raise ConfigError(
                f"DeepSpeed config not found: {path} (not a file relative to {Path.cwd()}; shipped names: {avail})"
            )
        p = shipped
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"DeepSpeed config {p} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None


def _check_keys(section: dict, known: set[str], where: str) -> None:
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{key}' in {where}{hint}; DeepSpeed would silently ignore it")


def _fill(section: dict, key: str, value: Any, where: str, *, what: str) -> None:
    """Replace "auto"/missing with value; an explicit different value is an error."""
    current = section.get(key, "auto")
    if current == "auto":
        section[key] = value
    elif current != value:
        raise ConfigError(
            f"{where}: '{key}' is {current!r} but the run config gives {value!r} ({what}); "
            f'set it to "auto" or change the run setting'
        )


def resolve_ds_config(
    raw: dict[str, Any], train: TrainArgs, optim: OptimArgs, *, world_size: int | None, device_type: str
) -> dict[str, Any]:
    """Return the final DeepSpeed dict for this run (also written into the run folder).

    ``world_size=None`` is the check dsclip train runs before the process group (train/preflight.py): every
    rule but the batch triad's, which needs the world, and nothing printed (the real pass prints)."""
    ds = copy.deepcopy(raw)
    where = f"DeepSpeed config {train.deepspeed_config}"
    if not isinstance(ds, dict):
        raise ConfigError(f"{where} must be a JSON object")
    _check_structure(ds, where)
    if world_size is not None:
        _fill_batch(ds, train, world_size, where)
    clip = optim.grad_clip_norm if optim.grad_clip_norm is not None else 0.0
    _fill(ds, "gradient_clipping", clip, where, what="--grad-clip-norm")
    if train.device is not None and train.device != device_type:
        raise ConfigError(
            f"--device {train.device}: the DeepSpeed accelerator here is {device_type}; use --device {device_type} "
            f"or drop --device (DS_ACCELERATOR selects DeepSpeed's accelerator)"
        )
    _fill_precision(ds, train, where, device_type)
    _fill_grad_accum_dtype(ds, train, where, world_size)
    _fill_optimizer(ds, optim, where)
    # The installed DeepSpeed's own schema of zero_optimization/compile (which the fills above leave alone),
    # before any model. Last because it is the one rule that imports deepspeed (its pydantic models): a
    # run that fails an earlier rule exits without loading DeepSpeed.
    check_zero_and_compile(ds, where, device_type)

    ac = ds.get("activation_checkpointing", {})
    if device_type == "cpu" and ac.get("cpu_checkpointing") and world_size is not None:
        # Activations already live in host memory; DeepSpeed 0.19's offload path then hands the
        # recomputation an empty tensor ("expected input with shape [*, W], but got input of size[]").
        say(f"dsclip: {where}: activation_checkpointing.cpu_checkpointing ignored on a CPU device")
        ac["cpu_checkpointing"] = False

    ds.setdefault("steps_per_print", 10**9)  # dsclip prints its own, honest, line
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def _check_structure(ds: dict[str, Any], where: str) -> None:
    """Unknown keys (DeepSpeed would ignore them) and blocks dsclip cannot honour are errors."""
    _check_keys(ds, KNOWN_TOP_LEVEL, where)
    ds.setdefault("zero_optimization", {"stage": 0})
    _check_keys(
        ds.get("activation_checkpointing", {}), KNOWN_ACTIVATION_CHECKPOINTING, f"{where} activation_checkpointing"
    )
    _check_keys(ds.get("fp16", {}), KNOWN_FP16, f"{where} fp16")
    _check_keys(ds.get("bf16", {}), KNOWN_BF16, f"{where} bf16")
    if ds.get("managed_gradient_accumulation", True) is False:
        raise ConfigError(
            f"{where}: managed_gradient_accumulation=false is incompatible with dsclip's gradient cache "
            f"(--accum-freq), which drives the accumulation boundary itself; remove the key"
        )
    if "pipeline" in ds:
        raise ConfigError(
            f"{where}: pipeline parallelism is not supported (the contrastive loss needs whole "
            f"embeddings on every data-parallel rank); remove the 'pipeline' block"
        )
    if "scheduler" in ds:
        raise ConfigError(f"{where} has a 'scheduler' block; dsclip owns the schedule: use --lr-scheduler/--warmup")


def _fill_batch(ds: dict[str, Any], train: TrainArgs, world_size: int, where: str) -> None:
    # Batch triad, in the user's terms: micro-batch × accum_freq × world = global batch.
    b, k = train.batch_size, train.accum_freq
    _fill(ds, "train_micro_batch_size_per_gpu", b, where, what="--batch-size, per rank")
    _fill(ds, "gradient_accumulation_steps", k, where, what="--accum-freq")
    _fill(
        ds,
        "train_batch_size",
        b * k * world_size,
        where,
        what=f"--batch-size {b} × --accum-freq {k} × world {world_size}",
    )
    # ...and in DeepSpeed's terms (see module docstring): one "micro-batch" = one optimizer step's rows.
    ds["train_micro_batch_size_per_gpu"] = b * k
    ds["gradient_accumulation_steps"] = 1
    ds["train_batch_size"] = b * k * world_size


def _fill_precision(ds: dict[str, Any], train: TrainArgs, where: str, device_type: str) -> None:
    # Precision: the JSON may fix it (zero2_bf16.json) or leave it "auto" for --precision.
    run_p = normalize_precision(train.precision)
    json_p = None
    for name in ("bf16", "fp16"):
        enabled = ds.get(name, {}).get("enabled", "auto")
        if enabled is True:
            if json_p is not None:
                raise ConfigError(f"{where} enables both bf16 and fp16; pick one")
            json_p = name
    explicit_off = all(ds.get(n, {}).get("enabled", "auto") is False for n in ("bf16", "fp16"))
    if explicit_off:
        json_p = "fp32"
    if json_p and run_p != "auto" and json_p != run_p:
        raise ConfigError(
            f"{where} sets precision {json_p} but --precision is {train.precision}; "
            f"use a matching config (ds_configs/*_{run_p}.json) or --precision auto"
        )
    precision = json_p or (run_p if run_p != "auto" else "fp32")
    for name in ("bf16", "fp16"):
        ds.setdefault(name, {})["enabled"] = precision == name
    if precision == "fp16":
        if device_type == "cpu":
            raise ConfigError(
                "fp16 is not supported by DeepSpeed on CPU; use --precision bf16 or fp32 "
                "(or a ds_configs/*_bf16.json / *_fp32.json config)"
            )
        fp16 = ds["fp16"]
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic loss scaling
        fp16.setdefault("initial_scale_power", 16)


def ds_precision(ds: dict[str, Any]) -> str:
    """fp32, bf16 or fp16: what a resolved DeepSpeed dict runs in."""
    return "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "fp32"


def grad_reduction_of(ds: dict[str, Any], train: TrainArgs, world: int | None) -> str:
    """The gradient cache's reduction for this run (``world=None``: before the process group, as at world > 1)."""
    return choose_grad_reduction(
        train.grad_reduction,
        stage=zero_stage(ds),
        world=2 if world is None else world,
        accum_freq=train.accum_freq,
        precision=ds_precision(ds),
    )


def _fill_grad_accum_dtype(ds: dict[str, Any], train: TrainArgs, where: str, world: int | None) -> None:
    """Where a 16-bit run's gradients are summed or partitioned by DeepSpeed, they are in fp32
    (dsclip/engine/accumulation.py): ``data_types.grad_accum_dtype: fp32``.

    ZeRO-2/3 sharded (any K): the partition each chunk's reduction adds into is then fp32 (ZeRO-2's compact fp32
    partition buffer, ZeRO-3's flat gradient partition), and the optimizer step reads it in place: 4 B x P / N
    held, not a 16-bit partition plus the fp32 copy the step makes of it (6 B x P / N). ZeRO-1 with K > 1: the
    BF16_Optimizer wrapper (fp16: a per-parameter fp32 grad_accum) sums every backward in fp32. ZeRO-0 has no
    fp32 accumulation in DeepSpeed (bf16 + fp32 accumulation is an "unsupported mix" there), so K > 1 in
    16-bit is refused. Coalesced ZeRO-2/3 keeps the model's dtype: it sums in ``.grad`` (16-bit only at K = 1)."""
    precision, stage = ds_precision(ds), zero_stage(ds)
    reduction = grad_reduction_of(ds, train, world)  # raises for a combination that cannot be exact
    if precision == "fp32":
        return
    if stage == 0 and train.accum_freq > 1:
        raise ConfigError(
            f"{where}: ZeRO-0 with --precision {precision} and --accum-freq {train.accum_freq} would sum the chunk "
            f"gradients in {precision} (DeepSpeed has no fp32 accumulation at stage 0); use a ZeRO-1/2/3 config "
            f"(e.g. ds_configs/zero2_{precision}.json) or --accum-freq 1"
        )
    if not (reduction == "sharded" or (stage == 1 and train.accum_freq > 1)):
        return
    dtypes = ds.setdefault("data_types", {})
    if dtypes.get("grad_accum_dtype", "fp32") not in ("fp32", "float32"):
        raise ConfigError(
            f"{where} sets data_types.grad_accum_dtype {dtypes['grad_accum_dtype']!r}, but this {precision} run "
            f"sums or partitions its gradients in it ({reduction}, --accum-freq {train.accum_freq}); remove the key "
            f"or set fp32"
        )
    dtypes["grad_accum_dtype"] = "fp32"


def _fill_optimizer(ds: dict[str, Any], o: OptimArgs, where: str) -> None:
    # Optimizer: if the JSON has an optimizer block DeepSpeed builds it; fill its auto params.
    if "optimizer" in ds and o.opt != "adamw":
        raise ConfigError(
            f"--opt {o.opt} conflicts with the optimizer block of {where} (type {ds['optimizer'].get('type')}): "
            f"drop --opt, or remove the JSON's optimizer block"
        )
    if "optimizer" in ds:
        params = ds["optimizer"].setdefault("params", {})
        _fill(params, "lr", o.lr, f"{where} optimizer.params", what="--lr")
        _fill(params, "weight_decay", o.wd, f"{where} optimizer.params", what="--wd")
        kind = str(ds["optimizer"].get("type", "")).lower()
        if kind not in MOMENTUM_OPTIMIZERS:  # SGD takes neither betas nor eps
            _fill(params, "betas", [o.beta1, o.beta2], f"{where} optimizer.params", what="--beta1/--beta2")
            _fill(params, "eps", o.eps, f"{where} optimizer.params", what="--eps")
        if o.momentum is not None:
            if kind not in MOMENTUM_OPTIMIZERS:
                raise ConfigError(
                    f"--momentum: the optimizer of {where} ({ds['optimizer'].get('type')}) takes no momentum; "
                    f"drop --momentum (Adam-type momentum is --beta1)"
                )
            _fill(params, "momentum", o.momentum, f"{where} optimizer.params", what="--momentum")
    elif o.opt != "adamw":
        if (ds.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
            raise ConfigError(
                f"--opt {o.opt} with ZeRO-Offload ({where} offload_optimizer): the offloaded step runs DeepSpeed's "
                f"CPU Adam; drop --opt (AdamW) or the offload_optimizer block"
            )
        if o.momentum is not None and not timm_optimizer_info(o.opt).has_momentum:
            raise ConfigError(f"--momentum: the optimizer {o.opt} takes no momentum; drop --momentum")
        ds.setdefault("zero_allow_untested_optimizer", True)  # a client optimizer, as AdamW below
    else:
        if o.momentum is not None:
            raise ConfigError(
                "--momentum: dsclip's default optimizer is AdamW, which takes no momentum (its first moment is "
                "--beta1); drop --momentum, or use --opt timm/sgd or a DeepSpeed JSON optimizer block of type SGD "
                "or MuSGD"
            )
        # We hand DeepSpeed our own AdamW (engine/optim.py: torch's, or DeepSpeedCPUAdam under
        # offload_optimizer, which ZeRO-Offload then accepts as its own); ZeRO wants this acknowledged.
        ds.setdefault("zero_allow_untested_optimizer", True)


# DeepSpeed optimizer types whose params take "momentum" (DeepSpeed's MuSGD, or torch.optim.SGD that it
# falls back to for names it does not know); they take no betas/eps.
MOMENTUM_OPTIMIZERS = ("sgd", "musgd")


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def precision_of(ds: dict[str, Any]) -> Precision:
    if ds.get("bf16", {}).get("enabled"):
        return Precision("bf16")
    if ds.get("fp16", {}).get("enabled"):
        return Precision("fp16")
    return Precision("fp32")
