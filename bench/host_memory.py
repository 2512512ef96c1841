"""A CPU rank's training step with glibc's default malloc thresholds against dsclip's fixed ones
(dsclip/engine/host_memory.py: freed memory stays in the process for the next step), side by side.

Each round starts two fresh processes, order alternating, each building the same dsclip engine
(vs_openclip.dsclip_trainer: ZeRO-2 fp32, one thread) for ``--model`` at world 1; one of them calls
``keep_freed_memory()`` first (`dsclip train` does this on every CPU rank). Each runs ``--warmup`` steps,
then ``--steps`` timed steps, and reports CPU seconds and minor page faults per step. Printed: per
setting, the median over all timed steps of every round, and the ratio of the medians.

    OMP_NUM_THREADS=1 .venv/bin/python bench/host_memory.py --model ViT-B-32 --batch 8 --steps 5 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank, world, model, batch, warmup, steps, keep):
    import vs_openclip as V

    from dsclip.engine.host_memory import keep_freed_memory
    from dsclip.model import get_model_config

    how = keep_freed_memory() if keep else "default"
    V.one_thread()
    cfg = get_model_config(model)
    run = V.dsclip_trainer(rank, world, "fp32", batch, cfg, opts={"keep_freed_memory": False})  # set above
    run(V.synthetic_batches(warmup, batch, cfg, seed=1), 0)
    out = []
    for i in range(steps):
        data = V.synthetic_batches(1, batch, cfg, seed=2 + i)
        c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run(data, warmup + i)
        out.append((time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
    return how, out


def _worker(spec: dict) -> None:
    from tests.distutil import run_world

    how, out = run_world(_rank, 1, spec["model"], spec["batch"], spec["warmup"], spec["steps"], spec["keep"])[0]
    print("RESULT " + json.dumps({"how": how, "steps": out}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return _worker(json.loads(a.worker))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    steps: dict[str, list] = {"default": [], "kept": []}
    for r in range(a.rounds):
        for keep in [False, True] if r % 2 == 0 else [True, False]:
            spec = dict(model=a.model, batch=a.batch, warmup=a.warmup, steps=a.steps, keep=keep)
            p = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True,
                               text=True)  # fmt: skip
            line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(p.stderr[-3000:])
            res = json.loads(line[len("RESULT ") :])
            name = "kept" if keep else "default"
            assert res["how"] == name, res["how"]
            steps[name] += res["steps"]
            cpu = statistics.median(c for c, _ in res["steps"])
            faults = statistics.median(f for _, f in res["steps"])
            print(f"round {r} {name:8s} {cpu:.3f} CPU-s/step  {faults:>8.0f} minor faults/step", flush=True)
    print(f"\n{a.model}, world 1, micro-batch {a.batch}, {a.rounds} rounds x {a.steps} steps")
    med = {}
    for name, got in steps.items():
        med[name] = statistics.median(c for c, _ in got)
        print(
            f"  {name:8s} median {med[name]:.3f} CPU-s/step (min {min(c for c, _ in got):.3f}, max "
            f"{max(c for c, _ in got):.3f}), minor faults/step median {statistics.median(f for _, f in got):.0f}"
        )
    print(f"  default / kept: {med['default'] / med['kept']:.3f}x CPU time per step")


if __name__ == "__main__":
    main()
