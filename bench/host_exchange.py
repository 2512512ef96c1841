"""The flush's gradient sum and the step's weight gather at world > 1 on one host, side by side:
DeepSpeed's shared-memory all-reduce (what dsclip used before) against dsclip's host slots.

Per iteration, over the same buffers (``--sizes``: the flat partition size of each parameter group):
  deepspeed  each group's flat gradients divided by the world size and summed by
             ``deepspeed.comm.inference_all_reduce``; then the gather as that sum again, every rank's
             buffer zero outside its own updated partition (dsclip/engine/local_flush.py before the slots)
  slots      ``_HostExchange.reduce_scatter`` (one barrier, each rank sums its own partition of every
             rank's slot) and ``_HostExchange.all_gather`` (publish, one barrier, read the others')
The copy of the gradients into the buffer is the same in both and left out. Blocks of ``--iters``
iterations alternate between the two, ``--rounds`` times; reported: rank 0's process CPU time and wall
time per iteration (median over rounds) and the ratio. Also checks that both give the same numbers.

    OMP_NUM_THREADS=1 .venv/bin/python bench/host_exchange.py --world 2 --sizes 815104,73224
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the demo model's two groups (weight decay / none: 1,630,208 + 146,433 parameters) halved at world 2
DEMO_SIZES = "815104,73224"


def _rank(rank, world, sizes, iters, rounds):
    import deepspeed
    import deepspeed.comm as ds_dist
    import torch

    from dsclip.engine.local_flush import _HostExchange

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(size * world, generator=gen) for size in sizes]  # this rank's gradients, per group

    # deepspeed: private flat buffers, whole-buffer sums
    flats = [torch.empty(size * world) for size in sizes]
    weights_ds = [torch.zeros(size * world) for size in sizes]

    def deepspeed_iteration():
        for flat, g in zip(flats, grads):
            flat.copy_(g)  # (left out of the timing below by doing the same copy in both variants)
        t0, c0 = time.perf_counter(), time.process_time()
        for flat in flats:
            flat.div_(world)
            ds_dist.inference_all_reduce(flat)
        for w, flat, size in zip(weights_ds, flats, sizes):
            mine = flat.narrow(0, rank * size, size)
            w.narrow(0, rank * size, size).copy_(mine)  # the optimizer's update lands in this rank's partition
            for r in range(world):
                if r != rank:
                    w.narrow(0, r * size, size).zero_()
            ds_dist.inference_all_reduce(w)
        return time.process_time() - c0, time.perf_counter() - t0

    exchange = _HostExchange.open(sizes, torch.float32, None)
    weights = [torch.zeros(size * world) for size in sizes]
    parts = [list(w.split(size)) for w, size in zip(weights, sizes)]

    def slots_iteration():
        exchange.before_writing_grads()
        for i, g in enumerate(grads):
            exchange.grads(i).copy_(g)
        t0, c0 = time.perf_counter(), time.process_time()
        exchange.reduce_scatter()
        for i, size in enumerate(sizes):
            parts[i][rank].copy_(exchange.grads(i).narrow(0, rank * size, size))
        exchange.all_gather(parts)
        return time.process_time() - c0, time.perf_counter() - t0

    deepspeed_iteration(), slots_iteration()  # warm: pages mapped, shm op loaded
    same = all(torch.equal(a, b) for a, b in zip(weights, weights_ds))
    results = {"deepspeed": [], "slots": []}
    for _ in range(rounds):
        for name, fn in (("deepspeed", deepspeed_iteration), ("slots", slots_iteration)):
            cpu = wall = 0.0
            for _ in range(iters):
                c, w = fn()
                cpu, wall = cpu + c, wall + w
            results[name].append((cpu / iters, wall / iters))
    return {"same": same, **results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default=DEMO_SIZES, help="partition size of each parameter group, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from tests.distutil import run_world

    sizes = [int(s) for s in args.sizes.split(",")]
    out = run_world(_rank, args.world, sizes, args.iters, args.rounds)[0]
    total = sum(sizes) * args.world
    print(f"world {args.world}, {total / 1e6:.2f} M fp32 elements, {args.rounds} rounds x {args.iters} iterations")
    print(f"same gathered weights: {out['same']}")
    med = {}
    for name in ("deepspeed", "slots"):
        cpu = [c for c, _ in out[name]]
        wall = [w for _, w in out[name]]
        med[name] = (statistics.median(cpu), statistics.median(wall))
        print(
            f"  {name:9s} CPU {med[name][0] * 1e3:7.2f} ms ({min(cpu) * 1e3:.2f}-{max(cpu) * 1e3:.2f})"
            f"  wall {med[name][1] * 1e3:7.2f} ms ({min(wall) * 1e3:.2f}-{max(wall) * 1e3:.2f}) per iteration"
        )
    ratios = [d[0] / s[0] for d, s in zip(out["deepspeed"], out["slots"])]
    wall_ratios = [d[1] / s[1] for d, s in zip(out["deepspeed"], out["slots"])]
    print(
        f"  deepspeed / slots: CPU {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), "
        f"wall {statistics.median(wall_ratios):.2f}x ({min(wall_ratios):.2f}-{max(wall_ratios):.2f}) per round"
    )


if __name__ == "__main__":
    main()
