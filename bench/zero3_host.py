"""ZeRO-3's host time per step against ZeRO-2's, and what each of DeepSpeed's own knobs buys (issue #29).

Host-side cost only, as the brief asks of CPU measurements: a thin model with the real model's tensor count
(ViT-H-14's 32 + 24 blocks or ViT-bigG-14's 48 + 32, width 32, so the arithmetic is negligible and a step is
the engine's per-tensor bookkeeping, the part a GPU waits for). One process builds one engine per variant
(ZeRO-2, the shipped ZeRO-3 JSON with and without dsclip's engine patches, the stock ZeRO-3 JSON, and
single-knob changes of it) and steps them in
turn, the order rotated every step; CPU seconds per step (``time.process_time``), median over the steps,
split into the engine's phases by timing ``engine.forward`` / ``engine.backward`` / ``engine.step`` (what is
left, "other", is mostly ZeRO-3's partitioned-gradient reduction when the coalesced backward ends).

The thin model's matrices are 32 × 32 (1 k elements) where ViT-H's are 1280 × 1280: every ZeRO-3 variant
below therefore gets ``stage3_param_persistence_threshold: 256``, so that matrices are gathered and vectors
(biases, norms) stay resident, as the shipped 1e5 threshold does for the real model ("persist-all" instead
keeps everything resident: ZeRO-3's bookkeeping without any gather).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/zero3_host.py --depth H --steps 4
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/zero3_host.py --depth H --world 2 \
        --variants "zero2,zero3,zero3 patches-off"   # two ranks over gloo: ZeRO-3 as a cluster runs it
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/zero3_host.py --depth H --gradcache   # item 4
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/zero3_host.py --depth H --profile zero3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (and the repository root on the path)

DEPTHS = {"H": "ViT-H-14", "bigG": "ViT-bigG-14"}
THIN_PERSIST = {"stage3_param_persistence_threshold": 256}
NO_LEAF = {"leaf_module": {"classes": []}}
LINEAR_ON = {"memory_efficient_linear": True}  # DeepSpeed's default: its autograd linear in place of F.linear
STOCK = NO_LEAF | LINEAR_ON  # DeepSpeed's defaults for what the shipped JSONs change
PATCHES_OFF = {"engine_patches": "none"}
NO_BLOCKS = {"engine_patches": "all,-zero3_blocks"}
EVERY_ZERO3 = "all,+zero3_step_views,+zero3_hook_fns"  # `all` and the opt-in ZeRO-3 patches (issue 53)
# name → (DeepSpeed JSON, zero_optimization overrides, run-config values). "zero3" is the shipped JSON (leaf
# modules, torch's linear) with dsclip's engine patches (the zero3_* ones: dsclip/engine/patches/), as `dsclip
# train` runs it.
VARIANTS = {
    "zero2": ("zero2_{p}", {}, {}),
    "zero3": ("zero3_{p}", THIN_PERSIST, {}),
    "zero3 patches-off": ("zero3_{p}", THIN_PERSIST, PATCHES_OFF),
    "zero3 every-patch": ("zero3_{p}", THIN_PERSIST, {"engine_patches": EVERY_ZERO3}),
    # each ZeRO-3 patch left out of every-patch alone: what it saves
    **{
        f"zero3 -{name}": ("zero3_{p}", THIN_PERSIST, {"engine_patches": f"{EVERY_ZERO3},-{name}"})
        for name in (
            "zero3_params",
            "zero3_gather",
            "zero3_norm",
            "zero3_step_views",
            "zero3_release",
            "zero3_hook_fns",
            "zero3_blocks",
            "zero3_forward_flags",
        )
    },
    "zero3 stock": ("zero3_{p}", THIN_PERSIST | STOCK, PATCHES_OFF),  # no leaves, DeepSpeed's linear, no patches
    "zero3 linear-on": ("zero3_{p}", THIN_PERSIST | LINEAR_ON, {}),
    "zero3 no-leaf": ("zero3_{p}", THIN_PERSIST | NO_LEAF, {}),
    "zero3 persist-all": ("zero3_{p}", NO_LEAF | {"stage3_param_persistence_threshold": 10**9}, {}),
    # the shipped JSON (leaf blocks) with every tensor resident: no gather, no release in the forward and
    # backward, so what is left over ZeRO-2 is ZeRO-3's per-module hooks and its gradient path. Both resident
    # rows keep DeepSpeed's hooks on the blocks (zero3_blocks off), as measured before that patch existed
    "zero3 resident": ("zero3_{p}", {"stage3_param_persistence_threshold": 10**9}, NO_BLOCKS),
    # a diagnostic bound, not a way to train: the same, with DeepSpeed's four per-module hooks taken off the
    # leaf blocks after the warm-up (STRIP_LEAF_HOOKS). With every tensor resident they fetch and release
    # nothing; the blocks' gradients are still reduced (DeepSpeed's full backward hook stays). What this
    # saves is what a leaner per-block path could at most save of the hooks' own cost.
    "zero3 resident -leaf-hooks": ("zero3_{p}", {"stage3_param_persistence_threshold": 10**9}, NO_BLOCKS),
    # every tensor resident with every patch on: at one rank a partition is the whole tensor, so this keeps
    # ZeRO-3's memory as it is and drops its fetches and releases (bench/results/zero3-local-flush_cpu2_2026-12-05.md)
    "zero3 resident-all": ("zero3_{p}", {"stage3_param_persistence_threshold": 10**9}, {}),
    "zero3 prefetch 0": ("zero3_{p}", THIN_PERSIST | {"stage3_prefetch_bucket_size": 0}, {}),
    "zero3 allreduce-fetch": ("zero3_{p}", THIN_PERSIST | {"stage3_use_all_reduce_for_fetch_params": True}, {}),
    "zero3 live 1e8": ("zero3_{p}", THIN_PERSIST | {"stage3_max_live_parameters": 10**8}, {}),
}
STRIP_LEAF_HOOKS = {"zero3 resident -leaf-hooks"}
# DeepSpeed's per-module ZeRO-3 hooks (parameter_offload.py, _register_deepspeed_module), by function name
ZERO3_MODULE_HOOKS = {
    "_pre_forward_module_hook",
    "_post_forward_module_hook",
    "_pre_backward_module_hook",
    "_post_backward_module_hook",
}
PHASES = ("forward", "backward", "step")
TORCH_LINEAR = None  # torch's F.linear, taken in each rank before any engine is built


def thin_config(depth: str) -> dict:
    return H.thin_config(DEPTHS[depth], width=32, image_size=28, context_length=16)


class PhaseClock:
    """CPU seconds spent inside ``engine.forward`` / ``backward`` / ``step`` (instance attributes wrap them)."""

    def __init__(self, engine):
        self.engine = engine
        self.spent = dict.fromkeys(PHASES, 0.0)
        for name in PHASES:
            setattr(engine, name, self._timed(name, getattr(engine, name)))

    def _timed(self, name, fn):
        def wrapper(*args, **kwargs):
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.process_time() - c0

        return wrapper

    def take(self) -> dict:
        out, self.spent = self.spent, dict.fromkeys(PHASES, 0.0)
        return out


def _trainer(rank, world, precision, batch, k, cfg, json_name, zero, values):
    import torch

    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep
    from dsclip.train.loop import step_seed

    extra = {"deepspeed_config": f"ds_configs/{json_name}.json", **values}
    # Each engine steps with the F.linear its own run would have. A ZeRO-3 engine whose JSON leaves
    # memory_efficient_linear at DeepSpeed's default has zero.Init replace torch's F.linear process-wide with
    # DeepSpeed's autograd linear, never put back; without this every engine built or stepped after it in this
    # process (ZeRO-2 too) ran DeepSpeed's linear: the rows before 2026-12-05 did.
    torch.nn.functional.linear = TORCH_LINEAR
    engine, bundle, _ = H.dsclip_engine(precision, batch, k, cfg, world, extra, {"zero_optimization": zero})
    own_linear, torch.nn.functional.linear = torch.nn.functional.linear, TORCH_LINEAR
    step_fn = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle), accum_freq=k)
    clock = PhaseClock(engine)
    engine.train()

    def run(chunk, n):
        torch.manual_seed(step_seed(0, n, rank))
        torch.nn.functional.linear = own_linear
        step_fn(chunk, grad_norm=False)  # between logged steps, as most are

    return run, clock


def _rank(rank, world, a, plan):
    """plan: name → (json, zero overrides, run-config values, micro-batch, K). Returns name → list of per-step
    phase dicts."""
    global TORCH_LINEAR
    import torch

    TORCH_LINEAR = torch.nn.functional.linear  # before any zero.Init
    H.one_thread()
    cfg = thin_config(a.depth)
    p = a.precision
    runs = {n: _trainer(rank, world, p, b, k, cfg, j.format(p=p), z, v) for n, (j, z, v, b, k) in plan.items()}
    rows = max(b * k for *_, b, k in plan.values())
    data = {}
    for b, k in {(b, k) for *_, b, k in plan.values()}:
        whole = H.synthetic_batches(2, rows, cfg, seed=1 + rank)  # the same rows for every split of the batch
        data[b, k] = [[(img[i * b : (i + 1) * b], txt[i * b : (i + 1) * b]) for i in range(k)] for img, txt in whole]
    for n, (run, clock) in runs.items():  # warm-up: optimizer states, allocator, ZeRO-3's trace
        *_, b, k = plan[n]
        for s in range(2):
            run(data[b, k][s], s)
        clock.take()
        if n in STRIP_LEAF_HOOKS:
            strip_leaf_hooks(clock.engine)
    if a.profile:
        run, clock = runs[a.profile]
        *_, b, k = plan[a.profile]
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        for s in range(a.steps):
            run(data[b, k][s % 2], 2 + s)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats(a.sort)
        stats.print_stats(a.lines)
        for name in a.callers_of:  # who calls it, and how often (e.g. get_rank: DeepSpeed's log guards)
            stats.print_callers(name)
        return out.getvalue()
    times = {n: [] for n in runs}
    names = list(runs)
    for s in range(a.steps):
        for n in names[s % len(names) :] + names[: s % len(names)]:
            run, clock = runs[n]
            *_, b, k = plan[n]
            c0 = time.process_time()
            run(data[b, k][s % 2], 2 + s)
            total = time.process_time() - c0
            phases = clock.take()
            times[n].append(phases | {"other": total - sum(phases.values()), "total": total})
    return times


def strip_leaf_hooks(engine) -> int:
    """Remove DeepSpeed's ZeRO-3 module hooks from the engine's leaf modules (the "-leaf-hooks" bound only)."""
    from deepspeed.utils import z3_leaf_module

    from dsclip.engine.fingerprint import unwrap

    leaves = [m for m in engine.module.modules() if z3_leaf_module(m)]
    removed = 0
    for module in leaves:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook_id, hook in list(hooks.items()):
                if getattr(unwrap(hook), "__name__", "") in ZERO3_MODULE_HOOKS:
                    del hooks[hook_id]
                    removed += 1
    if removed != 4 * len(leaves):
        raise RuntimeError(f"expected DeepSpeed's 4 hooks per leaf module, removed {removed}")
    return removed


def _plan(a) -> dict:
    if a.gradcache:
        # Item 4: the gradient cache's two passes (K = 2) against one forward + backward of the same rows.
        b = a.batch
        return {
            "zero2 K=1": ("zero2_{p}", {}, {}, 2 * b, 1),
            "zero2 K=2": ("zero2_{p}", {}, {}, b, 2),
            "zero3 K=1": ("zero3_{p}", THIN_PERSIST, {}, 2 * b, 1),
            "zero3 K=2": ("zero3_{p}", THIN_PERSIST, {}, b, 2),
            # one fetch trace for both kinds of forward (DeepSpeed's), and DeepSpeed's paths throughout
            "zero3 K=2 -zero3_traces": ("zero3_{p}", THIN_PERSIST, {"engine_patches": "all,-zero3_traces"}, b, 2),
            "zero3 K=2 patches-off": ("zero3_{p}", THIN_PERSIST, PATCHES_OFF, b, 2),
        }
    chosen = a.variants.split(",") if a.variants else list(VARIANTS)
    if a.profile:
        chosen = [a.profile]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    return {n: (*VARIANTS[n], a.batch, a.k) for n in chosen}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", choices=DEPTHS, default="H", help="the real model whose blocks the thin one has")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--world", type=int, default=1)
    H.common_args(ap, json_out=False, batch=4, steps=6)
    ap.add_argument("--k", type=int, default=1, help="micro-batches per step (the gradient cache)")
    ap.add_argument("--variants", default="", help=f"comma list of {list(VARIANTS)} (default: all)")
    ap.add_argument("--gradcache", action="store_true", help="K = 2 against K = 1 on the same rows (item 4)")
    ap.add_argument("--profile", default="", help="cProfile one variant instead of timing them")
    ap.add_argument("--callers-of", action="append", default=[], help="with --profile: print this function's callers")
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--sort", default="tottime", help="with --profile: pstats order (tottime, cumulative)")
    a = ap.parse_args(argv)
    from dsclip.testing.gloo_world import run_world

    plan = _plan(a)
    print(H.preamble(__file__), flush=True)
    ranks = run_world(_rank, a.world, a, plan, timeout=7200)
    if a.profile:
        print(ranks[0])
        return 0
    cfg = thin_config(a.depth)
    n_tensors = sum(1 for _ in _count_tensors(cfg))
    print(
        f"thin {DEPTHS[a.depth]} ({n_tensors} tensors, width 32), {a.precision}, world {a.world}, "
        f"{a.steps} steps each after 2 untimed, CPU ms per step (slowest rank, median over steps)\n"
    )
    first = next(iter(plan))
    print(
        "| variant | micro-batch × K | total | forward | backward | step | other | µs / tensor | "
        f"vs {first} |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    per_step = {n: [{k: max(r[n][s][k] for r in ranks) for k in ranks[0][n][s]} for s in range(a.steps)] for n in plan}
    base = [s["total"] for s in per_step[first]]
    for n, steps in per_step.items():
        med = {k: 1e3 * statistics.median(s[k] for s in steps) for k in steps[0]}
        ratio = statistics.median(s["total"] / b for s, b in zip(steps, base))
        *_, b, k = plan[n]
        cells = " | ".join(f"{med[p]:.1f}" for p in (*PHASES, "other"))
        print(
            f"| {n} | {b} × {k} | {med['total']:.1f} | {cells} | {1e3 * med['total'] / n_tensors:.0f} | {ratio:.2f} |"
        )
    return 0


def _count_tensors(cfg):
    import torch

    from dsclip.model import create_model

    with torch.device("meta"):
        yield from create_model(cfg).parameters()


if __name__ == "__main__":
    sys.exit(main())
