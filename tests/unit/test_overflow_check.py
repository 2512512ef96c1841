"""dsclip/engine/patches/overflow_check.py against DeepSpeed's own per-parameter inf/NaN check.

The replacement must give DeepSpeed's answer for every placement of a non-finite value (NaN, +inf,
-inf; in fp32, bf16 and fp16 gradients; first, middle or last tensor; with empty and missing
gradients), leave every gradient bit for bit as it was (the multi-tensor AMP check multiplies by 1),
read dsclip's flat partition when one is there, and hand what it does not handle (sparse gradients,
a group without gradients yet) to DeepSpeed's method. The end-to-end skip of a step on every rank is
in tests/dist/test_local_flush.py (bf16 cases).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from dsclip.engine.patches import overflow_check
from dsclip.engine.patches.local_flush import _FlatGrads

BAD = (float("nan"), float("inf"), float("-inf"))


def fake_optimizer(groups: list[list]) -> SimpleNamespace:
    """What both checks read of a ZeRO-1/2 optimizer: its groups and this rank's gradient fragments
    (a group given as None has no gradients yet)."""
    opt = SimpleNamespace(
        bit16_groups=[[None] * len(g or ()) for g in groups],
        bit16_groups_flat=[torch.zeros(1)],
        averaged_gradients={i: g for i, g in enumerate(groups) if g is not None},
        _has_inf_or_nan=DeepSpeedZeroOptimizer._has_inf_or_nan,  # DeepSpeed's own per-tensor check
    )
    opt.has_overflow_partitioned_grads_serial = lambda: DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(
        opt
    )
    return opt


def engine_of(opt, stage: int = 2) -> SimpleNamespace:
    return SimpleNamespace(optimizer=opt, zero_optimization_stage=lambda: stage)


def fast_overflow_check_supported(opt, stage: int = 2) -> bool:
    return overflow_check.applies(engine_of(opt, stage))


def install_fast_overflow_check(opt) -> None:
    overflow_check.install(engine_of(opt))


def deepspeeds_answer(groups) -> bool:
    # without the empty tensors (they hold no inf): DeepSpeed 0.19.2's per-tensor check raises on one
    groups = [None if g is None else [t for t in g if t is None or t.numel() > 0] for g in groups]
    return bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(fake_optimizer(groups)))


def gradients(seed: int) -> list[list]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(7, 5, generator=g), None, torch.randn(0), torch.randn(13, generator=g).bfloat16()],
        [torch.randn(300, generator=g).half(), torch.randn(2, 3, 4, generator=g), torch.randn(1, generator=g)],
    ]


def cases():
    yield "finite", None, None, None
    for value in BAD:
        for gi, ti in ((0, 0), (0, 3), (1, 0), (1, 2)):  # fp32 first, bf16 last, fp16 first, fp32 last
            for pos in ("first", "last"):
                yield f"{value} in group {gi} tensor {ti} {pos}", value, (gi, ti), pos


@pytest.mark.parametrize("name,value,where,pos", list(cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_same_answer_as_deepspeed_and_gradients_untouched(name, value, where, pos):
    groups = gradients(0)
    groups[0][0][3, 2] = -0.0  # signed zero and a subnormal must survive the multiply by 1 bit for bit
    groups[1][1][0, 0, 0] = 1e-40
    if where is not None:
        gi, ti = where
        groups[gi][ti].view(-1)[0 if pos == "first" else -1] = value
    before = [[None if t is None else t.clone() for t in g] for g in groups]
    expected = deepspeeds_answer(groups)
    assert expected == (value is not None), name

    opt = fake_optimizer(groups)
    assert fast_overflow_check_supported(opt)
    install_fast_overflow_check(opt)
    got = opt.has_overflow_partitioned_grads_serial()
    assert got.shape == (1,) and got.dtype == torch.bool
    assert bool(got) == expected, name
    for g, b in zip(groups, before):
        for t, tb in zip(g, b):
            if t is not None:  # equal bits: compare as integers (NaN != NaN as floats)
                assert torch.equal(t.view(-1).view(torch.uint8), tb.view(-1).view(torch.uint8)), name


@pytest.mark.parametrize("value", [None, *BAD])
def test_reads_dsclips_flat_partition(value):
    """Gradients from dsclip's flush: the flat partition is checked (here it alone holds the bad value,
    so the per-fragment lists cannot be what answered)."""
    flat = torch.randn(64).bfloat16()
    if value is not None:
        flat[40] = value
    grads = _FlatGrads([flat.narrow(0, 0, 8)])  # a fragment without the bad element
    grads.flat_partition = flat
    opt = fake_optimizer([grads])
    install_fast_overflow_check(opt)
    assert bool(opt.has_overflow_partitioned_grads_serial()) == (value is not None)


def test_falls_back_to_deepspeed_for_what_it_does_not_handle():
    calls = []
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, float("inf")]), (4,), check_invariants=True
    )
    for groups in ([[sparse]], [[torch.ones(3)], None]):
        opt = fake_optimizer(groups)
        opt.has_overflow_partitioned_grads_serial = lambda: calls.append(1) or torch.tensor([True])
        install_fast_overflow_check(opt)
        assert bool(opt.has_overflow_partitioned_grads_serial())
    assert len(calls) == 2


def test_not_installed_where_deepspeed_has_no_per_parameter_check():
    assert not fast_overflow_check_supported(None)
    assert not fast_overflow_check_supported(SimpleNamespace(bit16_groups=[], averaged_gradients=[]))
    # ZeRO-3 checks its one flat buffer
    assert not fast_overflow_check_supported(fake_optimizer([[torch.ones(3)]]), stage=3)
