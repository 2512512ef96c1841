"""How much gradient one rank holds at the end of the gradient cache's backwards, under a fake world N.

dsclip runs the K backwards of a step inside DeepSpeed's ``coalesce_grad_reduction`` block, whose hooks reduce
nothing: every backward accumulates into ``param.grad`` and the block's exit reduces them in one pass. This
rehearses rank 0 of a world-N job (dsclip.rehearsal, the fake process group) and, at that exit, before the
flush, sums the bytes of every ``param.grad`` against the parameters: 2 B/param (bf16) means the rank holds
the whole 16-bit gradient, which ``dsclip plan``'s ZeRO-2/3 memory (6 B x P / N of gradients) does not count.

    python bench/coalesced_grads.py --model ViT-B-32 --world 8 --zero 2 3 --micro 1 --accum 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsclip.rehearsal.counter as cm  # noqa: E402
from dsclip.plan.planner import shipped_ds_config  # noqa: E402
from dsclip.rehearsal.room import RehearsalSpec, run_child  # noqa: E402

seen: list[tuple[int, int, int]] = []


def _measuring(track):
    """``track_phases`` that also wraps the engine's coalesced block: at its exit, before DeepSpeed's flush,
    record (stage, bytes in param.grad, parameters)."""

    def wrapped_track(engine, counter):
        track(engine, counter)
        make = engine.coalesce_grad_reduction

        def block(*a, **k):
            inner = make(*a, **k)

            class Measured:
                def __enter__(self):
                    return inner.__enter__()

                def __exit__(self, *exc):
                    params = list(engine.module.parameters())
                    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
                    seen.append(
                        (
                            engine.zero_optimization_stage(),
                            grads,
                            sum(getattr(p, "ds_numel", p.numel()) for p in params),
                        )
                    )
                    return inner.__exit__(*exc)

            return Measured()

        engine.coalesce_grad_reduction = block

    return wrapped_track


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--zero", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--accum", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cm.track_phases = _measuring(cm.track_phases)
    specs = [
        RehearsalSpec(
            model=a.model,
            world=a.world,
            batch_size=a.micro,
            accum_freq=a.accum,
            ds_config=shipped_ds_config(z, "bf16")[1],
            precision="bf16",
            steps=1,
            grad_reduction="coalesced",  # the mode whose whole .grad this measures
        )  # fmt: skip
        for z in a.zero
    ]
    run_child(specs)
    print("| model | world | ZeRO | micro x K | param.grad bytes before the flush | parameters | B/param |")
    print("|---|---|---|---|---|---|---|")
    for zero, grads, params in seen[1::2] if len(seen) == 2 * len(specs) else seen:  # the timed step of each
        print(
            f"| {a.model} | {a.world} | {zero} | {a.micro}x{a.accum} | {grads:,} | {params:,} | {grads / params:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
