"""Host synchronisations per training step, before and after folding the stop-signal check into the step.

On a GPU every read of a device scalar on the host (``.item()``, ``.tolist()``, ``bool(t)``) waits for
the stream: a pipeline stall per call. This counts them on CPU, per optimizer step of 2 gloo ranks
(tiny model, ZeRO-2 fp32, ``--accum-freq 2``), with a ``TorchDispatchMode`` around the step:

  scalar reads   ``aten::_local_scalar_dense`` (what every ``.item()``/``bool()``/``float()`` of a tensor
                 dispatches to) and ``Tensor.tolist`` calls (one device-to-host copy each)
  collectives    ``c10d::*`` ops (all-reduce, all-gather, reduce-scatter, broadcast, barrier)

before  the loop and gradient cache of ``--before-rev`` (default a108e3d, before issue 16): the step,
        then ``stop.preemption_requested()`` every step (one all-reduce of one int, one ``.item()``).
after   this checkout: the stop flags ride on the non-finite check's all-reduce inside the step
        (``GradCacheStep(extra_flags=stop.local_stop_flags)``), as ``dsclip.train.loop`` runs it.

The old gradient cache is loaded from git (``git show REV:dsclip/train/gradcache.py``), so "before" is
the code as it was, not a re-enactment. A GPU time needs a device; the counts are what can be counted
here, and they are exact (the same on every machine).

    OMP_NUM_THREADS=1 .venv/bin/python bench/host_syncs.py
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _old_preemption_check():
    """dsclip.engine.world.stop.preemption_requested() of the before-revision, verbatim in effect."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _rank(rank, world, old_source, steps):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.engine.world import stop
    from dsclip.losses import build_loss
    from dsclip.model import create_model, get_model_config
    from dsclip.testing.gradcache import make_batches, make_cfg, rank_chunks
    from dsclip.train import gradcache as new_gc

    old_gc = types.ModuleType("gradcache_before")
    sys.modules[old_gc.__name__] = old_gc  # dataclasses look their module up there
    exec(compile(old_source, "gradcache_before.py", "exec"), old_gc.__dict__)

    class Count(TorchDispatchMode):
        """Dispatched ops, plus ``Tensor.tolist`` (on CPU it reads memory without dispatching anything,
        on a GPU it is one device-to-host copy: one sync, however many elements)."""

        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __enter__(self):
            real = self._real_tolist = torch.Tensor.tolist
            ops = self.ops

            def tolist(t):
                ops["Tensor.tolist"] += 1
                return real(t)

            torch.Tensor.tolist = tolist
            return super().__enter__()

        def __exit__(self, *exc):
            torch.Tensor.tolist = self._real_tolist
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name == "aten._local_scalar_dense" or name.startswith("c10d."):
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    cfg = make_cfg(2, 2)
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    mcfg = get_model_config("tiny")
    engine = build_engine(
        ds,
        cfg.train,
        cfg.optim,
        lambda: create_model(mcfg, vocab_size=256, eos_id=2, pad_id=0),
        total_steps=100,
        steps_per_epoch=100,
    ).engine
    images, tokens = make_batches(world, 2)
    chunks = rank_chunks(images, tokens, rank, world, 2)
    stop.install_preemption_handler()
    variants = {
        "before": (old_gc.GradCacheStep(engine, build_loss("infonce")), _old_preemption_check),
        "after": (new_gc.GradCacheStep(engine, build_loss("infonce"), extra_flags=stop.local_stop_flags), None),
    }
    out = {}
    for name, (step, check) in variants.items():
        step(chunks)  # warm-up (first-step allocations, DeepSpeed's lazy buffers)
        per_step = []
        for _ in range(steps):
            with Count() as c:
                r = step(chunks)
                if check is not None:
                    check()
                else:
                    stop.stop_reason(r.flags)
            per_step.append(dict(c.ops))
        out[name] = per_step
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-rev", default="a108e3d")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from dsclip.testing.gloo_world import run_world

    old = subprocess.run(
        ["git", "show", f"{args.before_rev}:dsclip/train/gradcache.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    results = run_world(_rank, 2, old, args.steps)
    rows = []
    for name in ("before", "after"):
        counts = [c for r in results for c in r[name]]
        assert all(c == counts[0] for c in counts), f"{name}: counts differ between steps/ranks: {counts}"
        c = counts[0]
        reads = c.get("aten._local_scalar_dense", 0) + c.get("Tensor.tolist", 0)
        colls = sum(v for k, v in c.items() if k.startswith("c10d."))
        rows.append((name, reads, colls, c))
    print(f"per step and rank (2 gloo ranks, ZeRO-2, K=2; equal on all steps and ranks); before = {args.before_rev}")
    print(f"{'':8} {'host scalar reads':>18} {'collectives':>12}  detail")
    for name, reads, colls, c in rows:
        print(f"{name:8} {reads:>18} {colls:>12}  {json.dumps(dict(sorted(c.items())))}")
    (b, br, bc, _), (a, ar, ac, _) = rows
    print(f"after/before: host scalar reads {ar}/{br}, collectives {ac}/{bc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
