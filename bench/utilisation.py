"""Utilisation against the machine's limit: measured GEMM peak, model FLOPs, MFU of dsclip and OpenCLIP.

1. Peak: sustained matmul rate of this machine (fp32 and bf16, all threads torch uses) at the GEMM
   shapes a ViT block runs (qkv, attention projection, MLP up/down for the model's width, B·T rows);
   the best shape's rate is "peak". On a GPU (``--device cuda``) the same with the GPU's bf16 GEMM.
2. Model FLOPs per training sample: ``torch.utils.flop_counter.FlopCounterMode`` over one forward of
   the model (math SDPA: the counter has no formula for the CPU flash kernel), times 3 (forward +
   backward), the MFU convention.
3. MFU = achieved model FLOP/s / peak, where achieved = samples/s of a real training step × FLOPs
   per sample, for dsclip (``build_engine`` + ``GradCacheStep``, ZeRO-2, as ``dsclip train`` runs it)
   and OpenCLIP in the same run, alternated: world 1 = ``open_clip_train.train.train_one_epoch``
   (bench/vs_openclip.py), world 2 = OpenCLIP's algorithm under DDP with --local-loss
   --gather-with-grad (bench/accumulation.py; open_clip_train itself cannot start 2 CPU processes).
   Each process has 1 thread; peak is the whole machine's (both cores), so world 2 can reach 100 %.
   ``--interleave``: instead of one fresh run per trainer and round, every trainer is built in the same
   rank processes and they take turns of ``--steps`` steps (``--rounds`` turns each, the order rotating):
   dsclip; ``open_clip_train.train.train_one_epoch`` with OpenCLIP's own model, in DDP at world 2 (the
   real trainer at both worlds); OpenCLIP's algorithm on dsclip's model (what separates the engine from
   the model). On a machine whose speed drifts between runs (this one: the same run 104 and 151 CPU-ms
   per step a minute apart) a turn is compared with the turns next to it, and the turn-by-turn ratios
   are printed with their spread.
4. Per-phase breakdown of one dsclip step (world 1): CPU time in the engine's forward, the loss,
   backward, the coalesced gradient reduction, the optimizer step, and the rest (host syncs, Python).

On CPU the machine is shared, so besides the all-threads sustained rate (``peak``) the script measures
one core's peak as the fastest single GEMM call with one thread (``fp32_core``) and reports MFU per
CPU-second (samples per CPU-second of a rank x FLOPs / one core's peak) next to the wall-clock MFU
(global samples/s x FLOPs / (ranks x one core's peak)).

    flock /tmp/dsclip-bench.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/utilisation.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accumulation as A  # noqa: E402
import harness as H  # noqa: E402
import vs_openclip as V  # noqa: E402

from dsclip.model import get_model_config  # noqa: E402


def vit_gemm_shapes(cfg: dict, rows: int) -> list[tuple[int, int, int]]:
    w = cfg["vision_cfg"]["width"]
    hidden = int(w * cfg["vision_cfg"].get("mlp_ratio", 4.0))
    return [(rows, w, 3 * w), (rows, w, w), (rows, w, hidden), (rows, hidden, w)]


def gemm_peak(shapes, dtype, device, seconds: float = 1.0) -> dict:
    """Best sustained rate over ``shapes`` (TFLOP/s), and each shape's."""
    per = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        H.sync(device)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            reps += 1
            if device.type == "cuda" and reps % 50:
                continue
            H.sync(device)
        H.sync(device)
        per[f"{m}x{k}x{n}"] = 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e12
    return {"peak": max(per.values()), "shapes": per}


def gemm_core_peak(shapes, dtype, reps: int = 40) -> dict:
    """One core's peak (TFLOP/s) at ``shapes``: one thread, each GEMM timed alone, the fastest call kept.

    Why the fastest and not the average: six engineers share this machine's two cores, so an average
    over a second measures the machine's load, not its arithmetic; the fastest call is what the core
    does while this process has it. MFU against it uses the process's CPU time, not wall time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per = {}
        for m, k, n in shapes:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            for _ in range(3):
                a @ b
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
            per[f"{m}x{k}x{n}"] = 2 * m * k * n / best / 1e12
        return {"peak": max(per.values()), "shapes": per}
    finally:
        torch.set_num_threads(threads)


def _phases_rank(rank, world, cfg, batch, steps):
    """Per-phase wall time of dsclip steps: wrap the engine's forward/backward/step, the loss, the flush."""
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    H.one_thread()
    engine, _, _ = H.dsclip_engine("fp32", batch, 1, cfg, world)
    acc = {"forward": 0.0, "loss (fwd+bwd)": 0.0, "backward": 0.0, "gradient reduction": 0.0, "optimizer step": 0.0}

    clock = time.process_time  # CPU seconds of this (one-thread) rank: the machine's load stays out

    def timed(name, fn):
        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += clock() - t

        return wrapper

    loss = build_loss("infonce")
    step_fn = GradCacheStep(engine, timed("loss (fwd+bwd)", lambda *a: loss(*a)))
    data = H.synthetic_batches(steps + 1, batch, cfg, seed=3)
    engine.train()
    step_fn(data[:1])  # warm-up
    engine.forward = timed("forward", engine.forward)
    engine.backward = timed("backward", engine.backward)
    engine.step = timed("optimizer step", engine.step)
    flush = engine._flush_coalesced_reduction_zero12
    engine._flush_coalesced_reduction_zero12 = timed("gradient reduction", flush)
    for k in acc:
        acc[k] = 0.0
    t0 = clock()
    for i in range(steps):
        step_fn(data[1 + i : 2 + i], grad_norm=False)  # a step between logging steps, as `dsclip train` runs most
    total = clock() - t0
    # the loss's autograd.grad runs inside the loss wrapper's caller, not in it: attribute it separately
    acc["other (loss backward, host syncs, Python)"] = total - sum(acc.values())
    return {"total_s": total / steps, **{k: v / steps for k, v in acc.items()}}


# The trainers --interleave runs in the same processes (names as the table prints them)
INTERLEAVED = ("dsclip", "open_clip_train", "OpenCLIP algorithm on dsclip's model")


def _interleaved_rank(rank, world, cfg, batch, warmup, blocks, block_steps, names):
    """Every trainer in ``names`` built in this rank's process, then run in turns of ``block_steps`` steps
    (the order rotating each block), all ranks starting each turn together: each trainer's turn b and the
    others' turn b see the same state of the machine, to within a block's time. Returns, per trainer, each
    turn's (wall seconds, CPU seconds of this process)."""
    import torch.distributed as dist

    H.one_thread()
    runs = {}
    for name in names:
        if name == "dsclip":
            runs[name] = H.dsclip_trainer(rank, world, "fp32", batch, cfg)
        elif name == "open_clip_train":
            runs[name] = (lambda epoch: lambda data, n0: epoch(data))(
                V.openclip_trainer("fp32", batch, cfg, rank=rank, world=world)
            )
        elif name == INTERLEAVED[2]:
            runs[name] = (lambda run: lambda data, n0: run(data))(A.openclip_style_trainer(rank, world, batch, 1, cfg))
        else:
            raise ValueError(f"unknown trainer {name!r}; choose from {INTERLEAVED}")
    for run in runs.values():
        run(H.synthetic_batches(warmup, batch, cfg, seed=1 + 100 * rank), 0)
    out = {name: [] for name in names}
    for b in range(blocks):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            data = H.synthetic_batches(block_steps, batch, cfg, seed=2 + 100 * rank + 1000 * b)
            if world > 1:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            runs[name](data, warmup + b * block_steps)
            out[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def interleaved(spec: dict, cfg: dict) -> dict[str, list[dict]]:
    """Per trainer, per turn: samples/s (global, the slowest rank's wall time) and samples per CPU-second
    (the slowest rank's), the fields H.alternate's runs have."""
    from dsclip.testing.gloo_world import run_world

    world, n = spec["world"], spec["block_steps"] * spec["batch"]
    per_rank = run_world(
        _interleaved_rank, world, cfg, spec["batch"], spec["warmup"], spec["blocks"], spec["block_steps"],
        spec["trainers"], timeout=7200,
    )  # fmt: skip
    out = {}
    for name in spec["trainers"]:
        turns = zip(*(r[name] for r in per_rank))  # per turn: each rank's (wall, cpu)
        out[name] = [
            {"samples_per_s": n * world / max(w for w, _ in t), "samples_per_cpu_s": n / max(c for _, c in t)}
            for t in turns
        ]
    return out


def _worker(spec: dict) -> dict:
    kind = spec.pop("kind")
    cfg = get_model_config(spec.pop("model"))
    if kind == "dsclip":
        return H.dsclip_worker("fp32", spec["batch"], spec["warmup"], spec["steps"], cfg, spec["world"])
    if kind == "openclip" and spec["world"] == 1:
        return V.openclip_worker("fp32", spec["batch"], spec["warmup"], spec["steps"], cfg)
    if kind == "openclip":
        return A.openclip_style_worker(spec["batch"], 1, spec["warmup"], spec["steps"], cfg, world=spec["world"])
    if kind == "interleaved":
        return interleaved(spec, cfg)
    if kind == "phases":
        from dsclip.testing.gloo_world import run_world

        return run_world(_phases_rank, 1, cfg, spec["batch"], spec["steps"])[0]
    raise ValueError(kind)


def run_worker(spec: dict) -> dict:
    return H.run_worker(spec, __file__, timeout=7200)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    H.common_args(ap, worker=True, batch=16, warmup=1, steps=3, rounds=2)
    ap.add_argument("--models", default="demo,ViT-B-32")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="run the trainers in the same processes, taking turns of --steps steps (--rounds turns each), "
        "instead of one fresh run per trainer and round: on a machine whose speed drifts between runs, each "
        "turn is compared with the other trainers' turns next to it",
    )
    ap.add_argument("--trainers", default=",".join(INTERLEAVED), help="with --interleave; dsclip first")
    ap.add_argument("--device", default="cpu", help="cpu: all of the above; cuda: peak bf16 GEMM and FLOPs only")
    a = ap.parse_args(argv)
    if a.worker:
        H.emit_result(_worker(json.loads(a.worker)))
        return 0
    print(H.preamble(__file__, a.device), flush=True)
    device = torch.device(a.device)
    report: dict = {"device": a.device, "threads": torch.get_num_threads(), "models": {}}
    for name in a.models.split(","):
        cfg = get_model_config(name)
        tokens = (cfg["vision_cfg"]["image_size"] // cfg["vision_cfg"]["patch_size"]) ** 2 + 1
        rows = a.batch * tokens if a.device == "cpu" else 32768
        shapes = vit_gemm_shapes(cfg, rows)
        peaks = {"fp32": gemm_peak(shapes, torch.float32, device), "bf16": gemm_peak(shapes, torch.bfloat16, device)}
        if a.device == "cpu":
            peaks["fp32_core"] = gemm_core_peak(shapes, torch.float32)
            peaks["bf16_core"] = gemm_core_peak(shapes, torch.bfloat16)
        flops = H.train_flops_per_sample(cfg)
        m = report["models"][name] = {"peak_tflops": peaks, "train_gflop_per_sample": flops / 1e9}
        print(
            f"== {name}: peak fp32 {peaks['fp32']['peak']:.3f} / bf16 {peaks['bf16']['peak']:.3f} TFLOP/s "
            f"({rows} rows); {flops / 1e9:.2f} GFLOP per training sample",
            flush=True,
        )
        if a.device != "cpu":
            continue
        print(
            f"   one core's best call: fp32 {peaks['fp32_core']['peak']:.3f} / bf16 {peaks['bf16_core']['peak']:.3f} "
            "TFLOP/s",
            flush=True,
        )
        common = {"model": name, "batch": a.batch, "warmup": a.warmup, "steps": a.steps}
        worlds = [int(x) for x in a.worlds.split(",")]
        if a.interleave:
            trainers = a.trainers.split(",")
            res, m["turn_ratios"] = {}, {}
            for w in worlds:
                spec = {"kind": "interleaved", "model": name, "world": w, "batch": a.batch, "warmup": a.warmup,
                        "blocks": a.rounds, "block_steps": a.steps, "trainers": trainers}  # fmt: skip
                turns = run_worker(spec)
                for trainer, runs in turns.items():
                    res[f"{trainer} world {w}"] = runs
                for trainer in trainers[1:]:  # dsclip's turn b against the other trainer's turn b
                    m["turn_ratios"][f"{trainer} world {w}"] = {
                        key: sorted(d[key] / o[key] for d, o in zip(turns[trainers[0]], turns[trainer]))
                        for key in ("samples_per_cpu_s", "samples_per_s")
                    }
        else:
            specs = {}
            for w in worlds:
                specs[f"dsclip world {w}"] = {"kind": "dsclip", "world": w, **common}
                specs[f"openclip world {w}"] = {"kind": "openclip", "world": w, **common}
            res = H.alternate(specs, a.rounds, run_worker)
        core = peaks["fp32_core"]["peak"] * 1e12
        m["mfu"], m["runs"] = {}, res
        for n, runs in res.items():
            w = int(n.rsplit(" world ", 1)[1])
            # per CPU-second: each rank's samples per CPU-second x FLOPs / one core's peak
            cpu = sorted(r["samples_per_cpu_s"] * flops / core for r in runs)
            # wall: global samples/s x FLOPs / the peak of the `w` cores the ranks ran on
            wall = sorted(r["samples_per_s"] * flops / (w * core) for r in runs)
            m["mfu"][n] = {
                "median": statistics.median(cpu), "min": cpu[0], "max": cpu[-1],
                "wall_median": statistics.median(wall), "wall_min": wall[0], "wall_max": wall[-1],
                "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
                "samples_per_cpu_s": statistics.median(r["samples_per_cpu_s"] for r in runs),
            }  # fmt: skip
        m["phases"] = run_worker({"kind": "phases", "model": name, "batch": a.batch, "steps": a.steps})
    # the last column's denominator: open_clip_train itself where it ran
    baseline = (
        "openclip"
        if not a.interleave
        else "open_clip_train"
        if "open_clip_train" in a.trainers
        else a.trainers.split(",")[-1]
    )
    print(
        "\n| model | world | trainer | samples/s (median) | samples/CPU-s per rank | MFU per CPU-second (median, "
        "min-max) | MFU wall (median, min-max) | dsclip / OpenCLIP (CPU / wall) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, m in report["models"].items():
        for n, v in m.get("mfu", {}).items():
            trainer, w = n.rsplit(" world ", 1)
            base = m["mfu"][f"{baseline} world {w}"]
            print(
                f"| {name} | {w} | {trainer} | {v['samples_per_s']:.1f} | {v['samples_per_cpu_s']:.1f} | "
                f"{100 * v['median']:.1f}% ({100 * v['min']:.1f}-{100 * v['max']:.1f}%) | "
                f"{100 * v['wall_median']:.1f}% ({100 * v['wall_min']:.1f}-{100 * v['wall_max']:.1f}%) | "
                f"{v['median'] / base['median']:.2f}× / {v['wall_median'] / base['wall_median']:.2f}× |"
            )
    for name, m in report["models"].items():
        for n, r in m.get("turn_ratios", {}).items():
            trainer, w = n.rsplit(" world ", 1)
            cpu, wall = r["samples_per_cpu_s"], r["samples_per_s"]
            print(
                f"{name} world {w}, dsclip / {trainer}, turn by turn ({len(cpu)} turns of {a.steps} steps): per "
                f"CPU-second {statistics.median(cpu):.3f}x ({cpu[0]:.3f}-{cpu[-1]:.3f}), wall "
                f"{statistics.median(wall):.3f}x ({wall[0]:.3f}-{wall[-1]:.3f})"
            )
    for name, m in report["models"].items():
        if "phases" in m:
            ph = m["phases"]
            print(f"\n{name}, one dsclip step at world 1 (micro-batch {a.batch}): {ph['total_s']:.3f} CPU-s")
            for k, v in ph.items():
                if k != "total_s":
                    print(f"  {k:<44} {v:8.3f} s  {100 * v / ph['total_s']:5.1f}%")
    H.write_json(a.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
