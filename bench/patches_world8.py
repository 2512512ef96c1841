"""Every engine patch earns its default: its host-time gain at world 8, rank 0 of the job (issue 53).

Each configuration runs in a process of its own as rank 0 of a world-8 job under torch's fake process group
(dsclip/engine/fake_world.py: DeepSpeed's partition and bucket sizes, the 1/8 optimizer shard and every
hook and bookkeeping step of a world-8 rank; collectives return at once and move nothing, so the numbers a
step computes are meaningless and only its host time is measured). Per patch: all patches on against all
but that one (``--engine-patches all,-NAME``), the two alternated over rounds (ABAB, a fresh process each
time), CPU milliseconds per step (``time.process_time``), median over the timed steps of every round.

Models, as the patches' stages are used: ZeRO-3 (the zero3_* patches) on a thin model with ViT-H-14's
tensor count (bench/zero3_host.py's, ZeRO-3 being for big models), ZeRO-2 (grad_hooks, grad_norm,
overflow_check) on a thin ViT-B-32 (width 64); bf16, the gradient cache at K = 2, micro-batch 8.
``local_flush`` applies at one rank only, so it is measured at world 1 (its configuration: ZeRO-2 on one
GPU) and said so. A patch stays in the default set with a gain of at least 3 % of the step
(dsclip/engine/patches/__init__.py, OPT_IN).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/patches_world8.py --rounds 2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (and the repository root on the path)

from dsclip.engine.patches import PATCHES  # noqa: E402

# every registered patch, from the seam's registry (a new patch is measured without editing this file)
ZERO3 = tuple(p.name for p in PATCHES if p.stages == (3,))
ZERO2 = tuple(p.name for p in PATCHES if p.stages == (1, 2) and p.name != "local_flush")  # world 1 only: apart
THRESHOLD = 0.03  # of the all-on step


def configurations(world: int) -> dict[str, dict]:
    """name -> worker spec. ``base`` rows are all patches on (all on the ``all,+...`` set: opt-in ones too)."""
    from dsclip.engine.patches import NAMES

    everything = "none," + ",".join(NAMES)  # opt-in patches included: each is measured against the same base
    specs = {
        "zero3 all": {"stage": 3, "world": world, "patches": everything},
        "zero2 all": {"stage": 2, "world": world, "patches": everything},
        "zero2 all, world 1": {"stage": 2, "world": 1, "patches": everything},
        "zero2 -local_flush, world 1": {"stage": 2, "world": 1, "patches": everything + ",-local_flush"},
    }
    for name in ZERO3:
        specs[f"zero3 -{name}"] = {"stage": 3, "world": world, "patches": f"{everything},-{name}"}
    for name in ZERO2:
        specs[f"zero2 -{name}"] = {"stage": 2, "world": world, "patches": f"{everything},-{name}"}
    return specs


def worker(spec: dict) -> dict:
    import torch
    from zero3_host import THIN_PERSIST, thin_config

    from dsclip.engine.build import autocast_dtype
    from dsclip.engine.fake_world import fake_world
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep
    from dsclip.train.loop import step_seed

    H.one_thread()
    stage, k, batch = spec["stage"], spec["k"], spec["batch"]
    cfg = thin_config("H") if stage == 3 else H.thin_config("ViT-B-32", width=64, image_size=64, context_length=32)
    extra = {"deepspeed_config": f"ds_configs/zero{stage}_bf16.json", "engine_patches": spec["patches"]}
    overrides = {"zero_optimization": THIN_PERSIST} if stage == 3 else {}
    with fake_world(spec["world"]):
        engine, bundle, _ = H.dsclip_engine("bf16", batch, k, cfg, spec["world"], extra, overrides)
        step_fn = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle), accum_freq=k)
        engine.train()
        data = H.synthetic_batches(2 * k, batch, cfg, seed=1)
        times = []
        for n in range(spec["warmup"] + spec["steps"]):
            torch.manual_seed(step_seed(0, n, 0))
            c0 = time.process_time()
            step_fn(data[(n % 2) * k : (n % 2 + 1) * k], grad_norm=False)  # between logged steps, as most are
            if n >= spec["warmup"]:
                times.append(time.process_time() - c0)
        return {"ms": [1000 * t for t in times], "active": list(bundle.patches.active)}


def run_one(spec: dict) -> dict:
    return H.run_worker(spec, __file__, timeout=900)


def base_and_without(patch: str) -> tuple[str, str]:
    if patch == "local_flush":
        return "zero2 all, world 1", "zero2 -local_flush, world 1"
    stage = "zero3" if patch in ZERO3 else "zero2"
    return f"{stage} all", f"{stage} -{patch}"


def paired(specs: dict[str, dict], patches: list[str], rounds: int) -> int:
    t0 = time.time()
    rows = []
    for p in patches:
        base, without = base_and_without(p)
        ratios, on_ms, off_ms = [], [], []
        for r in range(rounds):
            order = (base, without) if r % 2 == 0 else (without, base)
            got = {n: statistics.median(run_one(specs[n])["ms"]) for n in order}
            ratios.append(got[without] / got[base])
            on_ms.append(got[base])
            off_ms.append(got[without])
            print(f"{p} pair {r + 1}: all on {got[base]:.1f} ms, without {got[without]:.1f} ms", flush=True)
        rows.append((p, specs[base]["world"], on_ms, off_ms, statistics.median(ratios) - 1))
    print(f"\n{len(patches)} patches x {rounds} pairs in {time.time() - t0:.0f} s")
    print("\n| patch | world | all on, ms per pair | all but it, ms per pair | gain (median of the pairs) | default? |")
    print("|---|---:|---|---|---:|---|")
    for p, world, on, off, gain in rows:
        print(
            f"| `{p}` | {world} | {', '.join(f'{x:.0f}' for x in on)} | {', '.join(f'{x:.0f}' for x in off)} | "
            f"{100 * gain:+.1f} % | {'yes' if gain >= THRESHOLD else 'opt-in'} |"
        )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    H.common_args(ap, json_out=False, worker=True, rounds=2, steps=6, warmup=2, batch=8)
    ap.add_argument("--k", type=int, default=2, help="micro-batches per step (the gradient cache)")
    ap.add_argument("--only", default="", help="comma list of configuration names (default: all)")
    ap.add_argument(
        "--paired",
        default="",
        help="comma list of patches: for each, all-on and all-but-it run back to back, the order swapped every "
        "repetition (--rounds of them); the gain is the median of the pairs' ratios (load drift cancels)",
    )
    a = ap.parse_args(argv)
    if a.worker:
        H.emit_result(worker(json.loads(a.worker)))
        return 0
    print(H.preamble(__file__), flush=True)
    specs = configurations(a.world)
    for s in specs.values():
        s.update(k=a.k, batch=a.batch, steps=a.steps, warmup=a.warmup)
    if a.paired:
        return paired(specs, a.paired.split(","), a.rounds)
    if a.only:
        specs = {n: specs[n] for n in a.only.split(",")}
    names = list(specs)
    ms: dict[str, list[float]] = {n: [] for n in names}
    active: dict[str, list[str]] = {}
    t0 = time.time()
    for r in range(a.rounds):  # each round every configuration once, the order reversed every other round
        for n in names if r % 2 == 0 else names[::-1]:
            res = run_one(specs[n])
            ms[n] += res["ms"]
            active[n] = res["active"]
            print(f"round {r + 1} {n}: {statistics.median(res['ms']):.1f} ms", flush=True)
    print(f"\n{len(names)} configurations x {a.rounds} rounds in {time.time() - t0:.0f} s")
    print("\n| configuration | world | host ms per step (median) | patches active |\n|---|---:|---:|---|")
    for n in names:
        print(f"| {n} | {specs[n]['world']} | {statistics.median(ms[n]):.1f} | {', '.join(active[n]) or 'none'} |")
    print("\n| patch | world | all on | all but it | gain (% of the all-on step) | default? |")
    print("|---|---:|---:|---:|---:|---|")
    rows = [(p, "zero3 all", f"zero3 -{p}") for p in ZERO3] + [(p, "zero2 all", f"zero2 -{p}") for p in ZERO2]
    rows.append(("local_flush", "zero2 all, world 1", "zero2 -local_flush, world 1"))
    for p, base, without in rows:
        if base not in ms or without not in ms:
            continue
        on, off = statistics.median(ms[base]), statistics.median(ms[without])
        gain = (off - on) / on
        print(
            f"| `{p}` | {specs[base]['world']} | {on:.1f} | {off:.1f} | {100 * gain:+.1f} % | "
            f"{'yes' if gain >= THRESHOLD else 'opt-in'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
