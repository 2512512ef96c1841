"""What ZeRO-3 keeps gathered from the forward to the backward, with DeepSpeed's linear and with torch's.

DeepSpeed's zero.Init replaces ``F.linear`` with its autograd linear (``memory_efficient_linear: true``, its
default), which saves the parameter itself for the backward, so a gathered weight that ZeRO-3 releases after
the forward is freed. torch's ``F.linear`` (the shipped ``memory_efficient_linear: false``) saves a view of the
weight, which keeps the released gathered copy alive until its backward. This bench measures both on two CPU
ranks (ZeRO-3 gathers real copies only at world > 1): ViT-B-16's towers (150 M parameters, 142 M of them in
matrices ZeRO-3 partitions) on 32-pixel images and 8-token texts, so activations are small and what is
resident after the forward is mostly weights. Per rank, one timed step after two untimed ones:

* ``available_mb``: the partitioned parameters ZeRO-3 reports gathered when the forward returns;
* ``after_forward_mb``: the resident set's growth over the forward (``/proc/self/statm``, glibc told to
  return large blocks: ``MALLOC_MMAP_THRESHOLD_``);
* ``fwd_bwd_peak_mb``: the high-water mark over forward + backward, above the resident set before it.

The shipped prefetch settings re-gather the whole of this model for its backward before the forward ends, so
both linears hold everything there; the second half of the table runs with ``stage3_prefetch_bucket_size: 0``
and ``stage3_max_reuse_distance: 0``, which make ZeRO-3 release every weight after its forward, as a model
larger than the prefetch window sees for its early blocks.

    MALLOC_MMAP_THRESHOLD_=131072 PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/zero3_held_weights.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (and the repository root on the path)

MB = 2**20


def _rank(rank, world, linear_off: bool, ckpt: bool, release_all: bool) -> dict:
    import torch

    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.model import get_model_config
    from dsclip.train.gradcache import GradCacheStep

    H.one_thread()
    cfg = get_model_config("ViT-B-16")
    cfg["vision_cfg"].update(image_size=32)
    cfg["text_cfg"].update(context_length=8)
    zero = {"memory_efficient_linear": not linear_off}
    if release_all:
        zero |= {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
    engine, bundle, _ = H.dsclip_engine(
        "bf16", 2, 1, cfg, world, {"deepspeed_config": "ds_configs/zero3_bf16.json"}, {"zero_optimization": zero},
        grad_checkpointing=ckpt,
    )  # fmt: skip
    step = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle), accum_freq=1)
    partitioned = [p for p in engine.module.parameters() if not p.ds_persist]
    out = {"partitioned_mb": sum(p.ds_numel for p in partitioned) * 2 / MB}
    forward, backward = engine.forward, engine.backward

    def timed_forward(*args, **kwargs):
        out["base"] = H.rss_mb()
        H.reset_peak_rss()
        result = forward(*args, **kwargs)
        out["after_forward_mb"] = H.rss_mb() - out["base"]
        gathered = [p for p in partitioned if p.ds_status.name != "NOT_AVAILABLE"]
        out["available_mb"] = sum(p.ds_numel for p in gathered) * 2 / MB
        return result

    def timed_backward(*args, **kwargs):
        result = backward(*args, **kwargs)
        out["fwd_bwd_peak_mb"] = H.peak_rss_mb() - out["base"]
        return result

    engine.forward, engine.backward = timed_forward, timed_backward
    for img, txt in H.synthetic_batches(3, 2, cfg, seed=1 + rank):
        step([(img, txt)], grad_norm=False)
    out["linear"] = torch.nn.functional.linear.__name__
    out.pop("base")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args(argv)
    from dsclip.testing.gloo_world import run_world

    print(H.preamble(__file__), flush=True)
    print(
        f"ZeRO-3 bf16, ViT-B-16 towers (32 px, 8 tokens, micro-batch 2), world {a.world}, MB per rank (rank 0)\n\n"
        "| linear | checkpointing | ZeRO-3 releases | gathered after forward | RSS growth over forward "
        "| peak over forward + backward |\n|---|---|---|---:|---:|---:|"
    )
    for release_all in (False, True):
        for ckpt in (False, True):
            for linear_off in (False, True):
                r = run_world(_rank, a.world, linear_off, ckpt, release_all)[0]
                print(
                    f"| {'torch (shipped)' if linear_off else 'DeepSpeed'} ({r['linear']}) | {'on' if ckpt else 'off'} "
                    f"| {'every weight after its forward' if release_all else 'shipped prefetch'} "
                    f"| {r['available_mb']:.0f} of {r['partitioned_mb']:.0f} | {r['after_forward_mb']:.0f} "
                    f"| {r['fwd_bwd_peak_mb']:.0f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
