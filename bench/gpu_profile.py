"""Where dsclip's GPU step time goes, next to open_clip_train's: step-time variants and profiler tables.

Variants, same synthetic batches, bf16 (the device machine; ``--device cpu`` runs the code paths here):
  openclip          OpenCLIP model, torch.autocast bf16, fp32 weights, fused AdamW (open_clip_train's step)
  dsclip-autocast   dsclip's model in the same plain-torch loop: isolates the architecture
  dsclip-bf16       dsclip's model with bf16 weights in the plain loop (what DeepSpeed's bf16 computes in)
  dsclip-engine     the real thing: DeepSpeed ZeRO-2 bf16 engine + GradCacheStep (K=1; --ds-json zero3_{p}
                    and --accum-freq 2: ZeRO-3 with the gradient cache, issue #29)
Each: median step time over ``--steps`` after warm-up; then a torch.profiler table (top kernels by
device time) for openclip and dsclip-engine, and device-busy time / wall time per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import vs_openclip as V  # noqa: E402

from dsclip.model import create_model, get_model_config  # noqa: E402


def clip_loss(img, txt, scale):
    img, txt = F.normalize(img.float(), dim=-1), F.normalize(txt.float(), dim=-1)
    logits = scale.float() * img @ txt.T
    labels = torch.arange(img.shape[0], device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def plain_step_fn(model, dev, autocast: bool, weights_dtype):
    model = model.to(dev, dtype=weights_dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")

    def step(batch):
        img, tok = batch
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(image=img.to(weights_dtype), text=tok)
            loss = clip_loss(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def openclip_step_fn(name, cfg, dev):
    model = V.openclip_model(cfg, "fp32", dev, f"gpu-bench-{Path(name).stem}")
    return plain_step_fn(model, dev, autocast=dev.type == "cuda", weights_dtype=torch.float32)


def engine_step_fn(cfg, bs, dev, ds_json="zero2_{p}", accum=1):
    """dsclip's engine step on ``bs`` rows: ``accum`` micro-batches (the gradient cache), the shipped
    ``ds_configs/{ds_json}.json`` (``{p}``: the precision)."""
    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    precision = "bf16" if dev.type == "cuda" else "fp32"
    extra = {"deepspeed_config": f"ds_configs/{ds_json.format(p=precision)}.json"}
    mb = bs // accum
    engine, bundle, _ = H.dsclip_engine(precision, mb, accum, cfg, 1, extra=extra, device_type=dev.type)
    gc = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle), accum_freq=accum)

    def step(batch):  # a step between logged steps, as 99 in 100 of `dsclip train`
        gc([(batch[0][i * mb : (i + 1) * mb], batch[1][i * mb : (i + 1) * mb]) for i in range(accum)], grad_norm=False)

    return step


def time_steps(step, batches, dev) -> float:
    for b in batches[:2]:
        step(b)
    H.sync(dev)
    times = []
    for b in batches[2:]:
        t = time.perf_counter()
        step(b)
        H.sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile(step, batches, dev, label, top, sort=None):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    step(batches[0])
    H.sync(dev)
    t = time.perf_counter()
    with prof(activities=acts) as p:
        for b in batches[1:3]:
            step(b)
        H.sync(dev)
    wall = (time.perf_counter() - t) / 2
    ka = p.key_averages()
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    # device-busy: the kernels' own time only (an aten op's self device time is its kernels' again)
    kernels = [e for e in ka if getattr(e, "device_type", None) == DeviceType.CUDA] if dev.type == "cuda" else ka
    busy = sum(getattr(e, key) for e in kernels) / 2 / 1e6
    host = sum(e.self_cpu_time_total for e in ka) / 2 / 1e6
    print(
        f"\n== {label}: {wall * 1e3:.1f} ms/step wall, {busy * 1e3:.1f} ms/step device-busy, "
        f"{host * 1e3:.1f} ms/step host CPU in ops (profiled)",
        flush=True,
    )
    print(ka.table(sort_by=sort or key, row_limit=top, max_name_column_width=70), flush=True)


def host_profile(step, batches, dev, label, lines):
    """cProfile (wall clock) of the host side of a few steps: where the Python time goes, and where the
    host waits for the device (``item``/``tolist`` are the synchronisation points)."""
    import cProfile
    import io
    import pstats

    step(batches[0])
    H.sync(dev)
    prof = cProfile.Profile(time.perf_counter)
    t = time.perf_counter()
    prof.enable()
    for b in batches[1:]:
        step(b)
    H.sync(dev)
    prof.disable()
    n = len(batches) - 1
    print(f"\n== {label}: cProfile of {n} steps, {(time.perf_counter() - t) / n * 1e3:.1f} ms/step wall", flush=True)
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(lines)
        print(out.getvalue(), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="ViT-B-32")
    H.common_args(ap, json_out=False, batch=512, steps=6)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--no-profile", action="store_true", help="step times only")
    ap.add_argument("--variants", default="openclip,dsclip-autocast,dsclip-bf16,dsclip-engine")
    ap.add_argument("--ds-json", default="zero2_{p}", help="dsclip-engine's ds_configs/ JSON ({p}: the precision)")
    ap.add_argument("--accum-freq", type=int, default=1, help="dsclip-engine's micro-batches per step (--batch rows)")
    ap.add_argument("--sort", help="profiler table order (default: self device time; e.g. self_cpu_time_total)")
    ap.add_argument(
        "--cprofile", type=int, default=0, help="lines of a cProfile of dsclip-engine's host side (0: none)"
    )
    a = ap.parse_args(argv)
    if a.accum_freq < 1 or a.batch % a.accum_freq:
        ap.error(f"--accum-freq {a.accum_freq} must divide --batch {a.batch} (the step's rows)")
    known = ("openclip", "dsclip-autocast", "dsclip-bf16", "dsclip-engine")
    unknown = sorted(set(a.variants.split(",")) - set(known))
    if unknown:
        ap.error(f"unknown --variants {unknown}; choose from {', '.join(known)}")
    H.single_rank_env(29534)
    dev = torch.device(a.device)
    cfg = get_model_config(a.model)
    batches = H.make_batches(cfg, a.batch, a.steps + 2, dev)
    bf16 = torch.bfloat16 if dev.type == "cuda" else torch.float32
    variants = {
        "openclip": lambda: openclip_step_fn(a.model, cfg, dev),
        "dsclip-autocast": lambda: plain_step_fn(create_model(cfg), dev, dev.type == "cuda", torch.float32),
        "dsclip-bf16": lambda: plain_step_fn(create_model(cfg), dev, False, bf16),
        "dsclip-engine": lambda: engine_step_fn(cfg, a.batch, dev, a.ds_json, a.accum_freq),
    }
    steps = {}
    for name in a.variants.split(","):
        steps[name] = variants[name]()
        t = time_steps(steps[name], batches, dev)
        print(f"{a.model} batch {a.batch} {name}: {t * 1e3:.1f} ms/step, {a.batch / t:.0f} samples/s", flush=True)
        if name not in ("openclip", "dsclip-engine"):
            del steps[name]
        H.reset_mem(dev)
    for name in () if a.no_profile else [n for n in ("openclip", "dsclip-engine") if n in steps]:
        profile(steps[name], batches, dev, name, a.top, a.sort)
    if a.cprofile and "dsclip-engine" in steps:
        host_profile(steps["dsclip-engine"], batches, dev, "dsclip-engine", a.cprofile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
