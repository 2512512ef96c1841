"""Per-GPU memory of one training step, each number in one function (the tests check them against
measurements):

* model states (``model_state_bytes``): DeepSpeed mixed-precision accounting, per GPU. For ZeRO-2
  ``2P + (2 + 4 + 4 + 8)·P/N`` (16-bit params replicated; 16-bit and fp32 gradient partitions, fp32
  master, Adam m and v partitioned), for ZeRO-3 ``18·P/N + 4·largest_layer`` (everything
  partitioned plus the gathered layers in flight): identical to DeepSpeed's own
  ``estimate_zero2/3_model_states_mem_needs`` (tests/unit/test_plan.py) and to the tensors a real
  engine allocates (tests/dist/test_scale_plan.py). Under ZeRO-2/3 the plan then counts the gradients as
  dsclip's step holds them (``gpu_state_bytes``), per ``--grad-reduction``: ``sharded`` reduces each chunk
  into one fp32 partition, 4P/N (``sharded_grad_bytes``); ``coalesced`` leaves the WHOLE 16-bit gradient
  in ``.grad`` on every rank until the step boundary's one reduction, ~2P (``gradient_cache_grad_bytes``).
* activations (``activation_bytes``): the tensors autograd saves, listed per transformer block
  (pre-norm timm ``Block`` with fused SDPA: 8·T·W + 2·T·H elements plus fp32 norm statistics and the
  attention log-sum-exp) plus the stem/head of each tower; checked against the bytes autograd
  really saves in a forward of small models (fp32/bf16, patch dropout, checkpointing).
* loss memory per mode (``loss_bytes``) and the gradient cache's embedding cache.
* a CPU rank's resident model states (``cpu_model_state_bytes``), for ``--device cpu``.
"""

from __future__ import annotations

from dsclip.losses.config import LOSS_NAMES as LOSS_MODES
from dsclip.plan.architecture import Arch, Tower


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
SHARDED_GRADS_LINE = "grads (partition, reduced per chunk)"


def whole_grad_bytes(trainable_params: int, precision: str) -> float:
    """Bytes of ``param.grad`` one rank holds at the end of the gradient cache's backwards, before the one
    coalesced reduction: the whole gradient of every trainable parameter in the weights' dtype, whatever
    the stage or world (tests/dist/test_coalesced_grads.py measures it)."""
    return (4 if precision == "fp32" else 2) * float(trainable_params)


def sharded_grad_bytes(trainable_params: int, world: int) -> float:
    """Per-GPU gradient bytes of the sharded reduction under ZeRO-2/3: one fp32 partition, 4 B x trainable / N.

    16-bit runs get ``data_types.grad_accum_dtype: fp32`` (dsclip/engine/ds_config.py), so each chunk's reduced
    bucket is added into an fp32 partition (ZeRO-2's compact partition buffer, ZeRO-3's flat gradient partition)
    that the optimizer step reads in place: DeepSpeed's accounting of a 16-bit partition plus the step's fp32
    copy (6 B x P / N) does not apply. Measured by the rehearsal (``held_gradient_storages``, demo model, world 8
    and 64, ZeRO-2/3, K = 1 and 2: tests/unit/test_plan_comm.py)."""
    return 4.0 * float(trainable_params) / world


def gradient_cache_grad_bytes(
    step_partitions: float, trainable_params: int, world: int, zero: int, precision: str, offloaded: bool
) -> float:
    """Per-GPU bytes of gradients under ``--grad-reduction coalesced``, which DeepSpeed's ZeRO-2/3 accounting
    undercounts.

    The coalesced reduction runs every step's K backwards (K = 1 too) inside DeepSpeed's
    ``coalesce_grad_reduction`` (dsclip/engine/accumulation.py), so each rank accumulates the WHOLE gradient
    in ``param.grad`` (16-bit: 2 B x trainable params, 4 B in fp32; measured 2.000 B/param at world 8 under
    ZeRO-2 and ZeRO-3 alike,
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
    arch: Arch,
    gpus: int,
    zero: int,
    precision: str,
    offload: str = "none",
    *,
    ema: bool = False,
    locked: bool = True,
    grad_reduction: str = "coalesced",
) -> tuple[dict[str, float], float]:
    """(per-GPU model states as dsclip's step holds them, bytes offloaded to the host): DeepSpeed's accounting
    (``model_state_bytes``, ``split_offloaded``), whose "grads" under ZeRO-2/3 is the gradient cache's:
    ``grad_reduction="coalesced"`` holds the whole ``.grad`` (``GRADS_LINE``, ``gradient_cache_grad_bytes``);
    ``"sharded"`` reduces each chunk's gradients into the partition as they are produced (dsclip/engine/
    accumulation.py), so a rank holds one fp32 partition (``SHARDED_GRADS_LINE``, ``sharded_grad_bytes``) plus
    the reduction buckets (``bucket_bytes``, counted apart).
    ``locked=False``: as if every parameter trained."""
    trainable = arch.trainable_params if locked else arch.params
    states = model_state_bytes(arch.params, gpus, zero, precision, arch.largest_layer_params, trainable, ema)
    partitions = states["grads"]
    states, host = split_offloaded(states, offload)
    if zero < 2:
        return states, host
    if grad_reduction == "sharded":
        grads = 0.0 if offload != "none" else sharded_grad_bytes(trainable, gpus)
        return {
            (SHARDED_GRADS_LINE if k == "grads" else k): (grads if k == "grads" else v) for k, v in states.items()
        }, host
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
    "gathered" weight is a view of the rank's whole partition); ZeRO-3's coordinator may keep the same copies
    for their reuse anyway (``kept_weight_bytes``: the planner counts the larger of the two).
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


def kept_weight_bytes(params: int, gpus: int, zero: int, precision: str, ds_config: dict) -> float:
    """Gathered weights ZeRO-3's parameter coordinator keeps between a forward use and the backward's, with or
    without checkpointing: a parameter whose next use is within ``stage3_max_reuse_distance`` elements of fetches
    is not released, and prefetching stops at ``stage3_max_live_parameters`` live elements. Both are 1e9 in the
    shipped JSONs (and DeepSpeed's defaults), so a model under 1e9 parameters stays gathered whole until its
    backward releases it: 16-bit x min(P, max live, max reuse distance), an upper bound above 1e9.
    Measured on ViT-B-32 (151 M) at world 64 with checkpointing under the fake group: 264.5 MiB of gathered
    copies at the steady step's peak (2 B x P = 288 MiB); tests/unit/test_plan_comm.py. Nothing at one GPU (the
    gathered weight is the rank's whole partition)."""
    if zero < 3 or gpus <= 1:
        return 0.0
    max_live = _zero_number(ds_config, "stage3_max_live_parameters", 1e9)
    live = min(float(params), max_live, _zero_number(ds_config, "stage3_max_reuse_distance", 1e9))
    return live * (2 if precision in ("bf16", "fp16") else 4)


def gathered_weight_bytes(
    params: int, gpus: int, zero: int, precision: str, grad_checkpointing: bool, ds_config: dict, in_flight: float
) -> tuple[float, float, float]:
    """ZeRO-3's gathered copies, counted once: (held by autograd, ``held_weight_bytes``; kept beyond that by the
    coordinator, ``kept_weight_bytes`` less the held; the layers in flight, model_state_bytes' "gathered_layers"
    given as ``in_flight``, that are among them). Autograd's and the coordinator's are the same tensors, so the
    larger counts, and the in-flight layers are a part of it: held + kept - within is what the step holds."""
    held = held_weight_bytes(params, gpus, zero, precision, grad_checkpointing, ds_config)
    kept = max(0.0, kept_weight_bytes(params, gpus, zero, precision, ds_config) - held)
    return held, kept, min(in_flight, held + kept)


def _zero_number(ds_config: dict, key: str, default: float) -> float:
    """A number of the JSON's zero_optimization (DeepSpeed's default where absent or "auto")."""
    v = ds_config.get("zero_optimization", {}).get(key, default)
    return float(v) if not isinstance(v, str) else float(default)


ALLREDUCE_FALLBACK_NUMEL = 5e8  # DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE: the engine's flat all-reduce buffer, elements


def bucket_bytes(
    ds_config: dict, precision: str, accum_freq: int = 1, trainable_params: int = 0, params: int = 0
) -> float:
    """The reduction buffers DeepSpeed 0.19 allocates from the JSON's bucket sizes (elements -> bytes), per GPU.

    ZeRO-1/2 (``stage_1_and_2.setup_buckets``): one ``reduce_bucket_size`` buffer per gradient dtype, two with
    ``overlap_comm`` (double buffering), in the weights' dtype (ZeRO-2's fp32 partition receives the reduced
    result; the bucket stays 16-bit). The all-gather bucket is no buffer: the gather writes into the flat
    16-bit weights in place. ZeRO-1 with bf16 weights summed in fp32 (K > 1: ``grad_accum_dtype: fp32``) runs
    DeepSpeed's BF16_Optimizer instead: its fp32 gradient (model_state_bytes' "grads") is all-reduced at the
    boundary by the engine's ``allreduce_gradients``, which flattens it into a copy of up to
    ``MEMORY_OPT_ALLREDUCE_SIZE`` elements (4 B x min(trainable, 5e8)); fp16 there stages the fp32 accumulator
    (4 B buckets).
    ZeRO-3 (``stage3.py``, ``contiguous_gradients``): one ``reduce_bucket_size`` buffer per dtype, and the
    all-gathers' output: each coalesced gather lands in one flat buffer laid out rank by rank
    (``partition_parameters._all_gather_dtype``), which ``wait`` copies out into every parameter (``torch.cat``),
    so while the gathers in flight (``stage3_prefetch_bucket_size`` elements ahead) are alive their buffers sit
    beside the gathered copies: 16-bit x min(prefetch bucket, params). Measured on ViT-B-32 at world 8 (the
    steady step's forward): 274.5 MiB of gather buffers beside 264.5 MiB of copies.
    Measured under the fake world 8 and 64 with LiveTensorBytes (tests/unit/test_plan_comm.py).
    """
    z = ds_config.get("zero_optimization", {})
    stage = int(z.get("stage", 0))
    b = 2 if precision in ("bf16", "fp16") else 4
    reduce_bucket = _zero_number(ds_config, "reduce_bucket_size", 5e8)
    if stage == 0 or not z.get("contiguous_gradients", True):
        return 0.0
    if stage == 3:
        gathers = b * min(_zero_number(ds_config, "stage3_prefetch_bucket_size", 5e7), float(params))
        return b * reduce_bucket + gathers
    if stage == 1 and accum_freq > 1 and precision in ("bf16", "fp16"):
        if precision == "bf16":  # BF16_Optimizer: the engine's flat copy of the fp32 gradient
            return 4.0 * min(float(trainable_params), ALLREDUCE_FALLBACK_NUMEL)
        b = 4
    overlap = z.get("overlap_comm")
    double = 2 if overlap else 1  # DeepSpeed's default (None) is off below ZeRO-3
    return b * double * reduce_bucket


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


def checkpoint_copy_bytes(params: int, world: int, precision: str, *, ema: bool = False, writer: bool = True) -> float:
    """Host memory one rank's asynchronous save copies its checkpoint state into (dsclip.checkpoint.async_save),
    as DeepSpeed's files hold it: the fp32 master weights and the two Adam moments of its 1/world share
    (12 bytes per parameter over all ranks), the EMA's fp32 share with --ema-decay, and on the rank that
    writes the module file (data-parallel rank 0, ``writer``) the whole module in the training precision."""
    module = params * (4 if precision == "fp32" else 2) if writer else 0.0
    return 12.0 * params / world + (4.0 * params / world if ema else 0.0) + module
