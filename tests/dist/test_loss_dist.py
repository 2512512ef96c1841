"""Gloo multi-process tests of dsclip.losses: world sizes 1, 2 and 3, uneven local batches.

Each world size is spawned once (module-level cache) and runs every case; the parent compares the
per-rank results with the single-process full-batch references of tests/unit/test_losses.py:
  mean_r loss_r == L,  grad(x_r) == world * dL/dx[rows of r],  mean_r grad(scale) == dL/dscale.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from dsclip.testing.gloo_world import run_world
from tests.tolerances import loss_size, rounding, unit_roundoff
from tests.unit.test_losses import MaxNumel, assert_close, loss_and_grads, make_batch, ref_infonce, reference

pytestmark = pytest.mark.dist

D = 6
SIZES = {1: [(13,)], 2: [(7, 4), (6, 6)], 3: [(5, 2, 6), (4, 4, 4), (0, 5, 3)]}
# (loss name, label smoothing, pass a logit_bias, tile size)
MODES = [
    ("infonce", 0.0, False, 0),
    ("infonce", 0.1, True, 0),
    ("infonce_local", 0.0, False, 0),
    ("infonce_local", 0.15, True, 0),
    ("infonce_tiled", 0.0, False, 3),
    ("infonce_tiled", 0.1, True, 4),
    ("infonce_tiled", 0.0, False, 100),
    ("siglip", 0.0, True, 3),
    ("siglip", 0.0, False, 5),
]
BF16_MODES = [
    ("infonce", 0.0, False, 0),
    ("infonce_local", 0.0, False, 0),
    ("infonce_tiled", 0.0, False, 4),
    ("siglip", 0.0, True, 4),
]
WEIGHTED_MODES = [
    ("infonce", 0.0, False, 0),
    ("infonce_local", 0.1, False, 0),
    ("infonce_tiled", 0.1, True, 3),
    ("siglip", 0.0, True, 4),
]
MEM_SIZES, MEM_D, MEM_TILE = (48, 40, 44), 8, 16
TIMEOUT = 240


def _rows(sizes, rank):
    off = sum(sizes[:rank])
    return slice(off, off + sizes[rank])


def _weight(rank):
    return 0.5 + rank


def _gather_weights(sizes):
    return torch.linspace(-1, 2, 2 * sum(sizes), dtype=torch.float64).reshape(-1, 2)


def ref_per_rank_losses(name, x, y, s, b, sizes, eps=0.0):
    """The per-rank losses the convention implies (their mean is the full-batch loss)."""
    world, n = len(sizes), sum(sizes)
    if name == "infonce":  # global mode: every rank returns the full loss
        return [ref_infonce(x, y, s, b, eps)] * world
    z = s * x @ y.T + (0 if b is None else b)
    if name == "siglip":
        per_row = -F.logsigmoid((2 * torch.eye(n, dtype=z.dtype) - 1) * z).sum(1)
        return [per_row[_rows(sizes, r)].sum() * world / n for r in range(world)]
    d = z.diagonal()
    rows = torch.logsumexp(z, 1) - (1 - eps) * d - eps * z.mean(1)
    cols = torch.logsumexp(z, 0) - (1 - eps) * d - eps * z.mean(0)
    per = rows + cols
    return [per[_rows(sizes, r)].sum() * world / (2 * n) for r in range(world)]


def _global_batch(sizes, dtype=torch.float64):
    return make_batch(sum(sizes), D, seed=len(sizes) * 100 + sum(sizes), dtype=dtype)


def _correctness_worker(rank, world):
    from dsclip.losses import all_gather_with_grad, all_reduce_mean, build_loss
    from dsclip.losses.distributed import all_gather_columns_with_grad

    out = {}
    for sizes in SIZES[world]:
        x, y, s, b = _global_batch(sizes)
        xr, yr = x[_rows(sizes, rank)], y[_rows(sizes, rank)]
        for mode in MODES:
            name, eps, use_bias, tile = mode
            loss = build_loss(name, tile_size=max(tile, 1), label_smoothing=eps)
            out[sizes, mode] = loss_and_grads(loss, xr, yr, s, b if use_bias else None)
        xb, yb, _, _ = _global_batch(sizes, torch.bfloat16)
        for mode in BF16_MODES:
            name, eps, use_bias, tile = mode
            loss = build_loss(name, tile_size=max(tile, 1))
            bias = b.float() if use_bias else None
            out[sizes, mode, "bf16"] = loss_and_grads(
                loss, xb[_rows(sizes, rank)], yb[_rows(sizes, rank)], s.float(), bias
            )
        if len(set(sizes)) == 1:  # OpenCLIP needs equal local batches
            import open_clip.loss as ocl

            kw = dict(rank=rank, world_size=world)
            for key, oc in (
                ("global", ocl.ClipLoss(local_loss=False, gather_with_grad=True, **kw)),
                ("local", ocl.ClipLoss(local_loss=True, gather_with_grad=True, **kw)),
            ):
                out[sizes, "openclip", key] = loss_and_grads(oc, xr, yr, s, None)
            out[sizes, "openclip", "siglip"] = loss_and_grads(ocl.SigLipLoss(**kw), xr, yr, s, b)
        # per-rank upstream gradients differ (DeepSpeed scales, a weighted sum of losses...): rank r's
        # backward gets weight w_r, so grad(x_r) must be d(sum_s w_s loss_s)/dx_r
        for mode in WEIGHTED_MODES:
            name, eps, use_bias, tile = mode
            loss = build_loss(name, tile_size=max(tile, 1), label_smoothing=eps)
            out[sizes, mode, "weighted"] = loss_and_grads(
                lambda *a, loss=loss: loss(*a) * _weight(rank), xr, yr, s, b if use_bias else None
            )
        # the collectives themselves: uneven all-gather with grad, mean for logging
        t = (torch.arange(sizes[rank] * 2, dtype=torch.float64).reshape(-1, 2) + 100 * rank).requires_grad_()
        gathered = all_gather_with_grad(t)
        (gathered * _gather_weights(sizes)).sum().mul(_weight(rank)).backward()
        out[sizes, "gather"] = (gathered.detach(), t.grad, all_reduce_mean(torch.tensor(float(rank))))
        # several tensors in one collective (the losses' image + text features): bit for bit separate gathers
        base = [t.detach() * 0.37, torch.randn(sizes[rank], 3, dtype=torch.float64, generator=torch.Generator())]
        n = sum(sizes)
        weights = [torch.linspace(-1, 2, n * 2, dtype=torch.float64).reshape(n, 2), torch.ones(n, 3) * 0.3]
        together, alone = [b.clone().requires_grad_() for b in base], [b.clone().requires_grad_() for b in base]
        got = all_gather_columns_with_grad(together)
        ref = [all_gather_with_grad(a) for a in alone]
        for outs in (got, ref):
            sum((o * w).sum() for o, w in zip(outs, weights)).mul(_weight(rank)).backward()
        out[sizes, "columns"] = (
            [g.detach() for g in got],
            [r.detach() for r in ref],
            [a.grad for a in together],
            [a.grad for a in alone],
            all(g.is_contiguous() for g in got),
        )
    if world > 1:  # the tiled losses never materialise a big matrix on any rank
        sizes = MEM_SIZES[:world]
        x, y, s, b = make_batch(sum(sizes), MEM_D, seed=1)
        for name in ("infonce_tiled", "siglip"):
            leaves = [t.clone().requires_grad_() for t in (x[_rows(sizes, rank)], y[_rows(sizes, rank)], s, b)]
            with MaxNumel() as rec:
                build_loss(name, tile_size=MEM_TILE)(*leaves).backward()
            out[sizes, name, "max_numel"] = rec.max_numel
    return out


@functools.cache
def results(world):
    return run_world(_correctness_worker, world, timeout=TIMEOUT)


def _check(per_rank, sizes, ref, tol_loss, grad_close, world):
    """per_rank[r] = (loss_r, [gx_r, gy_r, gs_r, gb_r]); ref = (L, [dL/dx, dL/dy, dL/ds, dL/db])."""
    L, (gx, gy, gs, gb) = ref
    loss_mean = sum(r[0].double() for r in per_rank) / world
    tol_loss(loss_mean, L)
    for r, (_, g) in enumerate(per_rank):
        grad_close(g[0].double(), world * gx[_rows(sizes, r)])
        grad_close(g[1].double(), world * gy[_rows(sizes, r)])
    grad_close(sum(r[1][2].double() for r in per_rank) / world, gs)
    if gb is not None:
        grad_close(sum(r[1][3].double() for r in per_rank) / world, gb)


CASES = [(w, sizes, mode) for w in SIZES for sizes in SIZES[w] for mode in MODES]


@pytest.mark.parametrize(
    "world,sizes,mode", CASES, ids=[f"w{w}-{s}-{m[0]}-ls{m[1]}-b{int(m[2])}-t{m[3]}" for w, s, m in CASES]
)
def test_matches_full_batch_reference(world, sizes, mode):
    name, eps, use_bias, _ = mode
    x, y, s, b = _global_batch(sizes)
    ref = reference(name, x, y, s, b if use_bias else None, eps)
    per_rank = [res[sizes, mode] for res in results(world)]
    _check(per_rank, sizes, ref, assert_close, assert_close, world)


W_CASES = [(w, sizes, mode) for w in (2, 3) for sizes in SIZES[w] for mode in WEIGHTED_MODES]


@pytest.mark.parametrize("world,sizes,mode", W_CASES, ids=[f"w{w}-{s}-{m[0]}" for w, s, m in W_CASES])
def test_per_rank_upstream_gradients(world, sizes, mode):
    """Rank r backpropagates w_r * loss_r: each rank's features get d(sum_s w_s loss_s)/dx_r and the
    scale/bias gradients sum over ranks to d(sum_s w_s loss_s)/dscale. Catches a ring that applies
    the wrong rank's upstream gradient to remote rows or columns."""
    name, eps, use_bias, _ = mode
    x, y, s, b = _global_batch(sizes)
    _, ref_g = loss_and_grads(
        lambda *a: sum(_weight(r) * lr for r, lr in enumerate(ref_per_rank_losses(name, *a, sizes, eps))),
        x,
        y,
        s,
        b if use_bias else None,
    )
    per_rank = [res[sizes, mode, "weighted"] for res in results(world)]
    plain = ref_per_rank_losses(name, x, y, s, b if use_bias else None, sizes, eps)
    for r, (loss, g) in enumerate(per_rank):
        assert_close(loss, _weight(r) * plain[r])
        assert_close(g[0], ref_g[0][_rows(sizes, r)])
        assert_close(g[1], ref_g[1][_rows(sizes, r)])
    for k in (2, 3) if use_bias else (2,):
        assert_close(sum(g[k] for _, g in per_rank), ref_g[k])


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_with_grad_uneven_and_mean(world):
    for sizes in SIZES[world]:
        res = results(world)
        full = torch.cat(
            [torch.arange(sizes[r] * 2, dtype=torch.float64).reshape(-1, 2) + 100 * r for r in range(world)]
        )
        wsum = sum(_weight(r) for r in range(world))
        for r in range(world):
            gathered, grad, mean = res[r][sizes, "gather"]
            assert torch.equal(gathered, full)
            assert_close(grad, wsum * _gather_weights(sizes)[_rows(sizes, r)])
            assert float(mean) == (world - 1) / 2


@pytest.mark.parametrize("world", [2, 3])
def test_columns_gathered_together_equal_separate_gathers(world):
    for sizes in SIZES[world]:
        for r, res in enumerate(results(world)):
            got, ref, grads, ref_grads, contiguous = res[sizes, "columns"]
            assert contiguous, (sizes, r)
            assert [tuple(g.shape) for g in got] == [(sum(sizes), 2), (sum(sizes), 3)], (sizes, r)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (sizes, r)
            assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), (sizes, r)
            assert sizes[r] == 0 or all(g.abs().sum() > 0 for g in grads), (sizes, r)  # gradients did flow


BF16_CASES = [(w, sizes, mode) for w in SIZES for sizes in SIZES[w][:1] for mode in BF16_MODES]


@pytest.mark.parametrize("world,sizes,mode", BF16_CASES, ids=[f"w{w}-{s}-{m[0]}" for w, s, m in BF16_CASES])
def test_bf16_inputs(world, sizes, mode):
    """bf16 features (fp32 scale/bias): loss within fp32 rounding of the fp64 reference on the same bf16
    values (fp32 accumulation); feature gradients (returned in bf16) within 1% of the largest entry."""
    name, _, use_bias, _ = mode
    xb, yb, s, b = _global_batch(sizes, torch.bfloat16)
    ref = reference(name, xb.double(), yb.double(), s, b if use_bias else None)
    per_rank = [res[sizes, mode, "bf16"] for res in results(world)]
    assert per_rank[0][0].dtype == torch.float32 and per_rank[0][1][0].dtype == torch.bfloat16

    n = sum(sizes)
    # loss value in fp32: d-term logits, n-term log-sum-exp and mean, ~8 roundings in exp/log, plus the
    # all-reduce over ranks (world terms): tolerances.rounding over d + 2n + 8 + world terms of loss_size
    loss_tol_fp32 = rounding(D + 2 * n + 8 + world, loss_size(n, 7.0, 3.0))

    def loss_close(a, c):
        torch.testing.assert_close(a, c, rtol=0, atol=loss_tol_fp32)

    # feature gradients are rounded to bf16 once (relative 2^-9 = u_bf16) after fp32 arithmetic; 1e-2 = 5 u_bf16
    # also covers the bf16 rounding of the inputs propagated through the softmax (|dp/dz| <= 1/4 per logit)
    grad_rel = 5 * 2 * unit_roundoff(torch.bfloat16)

    def grad_close(a, c):
        torch.testing.assert_close(a, c, rtol=grad_rel, atol=grad_rel * float(c.abs().max()))

    _check(per_rank, sizes, ref, loss_close, grad_close, world)


@pytest.mark.parametrize("world", [2, 3])
def test_openclip_exact_per_rank(world):
    """Same per-rank numbers as OpenCLIP on gloo (equal local batches), float64."""
    sizes = next(s for s in SIZES[world] if len(set(s)) == 1)
    pytest.importorskip("open_clip.loss")
    for res in results(world):
        pairs = [
            (res[sizes, ("infonce", 0.0, False, 0)], res[sizes, "openclip", "global"], 4),
            (res[sizes, ("infonce_local", 0.0, False, 0)], res[sizes, "openclip", "local"], 4),
            (res[sizes, ("siglip", 0.0, True, 3)], res[sizes, "openclip", "siglip"], 4),
            # tiled InfoNCE: same per-rank loss and feature gradients as the local loss; its
            # logit_scale gradient is split differently across ranks (checked on average above)
            (res[sizes, ("infonce_tiled", 0.0, False, 3)], res[sizes, "openclip", "local"], 2),
        ]
        for (loss, grads), (oc_loss, oc_grads), n in pairs:
            assert_close(loss, oc_loss)
            for a, c in zip(grads[:n], oc_grads[:n]):
                if c is not None:
                    assert_close(a, c)


@pytest.mark.parametrize("world", [2, 3])
def test_tiled_memory_bounded_across_ranks(world):
    sizes = MEM_SIZES[:world]
    limit = max(MEM_TILE * MEM_TILE, max(sizes) * MEM_D)
    for res in results(world):
        for name in ("infonce_tiled", "siglip"):
            assert res[sizes, name, "max_numel"] <= limit < min(sizes) ** 2


# ---------------------------------------------------------------- bad input: error on all ranks


def _bad_cases(rank, world):
    """(case name, per-rank inputs) -- only some ranks are 'bad' in each case."""
    x, y, s, b = make_batch(4 * world, 8, seed=2)
    xr, yr = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
    last = world - 1
    nan = xr.clone()
    nan[1, 2] = float("nan")
    inf = yr.clone()
    inf[0, 0] = float("inf")
    return (xr, yr, s, b), [
        ("nan_image_last_rank", (nan if rank == last else xr, yr, s, b), f"rank {last}: non-finite"),
        (
            "inf_text_rank0",
            (xr, inf if rank == 0 else yr, s, b),
            "rank 0: non-finite values (NaN/Inf) in text",
        ),
        ("nan_scale_last_rank", (xr, yr, s * float("nan") if rank == last else s, b), "in logit_scale"),
        (
            "dim_mismatch",
            (xr[:, : 8 - (rank == last)], yr[:, : 8 - (rank == last)], s, b),
            "embedding dim differs",
        ),
        ("dtype_mismatch", (xr.float(), yr.float(), s, b) if rank == 0 else (xr, yr, s, b), "dtype differs"),
        ("bias_none_on_rank0", (xr, yr, s, None if rank == 0 else b), "logit_bias is given on some ranks"),
        (
            "rows_mismatch_last_rank",
            (xr, yr[:3] if rank == last else yr, s, b),
            "image features (4, 8) vs text",
        ),
    ]


BAD_INPUT_LOSSES = ("infonce", "infonce_local", "infonce_tiled", "siglip")


def _bad_input_worker(rank, world):
    from dsclip.losses import LossInputError, build_loss

    good, cases = _bad_cases(rank, world)
    report = []
    for name in BAD_INPUT_LOSSES:
        loss = build_loss(name, tile_size=3)
        for case, args, _ in cases:
            try:
                loss(*args)
                outcome = ("no error", "")
            except LossInputError as e:
                outcome = ("LossInputError", str(e))
            except Exception as e:  # report anything else as a failure
                outcome = (type(e).__name__, str(e))
            # the process group must still be in step: a good call right after works on every rank
            after = float(loss(*good).detach())
            report.append((name, case, outcome, after))
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_errors_on_every_rank(world):
    """NaN/Inf, mismatched D / dtype / bias / rows on SOME ranks: the same LossInputError on EVERY
    rank (no hang: run_world times out instead), and the group stays usable afterwards."""
    reports = run_world(_bad_input_worker, world, timeout=120)
    expected = {case: text for case, _, text in _bad_cases(0, world)[1]}
    for i, (name, case, *_) in enumerate(reports[0]):
        outcomes = [rep[i][2] for rep in reports]
        assert {o[0] for o in outcomes} == {"LossInputError"}, (name, case, outcomes)
        messages = {o[1] for o in outcomes}
        assert len(messages) == 1, (name, case, messages)  # the same message on every rank
        assert expected[case] in messages.pop(), (name, case)
    assert len(reports[0]) == len(BAD_INPUT_LOSSES) * len(expected)
    for rep in reports:
        assert all(torch.isfinite(torch.tensor(after)) for *_, after in rep)
