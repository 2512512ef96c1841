"""dsclip vs open_clip_train on one GPU: samples/s, peak memory and MFU, alternated in one process.

Run by ``bench/gpu_h200.sh`` on the device machine; ``--device cpu --models demo`` runs the same code
paths here (that is how the script is checked before the device time is spent).

For each model: one micro-batch size for both trainers (``--batch NAME=B``; halved on OOM), then
``--rounds`` rounds alternating the two trainers, each ``--steps`` timed steps after two warm-up steps.
Both train in bf16 autocast / bf16 DeepSpeed with fused AdamW on identical synthetic batches, plain
InfoNCE, no accumulation. MFU = 3 x forward FLOPs per sample (FlopCounterMode, bench/harness.py)
x samples/s / the bf16 GEMM rate measured at the start (8192^3 products).
Then the loss alone: tiled vs local InfoNCE forward+backward at large N (time and memory above baseline).

``--world N`` (issue #49): every trainer runs as rank 0 of a world-N job under torch's fake process group
(dsclip.engine.fake_world): open_clip_train's model wrapped in DDP with its loss gathering over N ranks,
dsclip's engine partitioning over N, as a rank of an N-GPU job. Collectives return at once (each rank's
own shard stands in for its peers', dsclip.rehearsal.counter), so the ratio is a world-N rank's without the
communication; the link model's time is ``dsclip plan --measure``'s. Default 1: one GPU, the whole job.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import vs_openclip as V  # noqa: E402

from dsclip.model import get_model_config  # noqa: E402

WORLD = 1  # --world: the fake world every trainer runs in (set by main)


def _bucket_unchanged(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def openclip_run(name, cfg, bs, steps, dev):
    from open_clip.loss import ClipLoss

    precision = "amp_bf16" if dev.type == "cuda" else "fp32"
    model = V.openclip_model(cfg, precision, dev, f"gpu-bench-{Path(name).stem}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    if WORLD > 1:  # open_clip_train's rank: its model in DDP (as its main() wraps it), its loss over WORLD ranks
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None)
        # the fake group's all-reduce future carries no tensor, which DDP's reducer refuses: a hook that hands the
        # bucket back unchanged stands in for it (what the fake all-reduce would have done, minus its launch)
        model.register_comm_hook(None, _bucket_unchanged)
    args = V.openclip_args(precision, bs, world=WORLD, device=dev)
    epoch = V.openclip_epoch(model, ClipLoss(rank=0, world_size=WORLD), opt, args)
    return H.timed_on_device(lambda batches, timed: epoch(batches), cfg, bs, steps, dev)  # all freed on return


def dsclip_run(name, cfg, bs, steps, dev, compile_blocks=False, engine_patches="all", ds_json=None, accum=1, zero=None):
    """dsclip's step: ``bs`` rows per step, ``accum`` micro-batches of ``bs // accum`` (the gradient cache);
    ``ds_json`` a shipped DeepSpeed JSON (default ZeRO-2 of the precision), ``zero`` zero_optimization overrides."""
    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep
    from dsclip.train.metrics import LogArgs

    precision = "bf16" if dev.type == "cuda" else "fp32"
    # compile_blocks: --torchcompile (inductor, every transformer block); compiled in the untimed warm-up
    # engine_patches: --engine-patches (dsclip/engine/patches/): all (the default), none (DeepSpeed's own paths)
    extra = {"torchcompile": True} if compile_blocks else {}
    extra["engine_patches"] = engine_patches
    if ds_json:
        extra["deepspeed_config"] = f"ds_configs/{ds_json.format(p=precision)}.json"
    mb = bs // accum
    engine, bundle, _ = H.dsclip_engine(
        precision,
        mb,
        accum,
        cfg,
        WORLD,
        extra=extra,
        ds_overrides={"zero_optimization": zero or {}},
        device_type=dev.type,
    )
    step = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle), accum_freq=accum)

    def chunks(b):
        return [(b[0][i * mb : (i + 1) * mb], b[1][i * mb : (i + 1) * mb]) for i in range(accum)]

    log_every = LogArgs().log_every_n_steps

    def run(batches, timed):  # timed: the gradient norm on logged steps only, as `dsclip train` runs
        for i, b in enumerate(batches):
            step(chunks(b), grad_norm=not timed or (i + 1) % log_every == 0)

    sps, mem = H.timed_on_device(run, cfg, bs, steps, dev)
    engine.destroy()  # the rest is freed on return
    restore_torch_linear()
    return sps, mem


def restore_torch_linear():
    """Put torch's ``F.linear`` back after a ZeRO-3 engine. Its ``zero.Init`` replaces it process-wide with
    DeepSpeed's autograd linear (``memory_efficient_linear``, "This will persist unless manually reset"), so
    every trainer run after the first ZeRO-3 one, ZeRO-2 and OpenCLIP included, ran DeepSpeed's linear (the
    H200 run of 2026-12-04: ViT-H-14's ZeRO-2 row came after two ZeRO-3 engines)."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patched

    original = getattr(Patched, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


EVERY_ZERO12 = "all,+local_flush,+overflow_check,+grad_hooks,+grad_norm"
TRAINERS = {
    "openclip": openclip_run,
    "dsclip": dsclip_run,
    "dsclip_compile": lambda *a: dsclip_run(*a, compile_blocks=True),
    # the seam (issue #31): DeepSpeed's own paths only, and each patch left out in turn
    "dsclip_patches_none": lambda *a: dsclip_run(*a, engine_patches="none"),
    # every ZeRO-1/2 patch, the opt-in ones too (issue 53: a patch is in `all` with >= 3 % of the step), and
    # every one but each: the GPU evidence for the default set
    "dsclip_every_patch": functools.partial(dsclip_run, engine_patches=EVERY_ZERO12),
    **{
        f"dsclip_no_{p}": functools.partial(dsclip_run, engine_patches=f"{EVERY_ZERO12},-{p}")
        for p in ("local_flush", "overflow_check", "grad_hooks", "grad_norm")
    },
    # ZeRO-3 against ZeRO-2 (issue #29), the gradient cache at K = 2 (the batch given is the step's rows):
    # the shipped JSON (each block one leaf) and stock ZeRO-3 (no leaf modules, one fetch per tensor)
    "dsclip_zero2_k2": functools.partial(dsclip_run, accum=2),
    "dsclip_zero3_k2": functools.partial(dsclip_run, ds_json="zero3_{p}", accum=2),
    "dsclip_zero3_noleaf_k2": functools.partial(
        dsclip_run, ds_json="zero3_{p}", accum=2, zero={"leaf_module": {"classes": []}}
    ),
    # the shipped JSON runs torch's linear (memory_efficient_linear: false, since 2026-12-05); DeepSpeed's
    # default, its autograd linear (a Python Function per nn.Linear call, the bias added apart from the GEMM)
    "dsclip_zero3_linear_on_k2": functools.partial(
        dsclip_run, ds_json="zero3_{p}", accum=2, zero={"memory_efficient_linear": True}
    ),
    # DeepSpeed's four hooks on each leaf block instead of dsclip's two (zero3_blocks): whether dsclip's
    # prefetch hides the gathers as well as DeepSpeed's queue does
    "dsclip_zero3_no_blocks_k2": functools.partial(
        dsclip_run, ds_json="zero3_{p}", accum=2, engine_patches="all,-zero3_blocks"
    ),
}


def fitting_batch(name, cfg, bs, dev):
    """``bs`` or the largest power-of-two fraction of it with which both trainers run a step."""
    while bs >= 1:
        try:
            for fn in (openclip_run, dsclip_run):
                fn(name, cfg, bs, 1, dev)
                H.reset_mem(dev)
            return bs
        except torch.OutOfMemoryError:
            H.reset_mem(dev)
            print(f"{name}: batch {bs} does not fit, halving", flush=True)
            bs //= 2
    raise RuntimeError(f"{name}: not even batch 1 fits")


def loss_memory(dev, sizes, dim):
    from dsclip.losses import build_loss

    res = {}
    for n in sizes:
        for mode in ("infonce_local", "infonce_tiled"):
            key = f"{mode} {n}"
            try:
                H.reset_mem(dev)
                g = torch.Generator(device=dev).manual_seed(0)
                x = torch.nn.functional.normalize(torch.randn(n, dim, device=dev, generator=g), dim=-1)
                y = torch.nn.functional.normalize(torch.randn(n, dim, device=dev, generator=g), dim=-1)
                x.requires_grad_()
                y.requires_grad_()
                scale = torch.tensor(14.0, device=dev, requires_grad=True)
                base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
                fn = build_loss(mode)
                H.sync(dev)
                t = time.perf_counter()
                fn(x, y, scale).backward()
                H.sync(dev)
                extra = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev.type == "cuda" else float("nan")
                res[key] = {"s": time.perf_counter() - t, "peak_gb_above_inputs": extra}
            except torch.OutOfMemoryError:
                res[key] = "OOM"
            print(key, res[key], flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="ViT-B-32=512,ViT-L-14=128", help="NAME=micro-batch,...")
    H.common_args(ap, rounds=2, steps=8)
    ap.add_argument(
        "--trainers",
        default="openclip,dsclip",
        help="compared trainers, alternated: openclip, dsclip, dsclip_compile (dsclip with --torchcompile), "
        "dsclip_patches_none (--engine-patches none), dsclip_no_PATCH (--engine-patches all,-PATCH)",
    )
    ap.add_argument("--assume-fits", action="store_true", help="skip the OOM probe: the given batch is known to fit")
    ap.add_argument("--loss-sizes", default="32768,65536,131072", help="N for the loss-memory rows ('' skips them)")
    ap.add_argument("--loss-dim", type=int, default=768)
    ap.add_argument(
        "--world", type=int, default=1, help="run every trainer as rank 0 of a world-N job (torch's fake process group)"
    )
    a = ap.parse_args(argv)
    unknown = set(a.trainers.split(",")) - set(TRAINERS)
    if unknown:
        ap.error(f"unknown trainer(s) {sorted(unknown)}; choose from {sorted(TRAINERS)}")
    if a.world > 1:
        global WORLD
        WORLD = a.world
        from dsclip.engine.fake_world import fake_world
        from dsclip.rehearsal.counter import CollectiveCounter

        # the counter before the world: DeepSpeed's backend keeps references to the collectives it finds then
        with CollectiveCounter(fill_outputs=True), fake_world(a.world):
            return run(a)
    H.single_rank_env(29533)
    return run(a)


def run(a) -> int:
    trainers = a.trainers.split(",")
    dev = torch.device(a.device)
    print(H.preamble(__file__, dev.type), flush=True)
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "world": WORLD, "models": {}}
    print(f"world {WORLD}" + (" (rank 0 under torch's fake process group: no communication)" if WORLD > 1 else ""))
    peak = report["bf16_peak_tflops"] = H.bf16_peak_tflops(dev)
    print(f"measured dense bf16 GEMM rate (8192^3): {peak:.0f} TFLOP/s", flush=True)
    for spec in a.models.split(","):
        name, bs = spec.split("=")
        cfg = get_model_config(name)
        flops = H.train_flops_per_sample(cfg)
        bs = int(bs) if a.assume_fits else fitting_batch(name, cfg, int(bs), dev)
        rows = {t: [] for t in trainers}
        for r in range(a.rounds):
            for impl in trainers if r % 2 == 0 else trainers[::-1]:
                sps, mem = TRAINERS[impl](name, cfg, bs, a.steps, dev)
                H.reset_mem(dev)
                mfu = sps * flops / (peak * 1e12)
                rows[impl].append({"samples_per_s": sps, "peak_mem_gb": mem, "mfu": mfu})
                print(
                    f"{name} batch {bs} round {r} {impl}: {sps:.0f} samples/s, {mem:.1f} GiB, MFU {100 * mfu:.1f}%",
                    flush=True,
                )
        report["models"][name] = {"batch": bs, "train_gflop_per_sample": flops / 1e9, **rows}
    report["loss"] = loss_memory(dev, [int(n) for n in a.loss_sizes.split(",") if n], a.loss_dim)
    base = trainers[0]
    print(f"\n| model | micro-batch | trainer | samples/s (median, min-max) | MFU | peak GiB | / {base} |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, m in report["models"].items():
        med = {k: statistics.median(r["samples_per_s"] for r in m[k]) for k in trainers}
        for k in trainers:
            sps = sorted(r["samples_per_s"] for r in m[k])
            print(
                f"| {name} | {m['batch']} | {k} | {med[k]:.0f} ({sps[0]:.0f}-{sps[-1]:.0f}) | "
                f"{100 * statistics.median(r['mfu'] for r in m[k]):.1f}% | "
                f"{max(r['peak_mem_gb'] for r in m[k]):.1f} | {med[k] / med[base]:.2f}x |"
            )
    H.write_json(a.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
