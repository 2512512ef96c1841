"""Distillation (--distill-model) at world 2 over gloo against single-process OpenCLIP ``DistillClipLoss``.

Two levels:
- the loss: dsclip's ``DistillInfoNCELoss`` (global and local mode, even and uneven local batches) on 2
  ranks; mean over ranks of the per-rank losses == OpenCLIP's contrastive + distill on the whole batch in
  one process, and each rank's feature gradients == world * that reference's gradients (the team
  convention, tests/dist/test_loss_dist.py); float64, tolerance tests/tolerances.loss_tol;
- a whole training step: the gradient cache (K = 2 micro-batches per rank) with a frozen teacher of
  another embedding width outside the engine, ZeRO-2 and ZeRO-3, fp32; every student parameter's
  gradient and AdamW-updated weight == a single-process big-batch step with OpenCLIP's DistillClipLoss
  (tolerances derived as in tests/dist/test_gradcache.py); the teacher's weights are unchanged, it has
  no gradients, and none of its parameters is in the engine's module or optimizer.
"""

from __future__ import annotations

import functools
import math
import tempfile
from contextlib import nullcontext

import pytest
import torch

from dsclip.model import create_model, get_model_config  # before zero.Init patches torch.Tensor
from dsclip.testing.gloo_world import run_world
from dsclip.testing.gradcache import EPS, LR, SEED, make_batches, make_cfg, make_model, rank_chunks
from tests.dist.test_gradcache import assert_matches, grad_terms, whole_batch_features
from tests.tolerances import loss_size, loss_terms, rounding, worst_case
from tests.unit.test_losses import loss_and_grads, make_batch

pytestmark = pytest.mark.dist
oc_loss = pytest.importorskip("open_clip.loss")

D, DT = 6, 4  # student and teacher embedding widths: only the logits are compared, so they may differ
T_SCALE = 12.0  # the teacher's (exp'd) logit scale
SIZES = [(6, 6), (7, 4)]
MODES = ["infonce", "infonce_local"]
TIMEOUT = 600  # the machine may be shared: a loaded 2-core box took minutes for one ZeRO-3 step


def teacher_batch(n, seed):
    tx, ty, _, _ = make_batch(n, DT, seed=seed)
    return tx, ty, torch.tensor(T_SCALE, dtype=torch.float64)


def _global(sizes):
    n = sum(sizes)
    x, y, s, _ = make_batch(n, D, seed=50 + n)
    return (x, y, s), teacher_batch(n, seed=70 + n)


def _rows(sizes, rank):
    off = sum(sizes[:rank])
    return slice(off, off + sizes[rank])


def openclip_reference(x, y, s, tx, ty, ts):
    """OpenCLIP's DistillClipLoss, one process, whole batch: contrastive + distill, and its gradients."""
    loss = oc_loss.DistillClipLoss()

    def total(x, y, s, _bias):
        return sum(loss(x, y, s, tx, ty, ts))

    return loss_and_grads(total, x, y, s, None)


def _loss_worker(rank, world):
    from dsclip.losses import LossConfig, build_loss

    out = {}
    for sizes in SIZES:
        (x, y, s), (tx, ty, ts) = _global(sizes)
        rows = _rows(sizes, rank)
        for name in MODES:
            loss = build_loss(LossConfig(name=name, distill=True))

            def fn(a, b, c, _bias, loss=loss, rows=rows, tx=tx, ty=ty, ts=ts):
                return loss(
                    a, b, c, teacher_image_features=tx[rows], teacher_text_features=ty[rows], teacher_logit_scale=ts
                )

            out[sizes, name] = loss_and_grads(fn, x[rows], y[rows], s, None)
            if len(set(sizes)) == 1:  # OpenCLIP itself on 2 ranks (it needs equal local batches)
                oc = oc_loss.DistillClipLoss(
                    local_loss=name == "infonce_local", gather_with_grad=True, rank=rank, world_size=world
                )

                def oc_fn(a, b, c, _bias, oc=oc, rows=rows, tx=tx, ty=ty, ts=ts):
                    return sum(oc(a, b, c, tx[rows], ty[rows], ts))

                out[sizes, name, "openclip"] = loss_and_grads(oc_fn, x[rows], y[rows], s, None)
    # last: the mismatch error is raised on every rank after the row counts' exchange (the world stays usable)
    out["mismatch"] = _mismatch(rank)
    return out


@functools.cache
def loss_results():
    """One 2-rank world for every loss case (spawn + imports are most of a case's time); the tests that read
    it share an xdist group so that one worker spawns it once."""
    return run_world(_loss_worker, 2, timeout=TIMEOUT)


# float64: two logit matrices (D and DT terms), two cross-entropy pairs and their means over 11-12 rows,
# twice tolerances.loss_terms; terms up to the larger scale (teacher 12) + log N + 1. About 2e-12: a real
# error (a missing 1/2, a wrong rank's rows, a teacher transposed) is larger than 1e-6.
def _tol(n):
    return worst_case(2 * loss_terms(n, max(D, DT)), loss_size(n, T_SCALE), torch.float64)


@pytest.mark.xdist_group("distill_loss_world")
@pytest.mark.parametrize("sizes", SIZES, ids=[str(s) for s in SIZES])
@pytest.mark.parametrize("name", MODES)
def test_distill_loss_world2_matches_openclip_single_process(name, sizes):
    (x, y, s), (tx, ty, ts) = _global(sizes)
    ref_loss, (gx, gy, gs, _) = openclip_reference(x, y, s, tx, ty, ts)
    per_rank = [res[sizes, name] for res in loss_results()]
    world, tol = len(sizes), _tol(sum(sizes))

    def close(a, b):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)

    close(sum(r[0] for r in per_rank) / world, ref_loss)
    for r, (_, g) in enumerate(per_rank):
        close(g[0], world * gx[_rows(sizes, r)])
        close(g[1], world * gy[_rows(sizes, r)])
    close(sum(g[2] for _, g in per_rank) / world, gs)
    # the distillation term is really there: the reference without it is far off
    contrastive = oc_loss.ClipLoss()(x, y, s)
    assert abs(float(ref_loss - contrastive)) > 1.0


@pytest.mark.xdist_group("distill_loss_world")
@pytest.mark.parametrize("name", MODES)
def test_distill_loss_equals_openclip_per_rank(name):
    """Equal local batches: the same per-rank loss and gradients as OpenCLIP's own DistillClipLoss on gloo."""
    sizes = SIZES[0]
    for res in loss_results():
        (loss, grads), (oc, oc_grads) = res[sizes, name], res[sizes, name, "openclip"]
        tol = _tol(sum(sizes))
        torch.testing.assert_close(loss, oc, atol=tol, rtol=0)
        for a, b in zip(grads[:2], oc_grads[:2]):
            # OpenCLIP's gather_with_grad (torch.distributed.nn.all_gather) sums the ranks' gradients as dsclip
            torch.testing.assert_close(a, b, atol=tol, rtol=0)


@pytest.mark.xdist_group("distill_loss_world")
def test_mismatched_teacher_rows_fail_on_every_rank():
    results = [res["mismatch"] for res in loss_results()]
    assert all("teacher rows per rank (3, 4) != student rows per rank (4, 4)" in r for r in results), results


def _mismatch(rank):
    from dsclip.losses import LossConfig, LossInputError, build_loss

    x, y, s, _ = make_batch(4, D, seed=rank)
    tx, ty, ts = teacher_batch(3 if rank == 0 else 4, seed=rank)
    try:
        build_loss(LossConfig(distill=True))(
            x, y, s, teacher_image_features=tx, teacher_text_features=ty, teacher_logit_scale=ts
        )
    except LossInputError as e:
        return str(e)
    return "no error"


# ---------------------------------------------------------------- a whole step through the gradient cache


def make_teacher_model():
    """The tiny architecture with another embedding width and its own weights (seed)."""
    cfg = get_model_config("tiny")
    cfg["embed_dim"] = 24  # the student's is 32
    torch.manual_seed(SEED + 1)
    return create_model(cfg, vocab_size=256, eos_id=2, pad_id=0)


def _rank_step(rank, world, stage, loss_name, k):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import LossConfig, build_loss
    from dsclip.model import save_model
    from dsclip.train.gradcache import GradCacheStep
    from dsclip.train.teacher import TeacherPlan

    cfg = make_cfg(stage, k)
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    bundle = build_engine(ds, cfg.train, cfg.optim, make_model, total_steps=10, steps_per_epoch=10)
    engine = bundle.engine
    saved = make_teacher_model()
    teacher_before = {n: p.detach().clone() for n, p in saved.named_parameters()}
    teacher_file = save_model(saved, tempfile.mkdtemp(prefix=f"teacher{rank}_"))
    # what `dsclip train` does: ZeRO-3 -> partitioned in a forward-only engine, else a plain module per rank
    teacher = TeacherPlan("tiny-24", saved.config, str(teacher_file)).build(ds)
    teacher = teacher.to(torch.device("cpu"), torch.float32)
    teacher_model = teacher.model

    def full_param(p):
        return safe_get_full_fp32_param(p).clone()

    initial = {n: full_param(p) for n, p in engine.module.named_parameters()}
    step = GradCacheStep(engine, build_loss(LossConfig(name=loss_name, distill=True)), teacher=teacher)
    images, tokens = make_batches(world, k)
    torch.manual_seed(SEED + 17 * rank)
    engine.train()
    result = step(rank_chunks(images, tokens, rank, world, k), optimizer_step=False)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    engine.step()
    weights = {n: full_param(p) for n, p in engine.module.named_parameters()}
    teacher_params = dict(
        teacher_model.module.named_parameters() if teacher.partitioned else teacher_model.named_parameters()
    )
    # ZeRO-3: this rank holds only its partition of each teacher weight (empty placeholders outside forward)
    local_numel = sum(p.ds_tensor.numel() if teacher.partitioned else p.numel() for p in teacher_params.values())
    with deepspeed.zero.GatheredParameters(list(teacher_params.values())) if teacher.partitioned else nullcontext():
        teacher_unchanged = all(torch.equal(p, teacher_before[n]) for n, p in teacher_params.items())
    teacher_ids = {id(p) for p in teacher_model.parameters()}
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    in_optimizer = sum(id(p) in teacher_ids for g in optimizer.param_groups for p in g["params"])
    return {
        "loss": result.loss,
        "terms": result.terms,
        "grads": grads,
        "weights": weights,
        "initial": initial,
        "teacher_unchanged": teacher_unchanged,
        "teacher_partitioned": teacher.partitioned,
        "teacher_local_numel": local_numel,
        "teacher_numel": sum(p.numel() for p in saved.parameters()),
        "teacher_tensors": len(teacher_params),
        "teacher_grads": sum(p.grad is not None or p.requires_grad for p in teacher_params.values()),
        "teacher_in_module": sum(id(p) in teacher_ids for p in engine.module.parameters()),
        "teacher_in_optimizer": in_optimizer,
        "module_params": sorted(n for n, _ in engine.module.named_parameters()),
    }


def reference_step(initial, world, k, loss_name):
    """Single process, whole batch, OpenCLIP's DistillClipLoss; the teacher in eval mode without grad."""
    model = make_model()
    model.load_state_dict(initial)
    model.train()
    teacher = make_teacher_model().eval()
    img_f, txt_f, scale = whole_batch_features(model, world, k)
    images, tokens = make_batches(world, k)
    with torch.no_grad():
        t = teacher(image=images, text=tokens)
    parts = oc_loss.DistillClipLoss()(img_f, txt_f, scale, t["image_features"], t["text_features"], t["logit_scale"])
    loss = sum(parts)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    from dsclip.engine.optim import param_groups

    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=LR, betas=(0.9, 0.98), eps=EPS)
    opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), grads, weights, [p.item() for p in parts]


STEP_CASES = [(2, "infonce"), (3, "infonce_local")]  # ZeRO-3 last: its zero.Init context is the one that patches


def _rank_steps(rank, world, k):
    return {case: _rank_step(rank, world, *case, k) for case in STEP_CASES}


@functools.cache
def step_results(world, k):
    """Both cases' engines, one after the other in one 2-rank world (spawn + imports + DeepSpeed's
    set-up are most of a case's time); the tests share an xdist group so that one worker spawns it once."""
    per_rank = run_world(_rank_steps, world, k, timeout=TIMEOUT)
    return {case: [res[case] for res in per_rank] for case in STEP_CASES}


@pytest.mark.xdist_group("distill_step_world")
@pytest.mark.parametrize("stage,loss_name", STEP_CASES)
def test_gradcache_distill_step_equals_openclip_big_batch(stage, loss_name):
    world, k = 2, 2
    results = step_results(world, k)[stage, loss_name]
    ref = reference_step(results[0]["initial"], world, k, loss_name)
    # The distillation term chains a second set of logits and cross-entropies into every gradient: the
    # derived rounding tolerance (which grows as the square root of the chained terms) widens by that factor.
    n = world * k * 4
    slack = math.sqrt((grad_terms(world, k) + loss_terms(n, 32)) / grad_terms(world, k))
    assert_matches(results, ref[:3], world, k, grad_slack=slack)
    # the logged parts (OpenCLIP's contrastive_loss and distill_loss) are the full batch's, summing to the loss;
    # each is a loss value like the one assert_matches checks, at the same derived tolerance
    loss_tol = rounding(grad_terms(world, k), loss_size(n, float(torch.tensor(1 / 0.07))))
    for r in results:
        assert r["terms"]["contrastive_loss"] == pytest.approx(ref[3][0], abs=loss_tol)
        assert r["terms"]["distill_loss"] == pytest.approx(ref[3][1], abs=loss_tol)
        assert r["terms"]["contrastive_loss"] + r["terms"]["distill_loss"] == pytest.approx(r["loss"], abs=loss_tol)
    for r in results:
        assert r["teacher_unchanged"] and r["teacher_grads"] == 0
        assert r["teacher_partitioned"] == (stage == 3)
        if stage == 3:  # each rank holds ceil(numel / world) of every teacher tensor
            assert r["teacher_local_numel"] <= r["teacher_numel"] / world + r["teacher_tensors"]
        else:
            assert r["teacher_local_numel"] == r["teacher_numel"]
        assert r["teacher_in_module"] == 0 and r["teacher_in_optimizer"] == 0
        assert r["module_params"] == sorted(n for n, _ in make_model().named_parameters())
