"""``dsclip plan``'s command line: dsclip train's flag names with dsclip train's meanings.

``--batch-size`` is the micro-batch per GPU and ``--accum-freq`` the micro-batches per optimizer step, as
in ``dsclip train`` (OpenCLIP's meaning), so the contrastive batch is batch-size x accum-freq x GPUs.
Flags only the planner has (``--gpus``, ``--global-batch``, ``--max-batch``, ``--zero``, ...) say so in
their help. Spellings that used to mean something else stop with a one-line error naming the new flag,
so an old command line never silently plans another batch. The answer ends with a ready command for
the launcher asked for (``--launcher hostfile|sbatch``) with placeholders for the data and tokenizer.
``--measure`` then rehearses rank 0 of the planned job (dsclip.rehearsal) and prints it beside the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

from dsclip.config_base import ConfigError
from dsclip.engine.ds_config import PRECISIONS, PURE_PRECISIONS, load_ds_json, run_precision
from dsclip.engine.grad_reduction import GRAD_REDUCTIONS
from dsclip.losses.config import LOSS_NAMES as LOSS_MODES
from dsclip.losses.config import TRAIN_TILE_SIZE
from dsclip.model.lock import LockConfig
from dsclip.plan.comm import INTER_NODE_GBPS, INTRA_NODE_GBPS, LinkModel
from dsclip.plan.efficiency import DEFAULT_GPU, GPUS, gpu_spec
from dsclip.plan.job import Cluster, Job, default_ds_config, plan_configuration, plan_job
from dsclip.plan.planner import ROOT, Plan, largest_batch, train_args
from dsclip.plan.report import describe, format_plan, format_search

DEFAULT_MAX_BATCH_MICRO = 32  # --max-batch keeps room for this micro-batch when --batch-size is not given
SHARDS = "SHARDS/{00000..NNNNN}.tar"  # placeholder: the user's webdataset shards
SBATCH_SCRIPT = "launch/slurm/train.sbatch"

# old plan spellings -> the one-line error that names the flag to use now
RENAMED = {
    "--micro-batch": "--micro-batch is now --batch-size (the per-GPU micro-batch, as in dsclip train)",
    "--patch-dropout": "--patch-dropout is now --force-patch-dropout (as in dsclip train)",
}
BATCH_SIZE_MOVED = (
    "--batch-size is now the per-GPU micro-batch as in dsclip train; for the global batch use --global-batch"
)


class _Renamed(argparse.Action):
    """A flag plan used to take: refuse it with the new name instead of guessing what was meant."""

    def __call__(self, parser, namespace, values, option_string=None):
        msg = RENAMED[option_string]
        if option_string == "--micro-batch" and getattr(namespace, "batch_size", None) is not None:
            msg = BATCH_SIZE_MOVED + "; " + msg  # the old pair: --batch-size GLOBAL --micro-batch M
        parser.error(msg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsclip plan",
        description="Plan a run: per-GPU memory, the micro-batch x --accum-freq that fits, the step time, and "
        "a ready launch command. Flags are dsclip train's, with the same meanings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    _cluster_arguments(p)
    _batch_arguments(p)
    _engine_arguments(p)
    _rate_arguments(p)
    _output_arguments(p)
    _model_arguments(p)
    p.add_argument("--json", action="store_true", help="plan-only: print the plan as JSON")
    for old in RENAMED:
        p.add_argument(old, action=_Renamed, help=argparse.SUPPRESS)
    add_measure_arguments(p)  # --measure: the rehearsal (dsclip.rehearsal)
    return p


def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The model and the GPUs it is planned for."""
    p.add_argument("--model", required=True, help="architecture name (dsclip/model/configs) or JSON path")
    p.add_argument("--gpus", type=int, required=True, help="plan-only: total number of GPUs (ranks)")
    p.add_argument(
        "--gpu",
        help=f"plan-only: the GPU ({', '.join(GPUS)}): its memory and bf16 peak from dsclip/plan/efficiency.py's "
        f"table; default {DEFAULT_GPU}",
    )
    p.add_argument("--gpu-memory", type=float, help="plan-only: memory per GPU in GiB (overrides --gpu's)")


def _batch_arguments(p: argparse.ArgumentParser) -> None:
    """The contrastive batch and how it is split (dsclip train's flags)."""
    p.add_argument(
        "--batch-size",
        type=int,
        help="micro-batch per GPU, as in dsclip train; the contrastive batch is batch-size x accum-freq x GPUs. "
        f"With --global-batch: the run's micro-batch (default: the largest that fits); with --max-batch: the "
        f"micro-batch to keep room for (default {DEFAULT_MAX_BATCH_MICRO})",
    )
    p.add_argument(
        "--accum-freq", type=int, help="micro-batches per optimizer step, as in dsclip train; 1 when not given"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        help="plan-only: the global contrastive batch per optimizer step; the plan picks the micro-batch "
        "(or takes --batch-size) and --accum-freq",
    )
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="plan-only: find the largest contrastive batch that fits (gradient cache) and plan that batch",
    )


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """What the search would choose, fixed by the user: stage, DeepSpeed JSON, precision, checkpointing, loss."""
    p.add_argument(
        "--zero",
        type=int,
        choices=(1, 2, 3),
        help="plan-only: fix the ZeRO stage (default: the stage of --deepspeed-config, else searched: the fastest "
        "that fits); the shipped DeepSpeed JSONs of that stage are searched when --deepspeed-config is not given",
    )
    p.add_argument(
        "--deepspeed-config",
        help="DeepSpeed JSON, as in dsclip train (path or shipped name, e.g. zero3_bf16); fixes the stage and "
        "offload; default: the fastest shipped JSON that fits",
    )
    p.add_argument(
        "--precision",
        default="bf16",
        choices=[x for x in PRECISIONS if x not in PURE_PRECISIONS],
        help="as in dsclip train (amp = fp16, amp_bf16 = bf16, auto = from --deepspeed-config)",
    )
    p.add_argument(
        "--grad-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="as in dsclip train; not given: the plan searches both",
    )
    p.add_argument("--force-patch-dropout", type=float, default=0.0, help="FLIP patch-dropout rate, as in dsclip train")
    p.add_argument(
        "--loss",
        default=None,
        choices=LOSS_MODES,
        help="plan-only: fix the loss (the printed command carries dsclip train's flags for it); default: the "
        "fastest InfoNCE implementation that fits (global, local with gathered gradients, tiled: one loss value)",
    )
    p.add_argument("--loss-tile-size", type=int, default=TRAIN_TILE_SIZE, help="tile edge of the tiled losses")


def _rate_arguments(p: argparse.ArgumentParser) -> None:
    """What the step time and memory are predicted from: MFU, peak, node size, reserves."""
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="plan-only: model-FLOPs utilisation (3x fwd FLOPs / peak) to predict step times with; default: "
        "the one measured on an H200 for this model (or the nearest measured one), printed with its source",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="plan-only: bf16 GEMM TFLOP/s per GPU the MFU divides by (overrides --gpu's; H200 measured: 790)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="plan-only: GPUs per node (sbatch --gpus-per-node)")
    p.add_argument("--reserve", type=float, default=2.0, help="plan-only: GiB kept for the CUDA context")
    p.add_argument(
        "--host-memory",
        type=float,
        default=1024.0,
        help="plan-only: host RAM per node in GiB: the step's inputs (all --accum-freq micro-batches) are held there, "
        "and --async-save's copy of each rank's checkpoint state (where it does not fit: --no-async-save)",
    )


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """Training settings that change memory (dsclip train's flags, same meanings)."""
    p.add_argument("--force-image-size", type=int, help="train at this image size, as in dsclip train")
    p.add_argument("--lock-image", action=argparse.BooleanOptionalAction, default=False, help="as in dsclip train")
    p.add_argument("--lock-image-unlocked-groups", type=int, default=0, help="as in dsclip train")
    p.add_argument("--lock-text", action=argparse.BooleanOptionalAction, default=False, help="as in dsclip train")
    p.add_argument("--lock-text-unlocked-layers", type=int, default=0, help="as in dsclip train")
    p.add_argument(
        "--lock-text-freeze-layer-norm", action=argparse.BooleanOptionalAction, default=False, help="as in dsclip train"
    )
    p.add_argument(
        "--ema-decay", type=float, help="as in dsclip train: count the sharded EMA (4 B x trainable params / GPUs)"
    )
    p.add_argument(
        "--grad-reduction",
        choices=GRAD_REDUCTIONS,
        default="auto",
        help="as in dsclip train; auto: plan both under ZeRO-2/3 (sharded: an fp32 partition, K overlapped "
        "reductions; coalesced: the whole .grad, one exposed reduction) and keep the faster that fits",
    )


def _output_arguments(p: argparse.ArgumentParser) -> None:
    """What is printed: a CPU run's memory instead of a GPU's, the launcher of the command."""
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="plan-only: cpu predicts each rank's peak resident memory of a CPU run (--gpus = ranks, --gpu-memory = "
        "RAM per rank; needs --baseline-gb and --batch-size)",
    )
    p.add_argument(
        "--baseline-gb",
        type=float,
        help="plan-only, with --device cpu: measured resident GiB of a rank before the model exists "
        "(bench/largest_batch.py --baseline-only prints it)",
    )
    p.add_argument(
        "--launcher",
        default="hostfile",
        choices=("hostfile", "sbatch"),
        help="plan-only: the launcher of the printed command: deepspeed --hostfile, or sbatch " + SBATCH_SCRIPT,
    )


def clean_path(path: str) -> str:
    """A path as a user would type it: no ./, and relative to the working directory when it lies under it."""
    q = Path(os.path.normpath(path))
    if q.is_absolute():
        try:
            q = q.relative_to(Path.cwd())
        except ValueError:
            pass
    return q.as_posix()


def _ds_config(a, parser) -> tuple[str, tuple[str, dict] | None]:
    """(precision, (printed name, JSON) or None when not given) from --deepspeed-config / --zero / --precision."""
    if a.deepspeed_config is None:
        precision = run_precision(a.precision)
        return ("fp32" if precision == "auto" else precision), None  # the shipped zeroN.json says auto: fp32
    try:
        cfg = load_ds_json(a.deepspeed_config)
    except ConfigError as e:
        parser.error(str(e))
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (1, 2, 3):
        parser.error(f"--deepspeed-config {a.deepspeed_config}: zero_optimization.stage is {stage!r}; plan needs 1-3")
    if a.zero is not None and a.zero != stage:
        parser.error(f"--zero {a.zero} but --deepspeed-config {a.deepspeed_config} has stage {stage}: keep one")
    return run_precision(a.precision, cfg), (clean_path(a.deepspeed_config), cfg)  # auto: as dsclip train


def _global_batch(a, parser) -> tuple[int | None, int | None]:
    """(global contrastive batch or None for --max-batch, the run's micro-batch per GPU or None)."""
    given = [f for f, v in (("--global-batch", a.global_batch), ("--max-batch", a.max_batch or None)) if v]
    if len(given) > 1:
        parser.error(
            "--global-batch and --max-batch both given: keep one (--global-batch N plans that batch, "
            "--max-batch finds the largest that fits)"
        )
    if a.max_batch:
        if a.accum_freq is not None:
            parser.error("--max-batch chooses --accum-freq itself: drop --accum-freq (or plan it with --batch-size)")
        if a.device == "cpu":
            parser.error("--max-batch plans GPUs; with --device cpu give the run's --batch-size and --accum-freq")
        return None, a.batch_size or DEFAULT_MAX_BATCH_MICRO
    if a.global_batch is not None:
        micro = a.batch_size
        if a.accum_freq is not None:
            if micro is None:
                if a.global_batch % (a.gpus * a.accum_freq):
                    parser.error(f"--global-batch {a.global_batch} is not a multiple of --gpus x --accum-freq")
                micro = a.global_batch // (a.gpus * a.accum_freq)
            elif micro * a.accum_freq * a.gpus != a.global_batch:
                parser.error(
                    f"--global-batch {a.global_batch} but --batch-size {micro} x --accum-freq {a.accum_freq} x "
                    f"{a.gpus} GPUs = {micro * a.accum_freq * a.gpus}: drop one of them"
                )
        return a.global_batch, micro
    if a.batch_size is None:  # say what is missing, not what would be too much
        parser.error(
            "no batch given: add --batch-size N [--accum-freq K] (per GPU, as dsclip train), --global-batch N "
            "or --max-batch (find the largest that fits)"
        )
    return a.batch_size * (a.accum_freq or 1) * a.gpus, a.batch_size


# what the printed command leaves to the user: the shards, and their size where dsclip cannot read it
PLACEHOLDER_NOTE = (
    f"the command's {SHARDS} is your webdataset shards; shards without a sizes.json next to them (dsclip data "
    "write writes one; img2dataset does not) also need --train-num-samples N, the samples per epoch, as in OpenCLIP"
)
SPM = "SPM.model"  # placeholder: a sentencepiece model (`dsclip tokenizer train`), for non-OpenCLIP architectures


def _placeholders(model: str) -> list[str]:
    if model == "demo":  # the demo trains on its built-in data with its own tokenizer
        return []
    from dsclip.train.preflight import openclip_architecture

    # the tokenizer dsclip train defaults to for an OpenCLIP architecture, spelled out; any other model
    # (tiny, a JSON file) has no default: a sentencepiece model to fill in
    tok = f"open_clip:{model}" if openclip_architecture(model) else SPM
    return [f"--train-data {shlex.quote(SHARDS)}", f"--tokenizer {shlex.quote(tok)}"]


def recipe_for(model: str) -> str | None:
    """The shipped recipe of ``model`` (dsclip/recipes/MODEL.yaml, relative to the repo), None without one."""
    name = f"dsclip/recipes/{model}.yaml"
    return name if "/" not in model and (ROOT / name).is_file() else None


def recipe_overrides(recipe: str, plan: Plan) -> list[str]:
    """Flags that switch off what ``recipe`` turns on and the plan does not (a recipe's tiled loss, activation
    checkpointing, patch dropout, locking): the plan's flags only add, and the printed command must run the
    settings that were planned, whatever the recipe says."""
    from dataclasses import fields

    from dsclip.config import load_recipe
    from dsclip.losses.config import LOSS_FLAGS

    r = load_recipe(ROOT / recipe)
    out = []
    if r.get("grad_checkpointing") and not plan.grad_checkpointing:
        out.append("--no-grad-checkpointing")
    if r.get("force_patch_dropout") and not plan.patch_dropout:
        out.append("--force-patch-dropout 0")
    for key in ("siglip", "tiled_loss", "local_loss", "gather_with_grad"):
        flag = "--" + key.replace("_", "-")
        if r.get(key) and flag not in LOSS_FLAGS[plan.loss]:
            out.append("--no-" + flag[2:])
    for f in fields(LockConfig):
        if r.get(f.name) and not plan.lock.get(f.name):
            flag = "--" + f.name.replace("_", "-")
            out.append(f"--no-{flag[2:]}" if isinstance(r[f.name], bool) else f"{flag} 0")
    return out


def launch_command(plan: Plan, ds_name: str, tile: int, gpus_per_node: int, launcher: str) -> str:
    """The ready command: the launcher, then dsclip train's flags for this plan, then data/tokenizer placeholders.

    Every launcher runs the same settings: the model's shipped recipe where there is one (the plan's flags
    override it), else dsclip train's own defaults. train.sbatch takes the recipe as RECIPE (RECIPE=none: no
    recipe; unset it would be the demo's, whose lr and warm-up are the demo's)."""
    gpus = plan.gpus
    nodes, per_node = -(-gpus // gpus_per_node), min(gpus, gpus_per_node)
    recipe = recipe_for(plan.model)
    args = [*train_args(plan, ds_name, tile), *(recipe_overrides(recipe, plan) if recipe else [])]
    args += _placeholders(plan.model)
    if plan.device != "cpu" and launcher == "sbatch":
        head = (
            f"RECIPE={recipe or 'none'} sbatch --nodes={nodes} --ntasks-per-node={per_node} "
            f"--gpus-per-node={per_node} {SBATCH_SCRIPT}"
        )
        return " ".join([head, *args])
    if recipe is not None:
        args.insert(0, f"--config {recipe}")
    if plan.device == "cpu":  # one machine, CPU ranks over gloo
        head = f"deepspeed --num_gpus {gpus} --module dsclip train" if gpus > 1 else "dsclip train"
    elif gpus > 1:
        head = f"deepspeed --hostfile HOSTFILE --num_nodes {nodes} --num_gpus {per_node} --module dsclip train"
    else:
        head = "dsclip train"
    return " ".join([head, *args])


def _gpu(a, parser) -> tuple[float, float, str]:
    """(GiB per GPU, bf16 peak TFLOP/s, a note or "") from --gpu / --gpu-memory / --peak-tflops."""
    try:
        spec = gpu_spec(a.gpu or DEFAULT_GPU)
    except ValueError as e:
        parser.error(str(e))
    memory = a.gpu_memory if a.gpu_memory is not None else spec.memory_gib
    peak = a.peak_tflops if a.peak_tflops is not None else spec.peak_tflops
    note = ""
    if a.gpu is None and a.gpu_memory is not None and a.peak_tflops is None and a.device != "cpu":
        note = (
            f"the rate assumes --gpu {DEFAULT_GPU}'s {peak:g} TFLOP/s with your --gpu-memory {memory:g}: name --gpu "
            f"({', '.join(GPUS)}) or give --peak-tflops"
        )
    return memory, peak, note


def _flags(a, job: Job) -> dict[str, str]:
    """The flag that fixed each setting the job fixes (the search prints them)."""
    flags = {}
    if job.ds_config is not None:
        flags["zero"] = flags["offload"] = f"--deepspeed-config {job.ds_config[0]}"
    elif job.zero is not None:
        flags["zero"] = f"--zero {job.zero}"
    if job.loss is not None:
        flags["loss"] = f"--loss {job.loss}"
    if job.grad_checkpointing is not None:
        flags["grad_checkpointing"] = "--grad-checkpointing" if job.grad_checkpointing else "--no-grad-checkpointing"
    if job.micro_batch is not None:
        flags["micro_batch"] = f"--batch-size {job.micro_batch}"
    return flags


def _job(a, parser) -> Job:
    """The job the command line describes (dsclip train's flags); what it leaves open, the search chooses."""
    precision, ds = _ds_config(a, parser)
    batch, micro = _global_batch(a, parser)
    return Job(
        model=clean_path(a.model) if a.model.endswith(".json") else a.model, gpus=a.gpus, batch_size=batch,
        micro_batch=micro, precision=precision, zero=a.zero, ds_config=ds, loss=a.loss, tile=a.loss_tile_size,
        grad_checkpointing=a.grad_checkpointing, patch_dropout=a.force_patch_dropout, image_size=a.force_image_size,
        lock=_lock(a), ema_decay=a.ema_decay, grad_reduction=a.grad_reduction,
    )  # fmt: skip


def _cluster(a, memory: float, peak: float) -> Cluster:
    return Cluster(
        gpu_memory_gb=memory, peak_tflops=peak, gpus_per_node=a.gpus_per_node, host_memory_gb=a.host_memory,
        reserve_gb=a.reserve, link=link_from_args(a), gpu=a.gpu or "", mfu=a.mfu, device=a.device,
        baseline_gb=a.baseline_gb,
    )  # fmt: skip


def _lock(a) -> LockConfig:
    return LockConfig(
        lock_image=a.lock_image,
        lock_image_unlocked_groups=a.lock_image_unlocked_groups,
        lock_text=a.lock_text,
        lock_text_unlocked_layers=a.lock_text_unlocked_layers,
        lock_text_freeze_layer_norm=a.lock_text_freeze_layer_norm,
    )


def _with_command(plan: Plan, a) -> Plan:
    plan.command = launch_command(plan, plan.ds_config, a.loss_tile_size, a.gpus_per_node, a.launcher)
    if SHARDS in plan.command and PLACEHOLDER_NOTE not in plan.notes:  # quoted or not
        plan.notes.append(PLACEHOLDER_NOTE)
    return plan


def _search_and_print(a, job: Job, cluster: Cluster, gpu_note: str) -> int:
    """Plan by search (dsclip.plan.search): the chosen plan, the runners-up, and where the user's fixed
    settings do not fit, the cheapest change that does (or, when nothing fits, the smallest one)."""
    from dsclip.plan.search import cheapest_change, smallest_fit

    model, precision, micro, base = job.model, job.precision, job.micro_batch, job.plan_keywords(cluster)
    found = plan_job(job, cluster, flags=_flags(a, job))
    fixed = job.fixed()
    plan = _with_command(found.chosen, a)
    if gpu_note:
        plan.notes.append(gpu_note)
    moved = not plan.fits and a.global_batch is None and micro > plan.max_micro_batch
    if moved:  # most likely an old command line that meant the global batch
        plan.notes.insert(0, f"--batch-size {micro} per GPU does not fit; " + BATCH_SIZE_MOVED)
    tail, change = [], None
    if not plan.fits:
        change = cheapest_change(model, fixed=fixed, precision=precision, **base)
        if change is not None:
            p, changed = change
            _with_command(p, a)
            tail = [
                "",
                f"cheapest change that fits (changes your {', '.join(c.replace('_', ' ') for c in changed)}): "
                + describe(p),
                "try:",
                "  " + p.command,
            ]
        else:
            smallest = smallest_fit(model, precision=precision, **base)
            tail = ["", "nothing fits this batch on these GPUs, whatever the stage, offload, loss or checkpointing"]
            for what, p in smallest.items():
                _with_command(p, a)
                flag = f"--global-batch {p.batch_size}" if what == "global_batch" else f"--gpus {p.gpus}"
                tail += [f"smallest change that fits: {flag} ({describe(p)}); try:", "  " + p.command]
            if not smallest:
                tail.append("not even the smallest batch fits: add GPUs (or larger ones)")
    if a.json:
        out = asdict(plan)
        out["search"] = [
            {k: getattr(r, k) for k in ("zero", "offload", "grad_checkpointing", "loss", "micro_batch", "accum_freq",
                                        "fits", "samples_per_s_per_gpu", "ds_config")}
            | {"memory_gb": r.memory_gb.get("total")}
            for r in found.rows
        ]  # fmt: skip
        out["fixed_by_user"] = found.fixed
        if change is not None:
            out["suggestion"] = asdict(change[0]) | {"changes": change[1]}
        print(json.dumps(out, indent=2))
    else:
        print(format_search(found) + "\n\n" + format_plan(plan) + "\n".join(["", *tail] if tail else []))
    if moved:
        print(f"dsclip plan: {BATCH_SIZE_MOVED}", file=sys.stderr)
    if a.measure and plan.fits:  # rank 0 of the chosen plan, rehearsed under a fake world (run_measure)
        return run_measure(a, plan, job.chosen(plan, _chosen_ds_config(plan, job)))
    if a.measure:
        print("dsclip plan --measure: nothing rehearsed, the plan does not fit", file=sys.stderr)
    return 0 if plan.fits else 1


def _chosen_ds_config(plan: Plan, job: Job) -> tuple[str, dict]:
    """(name as printed, JSON) of the DeepSpeed config the plan runs: the job's own where it fixed one, else the
    shipped one the search chose, found as dsclip train finds it (load_ds_json: a path, else a shipped name)."""
    if job.ds_config is not None and job.ds_config[0] == plan.ds_config:
        return job.ds_config
    return plan.ds_config, load_ds_json(plan.ds_config)


# ---------------------------------------------------------------------------------------------------
# --measure: rank 0 of the planned job rehearsed on this machine (dsclip.rehearsal)
def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rehearsal (--measure)")
    g.add_argument(
        "--measure",
        action="store_true",
        help="plan-only: also run rank 0 of the planned job on this machine under torch's fake process group "
        "(world = --gpus) for a few steps on synthetic batches, and print measured memory and step time beside "
        "the plan, with the communication model's time apart. Losses are meaningless (collectives move no data)",
    )
    g.add_argument(
        "--measure-steps", type=int, default=3, help="plan-only: timed steps of --measure (after one warm-up)"
    )
    g.add_argument(
        "--measure-device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="plan-only: where --measure runs rank 0 (auto: cuda when one is visible)",
    )
    g.add_argument(
        "--intra-node-gbps",
        type=float,
        default=INTRA_NODE_GBPS,
        help="plan-only: NVLink/NVSwitch bus bandwidth inside a node, GB/s (nccl-tests busbw): the plan's "
        "communication time and --measure's",
    )
    g.add_argument(
        "--inter-node-gbps",
        type=float,
        default=INTER_NODE_GBPS,
        help="plan-only: network bandwidth per GPU between nodes, GB/s (400 Gb/s InfiniBand = 50): the plan's "
        "communication time once --gpus exceeds --gpus-per-node, and --measure's",
    )


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def link_from_args(a) -> LinkModel:
    link = LinkModel(gpus_per_node=a.gpus_per_node, intra_gbps=a.intra_node_gbps, inter_gbps=a.inter_node_gbps)
    if a.intra_node_gbps != INTRA_NODE_GBPS:
        link.intra_source = "given (--intra-node-gbps)"
    if a.inter_node_gbps != INTER_NODE_GBPS:
        link.inter_source = "given (--inter-node-gbps)"
    return link


def run_measure(a, plan: Plan, job: Job) -> int:
    """Rehearse rank 0 of ``job`` (the plan's, every setting chosen: Job.chosen) and print it beside ``plan``."""
    from dsclip.rehearsal.report import format_reductions, format_report
    from dsclip.rehearsal.room import RehearsalError, RehearsalSpec, rehearse_many

    if a.measure_steps < 1:
        print("dsclip plan: --measure-steps must be at least 1", file=sys.stderr)
        return 2
    device = _device(a.measure_device)
    try:
        spec = RehearsalSpec.from_job(job, gpus_per_node=a.gpus_per_node, steps=a.measure_steps, device=device)
    except RehearsalError as e:
        print(f"dsclip plan --measure: {e}", file=sys.stderr)
        return 2
    # each reduction the plan weighed that dsclip train would run at this K (the chosen one first)
    others = [m for m, row in plan.reductions.items() if m != plan.grad_reduction and not row["refused"]]
    modes = [plan.grad_reduction, *others]
    print(
        f"\nrehearsal: rank 0 of a world of {plan.gpus} under torch's fake process group on {device}, "
        f"micro-batch {spec.batch_size} x accum {spec.accum_freq}, ZeRO-{plan.zero} {plan.precision}, "
        f"loss {spec.loss}, {a.measure_steps} timed steps after 1 warm-up"
        + (" and 1 memory step (its tensors counted) ..." if device == "cpu" else " ...")
    )
    sys.stdout.flush()
    try:
        results = rehearse_many([replace(spec, grad_reduction=m) for m in modes])
    except RehearsalError as e:
        print(f"dsclip plan --measure: {e}", file=sys.stderr)
        return 2
    print(format_report(results[0], plan, link_from_args(a), device))
    if len(results) > 1 or plan.reductions:
        print(format_reductions(results, plan))
    return 0


def main_plan(argv: list[str]) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.gpus > a.gpus_per_node and a.gpus % a.gpus_per_node:
        parser.error(f"--gpus {a.gpus} does not fill whole nodes of --gpus-per-node {a.gpus_per_node}")
    if a.device == "cpu" and a.launcher == "sbatch":
        parser.error("--launcher sbatch starts GPU ranks; a --device cpu plan prints a one-machine deepspeed command")
    memory, peak, gpu_note = _gpu(a, parser)
    job, cluster = _job(a, parser), _cluster(a, memory, peak)
    if job.batch_size is not None and a.device != "cpu":
        return _search_and_print(a, job, cluster, gpu_note)
    # --max-batch and --device cpu plan one configuration: the flags', with the old defaults where not given
    job = dataclasses.replace(job, loss=job.loss or "infonce", grad_checkpointing=bool(job.grad_checkpointing))
    if job.batch_size is None:
        _, ds = default_ds_config(job)
        zero = int(ds.get("zero_optimization", {}).get("stage", job.zero or 2))
        batch = largest_batch(
            job.model, gpus=job.gpus, gpu_memory_gb=cluster.gpu_memory_gb, zero=zero, precision=job.precision,
            grad_checkpointing=job.grad_checkpointing, patch_dropout=job.patch_dropout, loss=job.loss, tile=job.tile,
            reserve_gb=cluster.reserve_gb, micro_batch=job.micro_batch, host_memory_gb=cluster.host_memory_gb,
            gpus_per_node=cluster.gpus_per_node, grad_reduction=job.grad_reduction,
        )  # fmt: skip
        if not a.json:
            print(
                f"largest contrastive batch: {batch} ({batch // a.gpus} per GPU, micro-batch {job.micro_batch}, "
                f"loss {job.loss}, ZeRO-{zero} {job.precision}"
                + (", grad-checkpointing" if job.grad_checkpointing else "")
                + ")\n"
            )
        if batch == 0:
            print(f"not even one micro-batch of {job.micro_batch} per GPU fits; lower --batch-size or add GPUs")
            return 1
        job = dataclasses.replace(job, batch_size=batch)
    plan = plan_configuration(job, cluster)
    _with_command(plan, a)
    if gpu_note:
        plan.notes.append(gpu_note)
    print(json.dumps(asdict(plan), indent=2) if a.json else format_plan(plan))
    if a.measure:  # rank 0 of this plan, rehearsed under a fake world (run_measure)
        return run_measure(a, plan, job.chosen(plan, default_ds_config(job))) or (0 if plan.fits else 1)
    return 0 if plan.fits else 1
