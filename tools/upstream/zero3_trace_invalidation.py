"""Reproduction for DeepSpeed: ZeRO-3's fetch trace is invalidated on every step when units of different
lengths alternate (a gradient cache's no-grad first pass at K > 1), so the coordinator never prefetches.

DeepSpeed only; one CPU process, no GPU, no dsclip. ZeRO-3 keeps one fetch trace per engine
(``PartitionedParameterCoordinator``). A unit runs from one root forward to the next; the unit after an
invalidation is recorded, and a later unit that goes past the recorded one invalidates it
(``trace_prologue``: "cache has only N modules"). A gradient cache at K = 2 makes three units per step:
a no-grad forward (the first micro-batch's embeddings), a forward whose graph is kept (the last one's), and a
forward of the first micro-batch again with one backward through both graphs. The long unit invalidates the
trace, the next step's short no-grad unit is recorded in its place, and the long unit invalidates it again:
one invalidation per step, the trace never complete when a step ends, nothing prefetched. Expected: a trace
that completes once and stays valid (e.g. one trace per kind of unit, or per grad mode). dsclip's workaround:
dsclip/engine/patches/zero3_traces.py (a second coordinator for no-grad forwards).

    TORCH_EXTENSIONS_DIR=... python tools/upstream/zero3_trace_invalidation.py

Prints (invalidations so far, trace complete) after each step for (a) one forward + backward per step (the
baseline: complete from step 2 on, no invalidation) and (b) the gradient cache's three units (one more
invalidation every step, never complete). Reproduced with DeepSpeed 0.19.8, torch 2.x, CPU, one process.
"""

from __future__ import annotations

import os

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,  # every tensor partitioned and fetched
        "stage3_prefetch_bucket_size": 10**6,
        "stage3_max_reuse_distance": 0,
    },
}
STEPS = 4


def run(gradient_cache: bool) -> list[tuple[int, bool]]:
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=CONFIG
    )
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    invalidations = [0]
    invalidate = coordinator._invalidate_trace

    def counting():
        invalidations[0] += 1
        invalidate()

    coordinator._invalidate_trace = counting
    x = torch.randn(4, 64)
    after_each_step = []
    for _ in range(STEPS):
        if gradient_cache:
            # a gradient cache at K = 2 (dsclip, GradCache): the first micro-batch's embeddings without a
            # graph, the last one's with its graph kept; then the first again with a graph, and one backward
            # through both (root forwards start units: [no-grad], [forward], [forward + both backwards])
            with torch.no_grad():
                engine(x)
            kept = engine(x)
            loss = engine(x).square().mean() + kept.square().mean()
        else:
            loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        after_each_step.append((invalidations[0], coordinator.is_complete_trace()))
    return after_each_step


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    baseline = run(gradient_cache=False)
    mixed = run(gradient_cache=True)
    print(f"DeepSpeed {deepspeed.__version__}: (invalidations so far, trace complete) after each of {STEPS} steps")
    print(f"  one forward + backward per step:        {baseline}")
    print(f"  a gradient cache's three units, K = 2:  {mixed}")
    if baseline[-1] == (0, True) and [n for n, _ in mixed] == list(range(1, STEPS + 1)):
        print("REPRODUCED: with the no-grad unit mixed in, the trace is invalidated on every step and is never")
        print("complete, so the coordinator never prefetches (every fetch waits for its all-gather)")
    else:
        print("not reproduced on this DeepSpeed")


if __name__ == "__main__":
    main()
