"""One plan: the memory budget (dsclip.plan.memory), the step time (dsclip.plan.flops, .efficiency, .comm), the
notes and the ``dsclip train`` command of one configuration; and the largest batch that fits.

The Python API counts in global rows: ``make_plan(batch_size=...)`` is the global contrastive batch and
``micro_batch`` the per-GPU micro-batch.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsclip.config_base import ConfigError
from dsclip.engine.ds_config import SHIPPED_DS_CONFIGS
from dsclip.engine.grad_reduction import GRAD_REDUCTIONS, choose_grad_reduction
from dsclip.losses.config import LOSS_FLAGS, TRAIN_TILE_SIZE
from dsclip.losses.config import LOSS_NAMES as LOSS_MODES
from dsclip.model.lock import LockConfig, check_lock_config
from dsclip.plan.architecture import Arch, load_arch
from dsclip.plan.comm import (
    LinkModel,
    exposed_seconds,
    persistent_numel,
    step_traffic,
    zero2_reduce_kind,
    zero3_persistence,
)
from dsclip.plan.efficiency import MEASURED, extra_forwards, offload_seconds, plan_mfu_row
from dsclip.plan.flops import forward_flops, loss_flops
from dsclip.plan.memory import (
    activation_bytes,
    bucket_bytes,
    checkpoint_copy_bytes,
    cpu_model_state_bytes,
    embedding_cache_bytes,
    gathered_weight_bytes,
    gpu_state_bytes,
    held_activation_bytes,
    input_bytes,
    loss_bytes,
    offload_of,
)

GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Plan:
    model: str
    gpus: int
    gpu_memory_gb: float
    batch_size: int
    zero: int
    precision: str
    grad_checkpointing: bool
    patch_dropout: float
    loss: str
    mfu: float
    peak_tflops: float
    params: int = 0
    trainable_params: int = 0
    locked_saving_gb: float = 0.0  # per GPU: gradients + optimizer state the locked parameters don't need
    image_size: int | None = None
    lock: dict = field(default_factory=dict)
    local_batch: int = 0
    micro_batch: int = 0
    accum_freq: int = 0
    max_micro_batch: int = 0
    fits: bool = False
    memory_gb: dict = field(default_factory=dict)
    activation_per_sample_mb: dict = field(default_factory=dict)
    loss_memory_gb: dict = field(default_factory=dict)
    forward_gflops_per_sample: dict = field(default_factory=dict)
    train_gflops_per_sample: float = 0.0
    executed_gflops_per_sample: float = 0.0
    step_time_s: float = 0.0
    samples_per_s_per_gpu: float = 0.0
    hfu: float = 0.0
    command: str = ""
    notes: list = field(default_factory=list)
    device: str = "cuda"
    host_inputs_gb: float = 0.0  # per GPU: the step's images + tokens the gradient cache holds on the host
    host_memory_gb: float = 0.0  # per node, the budget those inputs were checked against
    host_checkpoint_gb: float = 0.0  # per GPU: the async save's host copy of its optimizer-state share (+ EMA)
    host_checkpoint_module_gb: float = 0.0  # once per job: the module file's copy on data-parallel rank 0
    async_save: bool = True  # False: the async save's copy does not fit the host (the command says --no-async-save)
    mfu_source: str = ""  # where plan.mfu comes from (dsclip.plan.efficiency): measured, nearest, given
    offload: str = "none"  # ZeRO-Offload of the JSON: none, optimizer, optimizer+params
    host_offload_gb: float = 0.0  # per GPU: the model states ZeRO-Offload keeps in host RAM
    offload_s: float = 0.0  # per step: the host optimizer step and PCIe copies offload adds (dsclip.plan.efficiency)
    ds_config: str = ""  # the --deepspeed-config the command runs
    mfu_world: int = 0  # world size of the MFU row the plan took (0: none, --mfu or assumed)
    compute_s: float = 0.0  # per step: the model's FLOPs at the MFU (before communication and offload)
    comm_s: float = 0.0  # per step: the communication model's exposed time (dsclip.plan.comm)
    comm_total_s: float = 0.0  # per step: every collective back to back (what overlap could hide)
    comm_share: float = 0.0  # comm_s / step_time_s
    comm_link: str = ""  # the link model's figures and their sources
    # how the gradient cache reduces the K chunk gradients (dsclip/engine/accumulation.py): sharded | coalesced
    grad_reduction: str = "coalesced"
    grads_bytes: float = 0.0  # per GPU: the gradient line of memory_gb, unrounded (bytes)
    # per GPU: memory_gb's total less the reserve, unrounded: the tensors alive at the step's peak, what
    # max_memory_allocated (and a CPU rehearsal's LiveTensorBytes) measures
    tensor_bytes: float = 0.0
    comm_bytes: dict = field(default_factory=dict)  # per step, derived: "kind in phase" -> bytes (dsclip/plan/comm.py)
    # every reduction the plan weighed: mode -> {fits, samples_per_s_per_gpu, memory_gb, micro_batch, accum_freq,
    # refused (why the run would refuse it, or "")}
    reductions: dict = field(default_factory=dict)


def shipped_ds_config(zero: int, precision: str) -> tuple[str, dict]:
    name = f"ds_configs/zero{zero}_{precision}.json"
    path = SHIPPED_DS_CONFIGS / f"zero{zero}_{precision}.json"
    if not path.exists():
        path = SHIPPED_DS_CONFIGS / f"zero{zero}.json"
        name = f"ds_configs/zero{zero}.json"
    try:
        return name, json.loads(path.read_text())
    except FileNotFoundError:
        return name, {"zero_optimization": {"stage": zero}}


def _check_plan_args(loss, zero, precision, gpus, batch_size, gpu_memory_gb, patch_dropout, mfu) -> None:
    if loss not in LOSS_MODES:
        raise ConfigError(f"--loss must be one of {', '.join(LOSS_MODES)}, got {loss!r}")
    if zero not in (1, 2, 3):
        raise ConfigError(f"--zero must be 1, 2 or 3, got {zero}")
    if precision not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
    if gpus < 1 or batch_size < 1 or gpu_memory_gb <= 0:
        raise ConfigError(
            f"--gpus, the global batch (--global-batch, or --batch-size x --accum-freq x --gpus) and --gpu-memory "
            f"must be positive, got --gpus {gpus}, global batch {batch_size}, --gpu-memory {gpu_memory_gb:g}"
        )
    if batch_size % gpus:
        raise ConfigError(
            f"--batch-size {batch_size} is not a multiple of --gpus {gpus}: every rank needs the same number of rows"
        )
    if not 0.0 <= patch_dropout < 1.0:
        raise ConfigError(f"--patch-dropout must be in [0, 1), got {patch_dropout}")
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {mfu}")


def make_plan(
    model: str,
    *,
    gpus: int,
    gpu_memory_gb: float,
    batch_size: int,
    zero: int = 2,
    precision: str = "bf16",
    grad_checkpointing: bool = False,
    patch_dropout: float = 0.0,
    loss: str = "infonce",
    mfu: float | None = None,
    peak_tflops: float = 790.0,
    tile: int = TRAIN_TILE_SIZE,
    gpus_per_node: int = 8,
    reserve_gb: float = 2.0,
    keep_last_graph: bool = True,
    image_size: int | None = None,
    lock: LockConfig | None = None,
    micro_batch: int | None = None,
    host_memory_gb: float = 1024.0,
    device: str = "cuda",
    baseline_gb: float | None = None,
    ds_config: tuple[str, dict] | None = None,
    ema: bool = False,
    link: LinkModel | None = None,
    grad_reduction: str = "auto",
) -> Plan:
    """Plan one run. ``device="cpu"`` predicts the peak resident memory of each rank of a CPU run
    (``gpu_memory_gb`` is then the RAM per rank and ``baseline_gb`` the measured resident size of a rank
    before the model exists: see :func:`_plan_cpu_memory`). ``ds_config`` is (name as printed, JSON) of the
    user's DeepSpeed JSON; default: the shipped one for ``zero`` and ``precision``. ``link``: the links the
    communication time is modelled on (dsclip.plan.comm; default: NVLink inside ``gpus_per_node``, InfiniBand
    per GPU between nodes). ``grad_reduction`` (``--grad-reduction``): "auto" plans both reductions under
    ZeRO-2/3 and keeps the faster that fits and that the run would allow (:func:`_choose_reduction`)."""
    given = dict(locals())  # every argument, for planning each reduction with the same settings
    _check_plan_args(loss, zero, precision, gpus, batch_size, gpu_memory_gb, patch_dropout, mfu)
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ConfigError(f"--grad-reduction must be one of {', '.join(GRAD_REDUCTIONS)}, got {grad_reduction!r}")
    if grad_reduction == "auto" and zero >= 2 and device != "cpu":
        given.pop("grad_reduction")
        return _choose_reduction([make_plan(**given, grad_reduction=m) for m in ("sharded", "coalesced")])
    if grad_reduction == "auto":
        grad_reduction = "coalesced"  # ZeRO-1 (and a CPU run's plan): one reduction of the whole gradient
    given["grad_reduction"] = grad_reduction
    if lock is not None:
        shape = load_arch(model, count_params=False, image_size=image_size)
        check_lock_config(
            lock, {"vision_cfg": {"layers": shape.vision.layers}, "text_cfg": {"layers": shape.text.layers}}
        )
    arch = load_arch(model, patch_dropout, image_size=image_size, lock=lock)
    plan = Plan(
        model if isinstance(model, str) else "custom",  # a config dict (dsclip train's --deepspeed-config auto)
        gpus,
        gpu_memory_gb,
        batch_size,
        zero,
        precision,
        grad_checkpointing,
        patch_dropout,
        loss,
        mfu,
        peak_tflops,
        params=arch.params,
        trainable_params=arch.trainable_params,
        image_size=image_size,
        lock={k: v for k, v in asdict(lock).items() if v} if lock is not None else {},
    )
    plan.local_batch = batch_size // gpus
    plan.grad_reduction = grad_reduction
    ds_name, ds_cfg = ds_config or shipped_ds_config(zero, precision)
    plan.ds_config, plan.offload = ds_name, offload_of(ds_cfg)
    if device == "cpu":
        losses = _plan_cpu_memory(plan, arch, tile, baseline_gb, keep_last_graph, micro_batch)
    else:
        losses = _plan_memory(plan, arch, ds_cfg, tile, reserve_gb, micro_batch, ema=ema)
        _check_host(plan, gpus_per_node, host_memory_gb)
        _check_reduction(plan)
    _plan_speed(plan, arch, keep_last_graph, ds_cfg, link or LinkModel(gpus_per_node=gpus_per_node))
    plan.command = _train_command(plan, ds_name, tile, gpus_per_node)
    _plan_notes(plan, losses, tile, gpus_per_node)
    plan.reductions = {plan.grad_reduction: _reduction_row(plan)}
    if micro_batch is None and plan.fits and device != "cpu":
        return _fastest_split(plan, given)
    return plan


SPLITS_TRIED = 3  # the largest micro-batches that fit, each planned: the fastest split of the rows is kept


def _fastest_split(largest: Plan, given: dict) -> Plan:
    """The fastest of the ``SPLITS_TRIED`` largest micro-batches that fit (ties: the larger). The largest is not
    always the fastest: the rate model's MFU and the reductions per step depend on K, and a micro-batch at the
    memory's edge can buy one re-forward less for a lower utilisation (ViT-H-14 on 8 x 80 GB: 128 x 3 predicted
    1.6 % faster than 192 x 2)."""
    local = largest.local_batch
    smaller = [m for m in range(largest.micro_batch - 1, 0, -1) if local % m == 0][: SPLITS_TRIED - 1]
    plans = [largest] + [make_plan(**{**given, "micro_batch": m}) for m in smaller]
    best = max((p for p in plans if p.fits), key=lambda p: p.samples_per_s_per_gpu)
    best.max_micro_batch = largest.max_micro_batch
    return best


def _reduction_refusal(plan: Plan) -> str:
    """Why ``dsclip train`` would refuse this plan's reduction at its K ("" where it would not)."""
    try:
        choose_grad_reduction(
            plan.grad_reduction,
            stage=plan.zero,
            world=plan.gpus,
            accum_freq=max(plan.accum_freq, 1),
            precision=plan.precision,
        )
    except ConfigError as e:
        return str(e)
    return ""


def _check_reduction(plan: Plan) -> None:
    refused = _reduction_refusal(plan)
    if refused and plan.fits:
        plan.fits = False
        plan.notes.append(f"refused by dsclip train: {refused}")


def _reduction_row(plan: Plan) -> dict:
    return {
        "fits": plan.fits,
        "grads_gb": plan.grads_bytes / GiB,
        "comm_bytes": plan.comm_bytes,
        "samples_per_s_per_gpu": plan.samples_per_s_per_gpu,
        "memory_gb": plan.memory_gb.get("total", 0.0),
        "tensor_bytes": plan.tensor_bytes,
        "micro_batch": plan.micro_batch,
        "accum_freq": plan.accum_freq,
        "refused": _reduction_refusal(plan),
    }


def _choose_reduction(plans: list[Plan]) -> Plan:
    """The plan of the reduction to run: the fastest of those that fit (ties: the first, sharded, which holds
    less), else the first; it carries every reduction's row (``Plan.reductions``) and a note on the other."""
    fitting = [p for p in plans if p.fits]
    chosen = max(fitting, key=lambda p: p.samples_per_s_per_gpu) if fitting else plans[0]
    chosen.reductions = {p.grad_reduction: _reduction_row(p) for p in plans}
    for p in plans:
        if p is chosen:
            continue
        row = chosen.reductions[p.grad_reduction]
        why = row["refused"] or (
            "does not fit" if not row["fits"] else f"{row['samples_per_s_per_gpu']:g} samples/s/GPU"
        )
        chosen.notes.append(
            f"--grad-reduction {p.grad_reduction}: {row['memory_gb']:.1f} GiB, micro-batch {row['micro_batch']} x "
            f"{row['accum_freq']}; {why}"
        )
    return chosen


def _plan_memory(
    plan: Plan, arch: Arch, ds_cfg: dict, tile: int, reserve_gb: float, micro_batch: int | None, *, ema: bool = False
) -> dict[str, float]:
    """Fill the memory budget, the largest micro-batch that fits and the accumulation; returns loss bytes per mode."""
    local, loss, precision = plan.local_batch, plan.loss, plan.precision
    reduction = plan.grad_reduction
    states, host_states = gpu_state_bytes(
        arch, plan.gpus, plan.zero, precision, plan.offload, ema=ema, grad_reduction=reduction
    )
    unlocked, unlocked_host = gpu_state_bytes(
        arch, plan.gpus, plan.zero, precision, plan.offload, ema=ema, locked=False, grad_reduction=reduction
    )
    saved = sum(unlocked.values()) + unlocked_host - sum(states.values()) - host_states
    plan.locked_saving_gb = round(saved / GiB, 3)
    plan.host_offload_gb = round(host_states / GiB, 3)
    in_flight = states.get("gathered_layers", 0.0)
    held, kept, within_held = gathered_weight_bytes(
        arch.params, plan.gpus, plan.zero, precision, plan.grad_checkpointing, ds_cfg, in_flight
    )
    cache = embedding_cache_bytes(local, arch.embed_dim)
    losses = {m: loss_bytes(m, local, plan.batch_size, arch.embed_dim, tile) for m in LOSS_MODES}
    act = activation_bytes(arch, precision, plan.grad_checkpointing)
    fixed = sum(states.values()) + held + kept - within_held + cache + losses[loss] + reserve_gb * GiB

    def largest_micro(buckets: float) -> int:  # per sample: one chunk's graph at its backward peak, whatever K
        budget = plan.gpu_memory_gb * GiB - fixed - buckets
        return int(budget // held_activation_bytes(act, 1)) if budget > 0 else 0

    # the buckets can depend on K (ZeRO-1 bf16 sums K > 1 in BF16_Optimizer, which has its own): K = 1's and K > 1's
    one_chunk, chunks = (bucket_bytes(ds_cfg, precision, k, arch.trainable_params, arch.params) for k in (1, 2))
    grads = next((v for k, v in states.items() if k.startswith("grads")), 0.0)

    def not_together(micro: int) -> float:
        """Coalesced at K = 1 (ZeRO-2/3): the whole ``.grad`` builds up in the one backward as the activations and
        the held weights are released, so the peak is the larger of the two, not their sum (K > 1 re-forwards
        its chunks beside the gradient summed so far)."""
        if plan.zero < 2 or reduction != "coalesced":
            return 0.0
        return min(grads, held + kept + held_activation_bytes(act, micro))

    k1_need = fixed + one_chunk + held_activation_bytes(act, local) - not_together(local)
    fits_one, max_chunks = k1_need <= plan.gpu_memory_gb * GiB, largest_micro(chunks)
    plan.max_micro_batch = max(max_chunks, local) if fits_one else min(max_chunks, max(local - 1, 1))
    if micro_batch:  # the run's own micro-batch (it must divide this rank's rows)
        if local % micro_batch:
            raise ConfigError(f"--micro-batch {micro_batch} must divide the {local} rows per GPU")
        fit = fits_one if micro_batch == local else micro_batch <= max_chunks
        micro = micro_batch if fit else 0
    else:  # the largest divisor of `local` that fits
        smaller = (m for m in range(1, local) if local % m == 0 and m <= max_chunks)
        micro = local if fits_one else max(smaller, default=0)
    buckets = one_chunk if micro == local else chunks
    plan.fits = micro >= 1
    plan.micro_batch, plan.accum_freq = micro, (local // micro if micro else 0)
    plan.host_inputs_gb = round(input_bytes(arch, local) / GiB, 3)
    # --async-save copies each rank's checkpoint state to host memory; data-parallel rank 0 also the module
    share = checkpoint_copy_bytes(arch.params, plan.gpus, precision, ema=ema, writer=False)
    plan.host_checkpoint_gb = round(share / GiB, 3)
    writer = checkpoint_copy_bytes(arch.params, plan.gpus, precision, ema=ema)
    plan.host_checkpoint_module_gb = round((writer - share) / GiB, 3)

    plan.grads_bytes = grads
    mem = {k: v / GiB for k, v in states.items() if v or plan.offload == "none"}  # offloaded: a host line below
    mem["comm_buckets"] = buckets / GiB
    if held:
        mem["held_weights (torch's linear)"] = held / GiB
    if kept:
        mem["kept_weights (ZeRO-3 reuse)"] = kept / GiB
    if within_held:
        mem["gathered layers, within held weights"] = -within_held / GiB
    mem["embedding_cache"] = cache / GiB
    mem[f"loss ({loss})"] = losses[loss] / GiB
    mem["activations"] = held_activation_bytes(act, max(micro, 1)) / GiB
    if micro == local and not_together(local):
        mem["grads/activations not at once (K = 1)"] = -not_together(local) / GiB
    plan.tensor_bytes = sum(mem.values()) * GiB
    mem["reserve (CUDA context, allocator)"] = reserve_gb
    mem["total"] = sum(mem.values())
    if host_states:
        mem["(host) offloaded model states"] = host_states / GiB  # not on the GPU: after the total
    plan.memory_gb = {k: round(v, 3) for k, v in mem.items()}
    plan.activation_per_sample_mb = {k: round(v / 2**20, 3) for k, v in act.items()}
    plan.loss_memory_gb = {m: round(v / GiB, 3) for m, v in losses.items()}
    return losses


def _check_host(plan: Plan, gpus_per_node: int, host_memory_gb: float) -> None:
    """The step's inputs live in host RAM (all K micro-batches, until pass 2 ends): they must fit the node.
    The asynchronous save's host copy (dsclip.checkpoint.async_save) comes on top; where only it does not
    fit, the plan still fits and its command trains with --no-async-save (saves then stall for the write)."""
    plan.host_memory_gb = host_memory_gb
    per_node = min(plan.gpus, gpus_per_node)
    need = (plan.host_inputs_gb + plan.host_offload_gb) * per_node
    copies = plan.host_checkpoint_gb * per_node + plan.host_checkpoint_module_gb  # the module: one rank of the job
    if need > host_memory_gb:
        plan.fits = False
        offloaded = f" + {plan.host_offload_gb:.1f} GiB offloaded model states" if plan.host_offload_gb else ""
        plan.notes.append(
            f"does NOT fit the host: the step's inputs{' and offloaded states' if offloaded else ''} need "
            f"{need:.0f} GiB of host RAM per node ({plan.host_inputs_gb:.1f} GiB inputs{offloaded} per GPU) "
            f"against --host-memory {host_memory_gb:g}; lower the batch"
        )
    elif need + copies > host_memory_gb:
        plan.async_save = False
        plan.notes.append(
            f"the asynchronous save's host copy ({plan.host_checkpoint_gb:.1f} GiB per GPU + "
            f"{plan.host_checkpoint_module_gb:.1f} GiB module copy on one rank) does not fit beside the "
            f"{need:.0f} GiB the step holds per node against --host-memory {host_memory_gb:g}: the command "
            "trains with --no-async-save (each save stalls every rank for the whole write)"
        )


def _plan_cpu_memory(
    plan: Plan, arch: Arch, tile: int, baseline_gb: float | None, keep_last_graph: bool, micro_batch: int | None
) -> dict[str, float]:
    """Predict the peak resident set of each rank of a CPU run (``dsclip train`` on CPU ranks over gloo).

    Unlike the GPU budget (a sum of everything that could be alive), this follows the step's phases,
    because the prediction is compared with a measured peak: model states, the measured process
    baseline and the step's inputs are alive throughout; then the peak is the larger of
    * the loss: the fp32 embeddings (image + text) and their gradients (4 N_local x D), the loss's
      own buffers, and the kept last chunk's pass-1 graph;
    * pass 2: the embeddings' gradients (2 N_local x D) and one micro-batch's graph at its backward peak
      (the kept graph is back-propagated first, before any re-forward).
    ``baseline_gb`` must be measured (bench/largest_batch.py measures it): the resident size of a rank
    that has imported torch, DeepSpeed and dsclip and joined the gloo process group.
    """
    if baseline_gb is None:
        raise ConfigError("--device cpu needs --baseline-gb: measure it with bench/largest_batch.py --baseline-only")
    if plan.zero not in (1, 2):
        raise ConfigError(f"--device cpu predicts ZeRO-1/2 runs; got --zero {plan.zero}")
    if not micro_batch:
        raise ConfigError("--device cpu needs --micro-batch (the run's --batch-size per rank)")
    local, loss, d = plan.local_batch, plan.loss, arch.embed_dim
    if local % micro_batch:
        raise ConfigError(f"--micro-batch {micro_batch} must divide the {local} rows per rank")
    plan.device = "cpu"
    plan.micro_batch, plan.accum_freq, plan.max_micro_batch = micro_batch, local // micro_batch, micro_batch
    states = cpu_model_state_bytes(arch.params, plan.gpus, plan.zero, plan.precision)
    act = activation_bytes(arch, plan.precision, plan.grad_checkpointing)
    losses = {m: loss_bytes(m, local, plan.batch_size, d, tile) for m in LOSS_MODES}
    kept = micro_batch * act["saved"] if keep_last_graph and plan.accum_freq > 1 else 0.0
    loss_phase = embedding_cache_bytes(local, d) + losses[loss] + kept
    pass2_phase = embedding_cache_bytes(local, d) / 2 + held_activation_bytes(act, micro_batch)
    mem = {"baseline (measured)": baseline_gb}
    mem.update({k: v / GiB for k, v in states.items()})
    mem["inputs (K micro-batches)"] = input_bytes(arch, local) / GiB
    if loss_phase >= pass2_phase:
        mem["embedding_cache + grads"] = embedding_cache_bytes(local, d) / GiB
        mem[f"loss ({loss})"] = losses[loss] / GiB
        mem["activations (kept graph)"] = kept / GiB
    else:
        mem["embedding grads"] = embedding_cache_bytes(local, d) / 2 / GiB
        mem["activations"] = held_activation_bytes(act, micro_batch) / GiB
    mem["total"] = sum(mem.values())
    plan.fits = mem["total"] <= plan.gpu_memory_gb
    plan.host_inputs_gb = round(mem["inputs (K micro-batches)"], 3)
    plan.memory_gb = {k: round(v, 4) for k, v in mem.items()}
    plan.activation_per_sample_mb = {k: round(v / 2**20, 3) for k, v in act.items()}
    plan.loss_memory_gb = {m: round(v / GiB, 3) for m, v in losses.items()}
    return losses


def _measured_gflops() -> dict[str, float]:
    # forward GFLOPs per sample of each architecture with a measured MFU, counted as plans count them
    models = {m.model for m in MEASURED}
    return {name: forward_flops(load_arch(name, count_params=False))["total"] / 1e9 for name in models}


def _plan_speed(plan: Plan, arch: Arch, keep_last_graph: bool, ds_cfg: dict, link: LinkModel) -> None:
    fwd = forward_flops(arch)
    if plan.mfu is None:  # measured where dsclip has a measurement (dsclip.plan.efficiency), said where from
        plan.mfu, plan.mfu_source, plan.mfu_world = plan_mfu_row(
            plan.model, plan.zero, plan.precision, fwd["total"] / 1e9, _measured_gflops(),
            accum_freq=plan.accum_freq, grad_checkpointing=plan.grad_checkpointing, world=plan.gpus,
        )  # fmt: skip
    elif not plan.mfu_source:
        plan.mfu_source = "given (--mfu)"
    local, mfu = plan.local_batch, plan.mfu
    plan.forward_gflops_per_sample = {k: round(v / 1e9, 2) for k, v in fwd.items()}
    lf = loss_flops(plan.loss, local, plan.batch_size, arch.embed_dim) / local
    model_flops = 3 * fwd["total"] + lf  # forward + backward (2x), the MFU convention
    executed = model_flops + fwd["total"] * extra_forwards(plan.accum_freq, plan.grad_checkpointing, keep_last_graph)
    plan.train_gflops_per_sample = round(model_flops / 1e9, 2)
    plan.executed_gflops_per_sample = round(executed / 1e9, 2)
    plan.offload_s = round(
        offload_seconds(plan.offload, arch.params, arch.trainable_params, plan.gpus, plan.accum_freq,
                        plan.grad_checkpointing, keep_last_graph), 4,
    )  # fmt: skip
    compute = model_flops * local / (mfu * plan.peak_tflops * 1e12)
    _plan_comm(plan, arch, keep_last_graph, ds_cfg, link, compute)
    # six significant digits, not fixed decimals: a small model's step is well under a millisecond, and the
    # search (dsclip.plan.search) ranks configurations by these numbers
    step = compute + plan.comm_s + plan.offload_s
    plan.compute_s = float(f"{compute:.6g}")
    plan.step_time_s = float(f"{step:.6g}")
    plan.comm_share = round(plan.comm_s / step, 4) if step else 0.0
    plan.samples_per_s_per_gpu = float(f"{local / step:.6g}") if step else 0.0
    plan.hfu = round(mfu * executed / model_flops, 3)


def _plan_comm(plan: Plan, arch: Arch, keep_last_graph: bool, ds_cfg: dict, link: LinkModel, compute: float) -> None:
    """The communication model's exposed time per step (dsclip.plan.comm): the bytes this configuration
    sends, on ``link``, less what overlaps the compute. A CPU run's ranks talk over gloo, not these links:
    none there. The MFU rows measure compute only (a world-1 rank, or rank 0 under the fake group, whose
    collectives return at once), so the two add."""
    if plan.device == "cpu" or plan.gpus <= 1:
        return
    persistent = persistent_numel(arch.config_json, *zero3_persistence(ds_cfg)) if plan.zero == 3 else 0
    traffic = step_traffic(
        params=arch.params, trainable=arch.trainable_params, persistent=persistent, world=plan.gpus,
        zero=plan.zero, precision=plan.precision, accum_freq=plan.accum_freq, local_batch=plan.local_batch,
        embed_dim=arch.embed_dim, loss=plan.loss, keep_last_graph=keep_last_graph,
        grad_reduction=plan.grad_reduction, zero2_reduce=zero2_reduce_kind(ds_cfg),
    )  # fmt: skip
    plan.comm_bytes = {f"{kind} in {phase}": b for (kind, _, phase), b in sorted(traffic.bytes.items())}
    overlap = bool(ds_cfg.get("zero_optimization", {}).get("overlap_comm", False))
    exposed, total = exposed_seconds(traffic, link, zero=plan.zero, overlap_comm=overlap, compute_s=compute)
    plan.comm_s, plan.comm_total_s = float(f"{exposed:.6g}"), float(f"{total:.6g}")
    plan.comm_link = link.describe()


def _train_command(plan: Plan, ds_name: str, tile: int, gpus_per_node: int) -> str:
    gpus = plan.gpus
    nodes = math.ceil(gpus / gpus_per_node)
    launch = (
        f"deepspeed --num_nodes {nodes} --num_gpus {min(gpus, gpus_per_node)} --hostfile HOSTFILE " if gpus > 1 else ""
    )
    if plan.device == "cpu" and gpus > 1:  # one machine, CPU ranks over gloo
        launch = f"deepspeed --num_gpus {gpus} "
    head = f"{launch}--module dsclip train" if launch else "dsclip train"
    return " ".join([head, *train_args(plan, ds_name, tile)])


def train_args(plan: Plan, ds_name: str, tile: int) -> list[str]:
    """The ``dsclip train`` flags (shell words, already quoted) that run this plan's settings."""
    micro = plan.micro_batch
    args = [
        f"--model {shlex.quote(plan.model)}",
        f"--batch-size {max(micro, 1)}",
        f"--accum-freq {max(plan.accum_freq, 1)}",
        f"--precision {plan.precision}",
        f"--deepspeed-config {shlex.quote(ds_name)}",
    ]
    if plan.grad_checkpointing:
        args.append("--grad-checkpointing")
    if not plan.async_save:
        args.append("--no-async-save")
    train_pick = choose_grad_reduction(
        "auto", stage=plan.zero, world=plan.gpus, accum_freq=max(plan.accum_freq, 1), precision=plan.precision
    )
    if plan.grad_reduction != train_pick:  # dsclip train's own choice otherwise: the command says so
        args.append(f"--grad-reduction {plan.grad_reduction}")
    if plan.image_size:
        args.append(f"--force-image-size {plan.image_size}")
    for key, value in plan.lock.items():
        flag = "--" + key.replace("_", "-")
        args.append(flag if value is True else f"{flag} {value}")
    if plan.patch_dropout:
        args.append(f"--force-patch-dropout {plan.patch_dropout:g}")
    args += LOSS_FLAGS[plan.loss]
    if plan.loss in ("infonce_tiled", "siglip") and tile != TRAIN_TILE_SIZE:
        args.append(f"--loss-tile-size {tile}")
    return args


def _plan_notes(plan: Plan, losses: dict[str, float], tile: int, gpus_per_node: int) -> None:
    notes = plan.notes
    if not plan.fits and plan.device != "cpu" and plan.micro_batch == 0:
        notes.append(
            "does NOT fit: even one sample per micro-batch exceeds the memory left after model states, loss and cache"
        )
    if plan.loss == "infonce" and losses["infonce"] > 0.1 * plan.gpu_memory_gb * GiB:
        notes.append(
            f"global infonce builds the {plan.batch_size}x{plan.batch_size} logit matrix on every rank "
            f"({losses['infonce'] / GiB:.1f} GiB); --loss infonce_tiled gives the same loss in "
            f"{losses['infonce_tiled'] / GiB:.2f} GiB"
        )
    if plan.hfu > 0.75:
        notes.append(f"MFU {plan.mfu} with this recompute means {plan.hfu:.2f} hardware utilization: optimistic")
    if plan.precision == "fp16":
        notes.append("fp16 needs loss scaling; bf16 is the recommended precision on A100/H100/H200")


def largest_batch(
    model: str | dict,
    *,
    gpus: int,
    gpu_memory_gb: float,
    zero: int = 3,
    precision: str = "bf16",
    grad_checkpointing: bool = True,
    patch_dropout: float = 0.0,
    loss: str = "infonce_tiled",
    tile: int = 4096,
    reserve_gb: float = 2.0,
    micro_batch: int = 32,
    host_memory_gb: float = 1024.0,
    gpus_per_node: int = 8,
    grad_reduction: str = "auto",
) -> int:
    """The largest global contrastive batch (a multiple of gpus × micro_batch) whose step fits in memory.

    With the gradient cache only the cached embeddings (and, for the tiled/ring losses, O(rows·D) loss
    buffers) grow with the batch on the GPU; model states, communication buckets and the activations of
    one micro-batch do not. On the host the step's inputs grow with the batch (all K micro-batches are
    held for pass 2) and must fit ``host_memory_gb`` per node. The
    same accounting as :func:`make_plan` (which is called on the answer); ``grad_reduction="auto"`` counts the
    gradients as the sharded reduction holds them under ZeRO-2/3 (the less of the two).
    """
    if grad_reduction == "auto":
        grad_reduction = "sharded" if zero >= 2 else "coalesced"
    arch = load_arch(model, patch_dropout)
    _, ds_cfg = shipped_ds_config(zero, precision)
    act = activation_bytes(arch, precision, grad_checkpointing)
    states = gpu_state_bytes(arch, gpus, zero, precision, locked=False, grad_reduction=grad_reduction)[0]
    held, kept, within = gathered_weight_bytes(
        arch.params, gpus, zero, precision, grad_checkpointing, ds_cfg, states.get("gathered_layers", 0.0)
    )
    fixed = (
        sum(states.values())
        + max(bucket_bytes(ds_cfg, precision, k, arch.params, arch.params) for k in (1, 2))  # K = 1's or K > 1's
        + held
        + kept
        - within  # ZeRO-3's gathered copies, counted once
        + reserve_gb * GiB
        + held_activation_bytes(act, micro_batch)
    )
    per_node = min(gpus, gpus_per_node)

    def fits(local: int) -> bool:
        need = embedding_cache_bytes(local, arch.embed_dim) + loss_bytes(
            loss, local, local * gpus, arch.embed_dim, tile
        )
        host = input_bytes(arch, local) * per_node
        return fixed + need <= gpu_memory_gb * GiB and host <= host_memory_gb * GiB

    return largest_fitting(lambda k: fits(k * micro_batch)) * micro_batch * gpus  # k micro-batches per GPU


def largest_fitting(fits) -> int:
    """The largest n >= 1 with ``fits(n)`` for a ``fits`` that holds up to an edge (0: not even 1):
    doubling, then bisection."""
    if not fits(1):
        return 0
    lo, hi = 1, 2  # lo fits, hi does not
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
