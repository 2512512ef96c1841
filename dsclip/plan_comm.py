"""What one rank of a planned job sends per step, derived from the plan's configuration, and what of it the
step waits for: the communication half of ``dsclip plan``'s step time.

The rehearsal (dsclip.rehearsal) counts these bytes on a real engine under torch's fake process group; the
planner cannot build an engine for every candidate it searches, so it derives them (:func:`step_traffic`)
from the parameters, the stage, the precision, the gradient cache's K and the loss. tests/unit/
test_plan_comm.py holds the derivation equal to the rehearsal's counter at world 8 (the demo model and
ViT-B-32, ZeRO-1/2/3, K = 1 and 2) up to DeepSpeed's padding of each flat buffer to a multiple of the world.

Per step, on each rank of a world of ``n`` (``w`` bytes per 16-bit or fp32 element, ``T`` trainable
parameters, ``N`` the global rows, ``D`` the embedding width):

* the loss: a metadata all-gather (11 int64 per rank, dsclip.losses.common); the global InfoNCE losses
  gather image and text features (fp32, 2·N·D·4 bytes) in one all-gather and reduce-scatter their
  gradient back (same size). The tiled and SigLIP losses pass text blocks around a ring point to point
  (the counter does not see those): the text features forward, again in the backward with their gradient
  accumulators, about three all-gathers of N·D·4 bytes (counted as such).
* ZeRO-1/2: the gradient cache reduces the K backwards' gradients once, an all-reduce of w·T at the
  boundary (dsclip/train/gradcache.py); after the optimizer step every rank all-gathers the updated
  16-bit parameters, w·T.
* ZeRO-3: the boundary reduce-scatters w·T; every forward pass gathers the partitioned parameters, w·(P -
  persistent), where a pass is each of the gradient cache's K first forwards and its K - 1 re-forwards
  (K with the last graph not kept); the backward (and checkpointing's recompute) reuses them (measured:
  no gathers in the backward phase); after the step the persistent parameters (at most
  ``stage3_param_persistence_threshold`` elements each, held whole on every rank) are all-gathered.

The exposed share (what the step waits for) is dsclip.comm_model's: ZeRO-3's forward gathers hide
behind the compute they are prefetched under; the rest sits on the critical path.
"""

from __future__ import annotations

import functools

from dsclip.comm_model import LinkModel, Traffic, estimate

LOSS_META_INT64 = 11  # dsclip.losses.common._N_META: the per-rank metadata every loss gathers first
GATHERED_LOSSES = ("infonce", "infonce_local")  # one all-gather of the features, one reduce-scatter back
RING_LOSSES = ("infonce_tiled", "siglip")  # point to point around the ring (not collectives)


def zero3_persistence(ds_config: dict) -> tuple[int, int]:
    """(param threshold, model threshold) of the JSON's ZeRO-3, DeepSpeed's defaults where unset."""
    z = ds_config.get("zero_optimization", {})

    def num(key: str, default: int) -> int:
        v = z.get(key, default)
        return int(float(v)) if not isinstance(v, str) else default

    return num("stage3_param_persistence_threshold", 100_000), num("stage3_model_persistence_threshold", 2**63 - 1)


@functools.lru_cache(maxsize=64)
def persistent_numel(cfg_json: str, param_threshold: int, model_threshold: int) -> int:
    """Elements ZeRO-3 keeps whole on every rank: DeepSpeed's mark_persistent_parameters over the model's
    parameters in order (each at most ``param_threshold`` elements, until ``model_threshold`` is reached).
    Built once on the meta device per resolved config."""
    import json

    from dsclip.model import create_model  # lazy: torch

    total = 0
    for p in create_model(json.loads(cfg_json), device="meta").parameters():
        if p.numel() + total > model_threshold:
            continue
        if p.numel() <= param_threshold:
            total += p.numel()
    return total


def forward_passes(accum_freq: int, keep_last_graph: bool = True) -> int:
    """Forwards a gradient-cache step runs: K without a graph, then K - 1 re-forwards (K without the kept
    last graph; dsclip/train/gradcache.py)."""
    k = max(accum_freq, 1)
    return k + (k - 1 if keep_last_graph else k)


def step_traffic(
    *,
    params: int,
    trainable: int,
    persistent: int,
    world: int,
    zero: int,
    precision: str,
    accum_freq: int,
    local_batch: int,
    embed_dim: int,
    loss: str,
    keep_last_graph: bool = True,
) -> Traffic:
    """One rank's collectives per step, as (kind, group size, phase) -> calls and bytes (the counter's
    convention: the collective's whole buffer). Nothing at world 1."""
    t = Traffic()
    n = world
    if n <= 1:
        return t
    w = 2 if precision in ("bf16", "fp16") else 4
    rows = local_batch * n
    t.add("all_gather", n, LOSS_META_INT64 * 8 * n, "other")
    if loss in GATHERED_LOSSES:
        t.add("all_gather", n, 2 * rows * embed_dim * 4, "other")
        t.add("reduce_scatter", n, 2 * rows * embed_dim * 4, "other")
    elif loss in RING_LOSSES:
        t.add("all_gather", n, 3 * rows * embed_dim * 4, "ring")
    else:
        raise ValueError(f"unknown loss {loss!r}; known: {', '.join(GATHERED_LOSSES + RING_LOSSES)}")
    if zero in (1, 2):
        t.add("all_reduce", n, w * trainable, "boundary")
        t.add("all_gather", n, w * trainable, "step")
    elif zero == 3:
        t.add("reduce_scatter", n, w * trainable, "boundary")
        for _ in range(forward_passes(accum_freq, keep_last_graph)):
            t.add("all_gather", n, w * (params - persistent), "forward")
        t.add("all_gather", n, w * persistent, "step")
    else:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {zero}")
    return t


def hideable_compute_s(compute_s: float, zero: int) -> float:
    """Compute the overlappable collectives can hide behind: ZeRO-3 prefetches gathers through the whole
    forward and backward; ZeRO-1/2 reduce during the backward (about 2/3 of forward + backward)."""
    return compute_s if zero >= 3 else compute_s * 2.0 / 3.0


def exposed_seconds(traffic: Traffic, link: LinkModel, *, zero: int, overlap_comm: bool, compute_s: float):
    """(exposed, back-to-back) seconds of ``traffic`` on ``link`` beside ``compute_s`` of compute."""
    est = estimate(
        traffic, link, zero=zero, overlap_comm=overlap_comm, hideable_compute_s=hideable_compute_s(compute_s, zero)
    )
    return est.exposed_s, est.total_s
