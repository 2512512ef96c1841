"""AdamW step time on the CPU: DeepSpeed's DeepSpeedCPUAdam (what dsclip uses under offload_optimizer)
vs torch.optim.AdamW (what it handed ZeRO-Offload before), on real CLIP parameter sets.

The parameters have the shapes of ``dsclip.model.create_model(NAME)`` (built on the meta device, then
materialised as fp32 tensors), split into dsclip's two weight-decay groups; every optimizer gets the same
weights and gradients. This is the step ZeRO-Offload runs on the host for its fp32 master partition
(ZeRO-2/3 hand the optimizer flat partitions; the per-tensor layout here is the harder case for torch's
per-tensor loop, the flat one the same arithmetic). Methods are alternated within each round.

  dsclip_fused     dsclip.engine.optim.FusedAdamW: torch's fused AdamW kernel (what dsclip runs without offload)
  ds_cpu_adam      deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True) (vectorised C++, OpenMP)
  torch_adamw      torch.optim.AdamW defaults on CPU (per-tensor loop, foreach off on CPU tensors)
  torch_foreach    torch.optim.AdamW(foreach=True) (multi-tensor kernels)

    flock /tmp/dsclip-bench.lock env OMP_NUM_THREADS=2 .venv/bin/python bench/optimizer_step.py
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsclip.engine.optim import FusedAdamW, param_groups  # noqa: E402
from dsclip.model import create_model  # noqa: E402

METHODS = ("dsclip_fused", "ds_cpu_adam", "torch_adamw", "torch_foreach")


def parameter_set(name: str, flat: bool = False):
    """(groups of real fp32 tensors with grads, parameter count) for the architecture ``name``; ``flat``:
    each group as ONE tensor, the layout ZeRO-1/2 hand the optimizer (its flat fp32 partition)."""
    with torch.device("meta"):
        model = create_model(name)
    g = torch.Generator().manual_seed(0)
    real = {}
    for n, p in model.named_parameters():
        t = torch.empty(p.shape).normal_(0, 0.02, generator=g)
        t.grad = torch.empty(p.shape).normal_(0, 1e-3, generator=g)
        real[n] = torch.nn.Parameter(t)
        real[n].grad = t.grad
    ids = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {"params": [real[ids[id(p)]] for p in grp["params"]], "weight_decay": grp["weight_decay"]}
        for grp in param_groups(model, 0.2)
    ]
    if flat:
        for grp in groups:
            w = torch.nn.Parameter(torch.cat([p.detach().view(-1) for p in grp["params"]]))
            w.grad = torch.cat([p.grad.view(-1) for p in grp["params"]])
            grp["params"] = [w]
    return groups, sum(t.numel() for t in real.values())


def make_optimizer(method: str, groups):
    # fresh group dicts: torch's add_param_group writes the optimizer's defaults (fused, foreach, ...) into
    # the dicts it is given, so shared dicts would hand the first method's kernel choice to the others
    groups = [dict(g) for g in groups]
    kw = dict(lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
    if method == "ds_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
    if method == "dsclip_fused":
        return FusedAdamW(groups, **kw)
    return torch.optim.AdamW(groups, foreach=method == "torch_foreach", **kw)


def time_steps(opt, steps: int) -> list[float]:
    for _ in range(2):  # state allocation and first-touch page faults of exp_avg/exp_avg_sq: not timed
        opt.step()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="ViT-B-32,ViT-L-14")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per measurement (after two untimed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flat", action="store_true", help="one tensor per group (ZeRO's flat partition)")
    args = ap.parse_args()
    print(f"threads: torch {torch.get_num_threads()}", flush=True)
    rows = []
    for name in args.models.split(","):
        groups, n = parameter_set(name, args.flat)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for r in range(args.rounds):
            order = METHODS if r % 2 == 0 else METHODS[::-1]  # alternate: load drifts hit both sides
            for m in order:
                opt = make_optimizer(m, groups)
                times[m] += time_steps(opt, args.steps)
                del opt  # free the 2×N fp32 states before the next method allocates its own
                gc.collect()
        ref = statistics.median(times["torch_adamw"])
        for m in METHODS:
            t = times[m]
            rows.append((name, n, m, min(t), statistics.median(t), max(t), ref / statistics.median(t)))
            print(f"{name} {m}: median {statistics.median(t):.3f}s (min {min(t):.3f}, max {max(t):.3f})", flush=True)
        del groups
        gc.collect()
    print("\n| model | parameters | optimizer | step s (median, min-max) | speed-up vs torch AdamW |")
    print("|---|---:|---|---:|---:|")
    for name, n, m, lo, med, hi, ratio in rows:
        print(f"| {name} | {n / 1e6:.0f} M | {m} | {med:.3f} ({lo:.3f}-{hi:.3f}) | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
