"""ZeRO-1/2 at one rank: the local_flush patch against DeepSpeed's own coalesced flush, bit for bit.

dsclip/engine/patches/local_flush.py replaces DeepSpeed's bucketed flush by one copy of every ``.grad``
into a flat buffer laid out like the flat weights, handed to ``step()`` as the pre-flattened partition. At
one rank there is nothing to sum, so everything must be bit for bit what DeepSpeed's flush gives: the
gradients (``safe_get_full_grad``), the gradient norm, the weights and the Adam moments after each of
several steps (the buffer is reused across steps), for ZeRO-1 and ZeRO-2, fp32, bf16 and fp16 (the fp16
refusal of the CPU accelerator mocked). The patches are chosen as a user chooses them
(``--engine-patches``): all, none (DeepSpeed's paths: the reference), and overflow_check alone (DeepSpeed's
flush with dsclip's check, what GPUs at world > 1 run). The big-batch reference test (test_gradcache.py)
covers the same path against an independent computation.
"""

from __future__ import annotations

import pytest
import torch

from dsclip.testing.gloo_world import run_world
from dsclip.testing.gradcache import make_batches, make_cfg, make_model, rank_chunks
from tests.dist.test_gradcache import EVERY_PATCH

pytestmark = [pytest.mark.dist]
K, STEPS = 3, 3


def _run_cases(rank, world, cases):
    """Every (stage, mode, precision) case in this one world, engines built one after another (seeded model)."""
    return [_run(rank, world, stage, mode, precision) for stage, mode, precision in cases]


# --engine-patches of each mode. ours: every patch (the opt-in ones too); deepspeed: DeepSpeed's flush and
# check (the reference); deepspeed+check: DeepSpeed's flush with dsclip's multi-tensor overflow check
MODES = {"ours": EVERY_PATCH, "deepspeed": "none", "deepspeed+check": "overflow_check"}
# each other ZeRO-1/2 patch alone (overflow_check alone is deepspeed+check), on one case: DeepSpeed's paths but
# that one, bit for bit DeepSpeed's numbers (grad_norm acts without clipping only: tests/dist/test_grad_norm.py)
ALONE, ALONE_CASE = ("local_flush", "grad_hooks"), (2, "bf16")
MODES |= {name: name for name in ALONE}


def _run(rank, world, stage, mode, precision="fp32"):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from dsclip.engine.build import autocast_dtype, build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    # 16-bit with K > 1 sums in fp32 through DeepSpeed's sharded path (dsclip/engine/grad_reduction.py), which the
    # coalesced flush this patch replaces never runs: the 16-bit cases flush one micro-batch (K = 1), fp32 K = 3
    k = K if precision == "fp32" else 1
    cfg = make_cfg(stage, k)
    cfg.optim.grad_clip_norm = 0.05  # clipping rescales the flat buffer in place: covered too
    cfg.train.engine_patches = MODES[mode]
    device_type = "cpu"
    if precision in ("bf16", "fp16"):  # DeepSpeed checks bf16/fp16 gradients for inf/NaN before each step
        cfg.train.precision, cfg.train.deepspeed_config = precision, f"ds_configs/zero{stage}_{precision}.json"
    if precision == "fp16":
        # fp16 is a GPU path that DeepSpeed refuses on a CPU accelerator; torch runs fp16 on CPU, so the
        # refusal is mocked at the boundary (the accelerator's is_fp16_supported, dsclip's CPU check)
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
        device_type = "cuda"
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type=device_type
    )
    if precision == "fp16":
        ds["fp16"]["initial_scale_power"] = 4  # a loss scale this model's gradients do not overflow at
    bundle = build_engine(ds, cfg.train, cfg.optim, make_model, total_steps=10, steps_per_epoch=10)
    engine = bundle.engine
    step = GradCacheStep(engine, build_loss("infonce"), accum_freq=k, compute_dtype=autocast_dtype(bundle))
    named = list(engine.module.named_parameters())
    out = {
        "active": list(bundle.patches.active),
        "local_flush": "local_flush" in bundle.patches.active,
        "norm_fn": engine.optimizer.get_grad_norm_direct.__qualname__,
        "overflow_fn": engine.optimizer.has_overflow_partitioned_grads_serial.__qualname__,
        "check_grad_overflow": engine.optimizer.check_grad_overflow,
        "applied": [],
        "grads": [],
        "norms": [],
        "weights": [],
        "model": [],
        "exp_avg_sq": [],
    }
    for s in range(STEPS):
        images, tokens = make_batches(world, k, seed=100 + s)
        torch.manual_seed(7 + s)
        engine.train()
        step(rank_chunks(images, tokens, rank, world, k), optimizer_step=False)
        out["grads"].append({n: safe_get_full_grad(p).clone() for n, p in named})
        if precision != "fp32" and s == 1 and rank == 0:
            # one non-finite gradient element on one rank: every rank must skip this step, as DeepSpeed's does
            engine.optimizer.averaged_gradients[0][-1].view(-1)[0] = float("inf")
        engine.step()
        out["applied"].append(bool(engine.was_step_applied()))
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["weights"].append({n: safe_get_full_fp32_param(p).clone() for n, p in named})
        # the model's own weights (what the next forward reads): gathered from every rank's partition
        out["model"].append({n: p.detach().clone() for n, p in named})
        # the torch optimizer's state holds this rank's flat fp32 partition of each group
        state = engine.optimizer.optimizer.state
        out["exp_avg_sq"].append({i: st["exp_avg_sq"].clone() for i, st in enumerate(state.values())})
    # The step's re-pointing of parameters at their flat slices is skipped while they already are those
    # views (patches/local_flush._skip_if_views_in_place); a parameter moved off its slice must still be put back.
    opt = engine.optimizer
    p0 = opt.bit16_groups[0][0]
    p0.data = p0.data.clone()
    opt._update_model_bit16_weights(0)
    out["repointed"] = p0.data_ptr() == opt.bit16_groups_flat[0].data_ptr()
    return out


# (stage, precision); bf16 / fp16 (loss-scaled): DeepSpeed's overflow check runs before every step (fp32 has
# none), step 1 carries an inf gradient element, which must skip that step, and DeepSpeed's flush also runs
# with dsclip's overflow check (deepspeed+check) against the reference
CASES = [(1, "fp32"), (2, "fp32"), (2, "bf16"), (2, "fp16")]


def test_local_flush_is_bitwise_deepspeeds_flush():
    cases = []
    for stage, precision in CASES:
        modes = ("ours", "deepspeed", "deepspeed+check") if precision != "fp32" else ("ours", "deepspeed")
        cases += [(stage, mode, precision) for mode in modes]
    cases += [(*ALONE_CASE[:1], mode, ALONE_CASE[1]) for mode in ALONE]
    ranks = run_world(_run_cases, 1, cases)
    results = {c: [r[i] for r in ranks] for i, c in enumerate(cases)}
    for stage, precision in CASES:
        case = f"stage {stage}, {precision}"
        theirs = results[(stage, "deepspeed", precision)]
        assert all(t["overflow_fn"] == "DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial" for t in theirs)
        check_bitwise(results[(stage, "ours", precision)], theirs, case, precision != "fp32")
        if precision != "fp32":
            check_bitwise(
                results[(stage, "deepspeed+check", precision)],
                theirs,
                case + ", DeepSpeed's flush with dsclip's overflow check",
                expect_checked=True,
                local_flush=False,
            )
    check_alone(results)


def check_alone(results):
    """Each patch of ALONE by itself: active where its check passes, DeepSpeed's numbers bit for bit."""
    from dsclip.engine.patches import passes_check

    stage, precision = ALONE_CASE
    theirs = results[(stage, "deepspeed", precision)]
    for mode in ALONE:
        for ours, ref in zip(results[(stage, mode, precision)], theirs, strict=True):
            assert ours["active"] == ([mode] if passes_check(mode) else []), (mode, ours["active"])
            assert ours["applied"] == ref["applied"], mode
            assert same_bits(torch.tensor(ours["norms"]), torch.tensor(ref["norms"])), mode
            for key in ("grads", "weights", "model", "exp_avg_sq"):
                for s in range(STEPS):
                    diff = [n for n in ours[key][s] if not same_bits(ours[key][s][n], ref[key][s][n])]
                    assert not diff, f"{mode} alone, step {s}: {key} differ for {diff}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals the same NaN: an unchecked bf16 step with the planted inf leaves NaNs)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def check_bitwise(ours_ranks, theirs_ranks, case, expect_checked=False, local_flush=True):
    from dsclip.engine.patches import passes_check

    # on a DeepSpeed whose sources are not the verified ones (CI's oldest) the patches stay out and "ours" is
    # DeepSpeed's path: the comparison must then hold trivially, and still does
    local_flush = local_flush and passes_check("local_flush")
    checked = passes_check("overflow_check")
    for ours, theirs in zip(ours_ranks, theirs_ranks, strict=True):
        assert ours["local_flush"] == local_flush and not theirs["local_flush"], case
        assert ours["norm_fn"] == (
            "_flat_grad_norm.<locals>.grad_norm" if local_flush else "DeepSpeedZeroOptimizer.get_grad_norm_direct"
        ), case
        assert theirs["norm_fn"] == "DeepSpeedZeroOptimizer.get_grad_norm_direct", case
        assert ours["overflow_fn"] == (
            "_fast_overflow_check.<locals>.has_overflow_partitioned_grads_serial"
            if checked
            else "DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial"
        ), case
        # DeepSpeed's default decides whether bf16 is checked (0.19.8: yes, bf16.check_grad_overflow; older: no);
        # fp16 always is, fp32 never; the patches never change it
        overflow_checked = theirs["check_grad_overflow"]
        assert ours["check_grad_overflow"] == overflow_checked and (overflow_checked or "fp16" not in case), case
        if passes_check("local_flush"):  # the verified release
            assert overflow_checked == expect_checked, case
        assert ours["repointed"] and theirs["repointed"], case
        # bf16: the step with the inf element is skipped by both checks, the others applied
        expected = [s != 1 for s in range(STEPS)] if overflow_checked else [True] * STEPS
        assert ours["applied"] == theirs["applied"] == expected, case
        assert same_bits(torch.tensor(ours["norms"]), torch.tensor(theirs["norms"])), case
        # clipping was active (an unchecked step 1 with the planted inf makes the later norms non-finite)
        assert all(n > 0.05 for i, n in enumerate(ours["norms"]) if expected[i] and (overflow_checked or i == 0)), case
        for key in ("grads", "weights", "model", "exp_avg_sq"):
            for s in range(STEPS):
                diff = [n for n in ours[key][s] if not same_bits(ours[key][s][n], theirs[key][s][n])]
                assert not diff, f"{case}, step {s}: {key} differ for {diff}"
        # the steps moved the weights (the comparison is not between two untouched models)
        assert any(not torch.equal(ours["weights"][0][n], ours["weights"][-1][n]) for n in ours["weights"][0]), case


def test_blocked_sum_of_squares_is_float64_accurate():
    """The norm's blocks (a partial last one included) sum every square in float64: within float64's
    worst-case summation bound of the exact sum, where a float32 sum would be off by ~1e-3 here."""
    from dsclip.engine.patches.local_flush import NORM_BLOCK, sum_of_squares_fp64
    from tests.tolerances import worst_case

    x = torch.randn(2 * NORM_BLOCK + 12345, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = torch.sum(x.double() ** 2)
    got = sum_of_squares_fp64(x)
    assert got.dtype == torch.float64
    assert abs(got - exact) <= worst_case(x.numel(), float(exact), torch.float64)
    assert abs(torch.sum(x * x) - exact) > abs(got - exact)  # the float32 sum is worse
