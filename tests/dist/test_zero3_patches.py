"""ZeRO-3's patches (zero3_params, zero3_traces, zero3_gather, zero3_norm, zero3_release, zero3_hook_fns, zero3_blocks)
against DeepSpeed's own paths.

Two ranks, ZeRO-3, fp32, the gradient cache at K = 2, three steps, with the patches as a user selects them
(``--engine-patches``): all against none (DeepSpeed's paths: the reference), with and without clipping; then
each patch alone and each declared pair (a patch with the ones it requires), two steps each, against none.
One spawned world builds every engine in turn. The persistence threshold is
lowered so that the tiny model's matrices are partitioned and fetched per block and its vectors stay
persistent (the shipped 1e5 keeps every tensor of this model whole): both of the patched paths run.

- zero3_params, zero3_traces, zero3_gather, zero3_release and zero3_hook_fns move no number: gradients, fp32
  weights, the persistent tensors the next forward reads and Adam's moments are bit for bit DeepSpeed's. What
  each is for is checked too: zero3_traces' two fetch traces (no-grad forwards; forward + backward units) are
  recorded in the first step and never invalidated, where DeepSpeed's single trace mixes the two kinds of
  unit; zero3_release's direct path took every release of the training steps (DeepSpeed's
  ``Init._partition_param`` is not reached); every hooked module applies zero3_hook_fns' unbound functions.
- zero3_norm sums the same float64 squares in another order: the reported norm is within the float64
  bound of two summation orders of every gradient element (tests/tolerances.py), and without clipping the
  weights do not depend on it at all (bit for bit). With clipping the clip factor may move by float32
  rounding; the weights then stay within Adam's step times that rounding.

The big-batch reference test (test_gradcache.py) covers the same paths against an independent computation.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dsclip.testing.gloo_world import run_world
from dsclip.testing.gradcache import LR, make_batches, make_cfg, make_model, rank_chunks
from tests.dist.test_gradcache import EVERY_PATCH, ZERO3_PATCHES
from tests.dist.test_local_flush import same_bits
from tests.tolerances import unit_roundoff, worst_case

pytestmark = [pytest.mark.dist]
K, STEPS, WORLD = 2, 3, 2
# Below the tiny model's matrices (>= 64 x 64 = 4096 elements), above its vectors (<= 256)
PERSISTENCE_THRESHOLD = 1000


def _run_all(rank, world, runs):
    """Every (selection, clip, steps) of ``runs`` in this one world, one engine after another."""
    return [_run(rank, world, patches, clip, steps) for patches, clip, steps in runs]


_COUNTERS: dict[str, list[int]] = {}


def _counters() -> dict[str, list[int]]:
    """DeepSpeed's methods whose calls the checks count, wrapped on their classes once per process (wrapping
    again for a later engine would stack wrappers past the fingerprint check's unwrapping); zeroed per engine.
    Wrapped before the engine exists, so a patch's fallback is the counted method too."""
    if not _COUNTERS:
        from deepspeed.runtime.zero.partition_parameters import Init
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

        for cls, name in ((Stage3, "_prepare_fp32_grad_for_sub_group"), (Stage3, "_unflatten_partitioned_parameters"),
                          (Init, "_partition_param")):  # fmt: skip
            _COUNTERS[name] = [0]
            setattr(cls, name, counted(getattr(cls, name), _COUNTERS[name]))
    for counter in _COUNTERS.values():
        counter[0] = 0
    return _COUNTERS


def _run(rank, world, patches, clip, steps=STEPS):
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.engine.fingerprint import unwrap
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    cfg = make_cfg(3, K)
    cfg.optim.grad_clip_norm = clip
    cfg.train.engine_patches = EVERY_PATCH if patches == "all" else patches  # "all": the opt-in ones too
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    # zero3_step_views: DeepSpeed's per-tensor flatten and re-pointing in the step, counted
    counters = _counters()
    step_calls = {n: counters[n] for n in ("_prepare_fp32_grad_for_sub_group", "_unflatten_partitioned_parameters")}
    bundle = build_engine(ds, cfg.train, cfg.optim, make_model, total_steps=10, steps_per_epoch=10)
    engine = bundle.engine
    opt = engine.optimizer
    step = GradCacheStep(engine, build_loss("infonce"), accum_freq=K)
    named = list(engine.module.named_parameters())
    persistent = [n for n, p in named if p.ds_persist]
    out = {
        "patches": [n for n in bundle.patches.active if n in ZERO3_PATCHES],
        "active": [n for n in bundle.patches.active if n in ZERO3_PATCHES],
        "norm_fn": unwrap(opt.get_grad_norm_direct).__qualname__,  # unwrap: DeepSpeed's NVTX decorator
        "post_step_fn": unwrap(opt._post_step).__qualname__,
        "persistent": len(persistent),
        "partitioned": len(named) - len(persistent),
        "grads": [],
        "norms": [],
        "weights": [],
        "persistent_values": [],
        "all_available": [],
        "exp_avg": [],
        "invalidations": [],  # trace invalidations so far, after each step
    }
    dispatcher = coordinator.iter_params
    if getattr(dispatcher, "dsclip_dispatcher", False):
        # zero3_params: every module of the engine, own and subtree parameters, the same objects in the same
        # order as DeepSpeed's walk gives (external parameters included: both read them live)
        deepspeed_iter = dispatcher.__wrapped__
        out["same_lists"] = all(
            [id(p) for p in dispatcher(m, r)] == [id(p) for p in deepspeed_iter(m, r)]
            for m in engine.module.modules()
            for r in (False, True)
        )
    # every invalidation of a ZeRO-3 fetch trace (DeepSpeed's coordinator and, with zero3_traces, the no-grad one)
    invalidations = [0]
    offload = opt.parameter_offload
    for coord in (offload.param_coordinator, getattr(offload, "dsclip_no_grad_coordinator", None)):
        if coord is not None:
            coord._invalidate_trace = counted(coord._invalidate_trace, invalidations)
    # zero3_release: DeepSpeed's per-parameter partition path, counted from here on (the steps)
    partition_calls = counters["_partition_param"]
    partition_calls[0] = 0
    for s in range(steps):
        images, tokens = make_batches(world, K, seed=300 + s)
        torch.manual_seed(11 + s)
        engine.train()
        step(rank_chunks(images, tokens, rank, world, K), optimizer_step=False)
        out["grads"].append({n: safe_get_full_grad(p).clone() for n, p in named})
        engine.step()
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["weights"].append({n: safe_get_full_fp32_param(p).clone() for n, p in named})
        # what the next forward reads without a fetch: the persistent tensors gathered after the step
        values = dict(named)
        out["persistent_values"].append({n: values[n].detach().clone() for n in persistent})
        out["all_available"].append(all(values[n].ds_status == ZeroParamStatus.AVAILABLE for n in persistent))
        state = opt.optimizer.state
        out["exp_avg"].append({i: st["exp_avg"].clone() for i, st in enumerate(state.values())})
        out["invalidations"].append(invalidations[0])
    out["elements"] = sum(p.ds_numel for _, p in named)
    out["deepspeed_step_calls"] = {name: counter[0] for name, counter in step_calls.items()}
    out["sub_groups"] = len(opt.fp16_groups)
    out["deepspeed_partition_calls"] = partition_calls[0]
    # zero3_hook_fns: the backward-hook functions every hooked module applies, by kind
    fns = [m.__dict__.get(a) for m in engine.module.modules() for a in ("pre_bwd_fn", "post_bwd_fn")]
    out["hook_fns"] = sorted({f.__name__ for f in fns if f is not None})
    return out


def counted(fn, counter):
    @functools.wraps(fn)  # __wrapped__: the patches' fingerprint checks read the counted method's own source
    def wrapper(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)

    return wrapper


def _check(ranks, clip):
    from dsclip.engine.patches import passes_check

    expected = [n for n in ZERO3_PATCHES if passes_check(n)]  # on CI's oldest DeepSpeed: DeepSpeed's paths
    for r in ranks:
        ours, theirs = r["all"], r["none"]
        assert ours["patches"] == expected and theirs["patches"] == []
        assert ours["persistent"] > 0 and ours["partitioned"] > 0  # both kinds of tensor are in play
        if "zero3_norm" in expected:
            assert ours["norm_fn"] == "_flat_grad_norm.<locals>.get_grad_norm_direct"
        if "zero3_gather" in expected:
            assert ours["post_step_fn"] == "_coalesced_post_step.<locals>._post_step"
        if "zero3_params" in expected:
            assert ours["same_lists"]
        if "zero3_traces" in expected:  # recorded in the first step, never invalidated
            assert ours["invalidations"] == [0] * STEPS, ours["invalidations"]
            # DeepSpeed's single trace: the no-grad forward and the forward + backward units mix in it
            assert theirs["invalidations"][-1] >= 1, theirs["invalidations"]
        if "zero3_release" in expected:  # every release of the steps took the direct path
            assert ours["deepspeed_partition_calls"] == 0, ours["deepspeed_partition_calls"]
        assert theirs["deepspeed_partition_calls"] > 0  # the count sees DeepSpeed's path where it runs
        # zero3_step_views: neither of DeepSpeed's per-tensor loops ran in a step (one call per sub-group each)
        per_step = dict.fromkeys(theirs["deepspeed_step_calls"], STEPS * ours["sub_groups"])
        assert theirs["deepspeed_step_calls"] == per_step
        if "zero3_step_views" in expected:
            assert ours["deepspeed_step_calls"] == dict.fromkeys(ours["deepspeed_step_calls"], 0)
        deepspeeds = ["PostBackwardFunctionModule", "PreBackwardFunctionForModule"]
        assert theirs["hook_fns"] == deepspeeds
        if "zero3_hook_fns" in expected:
            assert ours["hook_fns"] == ["Unbound" + n for n in deepspeeds]
        assert theirs["norm_fn"] == "DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct"
        assert theirs["post_step_fn"] == "DeepSpeedZeroOptimizer_Stage3._post_step"
        assert all(ours["all_available"]) and all(theirs["all_available"])
        for s in range(STEPS):
            # the norm: two float64 summation orders of every squared gradient element (each square exact
            # to u, the sum of squares is norm^2); then the square root halves the relative difference
            bound = worst_case(ours["elements"] + 2, theirs["norms"][s] ** 2, torch.float64) / (2 * theirs["norms"][s])
            assert abs(ours["norms"][s] - theirs["norms"][s]) <= bound, (s, ours["norms"][s], theirs["norms"][s])
            diff = [n for n in ours["grads"][s] if not same_bits(ours["grads"][s][n], theirs["grads"][s][n])]
            assert not diff, f"step {s}: gradients differ for {diff}"
            for key in ("weights", "persistent_values", "exp_avg"):
                a, b = ours[key][s], theirs[key][s]
                if clip is None:
                    diff = [n for n in a if not same_bits(a[n], b[n])]
                else:
                    # the clip factor max_norm / norm, rounded to float32, may move by one ulp: Adam's update
                    # (lr-sized, moments included) moves by that relative amount, per step so far
                    tol = (s + 1) * 4 * unit_roundoff() * (LR if key != "exp_avg" else 1.0)
                    diff = [n for n in a if not torch.allclose(a[n], b[n], rtol=2 * unit_roundoff(), atol=tol)]
                assert not diff, f"step {s}: {key} differ for {diff}"
        assert any(not torch.equal(ours["weights"][0][n], ours["weights"][-1][n]) for n in ours["weights"][0])


def test_zero3_patches_compute_what_deepspeed_computes():
    # one world, one engine after another: all and none with and without clipping, then each patch alone
    # and each declared pair (below)
    runs = [(mode, clip, STEPS) for clip in (None, 0.05) for mode in ("all", "none")]
    alone = _alone_selections()
    runs += [(selection, None, ALONE_STEPS) for selection in alone]
    ranks = run_world(_run_all, WORLD, runs)
    for clip in (None, 0.05):
        by_mode = [{mode: r[runs.index((mode, clip, STEPS))] for mode in ("all", "none")} for r in ranks]
        if clip is not None:  # clipping acted: the norms were above the clip value
            assert all(n > clip for n in by_mode[0]["none"]["norms"])
        _check(by_mode, clip)
    reference = runs.index(("none", None, STEPS))
    _check_alone([r[reference] for r in ranks], [r[4:] for r in ranks], alone)


# Each patch by itself and each declared pair (a patch with the ones it requires): DeepSpeed's paths but
# those, bit for bit DeepSpeed's numbers (no clipping: zero3_norm's summation order then moves no weight)
ALONE_STEPS = 2


def _alone_selections() -> list[str]:
    from dsclip.engine.patches import PATCHES

    zero3 = [p for p in PATCHES if p.name in ZERO3_PATCHES]
    pairs = [",".join((*p.requires, p.name)) for p in zero3 if p.requires]
    return [*(p.name for p in zero3), *pairs]


def _check_alone(references, alone_ranks, selections):
    from dsclip.engine.patches import PATCHES, passes_check

    assert "zero3_blocks,zero3_forward_flags" in selections
    requires = {p.name: p.requires for p in PATCHES}
    for theirs, runs in zip(references, alone_ranks, strict=True):
        assert theirs["active"] == []
        for selection, ours in zip(selections, runs, strict=True):
            # a patch is on where its check passes and every patch it requires is selected and on
            on = []
            for n in selection.split(","):
                if passes_check(n) and all(q in on for q in requires[n]):
                    on.append(n)
            assert ours["active"] == on, (selection, ours["active"])
            for s in range(ALONE_STEPS):
                norm = theirs["norms"][s]
                bound = worst_case(ours["elements"] + 2, norm**2, torch.float64) / (2 * norm)
                assert abs(ours["norms"][s] - norm) <= bound, (selection, s)
                for key in ("grads", "weights", "persistent_values", "exp_avg"):
                    a, b = ours[key][s], theirs[key][s]
                    diff = [n for n in a if not same_bits(a[n], b[n])]
                    assert not diff, f"{selection}, step {s}: {key} differ for {diff}"
