"""One rank of a world-8 / world-64 job on one GPU: dsclip's ZeRO-1/2/3 under torch's fake process group.

Every GPU figure before this was a world-1 rank's, where patches such as ``local_flush`` apply that a rank of
an 8-GPU job never runs. Here each row is rank 0 of a world-N job (dsclip.rehearsal: ``dsclip train``'s
engine and gradient-cache step, synthetic batches, bf16), its collectives answered at once by the fake
group: the GPU time of everything a real rank does except communicating. The communication model
(dsclip.plan.comm, nccl-tests bus bandwidths, printed with their source) adds what the links would cost,
shown apart. Each (world, model) runs in its own child process (one fake world per process); rows print as
each child finishes. ``--json-out`` keeps every result. On a GPU each row with the default patches also prints
as a ``MeasuredMFU(..., world=N)`` line for dsclip/plan/efficiency.py's table (``SOURCE``: the results file
it goes in), which plans at that world size then take before the world-1 rows.

    python3 bench/gpu_world.py --worlds 8 64 --models ViT-B-32=512,ViT-L-14=128,ViT-H-14=64:ckpt \\
        --configs zero2,zero2_none,zero1,zero3 --steps 3 --json-out OUT/world.json \\
        --memory-check 32:ViT-bigG-14=64:ckpt:zero2 --memory-timeout 100

``--memory-check WORLD:MODEL=MICRO[:ckpt]:CONFIG`` runs first, in its own child: rank 0 of that world, its
measured peak (CUDA max_memory_allocated) beside ``dsclip plan``'s per-GPU total for the same settings
without the plan's 2 GiB reserve for the CUDA context and allocator (which max_memory_allocated does not
see), their ratio, and the plan's parts (issue #49's goal: the plan within 10 % on memory). DeepSpeed's
coalesced block (the gradient cache's K backwards) accumulates every parameter's full 16-bit gradient in
``param.grad`` before its one reduction; the plan counts it (its "grads (whole, until the one reduction)"
part: 2 B x P plus the 16-bit partition, dsclip.plan.gradient_cache_grad_bytes) and the row prints that
2 B x P apart too, so the plan's gradient part can be read against it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsclip.plan.comm import (  # noqa: E402
    LinkModel,
    Traffic,
    estimate,
    hideable_compute_s,  # noqa: E402
)
from dsclip.plan.planner import make_plan, shipped_ds_config  # noqa: E402
from dsclip.rehearsal.room import RehearsalError, RehearsalSpec, rehearse_many  # noqa: E402

# config name -> (ZeRO stage, engine patches); the *_coalesced ones run --grad-reduction coalesced, the others auto
# (ZeRO-2/3 at world > 1: sharded), issue 57
CONFIGS = {
    "zero2": (2, "all"),
    "zero2_none": (2, "none"),
    "zero1": (1, "all"),
    "zero3": (3, "all"),
    "zero2_coalesced": (2, "all"),
    "zero3_coalesced": (3, "all"),
}


def reduction_of(config: str) -> str:
    return "coalesced" if config.endswith("_coalesced") else "auto"


GiB = 2**30


def parse_models(text: str) -> list[tuple[str, int, bool]]:
    out = []
    for item in text.split(","):
        name, _, rest = item.partition("=")
        micro, _, flag = rest.partition(":")
        out.append((name, int(micro), flag == "ckpt"))
    return out


def row(world: int, model: str, config: str, r, link: LinkModel, k: int) -> tuple[str, dict]:
    zero, patches = CONFIGS[config]
    spec = r.spec
    step = statistics.median(r.step_s) if r.step_s else float("nan")
    traffic = Traffic()
    for kind, n, phase, calls, nbytes in r.traffic:
        traffic.calls[(kind, n, phase)], traffic.bytes[(kind, n, phase)] = calls, nbytes
    est = estimate(
        traffic, link, zero=zero, overlap_comm=bool(spec["ds_config"]["zero_optimization"].get("overlap_comm")),
        hideable_compute_s=hideable_compute_s(step, zero),
    )  # fmt: skip
    plan = make_plan(
        model, gpus=world, gpu_memory_gb=141.0, batch_size=spec["batch_size"] * k * world, zero=zero,
        precision="bf16", grad_checkpointing=spec["grad_checkpointing"], micro_batch=spec["batch_size"],
        grad_reduction=r.grad_reduction if r.grad_reduction in ("sharded", "coalesced") else "auto",
    )  # fmt: skip
    samples = spec["batch_size"] * k / (step + est.exposed_s)
    line = (
        f"| {world} | {model} | {spec['batch_size']}x{k}{' ckpt' if spec['grad_checkpointing'] else ''} | {config} | "
        f"{step * 1e3:.1f} | {est.exposed_s * 1e3:.1f} | {samples:.0f} | {r.peak_bytes / GiB:.2f} | "
        f"{plan.memory_gb.get('total', float('nan')):.2f} | {plan.compute_s * 1e3:.1f} | {plan.comm_s * 1e3:.1f} | "
        f"{r.skipped} |"
    )
    table = table_row(world, model, config, r, plan, step, k)
    return line + (f"\n#   table row: {table}" if table else ""), {
        "world": world,
        "model": model,
        "config": config,
        "result": asdict(r),
        "exposed_comm_s": est.exposed_s,
        "grad_reduction": r.grad_reduction,
        "grad_bytes_measured": r.grad_bytes,
        "grad_bytes_plan": plan.grads_bytes,
        "table_row": table,
    }


def table_row(world: int, model: str, config: str, r, plan, step: float, k: int) -> str:
    """The rank's compute as a dsclip/plan/efficiency.py MEASURED row (a world-N row: fake collectives, no link
    time), for the default patch set only: MFU = the plan's model FLOPs per sample (3 x forward + loss, the
    planner's convention) x the measured samples/s / the H200's measured 790 TFLOP/s."""
    if config == "zero2_none" or not r.step_s or r.skipped or r.spec["device"] != "cuda":
        return ""
    samples = r.spec["batch_size"] * k / step
    mfu = plan.train_gflops_per_sample * 1e9 * samples / (plan.peak_tflops * 1e12)
    return (
        f'MeasuredMFU("{model}", {CONFIGS[config][0]}, "bf16", {r.spec["batch_size"]}, {samples:.1f}, {mfu:.4f}, '
        f'"H200", SOURCE, accum_freq={k}, grad_checkpointing={r.spec["grad_checkpointing"]}, world={world})'
    )


def parse_memory_check(text: str) -> tuple[int, str, int, bool, str]:
    """ "32:ViT-bigG-14=64:ckpt:zero2" -> (32, "ViT-bigG-14", 64, True, "zero2")."""
    world, _, rest = text.partition(":")
    parts = rest.split(":")
    name, _, micro = parts[0].partition("=")
    config = parts[-1]
    if config not in CONFIGS or not micro:
        raise SystemExit(
            f"--memory-check {text!r}: want WORLD:MODEL=MICRO[:ckpt]:CONFIG, CONFIG in {', '.join(CONFIGS)}"
        )
    return int(world), name, int(micro), "ckpt" in parts[1:-1], config


def memory_row(world: int, model: str, config: str, r) -> tuple[str, dict]:
    """Measured peak against the plan's total (less its reserve), with the plan's parts."""
    zero = CONFIGS[config][0]
    spec = r.spec
    plan = make_plan(
        model, gpus=world, gpu_memory_gb=141.0, batch_size=spec["batch_size"] * spec["accum_freq"] * world,
        zero=zero, precision="bf16", grad_checkpointing=spec["grad_checkpointing"], micro_batch=spec["batch_size"],
    )  # fmt: skip
    planned = plan.tensor_bytes / GiB  # the total less its reserve, unrounded
    measured = r.peak_bytes / GiB
    full_grads = 2 * r.params / GiB  # the coalesced block's param.grad, bf16
    parts = ", ".join(f"{k} {v:.2f}" for k, v in plan.memory_gb.items() if k not in ("total",))
    line = (
        f"| {world} | {model} | {spec['batch_size']}x{spec['accum_freq']}"
        f"{' ckpt' if spec['grad_checkpointing'] else ''} | {config} | {measured:.2f} | {planned:.2f} | "
        f"{planned / measured - 1:+.1%} | {full_grads:.2f} | {r.skipped} |"
    )
    return line + f"\n#   measured: {r.peak_kind}\n#   plan parts (GiB): {parts}", {
        "world": world, "model": model, "config": config, "measured_gib": measured, "plan_gib_less_reserve": planned,
        "plan_memory_gb": plan.memory_gb, "full_bf16_grads_gib": full_grads, "result": asdict(r),
    }  # fmt: skip


def run_memory_check(a, kept: list) -> None:
    world, model, micro, ckpt, config = parse_memory_check(a.memory_check)
    zero, patches = CONFIGS[config]
    print(f"# memory at world {world}: rank 0's measured peak against dsclip plan's per-GPU total")
    print("| world | model | micro x K | config | peak GiB | plan GiB (less reserve) | plan vs measured "
          "| full bf16 .grad GiB | skipped |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    spec = RehearsalSpec(
        model=model, world=world, batch_size=micro, accum_freq=a.accum_freq,
        ds_config=shipped_ds_config(zero, "bf16")[1], precision="bf16", grad_checkpointing=ckpt,
        engine_patches=patches, steps=a.memory_steps, device=a.device,
    )  # fmt: skip
    try:
        (r,) = rehearse_many([spec], timeout_s=a.memory_timeout)
    except RehearsalError as e:
        print(f"| {world} | {model} | {micro} | {config} | failed: {e} |", flush=True)
        return
    line, data = memory_row(world, model, config, r)
    print(line, flush=True)
    kept.append(data)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(kept, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--models", default="ViT-B-32=512,ViT-L-14=128,ViT-H-14=64:ckpt")
    ap.add_argument("--configs", default="zero2,zero2_none,zero1,zero3")
    ap.add_argument("--accum-freq", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child (one world, one model)")
    ap.add_argument("--json-out")
    ap.add_argument("--memory-check", help="WORLD:MODEL=MICRO[:ckpt]:CONFIG, run first: measured peak memory vs plan")
    ap.add_argument("--memory-timeout", type=float, default=100.0, help="seconds for the --memory-check child")
    ap.add_argument("--memory-steps", type=int, default=2, help="timed steps of the --memory-check child")
    a = ap.parse_args()
    kept = []
    if a.memory_check:
        run_memory_check(a, kept)
    link = LinkModel()
    print(f"# link model: {link.describe()}")
    print("# step = rank 0's measured time per step (fake collectives); comm = the link model's exposed time")
    print(
        "| world | model | micro x K | config | step ms | comm ms (model) | samples/s/rank | peak GiB "
        "| plan GiB | plan compute ms | plan comm ms (derived) | skipped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world in a.worlds:
        for model, micro, ckpt in parse_models(a.models):
            specs = []
            for config in a.configs.split(","):
                zero, patches = CONFIGS[config]
                specs.append(
                    RehearsalSpec(
                        model=model,
                        world=world,
                        batch_size=micro,
                        accum_freq=a.accum_freq,
                        ds_config=shipped_ds_config(zero, "bf16")[1],
                        precision="bf16",
                        grad_checkpointing=ckpt,
                        engine_patches=patches,
                        steps=a.steps,
                        device=a.device,
                        grad_reduction=reduction_of(config),
                    )  # fmt: skip
                )
            try:
                results = rehearse_many(specs, timeout_s=a.timeout)
            except RehearsalError as e:
                print(f"| {world} | {model} | {micro} | - | failed: {e} |", flush=True)
                continue
            for config, r in zip(a.configs.split(","), results, strict=True):
                line, data = row(world, model, config, r, link, a.accum_freq)
                print(line, flush=True)
                kept.append(data)
            if a.json_out:
                Path(a.json_out).write_text(json.dumps(kept, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
