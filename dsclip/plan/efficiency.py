"""The model-FLOPs utilisation ``dsclip plan`` predicts step times with: measured where dsclip has a
measurement, and saying which one; assumed (0.4) only where nothing was measured.

Each figure is a row of a results file in bench/results/ (tests/unit/test_plan_efficiency.py reads the
file and checks the number here against it). MFU = 3 x forward FLOPs x samples/s / the bf16 dense
GEMM peak measured on that GPU (790 TFLOP/s on the H200), the convention of bench/gpu_bench.py and of
the planner.

Rows hold the world size they were measured at. A world-1 row is one GPU alone; a world-N row is rank 0 of a
world-N job rehearsed on one GPU under torch's fake process group (dsclip.rehearsal, bench/gpu_world.py):
everything a rank of that job computes (its partitions, buckets, hooks and host work at world N), with
collectives that return at once. Neither holds link time: the planner adds the communication model's exposed
time (dsclip.plan.comm) to the step either row gives. CPU rehearsal rows measure host time only (a CPU's
step is not a GPU's): they are not rows here, and a row whose ``gpu`` is a CPU is never taken for a GPU's
step time.

How a figure is chosen for a plan:
* among the rows measured at the plan's world size when they can give its figure (else those of the
  nearest world size that can; ties to the smaller):
* the same architecture measured at the same ZeRO stage and a 16-bit precision: that figure;
* otherwise the measured architecture nearest in forward FLOPs per sample (MFU grows with a model's
  GEMM sizes: ViT-B-32 28.8 %, ViT-L-14 45.1 %); a larger model than any measured takes the largest's
  figure, which its bigger GEMMs usually exceed (so the prediction errs slow);
* ZeRO-3: the model's own ZeRO-3 row; else its ZeRO-2 figure scaled by ZeRO-3's measured share of
  ZeRO-2's MFU on the nearest model measured at both in one run (bench/gpu_bench.py's zero3 trainers,
  gpu_h200.sh stage ``zero3``: 0.30 at ViT-L-14 on one H200, 2026-12-04);
* fp32 has no measurement: the assumed figure.

A row measured with the gradient cache (K > 1) or activation checkpointing did more arithmetic than the
MFU counts (pass 2 re-forwards K - 1 of K chunks; checkpointing re-forwards everything). The figure moves
between runs at the same hardware utilisation: a row's MFU times its executed / counted FLOPs, divided by
the plan's (:func:`executed_share`), and the source says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ASSUMED_MFU = 0.4
NO_ZERO3_NOTE = "; ZeRO-3 is not measured on a GPU yet, so this is ZeRO-2's figure (the ZeRO-3 step may be slower)"


@dataclass(frozen=True)
class MeasuredMFU:
    model: str
    zero: int
    precision: str
    micro_batch: int
    samples_per_s: float
    mfu: float
    gpu: str
    source: str  # bench/results/ file holding the row
    accum_freq: int = 1  # the gradient cache's micro-batches per step
    grad_checkpointing: bool = False
    world: int = 1  # the job's world size: 1, or rank 0 of a world-N job under the fake process group

    def describe(self) -> str:
        shape = f"micro-batch {self.micro_batch}" + (f" x K {self.accum_freq}" if self.accum_freq > 1 else "")
        ckpt = ", --grad-checkpointing" if self.grad_checkpointing else ""
        where = (
            f"world 1, one {self.gpu}"
            if self.world == 1
            else f"rank 0 of world {self.world} (fake group), one {self.gpu}"
        )
        return (
            f"{self.model} ZeRO-{self.zero} {self.precision} {shape}{ckpt}: {self.mfu:.1%} "
            f"({self.samples_per_s:,.0f} samples/s per rank; {where}; {self.source})"
        )


def is_gpu_row(m: MeasuredMFU) -> bool:
    """A GPU's row (a CPU rehearsal's host time is not a GPU's step time)."""
    return "cpu" not in m.gpu.lower()


def rows_by_world(rows, world: int) -> list[list]:
    """The rows grouped by world size, the plan's own first, then the nearest (ties to the smaller world)."""
    worlds = sorted({m.world for m in rows}, key=lambda w: (abs(math.log(w / max(world, 1))), w))
    return [[m for m in rows if m.world == w] for w in worlds]


def _serves(rows, model: str, zero: int) -> bool:
    """Rows a plan's figure can come from: a ZeRO-1/2 row, or the model's own ZeRO-3 row for a ZeRO-3 plan."""
    return any(m.zero in (1, 2) or (zero == 3 and m.zero == 3 and m.model == model) for m in rows)


def extra_forwards(accum_freq: int, grad_checkpointing: bool, keep_last_graph: bool = True) -> float:
    """Forwards per sample beyond the one MFU counts: the gradient cache's pass 2 re-forwards K - 1 of K
    chunks (all K without the kept last graph, dsclip/train/gradcache.py), activation checkpointing
    re-forwards everything once more."""
    k = max(accum_freq, 1)
    reforward = (k - 1) / k if keep_last_graph else 1.0
    return reforward + (1.0 if grad_checkpointing else 0.0)


def executed_share(accum_freq: int, grad_checkpointing: bool) -> float:
    """Executed FLOPs over the FLOPs MFU counts (forward + 2x backward): a forward is a third of them."""
    return 1.0 + extra_forwards(accum_freq, grad_checkpointing) / 3.0


_GPU_1201 = "bench/results/gpu-h200_h200_2026-12-01.md"
_GPU_1204 = "bench/results/gpu-h200_h200_2026-12-04.md"
MEASURED: tuple[MeasuredMFU, ...] = (
    MeasuredMFU("ViT-B-32", 2, "bf16", 512, 5043, 0.288, "H200", _GPU_1201),
    MeasuredMFU("ViT-L-14", 2, "bf16", 128, 675, 0.451, "H200", _GPU_1201),
    # ZeRO-3 against ZeRO-2 in one run, the gradient cache at K = 2 (ViT-H-14's ZeRO-2 row of that run ran
    # after DeepSpeed had replaced torch's linear process-wide, so it is not taken). The ZeRO-3 rows ran
    # DeepSpeed's linear, the JSONs' setting then; the shipped ones run torch's since 2026-12-05
    # (docs/zero-and-precision.md), so these may err slow until the next GPU run.
    MeasuredMFU("ViT-L-14", 2, "bf16", 64, 550, 0.363, "H200", _GPU_1204, accum_freq=2),
    MeasuredMFU("ViT-L-14", 3, "bf16", 64, 163, 0.108, "H200", _GPU_1204, accum_freq=2),
    MeasuredMFU("ViT-H-14", 3, "bf16", 32, 72, 0.103, "H200", _GPU_1204, accum_freq=2),
    MeasuredMFU("ViT-bigG-14", 3, "bf16", 64, 39.7, 0.159, "H200", _GPU_1204),
)


def _own(rows, model: str, accum_freq: int, grad_checkpointing: bool) -> MeasuredMFU | None:
    """The model's row run most like the plan (the same K and checkpointing first), or None."""
    same = [m for m in rows if m.model == model]
    if not same:
        return None
    return min(same, key=lambda m: (m.accum_freq != accum_freq) + (m.grad_checkpointing != grad_checkpointing))


def _base_figure(rows, model: str, forward_gflops: float, measured_gflops: dict[str, float], k: int, ckpt: bool):
    """The row a plan of ``model`` takes among ``rows`` and how it was chosen ("" for the model's own)."""
    own = _own(rows, model, k, ckpt)
    if own is not None:
        return own, ""
    largest = max(rows, key=lambda m: measured_gflops[m.model])
    if forward_gflops >= measured_gflops[largest.model]:
        return _own(rows, largest.model, k, ckpt), "the largest model measured"
    nearest = min(rows, key=lambda m: abs(math.log(measured_gflops[m.model] / forward_gflops)))
    return _own(rows, nearest.model, k, ckpt), "the measured model nearest in FLOPs per sample"


def _rerun(row: MeasuredMFU, mfu: float, accum_freq: int, grad_checkpointing: bool) -> tuple[float, str]:
    """``mfu`` (taken from ``row``) for a run with the plan's K and checkpointing, at the row's hardware
    utilisation; the note says so when they differ."""
    factor = executed_share(row.accum_freq, row.grad_checkpointing) / executed_share(accum_freq, grad_checkpointing)
    if factor == 1.0:  # run like the plan (equal shares come only from equal K and checkpointing)
        return mfu, ""
    plan = f"K {max(accum_freq, 1)}" + (", --grad-checkpointing" if grad_checkpointing else "")
    return round(mfu * factor, 4), f"; x {factor:.2f} for this plan's re-forwards ({plan}) at the same utilisation"


def _zero3_share(rows, forward_gflops: float, measured_gflops: dict[str, float]) -> tuple[float, str] | None:
    """ZeRO-3's measured share of ZeRO-2's MFU on the model nearest in FLOPs measured at both in one run (the
    same K and checkpointing), and the words for the source; None without such a pair."""
    base = [m for m in rows if m.zero in (1, 2)]
    like = {(b.model, b.accum_freq, b.grad_checkpointing): b for b in base}
    zero3 = [z for z in rows if z.zero == 3]
    pairs = [(z, like[key]) for z in zero3 if (key := (z.model, z.accum_freq, z.grad_checkpointing)) in like]
    if not pairs:
        return None
    z, b = min(pairs, key=lambda zb: abs(math.log(measured_gflops[zb[0].model] / forward_gflops)))
    share = z.mfu / b.mfu
    return share, f"; x {share:.2f}, ZeRO-3's share of ZeRO-2's MFU measured on {z.model} ({z.describe()})"


def plan_mfu(model: str, zero: int, precision: str, forward_gflops: float, measured_gflops, measured=None,
             accum_freq: int = 1, grad_checkpointing: bool = False, world: int = 1) -> tuple[float, str]:  # fmt: skip
    """(MFU, where it comes from): :func:`plan_mfu_row` without the row's world size."""
    mfu, source, _ = plan_mfu_row(
        model, zero, precision, forward_gflops, measured_gflops, measured, accum_freq, grad_checkpointing, world
    )
    return mfu, source


def plan_mfu_row(
    model: str,
    zero: int,
    precision: str,
    forward_gflops: float,
    measured_gflops: dict[str, float],
    measured: tuple[MeasuredMFU, ...] | None = None,
    accum_freq: int = 1,
    grad_checkpointing: bool = False,
    world: int = 1,
) -> tuple[float, str, int]:
    """(MFU, where it comes from, the world size of the rows it came from: 0 where assumed) for a plan at
    ``world`` GPUs: the GPU rows measured at the world size nearest the plan's (its own where any exist).
    ``measured_gflops`` maps each measured architecture to its forward GFLOPs per sample (computed by the
    planner, so the comparison uses one FLOP count);
    ``measured``: the table (default :data:`MEASURED`); ``accum_freq`` and ``grad_checkpointing``: the
    plan's (a row run otherwise is moved to them by :func:`executed_share`).

    ZeRO-3: the model's own ZeRO-3 row where there is one; else its ZeRO-1/2 figure (as for ZeRO-2) times
    ZeRO-3's measured share of ZeRO-2's MFU on the measured model nearest in FLOPs that has both in one
    run (the same K and checkpointing); else the ZeRO-2 figure as it is, and the source says ZeRO-3 was
    not measured."""
    k, ckpt = accum_freq, grad_checkpointing
    table = MEASURED if measured is None else measured
    usable = [m for m in table if m.precision in ("bf16", "fp16") and is_gpu_row(m)]
    rows = next((r for r in rows_by_world(usable, world) if _serves(r, model, zero) or precision == "fp32"), [])
    if not rows:
        return ASSUMED_MFU, f"assumed {ASSUMED_MFU:g} (no GPU measurement; give --mfu)", 0
    at = rows[0].world
    zero3 = [m for m in rows if m.zero == 3]
    if precision == "fp32":
        source = f"assumed {ASSUMED_MFU:g} (no fp32 measurement; give --mfu)"
        share = _zero3_share(rows, forward_gflops, measured_gflops) if zero == 3 else None
        if share is None:
            return ASSUMED_MFU, source, 0
        # ZeRO-3's gathers and hooks cost an fp32 step too: the measured share keeps the stages apart
        return round(ASSUMED_MFU * share[0], 4), source + share[1], at
    if zero == 3:
        own = _own(zero3, model, k, ckpt)
        if own is not None:
            mfu, moved = _rerun(own, own.mfu, k, ckpt)
            return mfu, f"measured, {own.describe()}{moved}", at
    base = [m for m in rows if m.zero in (1, 2)]
    pick, how = _base_figure(base, model, forward_gflops, measured_gflops, k, ckpt)
    mfu = pick.mfu
    source = f"measured, {pick.describe()}" if not how else (
        f"from {how}, {pick.describe()}; {model} is {forward_gflops:.0f} against "
        f"{measured_gflops[pick.model]:.0f} forward GFLOPs per sample"
    )  # fmt: skip
    if zero == 3:
        share = _zero3_share(rows, forward_gflops, measured_gflops)
        if share is not None:
            mfu = round(mfu * share[0], 4)
            source += share[1]
        else:
            source += NO_ZERO3_NOTE
    mfu, moved = _rerun(pick, mfu, k, ckpt)
    return mfu, source + moved, at


# ZeRO-Offload's cost per step. The host's Adam: DeepSpeedCPUAdam updated ViT-L-14's 428 M-parameter flat
# partition in 0.249 s on one rank of a 2-core CPU (bench/results/optimizer-step_cpu2_2026-11-30.md): a
# cluster node's cores per rank are rarely fewer, so the figure errs slow. The copies: pinned host <-> device
# over PCIe Gen4 x16 moves ~25 GB/s of its 32 nominal (assumed, not measured here; Gen5 doubles it).
CPU_ADAM_PARAMS_PER_S = 428e6 / 0.249
PCIE_BYTES_PER_S = 25e9


def offload_seconds(
    offload: str,
    params: int,
    trainable: int,
    gpus: int,
    accum_freq: int,
    grad_checkpointing: bool,
    keep_last_graph: bool = True,
) -> float:
    """Seconds ZeRO-Offload adds to a step on each rank, not overlapped with the GPU's work (so it errs slow).

    optimizer: the rank's fp32 gradient partition down (4 B), the host Adam over it, the 16-bit weights back
    up (2 B). optimizer+params: also every gather of the weights crosses PCIe, each pass over the model
    fetching the rank's 16-bit partition: the gradient cache's K no-grad forwards, its K - 1 re-forwards (K
    without the kept graph), K backwards and, with checkpointing, K recomputes."""
    if offload == "none":
        return 0.0
    n = max(gpus, 1)
    part, own = float(trainable) / n, float(params) / n
    t = part / CPU_ADAM_PARAMS_PER_S + (4 * part + 2 * own) / PCIE_BYTES_PER_S
    if offload == "optimizer+params":
        k = max(accum_freq, 1)
        passes = k + (k - 1 if keep_last_graph else k) + k + (k if grad_checkpointing else 0)
        t += passes * 2 * own / PCIE_BYTES_PER_S
    return t


@dataclass(frozen=True)
class GPU:
    memory_gib: float  # total device memory as the driver reports it (nvidia-smi), in GiB
    spec_bf16_tflops: float  # dense (no sparsity) bf16 tensor-core peak of the vendor's datasheet
    source: str

    @property
    def peak_tflops(self) -> float:
        """The bf16 GEMM rate the planner's MFU divides by: measured on the H200 (an 8192³ bf16 GEMM, 776-797
        TFLOP/s, bench/results/gpu-h200_h200_2026-12-0{1,4}.md: 790), and for any other GPU its datasheet
        figure times the H200's measured share of its own (790 / 989), the same tensor-core generation's
        achievable fraction: an assumption until that GPU is measured."""
        return round(self.spec_bf16_tflops * H200_MEASURED_TFLOPS / GPUS["h200"].spec_bf16_tflops, 1)


H200_MEASURED_TFLOPS = 790.0
_HOPPER = "NVIDIA H100/H200 datasheets (SXM, dense bf16 989.4 TFLOP/s)"
GPUS: dict[str, GPU] = {
    # the one GPU dsclip has measured: 143,771 MiB (bench/results/gpu-h200_h200_2026-12-04.md)
    "h200": GPU(140.4, 989.4, _HOPPER + "; memory 143,771 MiB measured"),
    "h100": GPU(79.6, 989.4, _HOPPER + "; 80 GB HBM3 = 81,559 MiB"),
    "h100-pcie": GPU(79.6, 756.0, "NVIDIA H100 PCIe datasheet (dense bf16 756 TFLOP/s, 80 GB)"),
    "a100-80": GPU(80.0, 312.0, "NVIDIA A100 datasheet (dense bf16 312 TFLOP/s, 80 GB = 81,920 MiB)"),
    "a100-40": GPU(40.0, 312.0, "NVIDIA A100 datasheet (dense bf16 312 TFLOP/s, 40 GB = 40,960 MiB)"),
    "l40s": GPU(45.0, 362.1, "NVIDIA L40S datasheet (dense bf16 362 TFLOP/s, 48 GB = 46,068 MiB)"),
    "l4": GPU(22.5, 121.0, "NVIDIA L4 datasheet (dense bf16 121 TFLOP/s, 24 GB = 23,034 MiB)"),
    "a10": GPU(22.5, 125.0, "NVIDIA A10 datasheet (dense bf16 125 TFLOP/s, 24 GB = 23,028 MiB)"),
}
DEFAULT_GPU = "h100"  # the planner's default: an 80 GB Hopper, the common cluster GPU


def gpu_spec(name: str) -> GPU:
    """The table's row of ``name`` (case-insensitive); a one-line error listing the known ones otherwise."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(
            f"unknown --gpu {name!r}; known: {', '.join(GPUS)} (or give --gpu-memory GiB and --peak-tflops)"
        )
    return GPUS[key]
