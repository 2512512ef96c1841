#!/usr/bin/env bash
# GPU measurements for issue 8, item 5 (one H200; NOT run yet: the task that wrote this had no GPU).
#
# Measures, in bf16 at the largest micro-batch that fits (found by doubling until OOM):
#   1. dsclip vs open_clip_train samples/s/GPU for ViT-B-32 and ViT-L-14 (same OpenCLIP JSON, same
#      synthetic data, alternated), peak memory (torch.cuda.max_memory_allocated), MFU from dsclip plan's
#      FLOPs per sample (3x forward) and the peak dense bf16 rate measured here (~790 TFLOP/s);
#   2. tiled vs local InfoNCE at large batch (bench/loss_memory.py-style: loss fwd+bwd only).
# Everything stays on the machine; results land in $OUT (or ./gpu_results) as JSON + a log.
#
# Usage (repo root, on the GPU machine):  bash bench/gpu_h200.sh [--quick]
# Budget: ~10 minutes with --quick (B/32 and L/14, 2 rounds, 6 timed steps each).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_results}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
QUICK=${1:-}
ROUNDS=2; STEPS=6
[ "$QUICK" = "--quick" ] || { ROUNDS=3; STEPS=10; }

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch, deepspeed, open_clip; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'open_clip', open_clip.__version__)"
} | tee "$OUT/env.txt"

"$PY" - "$OUT" "$ROUNDS" "$STEPS" <<'PYEOF' 2>&1 | tee "$OUT/gpu_bench.log"
import json, sys, time, math
import torch
sys.path.insert(0, "bench")
out_dir, rounds, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from dsclip import plan as P
from dsclip.model import get_model_config

dev = torch.device("cuda")

def peak_tflops():
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
    for _ in range(3): a @ b
    torch.cuda.synchronize(); t = time.perf_counter(); n = 20
    for _ in range(n): a @ b
    torch.cuda.synchronize(); return 2 * 8192**3 * n / (time.perf_counter() - t) / 1e12

def batches(cfg, bs, n):
    s, L, V = cfg["vision_cfg"]["image_size"], cfg["text_cfg"].get("context_length", 77), cfg["text_cfg"].get("vocab_size", 49408)
    out = []
    for i in range(n):
        img = torch.randn(bs, 3, s, s, device=dev)
        tok = torch.randint(1, V - 1, (bs, L), device=dev); tok[:, 20] = V - 1; tok[:, 21:] = 0
        out.append((img, tok))
    return out

def openclip_run(name, bs, n):
    import open_clip
    from open_clip.loss import ClipLoss
    from open_clip_train.train import train_one_epoch
    from types import SimpleNamespace
    model = open_clip.create_model(name, precision="amp_bf16", device=dev, output_dict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loss = ClipLoss()
    args = SimpleNamespace(device="cuda", precision="amp_bf16", accum_freq=1, distill=False, skip_scheduler=True,
                           horovod=False, grad_clip_norm=None, log_every_n_steps=10**9, batch_size=bs, world_size=1,
                           rank=0, local_rank=0, wandb=False, save_logs=False)
    class L(list):
        num_batches = property(len); num_samples = property(lambda s: len(s) * bs)
    def epoch(bt):
        train_one_epoch(model, {"train": SimpleNamespace(dataloader=L(bt), set_epoch=lambda e: None)}, loss, 0, opt,
                        None, None, None, args)
    cfg = get_model_config(name)
    epoch(batches(cfg, bs, 2)); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    data = batches(cfg, bs, n); torch.cuda.synchronize(); t = time.perf_counter()
    epoch(data); torch.cuda.synchronize()
    return n * bs / (time.perf_counter() - t), torch.cuda.max_memory_allocated() / 2**30

def dsclip_run(name, bs, n, loss_name="infonce"):
    import os
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("LOCAL_RANK", "0")
    import vs_openclip as V
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep
    from dsclip.engine.build import autocast_dtype
    cfg = get_model_config(name)
    engine, bundle, rc = V.dsclip_engine("bf16", bs, 1, cfg, 1, extra={"model": name})
    gc = GradCacheStep(engine, build_loss(loss_name), compute_dtype=autocast_dtype(bundle))
    for b in batches(cfg, bs, 2): gc([b])
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    data = batches(cfg, bs, n); t = time.perf_counter()
    for b in data: gc([b])
    torch.cuda.synchronize()
    sps = n * bs / (time.perf_counter() - t)
    del engine, gc; torch.cuda.empty_cache()
    return sps, torch.cuda.max_memory_allocated() / 2**30

def largest_batch(fn, name, start):
    bs, best = start, None
    while bs <= 4096:
        try:
            fn(name, bs, 2); best = bs; bs *= 2
        except torch.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
    return best

peak = peak_tflops()
print(f"measured dense bf16 peak: {peak:.0f} TFLOP/s", flush=True)
results = {"peak_tflops": peak, "models": {}}
for name, start in (("ViT-B-32", 256), ("ViT-L-14", 64)):
    fwd = P.forward_flops(P.load_arch(name))["total"]
    bs = min(largest_batch(openclip_run, name, start) or start, largest_batch(dsclip_run, name, start) or start)
    rows = {"openclip": [], "dsclip": []}
    for r in range(rounds):
        for impl in (("openclip", "dsclip") if r % 2 == 0 else ("dsclip", "openclip")):
            sps, mem = (openclip_run if impl == "openclip" else dsclip_run)(name, bs, steps)
            rows[impl].append({"samples_per_s": sps, "peak_mem_gb": mem, "mfu": 3 * fwd * sps / (peak * 1e12)})
            print(f"{name} bs {bs} round {r} {impl}: {sps:.0f} samples/s/GPU, {mem:.1f} GiB, "
                  f"MFU {rows[impl][-1]['mfu']:.3f}", flush=True)
    results["models"][name] = {"batch": bs, **rows}

# tiled vs local InfoNCE at large batch (loss forward+backward only, D=768)
from dsclip.losses import build_loss
lres = {}
for n in (32768, 65536, 131072):
    for mode in ("infonce_local", "infonce_tiled"):
        try:
            torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
            x = torch.nn.functional.normalize(torch.randn(n, 768, device=dev), dim=-1).requires_grad_()
            y = torch.nn.functional.normalize(torch.randn(n, 768, device=dev), dim=-1).requires_grad_()
            s = torch.tensor(14.0, device=dev, requires_grad=True)
            base = torch.cuda.memory_allocated(); fn = build_loss(mode)
            torch.cuda.synchronize(); t = time.perf_counter()
            fn(x, y, s).backward(); torch.cuda.synchronize()
            lres[f"{mode} {n}"] = {"s": time.perf_counter() - t, "peak_gb": (torch.cuda.max_memory_allocated() - base) / 2**30}
        except torch.OutOfMemoryError:
            lres[f"{mode} {n}"] = "OOM"
        print(mode, n, lres[f"{mode} {n}"], flush=True)
results["loss"] = lres
json.dump(results, open(f"{out_dir}/gpu_results.json", "w"), indent=1)
PYEOF
# Utilisation (issue 17, item 1): this GPU's measured bf16/fp32 GEMM peak at ViT block shapes and the
# FLOPs per training sample (FlopCounterMode); MFU = the samples/s above x FLOPs / this peak.
"$PY" bench/utilisation.py --device cuda --models ViT-B-32,ViT-L-14 --json-out "$OUT/utilisation.json" \
  2>&1 | tee "$OUT/utilisation.log"
echo "results: $OUT/gpu_results.json $OUT/utilisation.json"
