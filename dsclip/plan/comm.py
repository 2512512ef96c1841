"""What one rank of a planned job sends per step, derived from the plan's configuration, and what of it the
step waits for on the cluster's links: the communication half of ``dsclip plan``'s step time.

The rehearsal's counter (dsclip.rehearsal.counter) counts these bytes on a real engine under torch's fake
process group; the planner cannot build an engine for every candidate it searches, so it derives them
(:func:`step_traffic`) from the parameters, the stage, the precision, the gradient cache's K and the loss. tests/unit/
test_plan_comm.py holds the derivation equal to the rehearsal's counter at world 8 (the demo model and
ViT-B-32, ZeRO-1/2/3, K = 1 and 2) up to DeepSpeed's padding of each flat buffer to a multiple of the world.

Per step, on each rank of a world of ``n`` (``w`` bytes per 16-bit or fp32 element, ``T`` trainable
parameters, ``N`` the global rows, ``D`` the embedding width):

* the loss: a metadata all-gather (11 int64 per rank, dsclip.losses.common); the global InfoNCE losses
  gather image and text features (fp32, 2·N·D·4 bytes) in one all-gather and reduce-scatter their
  gradient back (same size). The tiled and SigLIP losses pass text blocks around a ring point to point
  (the counter counts those as "send" and "recv"): the text features forward, again in the backward with their gradient
  accumulators, about three all-gathers of N·D·4 bytes (counted as such).
* ZeRO-1/2: the gradient cache reduces the K backwards' gradients once, an all-reduce of w·T at the
  boundary (dsclip/train/gradcache.py); after the optimizer step every rank all-gathers the updated
  16-bit parameters, w·T.
* ZeRO-3: the boundary reduce-scatters w·T; every forward pass gathers the partitioned parameters, w·(P -
  persistent), where a pass is each of the gradient cache's K first forwards and its K - 1 re-forwards
  (K with the last graph not kept); the backward (and checkpointing's recompute) reuses them (measured:
  no gathers in the backward phase); after the step the persistent parameters (at most
  ``stage3_param_persistence_threshold`` elements each, held whole on every rank) are all-gathered.

The exposed share (what the step waits for) is :func:`estimate`'s: ZeRO-3's forward gathers hide
behind the compute they are prefetched under; the rest sits on the critical path.

:class:`LinkModel` turns bytes into seconds with nccl-tests' bus-bandwidth convention:
``time = size x factor(n) / busbw`` where ``size`` is the collective's whole buffer (all-reduce: the
tensor; all-gather: the gathered output; reduce-scatter: the input) and ``factor`` the ring's traffic per
byte: all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n``, broadcast 1. A group that fits
in one node runs at the intra-node bus bandwidth, a larger one at the inter-node bandwidth per GPU (a flat
ring bound: NCCL's tree/NVLS algorithms can do better across nodes, so this errs long). :class:`Traffic`
(calls and bytes per kind, group size and phase) is what both the derivation and the counter produce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

# Defaults, each with where it comes from (printed beside the times).
# Intra-node: nccl-tests all_reduce_perf busbw at large sizes on 8x H100 SXM5 with NVSwitch, 460-480 GB/s;
# we take the low end. H200 has the same NVLink-4 / NVSwitch fabric (900 GB/s bidirectional per GPU).
INTRA_NODE_GBPS = 460.0
INTRA_NODE_SOURCE = (
    "nccl-tests all_reduce_perf busbw 460-480 GB/s on 8x H100 SXM5 NVSwitch, low end "
    "(docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); H200: same NVLink-4 fabric"
)
# Inter-node: one 400 Gb/s InfiniBand NDR (ConnectX-7) port per GPU, as on DGX/HGX H100 and H200 nodes.
INTER_NODE_GBPS = 50.0
INTER_NODE_SOURCE = "InfiniBand NDR 400 Gb/s per GPU (one ConnectX-7 per GPU on HGX H100/H200) = 50 GB/s, link rate"

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


def zero2_reduce_kind(ds_config: dict) -> str:
    """How ZeRO-2 reduces a gradient bucket under this JSON: "reduce" (one reduce to each partition's owner,
    ``use_multi_rank_bucket_allreduce: false``, the shipped JSONs) or "all_reduce" (DeepSpeed's default)."""
    z = ds_config.get("zero_optimization", {})
    return "all_reduce" if z.get("use_multi_rank_bucket_allreduce", True) else "reduce"


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
    grad_reduction: str = "coalesced",
    zero2_reduce: str = "reduce",
) -> Traffic:
    """One rank's collectives per step, as (kind, group size, phase) -> calls and bytes (the counter's
    convention: the collective's whole buffer). Nothing at world 1.

    The gradient reduction (``grad_reduction``, dsclip/engine/accumulation.py): "coalesced" reduces the summed
    gradient once, at the boundary (exposed); "sharded" reduces every chunk's gradient inside its backward (K
    reductions, overlappable with overlap_comm). ZeRO-2 reduces a bucket with one all-reduce
    (``zero2_reduce="all_reduce"``: DeepSpeed's default ``use_multi_rank_bucket_allreduce``) or with one reduce
    to each partition's owner (``"reduce"``, the shipped JSONs: reduce-scatter's (n-1)/n of the traffic, not
    all-reduce's 2(n-1)/n); ZeRO-3 reduce-scatters."""
    t = Traffic()
    if world <= 1:
        return t
    w = 2 if precision in ("bf16", "fp16") else 4
    loss_traffic(t, world, local_batch * world, embed_dim, loss)
    gradient_traffic(
        t, world, w, trainable, zero, accum_freq=accum_freq, grad_reduction=grad_reduction, zero2_reduce=zero2_reduce
    )
    passes = forward_passes(accum_freq, keep_last_graph)
    parameter_traffic(t, world, w, params=params, trainable=trainable, persistent=persistent, zero=zero, passes=passes)
    return t


def loss_traffic(t: Traffic, n: int, rows: int, embed_dim: int, loss: str) -> None:
    """The loss's: its metadata, then the gathered features and their gradients, or the ring's blocks."""
    t.add("all_gather", n, LOSS_META_INT64 * 8 * n, "other")
    if loss in GATHERED_LOSSES:
        t.add("all_gather", n, 2 * rows * embed_dim * 4, "other")
        t.add("reduce_scatter", n, 2 * rows * embed_dim * 4, "other")
    elif loss in RING_LOSSES:
        t.add("all_gather", n, 3 * rows * embed_dim * 4, "ring")
    else:
        raise ValueError(f"unknown loss {loss!r}; known: {', '.join(GATHERED_LOSSES + RING_LOSSES)}")


def gradient_traffic(
    t: Traffic, n: int, w: int, trainable: int, zero: int, *, accum_freq: int, grad_reduction: str, zero2_reduce: str
) -> None:
    """The gradients' reduction (``grad_reduction``, dsclip/engine/accumulation.py): "coalesced" reduces the K
    backwards' summed gradient once, at the step boundary; "sharded" (ZeRO-2/3) reduces each chunk's inside its
    backward, K reductions. ZeRO-1 all-reduces; ZeRO-2 reduces each bucket with ``zero2_reduce``; ZeRO-3
    reduce-scatters into the partitions."""
    sharded = grad_reduction == "sharded" and zero >= 2
    reductions, phase = (max(accum_freq, 1), "backward") if sharded else (1, "boundary")
    if zero == 1 and w == 2 and accum_freq > 1:
        # 16-bit ZeRO-1 with K > 1 sums in fp32 through DeepSpeed's BF16_Optimizer (dsclip/engine/ds_config.py),
        # which all-reduces inside the final backward (overlap_comm does not reach it; the shipped ZeRO-1 JSON
        # has none)
        phase = "backward"
    if zero in (1, 2, 3):
        kind = {1: "all_reduce", 2: zero2_reduce, 3: "reduce_scatter"}[zero]
        for _ in range(reductions):
            t.add(kind, n, w * trainable, phase)
    else:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {zero}")


def parameter_traffic(
    t: Traffic, n: int, w: int, *, params: int, trainable: int, persistent: int, zero: int, passes: int
) -> None:
    """The parameters' gathers: ZeRO-1/2 all-gather the updated 16-bit trainable parameters after the step;
    ZeRO-3 gathers the partitioned ones in each of ``passes`` forwards, then the persistent ones after the step."""
    if zero in (1, 2):
        t.add("all_gather", n, w * trainable, "step")
        return
    for _ in range(passes):
        t.add("all_gather", n, w * (params - persistent), "forward")
    t.add("all_gather", n, w * persistent, "step")


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


# ---------------------------------------------------------------------------------------------------
# what a step sends
@dataclass
class Traffic:
    """Per (kind, group size, phase of the step): calls and bytes."""

    calls: dict[tuple[str, int, str], int] = field(default_factory=dict)
    bytes: dict[tuple[str, int, str], int] = field(default_factory=dict)

    def add(self, kind: str, group: int, nbytes: int, phase: str = "other") -> None:
        key = (kind, group, phase)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def merge(self, other: Traffic) -> None:
        for key, c in other.calls.items():
            self.calls[key] = self.calls.get(key, 0) + c
            self.bytes[key] = self.bytes.get(key, 0) + other.bytes[key]

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (calls, bytes), summed over group sizes."""
        out: dict[str, tuple[int, int]] = {}
        for key, c in self.calls.items():
            calls, b = out.get(key[0], (0, 0))
            out[key[0]] = (calls + c, b + self.bytes[key])
        return out

    def scaled(self, divisor: int) -> Traffic:
        """Per step from a total over ``divisor`` steps (integer division: counts are per-step exact)."""
        return Traffic(
            {k: v // divisor for k, v in self.calls.items()}, {k: v // divisor for k, v in self.bytes.items()}
        )


# ---------------------------------------------------------------------------------------------------
# the link model
def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank moves over its slowest link per byte of the collective's buffer (nccl-tests' busbw
    factor): all-reduce 2(n-1)/n, all-gather / reduce-scatter (n-1)/n, broadcast / reduce 1, none at n = 1."""
    if n <= 1 or kind in ("barrier", "recv"):  # a receive is its peer's send: its time is counted there
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass
class LinkModel:
    gpus_per_node: int = 8
    intra_gbps: float = INTRA_NODE_GBPS  # GB/s bus bandwidth inside a node
    inter_gbps: float = INTER_NODE_GBPS  # GB/s per GPU between nodes
    intra_source: str = INTRA_NODE_SOURCE
    inter_source: str = INTER_NODE_SOURCE

    def busbw(self, n: int) -> float:
        """GB/s of a ring over ``n`` ranks: intra-node while the group fits in a node, else the per-GPU
        inter-node link (the slowest hop of a ring that leaves the node)."""
        return self.intra_gbps if n <= self.gpus_per_node else self.inter_gbps

    def seconds(self, kind: str, n: int, nbytes: float) -> float:
        f = ring_factor(kind, n)
        return 0.0 if f == 0.0 else nbytes * f / (self.busbw(n) * 1e9)

    def describe(self) -> str:
        return (
            f"intra-node {self.intra_gbps:g} GB/s ({self.intra_source}); inter-node {self.inter_gbps:g} GB/s per "
            f"GPU ({self.inter_source}); {self.gpus_per_node} GPUs per node"
        )


# What hides behind compute, per ZeRO stage and phase of the step (track_phases labels each call):
# * ZeRO-1/2 with overlap_comm: gradient reductions made inside a backward run on a side stream, hidden
#   behind the rest of that backward.
# * dsclip's gradient cache reduces the K backwards' gradients once, when DeepSpeed's
#   coalesce_grad_reduction block exits ("boundary"): after the last backward, before the optimizer
#   step that needs them, so nothing is left to hide it: exposed.
# * ZeRO-3: gathers (and reduce-scatters) inside forward and backward are prefetched / overlapped
#   (stage3_prefetch_bucket_size): hidden up to the compute they overlap.
# * The step's all-gather of updated parameters (ZeRO-1/2) waits for the optimizer: exposed. The loss's
#   all-gather of embeddings and the gradient cache's all-reduce (phase "other") sit on the critical path.
def overlappable(kind: str, phase: str, zero: int, overlap_comm: bool) -> bool:
    if kind == "barrier":
        return False
    if zero >= 3:
        return phase in ("forward", "backward")
    return overlap_comm and phase == "backward"


@dataclass
class CommEstimate:
    total_s: float  # every collective back to back
    exposed_s: float  # what the overlap cannot hide, given the compute it could hide behind
    per_kind: dict[str, dict]  # "kind in phase" -> {"calls", "bytes", "seconds", "overlappable"}


def estimate(
    traffic: Traffic, link: LinkModel, *, zero: int, overlap_comm: bool, hideable_compute_s: float
) -> CommEstimate:
    """Time of one step's traffic on ``link``. ``hideable_compute_s`` is the compute the overlappable part can
    hide behind (ZeRO-1/2: the last backward, ZeRO-3: forward + backward); only the excess is exposed."""
    per_kind: dict[str, dict] = {}
    over = total = 0.0
    for (kind, n, phase), b in traffic.bytes.items():
        s = link.seconds(kind, n, b)
        ov = overlappable(kind, phase, zero, overlap_comm)
        d = per_kind.setdefault(f"{kind} in {phase}", {"calls": 0, "bytes": 0, "seconds": 0.0, "overlappable": ov})
        d["calls"] += traffic.calls[(kind, n, phase)]
        d["bytes"] += b
        d["seconds"] += s
        total += s
        over += s if ov else 0.0
    exposed = (total - over) + max(0.0, over - max(0.0, hideable_compute_s))
    return CommEstimate(total, exposed, per_kind)
