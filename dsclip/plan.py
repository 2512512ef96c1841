"""``dsclip plan``: what fits on each GPU, and how fast it runs, before a big job is queued.

    dsclip plan --model ViT-bigG-14 --gpus 256 --gpu-memory 80 --batch-size 64 --accum-freq 2 | --max-batch \
        [--zero 2|3] [--precision bf16] [--grad-checkpointing] [--force-patch-dropout 0.5] \
        [--loss infonce|infonce_local|infonce_tiled|siglip] [--mfu MEASURED] [--peak-tflops 790]

The command line (dsclip/plan_cli.py) takes dsclip train's flag names with their meanings. The Python
API below counts in global rows: ``make_plan(batch_size=...)`` is the global contrastive batch and
``micro_batch`` the per-GPU micro-batch.

Everything is computed from the architecture (no GPU, no weights: the model is built on the meta
device to count parameters). Each number has one function here, and the tests check them against
measurements:

* model states (``model_state_bytes``): DeepSpeed mixed-precision accounting, per GPU. For ZeRO-2
  ``2P + (2 + 4 + 4 + 8)·P/N`` (16-bit params replicated; 16-bit and fp32 gradient partitions, fp32
  master, Adam m and v partitioned), for ZeRO-3 ``18·P/N + 4·largest_layer`` (everything
  partitioned plus the gathered layers in flight): identical to DeepSpeed's own
  ``estimate_zero2/3_model_states_mem_needs`` (tests/unit/test_plan.py) and to the tensors a real
  engine allocates (tests/dist/test_scale_plan.py). Under ZeRO-2/3 the plan then counts the gradients as
  dsclip's step holds them (``gradient_cache_grad_bytes``): the gradient cache's one coalesced reduction
  leaves the WHOLE 16-bit gradient in ``.grad`` on every rank until the step boundary, ~2P, not 6P/N.
* activations (``activation_bytes``): the tensors autograd saves, listed per transformer block
  (pre-norm timm ``Block`` with fused SDPA: 8·T·W + 2·T·H elements plus fp32 norm statistics and the
  attention log-sum-exp) plus the stem/head of each tower; checked against the bytes autograd
  really saves in a forward of small models (fp32/bf16, patch dropout, checkpointing).
* loss memory per mode (``loss_bytes``) and the gradient cache's embedding cache.
* FLOPs (``forward_flops``): every matmul, the patch-embedding convolution and attention, checked
  against ``torch.utils.flop_counter.FlopCounterMode``.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsclip.comm_model import LinkModel
from dsclip.config_base import ConfigError
from dsclip.engine.ds_config import SHIPPED_DS_CONFIGS
from dsclip.losses.config import LOSS_FLAGS, TRAIN_TILE_SIZE
from dsclip.losses.config import LOSS_NAMES as LOSS_MODES
from dsclip.model import get_model_config, resolve_model_config
from dsclip.model.lock import LockConfig, check_lock_config
from dsclip.plan_comm import exposed_seconds, persistent_numel, step_traffic, zero3_persistence
from dsclip.plan_efficiency import MEASURED, extra_forwards, offload_seconds, plan_mfu_row

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------
# architecture
@dataclass
class Tower:
    tokens: int  # T: sequence length seen by the blocks
    width: int  # W
    layers: int
    heads: int
    hidden: int  # H: MLP hidden width (int(W * mlp_ratio), as timm's Block)
    causal: bool = False


@dataclass
class Arch:
    name: str
    embed_dim: int
    image_size: int
    patch_size: int
    vision: Tower
    text: Tower
    vocab_size: int
    params: int = 0
    vision_params: int = 0
    text_params: int = 0
    largest_layer_params: int = 0
    trainable_params: int = 0  # after --lock-image / --lock-text
    patch_dropout: float = 0.0
    config_json: str = ""  # the resolved config (sorted JSON): what ZeRO-3's persistent parameters are counted on

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def kept_patches(patches: int, patch_dropout: float) -> int:
    """timm's PatchDropout keeps max(1, int(N * (1 - p))) patches (the class token is always kept)."""
    return patches if patch_dropout <= 0 else max(1, int(patches * (1.0 - patch_dropout)))


def load_arch(
    model: str | dict,
    patch_dropout: float = 0.0,
    count_params: bool = True,
    image_size: int | None = None,
    lock: LockConfig | None = None,
) -> Arch:
    """Shapes of a registered name / JSON path / config dict; parameters counted on the meta device.
    ``image_size``: ``--force-image-size``; ``lock``: the locking flags (trainable parameters counted)."""
    raw = copy.deepcopy(model) if isinstance(model, dict) else get_model_config(model)
    if image_size:
        raw.setdefault("vision_cfg", {})["image_size"] = int(image_size)
    cfg = resolve_model_config(raw)
    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    n = (v["image_size"] // v["patch_size"]) ** 2
    vis = Tower(
        1 + kept_patches(n, patch_dropout),
        v["width"],
        v["layers"],
        v["width"] // v["head_width"],
        int(v["width"] * v["mlp_ratio"]),
    )
    txt = Tower(
        t["context_length"],
        t["width"],
        t["layers"],
        t["heads"],
        int(t["width"] * t["mlp_ratio"]),
        causal=True,
    )
    arch = Arch(
        str(model if not isinstance(model, dict) else "custom"),
        cfg["embed_dim"],
        v["image_size"],
        v["patch_size"],
        vis,
        txt,
        t["vocab_size"],
        patch_dropout=patch_dropout,
    )
    if count_params:
        lock_key = json.dumps(asdict(lock), sort_keys=True) if lock else ""
        arch.config_json = json.dumps(cfg, sort_keys=True)
        counts = _param_counts(arch.config_json, lock_key)
        arch.params, arch.trainable_params, arch.vision_params, arch.text_params, arch.largest_layer_params = counts
    return arch


@functools.lru_cache(maxsize=64)
def _param_counts(cfg_json: str, lock_json: str) -> tuple[int, int, int, int, int]:
    """(params, trainable, vision, text, largest layer) of a resolved config, built once on the meta device:
    the search (dsclip.plan_search) plans dozens of configurations of one model."""
    cfg = json.loads(cfg_json)
    lock = LockConfig(**json.loads(lock_json)) if lock_json else None
    from dsclip.model import create_model  # lazy: torch + timm, which `dsclip plan --help` must not load (#33)
    from dsclip.model.lock import apply_locking

    m = create_model(cfg, device="meta")
    params = sum(p.numel() for p in m.parameters())
    trainable = apply_locking(m, lock)["trainable"] if lock is not None else params
    vision = sum(p.numel() for p in m.visual.parameters())
    text = sum(p.numel() for p in m.text.parameters())
    # As DeepSpeed's model_to_params: the most parameters any single module owns directly.
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    return params, trainable, vision, text, largest


# ---------------------------------------------------------------------------------------------------
# model states
def model_state_bytes(
    params: int,
    world: int,
    zero: int,
    precision: str = "bf16",
    largest_layer_params: int = 0,
    trainable_params: int | None = None,
    ema: bool = False,
) -> dict[str, float]:
    """Per-GPU bytes of parameters, gradients and Adam states under ZeRO-``zero`` (DeepSpeed's accounting).

    Mixed precision (bf16/fp16): 16-bit parameters (2 B), a 16-bit gradient partition (2 B) and an fp32
    gradient partition (4 B), fp32 master weights (4 B) and Adam m, v (8 B). fp32: 4 B parameters,
    4 B gradients, 8 B Adam, no master copy. ZeRO-1 partitions the optimizer (master + Adam), ZeRO-2 also
    the gradients, ZeRO-3 also the parameters, which are then gathered a layer or two at a time
    (DeepSpeed's estimate: 4 B x the largest layer). Locked parameters (``trainable_params`` < ``params``)
    have parameters only: no gradient, master copy or Adam state. ``ema`` (``--ema-decay``): dsclip's EMA
    is one fp32 copy of each trainable parameter, sharded as the master weights are (4 B x trainable / N
    under ZeRO-1/2/3; dsclip.engine.ema).
    """
    p, n = float(params), float(world)
    t = p if trainable_params is None else float(trainable_params)
    mixed = precision in ("bf16", "fp16")
    w_b = 2 if mixed else 4
    g_b = (2 + 4) if mixed else 4
    master_b = 4 if mixed else 0
    out = {
        "params": p * w_b / (n if zero >= 3 else 1),
        "grads": t * g_b / (n if zero >= 2 else 1),
        "optimizer": t * (master_b + 8) / (n if zero >= 1 else 1),
    }
    if ema:
        out["ema"] = t * 4 / (n if zero >= 1 else 1)
    if zero >= 3:
        out["gathered_layers"] = 4.0 * largest_layer_params
    return out


OFFLOADS = ("none", "optimizer", "optimizer+params")


def offload_of(ds_config: dict) -> str:
    """What the JSON's ZeRO-Offload moves to the host: "none", "optimizer" or "optimizer+params"."""
    z = ds_config.get("zero_optimization", {})

    def on(key):
        return (z.get(key) or {}).get("device", "none") not in ("none", None)

    return "optimizer+params" if on("offload_param") else "optimizer" if on("offload_optimizer") else "none"


def split_offloaded(states: dict[str, float], offload: str) -> tuple[dict[str, float], float]:
    """(states left on the GPU, bytes moved to the host) under ZeRO-Offload, as DeepSpeed's own
    ``estimate_zero2/3_model_states_mem_needs`` count them: offloading the optimizer moves the gradient
    partitions, fp32 master and Adam states to the host (the GPU keeps its 16-bit weights: 2P under ZeRO-2,
    2P/N plus the gathered layers under ZeRO-3); offloading the parameters (ZeRO-3) moves the 16-bit
    partition too."""
    moved = {"none": (), "optimizer": ("grads", "optimizer"), "optimizer+params": ("grads", "optimizer", "params")}
    keys = moved[offload]
    return {k: (0.0 if k in keys else v) for k, v in states.items()}, sum(states[k] for k in keys)


GRADS_LINE = "grads (whole, until the one reduction)"


def whole_grad_bytes(trainable_params: int, precision: str) -> float:
    """Bytes of ``param.grad`` one rank holds at the end of the gradient cache's backwards, before the one
    coalesced reduction: the whole gradient of every trainable parameter in the weights' dtype, whatever
    the stage or world (tests/dist/test_coalesced_grads.py measures it)."""
    return (4 if precision == "fp32" else 2) * float(trainable_params)


def gradient_cache_grad_bytes(
    step_partitions: float, trainable_params: int, world: int, zero: int, precision: str, offloaded: bool
) -> float:
    """Per-GPU bytes of gradients under dsclip's step, which DeepSpeed's ZeRO-2/3 accounting undercounts.

    dsclip runs every step's K backwards (K = 1 too) inside DeepSpeed's ``coalesce_grad_reduction``
    (dsclip/train/gradcache.py), so each rank accumulates the WHOLE gradient in ``param.grad`` (16-bit:
    2 B x trainable params, 4 B in fp32; measured 2.000 B/param at world 8 under ZeRO-2 and ZeRO-3 alike,
    bench/results/coalesced-grads_cpu2_2026-12-06.md) until the step boundary's one reduction. Only then
    does DeepSpeed keep the partitions ``step_partitions`` (``model_state_bytes``'s "grads": the 16-bit
    partition, and in the step the fp32 copy made from it after ``.grad`` is freed). Not double counted:
    what is alive together is the larger of (a) the whole ``.grad`` plus one 16-bit partition (ZeRO-3's
    flat partition buffer lives the whole run; ZeRO-2 builds its partition at the boundary before it frees
    ``.grad``) and (b) the step's partitions. At world 1 (b) is the larger in mixed precision, so one GPU's
    count is DeepSpeed's. With the optimizer offloaded the partitions live on the host, the whole ``.grad``
    still on the GPU. ZeRO-1 is already counted whole (``step_partitions``).
    """
    if zero < 2:
        return step_partitions
    whole = whole_grad_bytes(trainable_params, precision)
    if offloaded:
        return whole
    return max(whole + whole / world, step_partitions)


def gpu_state_bytes(
    arch: Arch, gpus: int, zero: int, precision: str, offload: str = "none", *, ema: bool = False, locked: bool = True
) -> tuple[dict[str, float], float]:
    """(per-GPU model states as dsclip's step holds them, bytes offloaded to the host): DeepSpeed's accounting
    (``model_state_bytes``, ``split_offloaded``) with its "grads" replaced by ``GRADS_LINE``
    (``gradient_cache_grad_bytes``) under ZeRO-2/3. ``locked=False``: as if every parameter trained."""
    trainable = arch.trainable_params if locked else arch.params
    states = model_state_bytes(arch.params, gpus, zero, precision, arch.largest_layer_params, trainable, ema)
    partitions = states["grads"]
    states, host = split_offloaded(states, offload)
    if zero < 2:
        return states, host
    grads = gradient_cache_grad_bytes(partitions, trainable, gpus, zero, precision, offload != "none")
    return {(GRADS_LINE if k == "grads" else k): (grads if k == "grads" else v) for k, v in states.items()}, host


def held_weight_bytes(
    params: int, gpus: int, zero: int, precision: str, grad_checkpointing: bool, ds_config: dict
) -> float:
    """Gathered weights that autograd keeps alive from the forward to each layer's backward under ZeRO-3 with
    torch's ``F.linear`` (the shipped ``memory_efficient_linear: false``).

    torch's linear saves a view of its weight for the backward, so a gathered weight that ZeRO-3 releases
    after the forward stays allocated until its backward: the whole model's weights (2 B each in bf16/fp16,
    4 B in fp32) at the turn from forward to backward. DeepSpeed's autograd linear
    (``memory_efficient_linear: true``, its default) saves the parameter itself, whose gathered copy a release
    frees. Nothing is held with activation checkpointing (the forward keeps no graph) or on one GPU (the
    "gathered" weight is a view of the rank's whole partition).
    Measured on two CPU ranks (bench/zero3_held_weights.py, bench/results/zero3-host_cpu2_2026-12-05.md): with
    ZeRO-3 releasing every weight after its forward, 235 MB of the 285 MB of partitioned weights stayed
    resident with torch's linear, none with DeepSpeed's; with checkpointing none with either. With the
    shipped prefetch settings DeepSpeed had re-gathered that whole 150 M-parameter model for its backward
    before the forward ended, with either linear. The sum counts the held weights at the forward's end, where
    a real step's activations peak too.
    """
    linear_off = ds_config.get("zero_optimization", {}).get("memory_efficient_linear", True) is False
    if zero < 3 or gpus <= 1 or grad_checkpointing or not linear_off:
        return 0.0
    return float(params) * (2 if precision in ("bf16", "fp16") else 4)


def bucket_bytes(ds_config: dict, precision: str) -> float:
    """Communication buffers DeepSpeed allocates from the JSON's bucket sizes (elements -> bytes)."""
    z = ds_config.get("zero_optimization", {})
    stage = int(z.get("stage", 0))
    b = 2 if precision in ("bf16", "fp16") else 4

    def num(key, default):
        v = z.get(key, default)
        return float(v) if not isinstance(v, str) else float(default)

    if stage == 3:
        return b * (num("reduce_bucket_size", 5e8) + num("stage3_prefetch_bucket_size", 5e7))
    if stage in (1, 2):
        double = 2 if z.get("overlap_comm") else 1
        return b * (double * num("reduce_bucket_size", 5e8) + num("allgather_bucket_size", 5e8))
    return 0.0


# ---------------------------------------------------------------------------------------------------
# activations
def block_saved_bytes(t: Tower, act_b: int) -> float:
    """Bytes autograd keeps per sample for one pre-norm block (timm Block, fused SDPA attention).

    norm1 input, norm1 output (qkv input), qkv output (q, k, v are views of it), attention output
    (= proj input: SDPA's output layout makes the transpose a view), norm2 input, norm2 output (fc1
    input), fc1 output (GELU input), GELU output (fc2 input): 8·T·W + 2·T·H elements; plus each
    LayerNorm's mean and rstd (fp32) and the attention log-sum-exp (fp32, heads × T).
    """
    T, W, H = t.tokens, t.width, t.hidden
    return act_b * (8 * T * W + 2 * T * H) + 4 * (2 * 2 * T + t.heads * T)


def block_input_bytes(t: Tower, act_b: int) -> float:
    return act_b * t.tokens * t.width


def tower_extra_bytes(arch: Arch, act_b: int) -> dict[str, float]:
    """Per-sample saved tensors outside the blocks (stem, final norm, pooling, projection, normalize)."""
    v, t, d = arch.vision, arch.text, arch.embed_dim
    vision = act_b * 3 * arch.image_size**2  # patch-embedding conv input (the image)
    vision += 2 * (act_b * v.tokens * v.width + 4 * 2 * v.tokens)  # norm_pre and final norm inputs + stats
    # The pooled class token is a view of the final norm's output, so the projection keeps that whole
    # (T, W) tensor alive; then the projection output and the normalized features.
    vision += act_b * (v.tokens * v.width + 2 * d)
    if arch.patch_dropout > 0:  # the gather keeps its full (1 + N)-token source and the kept indices
        vision += act_b * (1 + arch.patches) * v.width + 8 * (v.tokens - 1)
    text = 8 * t.tokens  # token ids (int64) kept by the embedding
    text += act_b * t.tokens * t.width + 4 * 2 * t.tokens  # ln_final input + stats
    text += act_b * (t.width + 2 * d) + 8  # pooled token, projection, normalize; pooling index
    return {"vision": float(vision), "text": float(text)}


def activation_bytes(arch: Arch, precision: str = "bf16", grad_checkpointing: bool = False) -> dict[str, float]:
    """Per-sample activation memory: what the forward keeps for backward, and the backward's transient peak.

    ``saved``: bytes alive at the end of a forward (what the tests measure). ``transient``: extra bytes at
    the backward peak: with checkpointing, one block's recomputed activations; always, the gradient
    flowing through the widest tensor (2 x T·H of the largest tower, a conservative working set).
    """
    act_b = 4 if precision == "fp32" else 2
    extra = tower_extra_bytes(arch, act_b)
    out: dict[str, float] = {}
    for name, tw in (("vision", arch.vision), ("text", arch.text)):
        per_block = block_input_bytes(tw, act_b) if grad_checkpointing else block_saved_bytes(tw, act_b)
        out[f"{name}_blocks"] = tw.layers * per_block
        out[f"{name}_other"] = extra[name]
    out["saved"] = sum(out.values())
    widest = max(act_b * 2 * tw.tokens * tw.hidden for tw in (arch.vision, arch.text))
    recompute = max(block_saved_bytes(tw, act_b) for tw in (arch.vision, arch.text)) if grad_checkpointing else 0
    out["transient"] = float(widest + recompute)
    out["peak"] = out["saved"] + out["transient"]
    return out


# ---------------------------------------------------------------------------------------------------
# loss and gradient cache
def loss_bytes(mode: str, local_rows: int, global_rows: int, dim: int, tile: int = 4096) -> float:
    """Peak bytes of one loss forward+backward on a rank holding ``local_rows`` of ``global_rows`` (fp32).

    infonce: the N×N logits, their two log-softmaxes and the logits' gradient (4 N² floats) plus the
    gathered features and their gradients; infonce_local: the same with b×N logits for both directions
    (2 × (logits, log-softmax, gradient) = 6 b·N); infonce_tiled / siglip: a few tile² blocks and the
    ring's receive/accumulate buffers (O(b·D)): the logit matrix is never built.
    """
    b, n, d, f = float(local_rows), float(global_rows), float(dim), 4.0
    gathered = 2 * 2 * n * d * f  # all image + text features and their gradients
    if mode == "infonce":
        return 4 * n * n * f + gathered
    if mode == "infonce_local":
        return 6 * b * n * f + gathered
    if mode in ("infonce_tiled", "siglip"):
        tl = min(tile, max(b, 1))
        return 3 * tl * tl * f + 4 * 2 * b * d * f
    raise ValueError(f"unknown loss mode {mode!r}; choose one of {', '.join(LOSS_MODES)}")


def embedding_cache_bytes(local_rows: int, dim: int) -> float:
    """The gradient cache's pass-1 embeddings (image + text, fp32) and their cached gradients."""
    return 4.0 * local_rows * dim * 4


def input_bytes(arch: Arch, rows: int) -> float:
    """The step's inputs held on the host: the gradient cache re-forwards every micro-batch in pass 2, so
    the loop keeps all K micro-batches of this rank (images fp32 as dsclip's loaders yield them, token
    ids int64) from the first forward to the last backward. On a GPU they stay in host memory (each
    chunk is copied to the device when it is forwarded), so they bound the batch by the host's RAM."""
    return float(rows) * (4 * 3 * arch.image_size**2 + 8 * arch.text.tokens)


def held_activation_bytes(act: dict[str, float], micro: int) -> float:
    """Activations at the backward peak: one micro-batch's graph being back-propagated. The last chunk's
    pass-1 graph that ``keep_last_graph`` keeps is the first one pass 2 back-propagates, so it is never alive
    beside a re-forwarded chunk's (dsclip/train/gradcache.py); before that it is held through the loss, where
    its ``saved`` bytes (below the backward ``peak``) sit beside the loss's buffers."""
    return micro * act["peak"]


# ---------------------------------------------------------------------------------------------------
# FLOPs
def tower_forward_flops(t: Tower) -> float:
    """Per-sample forward FLOPs of the blocks (2 per multiply-add): qkv, QKᵀ, AV, out-proj, MLP."""
    T, W, H = t.tokens, t.width, t.hidden
    per_block = 2 * T * W * 3 * W + 2 * 2 * T * T * W + 2 * T * W * W + 2 * 2 * T * W * H
    return float(t.layers * per_block)


def forward_flops(arch: Arch) -> dict[str, float]:
    v, t, d = arch.vision, arch.text, arch.embed_dim
    patch = 2.0 * arch.patches * 3 * arch.patch_size**2 * v.width  # conv over every patch (before dropout)
    vision = patch + tower_forward_flops(v) + 2.0 * v.width * d
    text = tower_forward_flops(t) + 2.0 * t.width * d
    return {"vision": vision, "text": text, "total": vision + text}


def loss_flops(mode: str, local_rows: int, global_rows: int, dim: int) -> float:
    """FLOPs of the loss on one rank per step (forward + backward): the logit matmuls dominate.

    infonce computes the whole N×N matrix on every rank; infonce_local two b×N matrices; the tiled
    losses compute each b×N block once and recompute it in backward (4 instead of 3 matmul passes)."""
    b, n, d = float(local_rows), float(global_rows), float(dim)
    one = 2 * b * n * d  # one b×N logit matmul
    if mode == "infonce":
        return 3 * 2 * n * n * d
    if mode == "infonce_local":
        return 3 * 2 * one
    return 4 * one


# ---------------------------------------------------------------------------------------------------
# the plan
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
    mfu_source: str = ""  # where plan.mfu comes from (dsclip.plan_efficiency): measured, nearest, given
    offload: str = "none"  # ZeRO-Offload of the JSON: none, optimizer, optimizer+params
    host_offload_gb: float = 0.0  # per GPU: the model states ZeRO-Offload keeps in host RAM
    offload_s: float = 0.0  # per step: the host optimizer step and PCIe copies offload adds (plan_efficiency)
    ds_config: str = ""  # the --deepspeed-config the command runs
    mfu_world: int = 0  # world size of the MFU row the plan took (0: none, --mfu or assumed)
    compute_s: float = 0.0  # per step: the model's FLOPs at the MFU (before communication and offload)
    comm_s: float = 0.0  # per step: the communication model's exposed time (dsclip.plan_comm)
    comm_total_s: float = 0.0  # per step: every collective back to back (what overlap could hide)
    comm_share: float = 0.0  # comm_s / step_time_s
    comm_link: str = ""  # the link model's figures and their sources


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
) -> Plan:
    """Plan one run. ``device="cpu"`` predicts the peak resident memory of each rank of a CPU run
    (``gpu_memory_gb`` is then the RAM per rank and ``baseline_gb`` the measured resident size of a rank
    before the model exists: see :func:`_plan_cpu_memory`). ``ds_config`` is (name as printed, JSON) of the
    user's DeepSpeed JSON; default: the shipped one for ``zero`` and ``precision``. ``link``: the links the
    communication time is modelled on (dsclip.comm_model; default: NVLink inside ``gpus_per_node``, InfiniBand
    per GPU between nodes)."""
    _check_plan_args(loss, zero, precision, gpus, batch_size, gpu_memory_gb, patch_dropout, mfu)
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
    ds_name, ds_cfg = ds_config or shipped_ds_config(zero, precision)
    plan.ds_config, plan.offload = ds_name, offload_of(ds_cfg)
    if device == "cpu":
        losses = _plan_cpu_memory(plan, arch, tile, baseline_gb, keep_last_graph, micro_batch)
    else:
        losses = _plan_memory(plan, arch, ds_cfg, tile, reserve_gb, micro_batch, ema=ema)
        _check_host(plan, gpus_per_node, host_memory_gb)
    _plan_speed(plan, arch, keep_last_graph, ds_cfg, link or LinkModel(gpus_per_node=gpus_per_node))
    plan.command = _train_command(plan, ds_name, tile, gpus_per_node)
    _plan_notes(plan, losses, tile, gpus_per_node)
    return plan


def _plan_memory(
    plan: Plan, arch: Arch, ds_cfg: dict, tile: int, reserve_gb: float, micro_batch: int | None, *, ema: bool = False
) -> dict[str, float]:
    """Fill the memory budget, the largest micro-batch that fits and the accumulation; returns loss bytes per mode."""
    local, loss, precision = plan.local_batch, plan.loss, plan.precision
    states, host_states = gpu_state_bytes(arch, plan.gpus, plan.zero, precision, plan.offload, ema=ema)
    unlocked, unlocked_host = gpu_state_bytes(
        arch, plan.gpus, plan.zero, precision, plan.offload, ema=ema, locked=False
    )
    saved = sum(unlocked.values()) + unlocked_host - sum(states.values()) - host_states
    plan.locked_saving_gb = round(saved / GiB, 3)
    plan.host_offload_gb = round(host_states / GiB, 3)
    buckets = bucket_bytes(ds_cfg, precision)
    held = held_weight_bytes(arch.params, plan.gpus, plan.zero, precision, plan.grad_checkpointing, ds_cfg)
    cache = embedding_cache_bytes(local, arch.embed_dim)
    losses = {m: loss_bytes(m, local, plan.batch_size, arch.embed_dim, tile) for m in LOSS_MODES}
    act = activation_bytes(arch, precision, plan.grad_checkpointing)
    fixed = sum(states.values()) + buckets + held + cache + losses[loss] + reserve_gb * GiB
    budget = plan.gpu_memory_gb * GiB - fixed
    # per sample of micro-batch: one chunk's graph at its backward peak, whatever K (held_activation_bytes)
    max_micro = int(budget // held_activation_bytes(act, 1)) if budget > 0 else 0
    plan.max_micro_batch = max_micro
    if micro_batch:  # the run's own micro-batch (it must divide this rank's rows)
        if local % micro_batch:
            raise ConfigError(f"--micro-batch {micro_batch} must divide the {local} rows per GPU")
        micro = micro_batch if micro_batch <= max_micro else 0
    else:  # the largest divisor of `local` that fits
        micro = max((m for m in range(1, local + 1) if local % m == 0 and m <= max_micro), default=0)
    plan.fits = micro >= 1
    plan.micro_batch, plan.accum_freq = micro, (local // micro if micro else 0)
    plan.host_inputs_gb = round(input_bytes(arch, local) / GiB, 3)

    mem = {k: v / GiB for k, v in states.items() if v or plan.offload == "none"}  # offloaded: a host line below
    mem["comm_buckets"] = buckets / GiB
    if held:
        mem["held_weights (torch's linear)"] = held / GiB
    mem["embedding_cache"] = cache / GiB
    mem[f"loss ({loss})"] = losses[loss] / GiB
    mem["activations"] = held_activation_bytes(act, max(micro, 1)) / GiB
    mem["reserve (CUDA context, allocator)"] = reserve_gb
    mem["total"] = sum(mem.values())
    if host_states:
        mem["(host) offloaded model states"] = host_states / GiB  # not on the GPU: after the total
    plan.memory_gb = {k: round(v, 3) for k, v in mem.items()}
    plan.activation_per_sample_mb = {k: round(v / 2**20, 3) for k, v in act.items()}
    plan.loss_memory_gb = {m: round(v / GiB, 3) for m, v in losses.items()}
    return losses


def _check_host(plan: Plan, gpus_per_node: int, host_memory_gb: float) -> None:
    """The step's inputs live in host RAM (all K micro-batches, until pass 2 ends): they must fit the node."""
    plan.host_memory_gb = host_memory_gb
    need = (plan.host_inputs_gb + plan.host_offload_gb) * min(plan.gpus, gpus_per_node)
    if need > host_memory_gb:
        plan.fits = False
        offloaded = f" + {plan.host_offload_gb:.1f} GiB offloaded model states" if plan.host_offload_gb else ""
        plan.notes.append(
            f"does NOT fit the host: the step's inputs{' and offloaded states' if offloaded else ''} need "
            f"{need:.0f} GiB of host RAM per node ({plan.host_inputs_gb:.1f} GiB inputs{offloaded} per GPU) "
            f"against --host-memory {host_memory_gb:g}; lower the batch"
        )


def cpu_model_state_bytes(params: int, world: int, zero: int, precision: str) -> dict[str, float]:
    """Resident bytes of the model states of a CPU rank under ZeRO-1/2 as dsclip drives it.

    The parameters (4 B fp32, 2 B bf16) live in DeepSpeed's flat buffer; the K backwards accumulate full
    gradients in ``.grad`` (dsclip takes ZeRO's hooks out inside the gradient cache), the reduction copies
    them into the bucket (its pages count only where written: up to the gradients' size, not the JSON's
    bucket size) and keeps an fp32 gradient partition; ZeRO-1/2 keeps an fp32 master partition even
    for fp32 weights, and Adam's m and v on it.
    """
    p, n = float(params), float(world)
    w_b = 4 if precision == "fp32" else 2
    return {"params": w_b * p, "grads": 2 * w_b * p + 4 * p / n, "optimizer": (4 + 8) * p / n}


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
    if plan.mfu is None:  # measured where dsclip has a measurement (dsclip.plan_efficiency), said where from
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
    # search (dsclip.plan_search) ranks configurations by these numbers
    step = compute + plan.comm_s + plan.offload_s
    plan.compute_s = float(f"{compute:.6g}")
    plan.step_time_s = float(f"{step:.6g}")
    plan.comm_share = round(plan.comm_s / step, 4) if step else 0.0
    plan.samples_per_s_per_gpu = float(f"{local / step:.6g}") if step else 0.0
    plan.hfu = round(mfu * executed / model_flops, 3)


def _plan_comm(plan: Plan, arch: Arch, keep_last_graph: bool, ds_cfg: dict, link: LinkModel, compute: float) -> None:
    """The communication model's exposed time per step (dsclip.plan_comm): the bytes this configuration
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
    )  # fmt: skip
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
) -> int:
    """The largest global contrastive batch (a multiple of gpus × micro_batch) whose step fits in memory.

    With the gradient cache only the cached embeddings (and, for the tiled/ring losses, O(rows·D) loss
    buffers) grow with the batch on the GPU; model states, communication buckets and the activations of
    one micro-batch do not. On the host the step's inputs grow with the batch (all K micro-batches are
    held for pass 2) and must fit ``host_memory_gb`` per node. The
    same accounting as :func:`make_plan` (which is called on the answer).
    """
    arch = load_arch(model, patch_dropout)
    _, ds_cfg = shipped_ds_config(zero, precision)
    act = activation_bytes(arch, precision, grad_checkpointing)
    fixed = (
        sum(gpu_state_bytes(arch, gpus, zero, precision, locked=False)[0].values())
        + bucket_bytes(ds_cfg, precision)
        + held_weight_bytes(arch.params, gpus, zero, precision, grad_checkpointing, ds_cfg)
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


def format_plan(p: Plan) -> str:
    lines = [*_headline(p), ""]
    lines.append(
        "per-GPU memory (GiB):"
        if p.device != "cpu"
        else "per-rank peak resident memory, predicted (GiB; the larger of the loss and pass-2 phases):"
    )
    for k, v in p.memory_gb.items():
        lines.append(f"  {k:<38} {v:10.3f}")
    a = p.activation_per_sample_mb
    lines += [
        "",
        "activations per sample (MiB): " + ", ".join(f"{k} {v:.2f}" for k, v in a.items()),
        "loss memory per mode (GiB, this rank, whole step's rows): "
        + ", ".join(f"{k} {v:.3f}" for k, v in p.loss_memory_gb.items()),
        "",
    ]
    if p.fits:
        lines.append(
            f"fits: micro-batch {p.micro_batch} x --accum-freq {p.accum_freq} per GPU "
            f"(largest micro-batch that fits: {p.max_micro_batch})"
        )
    else:
        lines.append("does NOT fit")
    if p.device != "cpu":
        lines.append(
            f"host RAM for the step's inputs: {p.host_inputs_gb:.2f} GiB per GPU (--host-memory {p.host_memory_gb:g} "
            f"GiB per node)"
        )
    lines += _step_time_lines(p)
    lines += [f"note: {n}" for n in p.notes]
    if p.fits:  # a command the plan says does not fit is never printed (the CLI prints a change that fits)
        lines += ["", "recommended:", "  " + p.command]
    return "\n".join(lines)


def _headline(p: Plan) -> list[str]:
    """The plan's first line (what is planned) and, with locking, what the locked parameters save."""
    head = (
        f"dsclip plan: {p.model} ({p.params / 1e9:.3f} B params, {p.trainable_params / 1e9:.3f} B trainable) | "
        + (f"{p.gpus} GPUs x {p.gpu_memory_gb:g} GiB | " if p.device != "cpu" else f"{p.gpus} CPU ranks | ")
        + f"ZeRO-{p.zero}{'' if p.offload == 'none' else ' offload ' + p.offload} {p.precision} | "
        + f"global batch {p.batch_size} ({p.local_batch}/GPU) | loss {p.loss}"
        + (" | grad-checkpointing" if p.grad_checkpointing else "")
        + (f" | patch-dropout {p.patch_dropout:g}" if p.patch_dropout else "")
        + (f" | image size {p.image_size}" if p.image_size else "")
    )
    if p.params == p.trainable_params:
        return [head]
    return [
        head,
        f"locked: {p.params - p.trainable_params:,} parameters ({', '.join(p.lock)}): "
        f"{p.locked_saving_gb:.3f} GiB/GPU of gradients + optimizer state not allocated",
    ]


def _step_time_lines(p: Plan) -> list[str]:
    """FLOPs, the MFU row and its world, and the step as compute + exposed communication (+ offload)."""
    f = p.forward_gflops_per_sample
    lines = [
        f"FLOPs per sample: forward {f['total']:.1f} GFLOP (vision {f['vision']:.1f}, text {f['text']:.1f}); "
        f"train (3x fwd) {p.train_gflops_per_sample:.1f}; "
        f"executed incl. recompute {p.executed_gflops_per_sample:.1f}",
        f"at MFU {p.mfu:g} of {p.peak_tflops:g} TFLOP/s: {p.step_time_s:.2f} s/step, "
        f"{p.samples_per_s_per_gpu:.1f} samples/s/GPU, "
        f"{p.samples_per_s_per_gpu * p.gpus:.0f} samples/s total "
        f"(hardware utilisation incl. recompute {p.hfu:.2f})",
        f"MFU {p.mfu:g}: {p.mfu_source}"
        + (
            f" (no row measured at world {p.gpus}: a world-{p.mfu_world} rank's compute, communication added below)"
            if p.mfu_world and p.mfu_world != p.gpus
            else ""
        ),
    ]
    if p.comm_link:
        lines += [
            f"step = compute {p.compute_s:.3f} s + exposed communication {p.comm_s:.3f} s "
            + (f"+ offload {p.offload_s:.3f} s " if p.offload_s else "")
            + f"(communication {p.comm_share:.1%} of the step; {p.comm_total_s:.3f} s back to back before "
            "overlap; dsclip/plan_comm.py)",
            f"links: {p.comm_link}",
        ]
    if p.offload_s:
        lines.append(
            f"ZeRO-Offload ({p.offload}) adds {p.offload_s:.2f} s/step: host Adam + PCIe copies (plan_efficiency)"
        )
    return lines
