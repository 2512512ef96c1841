"""The fake rank against a real one: under torch's fake process group at world 2, the rehearsal's rank 0
sends exactly the bytes, calls and kinds a real gloo rank 0 sends, step phase by step phase (ZeRO-2 and
ZeRO-3, gradient cache K = 1 and 2); and its optimizer partition is the plan's 1/N share.

One fake child process (all four configurations, one engine after another) runs while one real world of
two gloo ranks runs the same four: three processes for the file.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from dsclip.plan.memory import model_state_bytes
from dsclip.plan.planner import shipped_ds_config
from dsclip.rehearsal.room import RehearsalSpec, read_child, run_real_rank, start_child
from dsclip.testing.gloo_world import run_world

CONFIGS = [(2, 1), (2, 2), (3, 1), (3, 2)]  # (ZeRO stage, accum_freq)


def _specs(world: int) -> list[RehearsalSpec]:
    return [
        RehearsalSpec(
            model="demo",
            world=world,
            batch_size=4,
            accum_freq=k,
            ds_config=shipped_ds_config(z, "bf16")[1],
            precision="bf16",
            steps=1,
        )  # fmt: skip
        for z, k in CONFIGS
    ]


@pytest.fixture(scope="module")
def fake_and_real():
    specs = _specs(2)
    child = start_child(specs)  # the fake world-2 rank, meanwhile the real world runs
    try:
        real = run_world(run_real_rank, 2, [asdict(s) for s in specs])[0]
        out, err = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
        child.tmp.cleanup()
    return read_child(child.returncode, out, err), real


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[f"zero{z}-K{k}" for z, k in CONFIGS])
def test_fake_rank_sends_what_a_real_rank_sends(fake_and_real, i):
    fake, real = fake_and_real
    f, r = fake[i], real[i]
    assert f.skipped == 0 and r["skipped"] == 0 and f.step_s and r["step_s"]
    assert f.traffic, "nothing was counted: the counter did not see the step's collectives"
    # [kind, group size, phase, calls, bytes] per step, identical row for row
    assert f.traffic == r["traffic"]
    phases = {(row[0], row[2]) for row in f.traffic}
    # the loss's embedding gather (dsclip's loss holds its own reference to the collective) and ZeRO's own
    assert ("all_gather", "other") in phases
    assert phases & {("all_gather", "step"), ("all_gather", "forward")}  # ZeRO-1/2 after the step, ZeRO-3 before use
    # the bf16 gradients: at world 2 ZeRO-2/3 reduce them sharded, each chunk's inside its backward (K reductions;
    # dsclip/engine/grad_reduction.py), a coalesced step once at the boundary
    phase = "backward" if f.grad_reduction == "sharded" else "boundary"
    grads = sum(row[4] for row in f.traffic if row[2] == phase and row[0] in ("reduce", "reduce_scatter", "all_reduce"))
    assert grads >= 2 * f.params * (f.spec["accum_freq"] if phase == "backward" else 1)


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[f"zero{z}-K{k}" for z, k in CONFIGS])
def test_fake_rank_holds_the_plans_optimizer_share(fake_and_real, i):
    fake, real = fake_and_real
    f = fake[i]
    zero = CONFIGS[i][0]
    assert f.optimizer_numel == real[i]["optimizer_numel"]  # the same partition as a real rank 0
    assert f.loss_finite
    plan = model_state_bytes(f.params, 2, zero, "bf16")["optimizer"]  # fp32 master + Adam m, v: 12 B / param / N
    # DeepSpeed pads each group's flat buffer to a multiple of the world: a few elements over params / 2
    assert plan <= f.optimizer_bytes <= plan * 1.001 + 12 * 64
