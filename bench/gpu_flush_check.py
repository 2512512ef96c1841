"""The one-rank flat flush on a GPU against DeepSpeed's own flush: gradients, norms and weights.

tests/dist/test_local_flush.py proves dsclip/engine/patches/local_flush.py bit for bit against DeepSpeed's
coalesced flush on CPU (gloo, worlds 1 and 2). On a GPU only world 1 takes the flat flush (more ranks
keep NCCL's reduce-scatter), with bf16 weights and CUDA kernels, which the CPU tests cannot run. This
script runs the same steps (ZeRO-2 bf16, gradient cache K micro-batches, clipping on) three times on
the device: DeepSpeed's flush twice — the run-to-run spread of the GPU's own kernels (atomics in
attention and embedding backward) — and the flat flush once, and prints the largest differences.
The flat flush passes when it is within that spread (or bitwise equal).

    python3 bench/gpu_flush_check.py [--device cuda] [--model ViT-B-32] [--batch 64] [--accum-freq 2]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as G  # noqa: E402
import vs_openclip as V  # noqa: E402

from dsclip.model import get_model_config  # noqa: E402


def run(cfg, batches, k, dev, local_flush: bool, precision: str = "bf16") -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    precision = precision if dev.type == "cuda" else "fp32"
    engine, bundle, _ = V.dsclip_engine(
        precision,
        batches[0][0].shape[0],
        k,
        cfg,
        1,
        extra={"grad_clip_norm": 1.0, "engine_patches": "all" if local_flush else "none"},
        device_type=dev.type,
    )
    # DeepSpeed's runs keep its own per-parameter overflow check too: the reference is DeepSpeed's step as shipped
    step = GradCacheStep(engine, build_loss("infonce"), accum_freq=k, compute_dtype=autocast_dtype(bundle))
    named = list(engine.module.named_parameters())
    out = {"local_flush": "local_flush" in bundle.patches.active, "grads": [], "norms": [], "weights": []}
    for s in range(len(batches) // k):
        torch.manual_seed(7 + s)
        step(batches[s * k : (s + 1) * k], optimizer_step=False)
        out["grads"].append({n: safe_get_full_grad(p).float().cpu() for n, p in named})
        engine.step()
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["weights"].append({n: safe_get_full_fp32_param(p).float().cpu() for n, p in named})
    engine.destroy()
    return out


def max_diff(a: dict, b: dict) -> dict:
    """Largest |a - b| relative to max |b|, over every tensor of every step, per quantity."""
    res = {}
    for key in ("grads", "weights"):
        worst = 0.0
        for sa, sb in zip(a[key], b[key]):
            for n in sb:
                scale = sb[n].abs().max().clamp_min(1e-30)
                worst = max(worst, float((sa[n] - sb[n]).abs().max() / scale))
        res[key] = worst
    res["norms"] = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a["norms"], b["norms"]))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--accum-freq", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16"], help="on the GPU (CPU runs fp32)")
    a = ap.parse_args(argv)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29535", "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("LOCAL_RANK", "0")
    dev = torch.device(a.device)
    cfg = V.BENCH_CFG if a.model == "bench" else get_model_config(a.model)
    batches = G.make_batches(cfg, a.batch, a.steps * a.accum_freq, dev)
    ds1, ds2, ours = (run(cfg, batches, a.accum_freq, dev, local, a.precision) for local in (False, False, True))
    assert ours["local_flush"] and not ds1["local_flush"], "the flat flush was not (or always) installed"
    noise, diff = max_diff(ds2, ds1), max_diff(ours, ds1)
    print(
        f"{a.model}, {dev.type} {a.precision}, micro-batch {a.batch} x K {a.accum_freq}, {a.steps} steps, "
        "ZeRO-2, clipping 1.0"
    )
    print(
        "norms DeepSpeed flush:", [f"{x:.6g}" for x in ds1["norms"]], "flat flush:", [f"{x:.6g}" for x in ours["norms"]]
    )
    ok = True
    for key in ("grads", "norms", "weights"):
        within = diff[key] <= max(noise[key], 0.0) * 1.5 or diff[key] == 0.0
        ok &= within
        print(
            f"{key}: flat vs DeepSpeed max rel diff {diff[key]:.3g}; DeepSpeed vs itself {noise[key]:.3g} -> "
            f"{'bitwise' if diff[key] == 0 else 'within spread' if within else 'OUTSIDE spread'}"
        )
    print("flat flush check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
